package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// A reload whose new listener cannot bind (another process holds the
// port) is rejected, not "applied in part": the configuration in force
// stays the one the proxy runs, and the log says the last good one keeps
// serving.
func TestReloadToABusyPortIsRejected(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	started, err := policy.Parse([]byte("listeners:\n  - {name: a, listen: 127.0.0.1:0, upstream: 127.0.0.1:9}\n"))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	log := newLogger(policy.Log{Level: "info", Format: "json"}, "", &buf)
	reg := prometheus.NewRegistry()
	p := proxy.New(started, proxy.Options{Logger: &log, Registerer: reg})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	data := fmt.Sprintf("listeners:\n  - {name: a, listen: %s, upstream: 127.0.0.1:9}\n", busy.Addr())
	if _, ok := reload([]byte(data), triggerFile, p, metrics.NewProcess(reg), started, log); ok {
		t.Fatal("a reload onto a busy port was taken as applied")
	}
	out := buf.String()
	if !strings.Contains(out, "config reload rejected; keeping the last good config") ||
		!strings.Contains(out, `listeners[0].listen (listener \"a\")`) || strings.Contains(out, "applied in part") {
		t.Fatalf("log:\n%s\nwant the reload rejected, naming listeners[0].listen", out)
	}
	if p.Addr("a") == nil {
		t.Fatal("listener a is gone after a rejected reload")
	}
}

// A change of the config file is applied only once two reads a tick apart
// agree on it: a file written in place may be read half-written, and its
// first part often parses on its own.
func TestConfigChangeWaitsToSettle(t *testing.T) {
	applied := []byte("a")
	var s settle
	for i, step := range []struct {
		read  string
		ready bool
	}{
		{"a", false},    // unchanged
		{"ab", false},   // half-written: seen once
		{"abc", false},  // still being written
		{"abc", true},   // the same twice: settled
		{"abcd", false}, // another change, seen once
		{"a", false},    // back to what is applied: nothing to do
		{"abcd", false}, // the earlier sighting does not count
		{"abcd", true},
	} {
		if got := s.ready([]byte(step.read), applied); got != step.ready {
			t.Fatalf("step %d, read %q: ready = %v, want %v", i, step.read, got, step.ready)
		}
		if step.ready {
			applied, s = []byte(step.read), settle{}
		}
	}
}

// A SIGHUP while the config file cannot be read is a failed reload
// (config_last_reload_successful 0); when the same content can be read
// again, it is applied, and the gauge is 1 again. Before, the content
// equal to what was applied was skipped, and the gauge, which the README
// says to alert on, stayed 0 with the file on disk in force.
func TestReloadFailureClearsWhenTheFileIsBack(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "config.yaml")
	data := []byte("listeners:\n  - {name: a, listen: 127.0.0.1:0, upstream: 127.0.0.1:9}\n")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	started, err := policy.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	log := zerolog.Nop()
	reg := prometheus.NewRegistry()
	p := proxy.New(started, proxy.Options{Logger: &log, Registerer: reg})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	m := metrics.NewProcess(reg)
	ok := func() float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "livenessproxy_config_last_reload_successful" {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		t.Fatal("no livenessproxy_config_last_reload_successful")
		return 0
	}
	m.ConfigReload("ok") // as main records the start

	ctx, cancel := context.WithCancel(context.Background())
	hup := make(chan os.Signal)
	done := make(chan struct{})
	go func() {
		defer close(done)
		watchConfig(ctx, path, data, hup, p, m, newRunning(started), log)
	}()
	defer func() { cancel(); <-done }()

	if err := os.Rename(path, path+".away"); err != nil {
		t.Fatal(err)
	}
	hup <- syscall.SIGHUP
	hup <- syscall.SIGHUP // taken once the first is handled
	if got := ok(); got != 0 {
		t.Fatalf("config_last_reload_successful %v after a SIGHUP with the file missing, want 0", got)
	}
	if err := os.Rename(path+".away", path); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ok() != 1; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("config_last_reload_successful still 0 10s after the file, unchanged, was back")
		}
	}
}
