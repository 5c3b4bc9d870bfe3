package metrics

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// config_last_reload_successful follows the last load: 1 from the start
// (the process loaded its config), 0 while the file is rejected, 1 again
// with a new timestamp after a good reload; build_info carries the labels.
func TestReloadGaugesAndBuildInfo(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewProcess(reg)
	if got := testutil.ToFloat64(m.lastReloadOK); got != 1 {
		t.Fatalf("at start: config_last_reload_successful = %v, want 1", got)
	}
	started := testutil.ToFloat64(m.lastReloadAt)
	if started <= 0 {
		t.Fatalf("at start: success timestamp %v", started)
	}
	m.ConfigReload("error")
	if got := testutil.ToFloat64(m.lastReloadOK); got != 0 {
		t.Fatalf("after a rejected reload: %v, want 0", got)
	}
	if got := testutil.ToFloat64(m.lastReloadAt); got != started {
		t.Fatalf("a rejected reload moved the success timestamp: %v -> %v", started, got)
	}
	m.ConfigReload("ok")
	if got := testutil.ToFloat64(m.lastReloadOK); got != 1 {
		t.Fatalf("after a good reload: %v, want 1", got)
	}
	m.SetBuildInfo("1.2.3", "abc123", "go1.26.8")
	m.SetBuildInfo("1.2.4", "def456", "go1.26.8") // replaces, never two series
	want := `
# HELP livenessproxy_build_info 1, with the binary's version, VCS revision and Go version (process-wide).
# TYPE livenessproxy_build_info gauge
livenessproxy_build_info{goversion="go1.26.8",revision="def456",version="1.2.4"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "livenessproxy_build_info"); err != nil {
		t.Fatal(err)
	}
}
