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

// watched is a proxy started from a config file that watchConfig
// follows, with its log and its metrics.
type watched struct {
	t    *testing.T
	path string
	p    *proxy.Proxy
	reg  *prometheus.Registry
	log  syncBuffer
	hup  chan os.Signal
}

// startWatched starts a proxy on the config data, written to a file, and
// watchConfig on that file, as run does; the test's cleanup stops both.
func startWatched(t *testing.T, data []byte) *watched {
	t.Helper()
	w := &watched{t: t, path: filepath.Join(t.TempDir(), "config.yaml"), reg: prometheus.NewRegistry(), hup: make(chan os.Signal)}
	if err := os.WriteFile(w.path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	started, err := policy.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	log := newLogger(policy.Log{Level: "info", Format: "json"}, "", &w.log)
	w.p = proxy.New(started, proxy.Options{Logger: &log, Registerer: w.reg})
	if err := w.p.Start(); err != nil {
		t.Fatal(err)
	}
	m := metrics.NewProcess(w.reg)
	m.ConfigReload("ok") // as main records the start
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		watchConfig(ctx, w.path, data, w.hup, w.p, m, newRunning(started), log)
	}()
	t.Cleanup(func() { cancel(); <-done; _ = w.p.Close() })
	return w
}

// metric returns the value of the gauge name, or of the counter name's
// series whose result label is result.
func (w *watched) metric(name, result string) float64 {
	w.t.Helper()
	mfs, err := w.reg.Gather()
	if err != nil {
		w.t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			switch {
			case mf.GetName() != name:
			case result == "":
				return m.GetGauge().GetValue()
			case len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == result:
				return m.GetCounter().GetValue()
			}
		}
	}
	w.t.Fatalf("no %s{result=%q}", name, result)
	return 0
}

func (w *watched) lastReloadOK() float64 {
	return w.metric("livenessproxy_config_last_reload_successful", "")
}

func (w *watched) reloadErrors() float64 {
	return w.metric("livenessproxy_config_reloads_total", "error")
}

// waitLastReloadOK waits until config_last_reload_successful is want.
func (w *watched) waitLastReloadOK(want float64, within time.Duration, why string) {
	w.t.Helper()
	for deadline := time.Now().Add(within); w.lastReloadOK() != want; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			w.t.Fatalf("config_last_reload_successful still %v %v after %s, want %v; log:\n%s", w.lastReloadOK(), within, why, want, w.log.String())
		}
	}
}

func (w *watched) move(from, to string) {
	w.t.Helper()
	if err := os.Rename(from, to); err != nil {
		w.t.Fatal(err)
	}
}

const unreadableLog = "config reload: cannot read the file; keeping the last good config"

// A SIGHUP while the config file cannot be read is a failed reload
// (config_last_reload_successful 0); when the same content can be read
// again, it is applied, and the gauge is 1 again. Before, the content
// equal to what was applied was skipped, and the gauge, which the README
// says to alert on, stayed 0 with the file on disk in force.
func TestReloadFailureClearsWhenTheFileIsBack(t *testing.T) {
	w := startWatched(t, []byte("listeners:\n  - {name: a, listen: 127.0.0.1:0, upstream: 127.0.0.1:9}\n"))
	w.move(w.path, w.path+".away")
	w.hup <- syscall.SIGHUP
	w.hup <- syscall.SIGHUP // taken once the first is handled
	if got := w.lastReloadOK(); got != 0 {
		t.Fatalf("config_last_reload_successful %v after a SIGHUP with the file missing, want 0", got)
	}
	w.move(w.path+".away", w.path)
	w.waitLastReloadOK(1, 10*time.Second, "the file, unchanged, was back")
}

// A config file that stays missing (a renamed ConfigMap key, a lost
// mount, a file made unreadable) is a failed reload once a few ticks in a
// row cannot read it: logged once at error naming the file, counted in
// config_reloads_total{result="error"}, and config_last_reload_successful
// 0 until the file is read and applied again; the last good config keeps
// serving. Before, every tick skipped it in silence and the gauge stayed
// 1 (found by a helper's audit).
func TestConfigFileGoneIsAFailedReload(t *testing.T) {
	w := startWatched(t, []byte("listeners:\n  - {name: a, listen: 127.0.0.1:0, upstream: 127.0.0.1:9}\n"))
	w.move(w.path, w.path+".away")
	w.waitLastReloadOK(0, 5*watchInterval, "the file was removed")
	time.Sleep(watchInterval + 100*time.Millisecond) // another tick that cannot read it
	if n := strings.Count(w.log.String(), unreadableLog); n != 1 || !strings.Contains(w.log.String(), w.path) {
		t.Errorf("the file is gone: %d error lines %q, want one naming %s; log:\n%s", n, unreadableLog, w.path, w.log.String())
	}
	if n := w.reloadErrors(); n != 1 {
		t.Errorf("config_reloads_total{result=\"error\"} %v with the file gone, want 1", n)
	}
	if w.p.Addr("a") == nil {
		t.Error("listener a stopped with the file gone, want the last good config serving")
	}
	w.move(w.path+".away", w.path)
	w.waitLastReloadOK(1, 5*watchInterval, "the file was back")
}

// Its twin: a file missing for a tick or two, as during a ConfigMap's
// ..data swap, and again after it was read, is no failed reload: the
// count of failed reads starts again from a good read.
func TestConfigFileBrieflyMissingIsNoError(t *testing.T) {
	w := startWatched(t, []byte("listeners:\n  - {name: a, listen: 127.0.0.1:0, upstream: 127.0.0.1:9}\n"))
	// Gone for one tick or two, then back for two, three times, so that
	// the failed reads would add up to three or more without the good
	// reads between them. Back for two ticks, not one: a read is due
	// within the first second of the file's return, and the watcher may
	// run it late (a loaded machine); with one tick's span back (and 50
	// ms to spare at worst) a read run late found the file gone again,
	// and three failed reads came in a row.
	gone, back := watchInterval+50*time.Millisecond, 2*watchInterval
	for range 3 {
		w.move(w.path, w.path+".away")
		time.Sleep(gone)
		w.move(w.path+".away", w.path)
		time.Sleep(back)
	}
	if got, n := w.lastReloadOK(), w.reloadErrors(); got != 1 || n != 0 || strings.Contains(w.log.String(), unreadableLog) {
		t.Errorf("a file missing a tick at a time: config_last_reload_successful %v, %v reload errors, want 1 and 0; log:\n%s", got, n, w.log.String())
	}
}
