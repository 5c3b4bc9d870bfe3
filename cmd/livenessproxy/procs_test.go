package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// check names GOMAXPROCS and where it comes from: limits.procs (1 when the
// config says nothing), the runtime's default for 0, the environment's
// GOMAXPROCS over both.
func TestCheckNamesGOMAXPROCS(t *testing.T) {
	const listener = "listeners:\n  - {name: a, listen: 127.0.0.1:18098, upstream: pinot:8098}\n"
	t.Setenv("GOMAXPROCS", "")
	for _, tc := range []struct {
		name, env, limits, want string
	}{
		{"default", "", "", "GOMAXPROCS: 1 (limits.procs)\n"},
		{"key", "", "limits: {procs: 4}\n", "GOMAXPROCS: 4 (limits.procs)\n"},
		{"runtime's default", "", "limits: {procs: 0}\n",
			"GOMAXPROCS: " + strconv.Itoa(runtime.GOMAXPROCS(0)) + " (limits.procs 0: the Go runtime's default from the CPUs, the affinity mask and the cgroup's CPU limit)\n"},
		{"environment", "3", "limits: {procs: 4}\n", "GOMAXPROCS: 3 (GOMAXPROCS=3 (environment))\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("GOMAXPROCS", tc.env)
			cfg := writeConfig(t, tc.limits+listener)
			var out, errb bytes.Buffer
			if code := realMain([]string{"check", "--config", cfg}, &out, &errb); code != 0 {
				t.Fatalf("check: exit %d, stderr %q", code, errb.String())
			}
			if !strings.Contains(out.String(), tc.want) {
				t.Fatalf("check output lacks %q:\n%s", tc.want, out.String())
			}
		})
	}
	var out, errb bytes.Buffer
	cfg := writeConfig(t, "limits: {procs: -1}\n"+listener)
	if code := realMain([]string{"check", "--config", cfg}, &out, &errb); code != 1 || !strings.Contains(errb.String(), "limits.procs: -1 is negative") {
		t.Fatalf("check with limits.procs -1: exit %d, stderr %q", code, errb.String())
	}
}

// The binary runs Go code on one thread by default (the start log and the
// runtime's own gauge say so), and a reload that changes limits.procs
// applies it.
func TestRunAppliesGOMAXPROCS(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	var adminAddr, listenAddr, body, cfgPath string
	p := startProcUntil(t, func() (string, func() error) {
		adminAddr, listenAddr = testutil.ClosedAddr(t), testutil.ClosedAddr(t)
		body = fmt.Sprintf("admin: {listen: %q, control_listen: ''}\nshutdown_grace: 0s\nlisteners:\n  - {name: a, listen: %q, upstream: %q}\n", adminAddr, listenAddr, peer.Addr())
		cfgPath = writeConfig(t, body)
		return cfgPath, readyzOf(adminAddr)
	}, []string{"GOMAXPROCS="})
	stderr := p.stderr
	base := "http://" + adminAddr
	waitForLog(t, stderr, `"gomaxprocs":1,"gomaxprocs_source":"limits.procs"`, `"message":"limits"`)
	waitFor(t, 5*time.Second, func() bool { return gauge(base, "go_sched_gomaxprocs_threads 1\n") })

	if err := os.WriteFile(cfgPath, []byte("limits: {procs: 2}\n"+body), 0o600); err != nil {
		t.Fatal(err)
	}
	p.signal(syscall.SIGHUP)
	waitForLog(t, stderr, `"gomaxprocs":2,"was":1,"gomaxprocs_source":"limits.procs"`, `"message":"GOMAXPROCS changed"`)
	waitFor(t, 5*time.Second, func() bool { return gauge(base, "go_sched_gomaxprocs_threads 2\n") })
	if !echoes(listenAddr) {
		t.Fatal("no round trip through the proxy after the reload")
	}
}

// gauge reports whether the admin server's /metrics holds line.
func gauge(base, line string) bool {
	resp, err := httpc.Get(base + "/metrics")
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return bytes.Contains(body, []byte(line))
}
