package main

import (
	"bytes"
	"fmt"
	"net"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// GET /v1/config after a reload applied in part is the configuration in
// force: a reload that moves listener "a" from 127.0.0.1:X to
// 127.0.0.2:X (the same port, so it is bound only after the old socket
// is retired) and finds 127.0.0.2:X taken by another process leaves "a"
// bound nowhere, and /v1/config no longer lists it; "b", kept, is listed.
// Before, it showed the whole file, "a" at 127.0.0.2:X (found by a
// helper's audit).
func TestPartialReloadConfigListsTheListenersThatRun(t *testing.T) {
	started, err := policy.Parse([]byte("admin: {listen: '', control_listen: ''}\nlisteners:\n  - {name: a, listen: 127.0.0.1:0, upstream: 127.0.0.1:9}\n  - {name: b, listen: 127.0.0.1:0, upstream: 127.0.0.1:9}\n"))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	log := withRunLevel(newLogger(policy.Log{Level: "info", Format: "json"}, "", &buf)) // as run does
	defer zerolog.SetGlobalLevel(zerolog.TraceLevel)
	reg := prometheus.NewRegistry()
	p := proxy.New(started, proxy.Options{Logger: &log, Registerer: reg})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	_, port, _ := net.SplitHostPort(p.Addr("a").String())
	busy, err := net.Listen("tcp", "127.0.0.2:"+port) // someone else's socket
	if err != nil {
		t.Skipf("cannot bind 127.0.0.2: %v", err)
	}
	defer busy.Close()
	moved := fmt.Sprintf("admin: {listen: '', control_listen: ''}\nlisteners:\n  - {name: a, listen: '127.0.0.2:%s', upstream: 127.0.0.1:9}\n  - {name: b, listen: 127.0.0.1:0, upstream: 127.0.0.1:9}\n", port)

	run := newRunning(started)
	cfg, ok := reload([]byte(moved), triggerFile, p, metrics.NewProcess(reg), started, log)
	if ok {
		run.applied(cfg)
	}
	if !strings.Contains(buf.String(), "config reload applied in part") {
		t.Fatalf("premise: want a reload applied in part; log:\n%s", buf.String())
	}
	if p.Addr("a") != nil {
		t.Fatalf("premise: listener a still bound at %v", p.Addr("a"))
	}
	y, err := run.effective()
	if err != nil {
		t.Fatal(err)
	}
	in, err := policy.Parse(y)
	if err != nil {
		t.Fatal(err)
	}
	names := []string{}
	for _, l := range in.Listeners {
		names = append(names, l.Name)
		if l.Name == "a" {
			t.Errorf("GET /v1/config shows listener \"a\" listening on %s, but no listener \"a\" is bound (the reload was applied in part and its bind failed)", l.Listen)
		}
	}
	if len(names) != 1 || names[0] != "b" {
		t.Errorf("GET /v1/config lists listeners %q, want [b]", names)
	}
}
