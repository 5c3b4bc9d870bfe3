package main

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// The test binary doubles as the livenessproxy binary when LP_BE_MAIN=1,
// so the end-to-end tests run the real main with real signals.
func TestMain(m *testing.M) {
	if os.Getenv("LP_BE_MAIN") == "1" {
		os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
	}
	goleak.VerifyTestMain(m)
}

func writeConfig(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestCheck(t *testing.T) {
	good := writeConfig(t, "listeners:\n  - {name: a, listen: 127.0.0.1:18098, upstream: pinot:8098}\n")
	var out, errb bytes.Buffer
	if code := realMain([]string{"check", "--config", good}, &out, &errb); code != 0 {
		t.Fatalf("check good config: exit %d, stderr %q", code, errb.String())
	}
	bad := writeConfig(t, `defaults:
  write_buffer: {high_water_mark: 1MiB, low_water_mark: 2MiB}
listeners:
  - {name: a, listen: 127.0.0.1:18098, upstream: pinot:8098, write_timeot: 1s}
`)
	out.Reset()
	errb.Reset()
	if code := realMain([]string{"check", "--config", bad}, &out, &errb); code != 1 {
		t.Fatalf("check bad config: exit %d, want 1", code)
	}
	lines := strings.Split(strings.TrimSpace(errb.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("want one line per problem (2), got %q", errb.String())
	}
	for _, want := range []string{"listeners[0].write_timeot: unknown key", "defaults.write_buffer.low_water_mark"} {
		if !strings.Contains(errb.String(), want) {
			t.Errorf("check output %q does not name %q", errb.String(), want)
		}
	}
}

func TestVersionAndUsage(t *testing.T) {
	var out, errb bytes.Buffer
	if code := realMain([]string{"version"}, &out, &errb); code != 0 || !strings.HasPrefix(out.String(), "livenessproxy ") {
		t.Fatalf("version: exit %d, %q", code, out.String())
	}
	if code := realMain([]string{"frobnicate"}, &out, &errb); code != 2 {
		t.Fatalf("unknown verb: exit %d, want 2", code)
	}
	if code := realMain([]string{"run"}, &out, &errb); code != 2 || !strings.Contains(errb.String(), "--config") {
		t.Fatalf("run without --config: exit %d, %q", code, errb.String())
	}
}

// The real binary: listeners and both admin servers come up, /readyz
// turns ready, /metrics carries the listener's series and build_info, a
// link works, the actions are on the control server only, and SIGTERM
// drains and exits 0. Log lines are JSON with millisecond timestamps.
func TestRunServesAndDrainsOnSIGTERM(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	var adminAddr, controlAddr, listenAddr string
	p := startProcUntil(t, func() (string, func() error) {
		adminAddr, controlAddr, listenAddr = testutil.ClosedAddr(t), testutil.ClosedAddr(t), testutil.ClosedAddr(t)
		return writeConfig(t, fmt.Sprintf(`admin: {listen: %q, control_listen: %q}
log: {level: debug}
drain_timeout: 300ms
shutdown_grace: 0s
listeners:
  - {name: echo, listen: %q, upstream: %q}
`, adminAddr, controlAddr, listenAddr, peer.Addr())), readyzOf(adminAddr)
	}, nil, "--log-level", "info")
	stderr := p.stderr

	base := "http://" + adminAddr
	if s := httpStatus(base + "/healthz"); s != 200 {
		t.Fatalf("/healthz = %d", s)
	}

	c, err := net.Dial("tcp", listenAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	msg := []byte("through the binary")
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("echo through proxy: %q, %v", got, err)
	}

	resp, err := httpc.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	b := currentBuild()
	for _, want := range []string{
		fmt.Sprintf(`livenessproxy_build_info{goversion=%q,revision=%q,version=%q} 1`, b.goVersion, b.revision, b.version),
		`livenessproxy_links_total{listener="echo"} 1`,
		`livenessproxy_links_active{listener="echo"} 1`,
		`livenessproxy_bytes_total{direction="request",listener="echo"} 18`,
		`livenessproxy_link_closes_total{listener="echo",reason="write_timeout"} 0`,
	} {
		if !bytes.Contains(body, []byte(want)) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	// The actions are served on control_listen, not on admin.listen.
	if s := httpStatus("http://" + controlAddr + "/v1/endpoints"); s != 200 {
		t.Errorf("control server GET /v1/endpoints = %d", s)
	}
	resp, err = httpc.Post(base+"/v1/endpoints/"+peer.Addr()+"/disable", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 404 || !bytes.Contains(body, []byte("control_listen")) {
		t.Errorf("POST an action to admin.listen: %d %s, want 404 naming control_listen", resp.StatusCode, body)
	}

	begin := time.Now()
	p.signal(syscall.SIGTERM)
	if err := p.wait(5 * time.Second); err != nil {
		t.Fatalf("exit after SIGTERM: %v\n%s", err, stderr.String())
	}
	// The open link was given the 300ms drain, then cut.
	if d := time.Since(begin); d < 250*time.Millisecond {
		t.Fatalf("exited after %v, before the drain timeout with a link open", d)
	}
	if _, err := c.Read(got); err == nil {
		t.Fatal("link still open after exit")
	}
	var sawDrain, sawLimits bool
	for _, l := range jsonLines(t, stderr.String()) {
		if ts, _ := l["time"].(string); !msTime.MatchString(ts) {
			t.Errorf("log line %v: time is not RFC 3339 with milliseconds", l)
		}
		switch l["message"] {
		case "draining":
			sawDrain = l["drain_timeout_ms"] == 300.0
		case "limits":
			// The budget in force and where it came from, at start.
			sawLimits = l["memory_budget_bytes"].(float64) > 0 && l["memory_budget_source"] == "half of memory" &&
				l["memory_source"] != nil && l["max_links"].(float64) > 0
		case "livenessproxy started":
			if l["version"] != b.version || l["revision"] != b.revision {
				t.Errorf("start line %v: want version %s, revision %s", l, b.version, b.revision)
			}
		}
	}
	if !sawLimits {
		t.Errorf("no limits log line with the budget and its source in:\n%s", stderr.String())
	}
	if !sawDrain {
		t.Errorf("no drain log line with drain_timeout_ms 300 in:\n%s", stderr.String())
	}
}

// httpc keeps no idle connections, so no transport goroutine outlives a test.
var httpc = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 2 * time.Second}

func httpStatus(url string) int {
	resp, err := httpc.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// readyzOf is a startProcUntil check: the admin server at adminAddr
// says ready.
func readyzOf(adminAddr string) func() error {
	return func() error {
		if s := httpStatus("http://" + adminAddr + "/readyz"); s != 200 {
			return fmt.Errorf("GET /readyz: %d", s)
		}
		return nil
	}
}

func waitFor(t *testing.T, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %v", within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A ConfigMap-style update (the file is a symlink into a directory that is
// swapped) adds a listener; a broken update is rejected and the last good
// config keeps serving; SIGHUP reloads on demand.
func TestReloadFromConfigMapSwap(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	var dir, adminAddr, aAddr, one string
	write := func(gen, body string) {
		t.Helper()
		d := filepath.Join(dir, gen)
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "config.yaml"), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		tmp := filepath.Join(dir, "..data_tmp")
		if err := os.Symlink(gen, tmp); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
			t.Fatal(err)
		}
	}
	p := startProcUntil(t, func() (string, func() error) {
		dir, adminAddr, aAddr = t.TempDir(), testutil.ClosedAddr(t), testutil.ClosedAddr(t)
		one = fmt.Sprintf("admin: {listen: %q, control_listen: ''}\nlisteners:\n  - {name: a, listen: %q, upstream: %q}\n", adminAddr, aAddr, peer.Addr())
		write("gen1", one)
		cfgPath := filepath.Join(dir, "config.yaml")
		if err := os.Symlink(filepath.Join("..data", "config.yaml"), cfgPath); err != nil {
			t.Fatal(err)
		}
		return cfgPath, readyzOf(adminAddr)
	}, nil)
	base := "http://" + adminAddr
	stderr := p.stderr

	bAddr := testutil.ClosedAddr(t) // picked late: another process may take it until the reload binds it
	write("gen2", one+fmt.Sprintf("  - {name: b, listen: %q, upstream: %q}\n", bAddr, peer.Addr()))
	waitFor(t, 5*time.Second, func() bool { return echoes(bAddr) })
	waitForLog(t, stderr, `"trigger":"file","listeners":2,"listeners_added":["b"],"time":`, `"message":"config reloaded"`)

	write("gen3", one+"  - {name: c, listen: 127.0.0.1:1, upstream: x:1, write_timout: 1s}\n")
	waitFor(t, 5*time.Second, func() bool {
		return strings.Contains(stderr.String(), "listeners[1].write_timout: unknown key")
	})
	if !echoes(aAddr) || !echoes(bAddr) {
		t.Fatal("the last good config stopped serving after a broken update")
	}
	p.signal(syscall.SIGHUP)
	waitForLog(t, stderr, `"trigger":"sighup","problems":["listeners[1].write_timout: unknown key (line 4)"],"time":`,
		`"message":"config reload rejected; keeping the last good config"`)
	waitFor(t, 5*time.Second, func() bool {
		resp, err := httpc.Get(base + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return bytes.Contains(body, []byte(`livenessproxy_config_reloads_total{result="error"} 2`)) &&
			bytes.Contains(body, []byte(`livenessproxy_config_reloads_total{result="ok"} 1`))
	})
}

// waitForLog waits until a line of the child's log has every part of want.
func waitForLog(t *testing.T, log *syncBuffer, want ...string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		for l := range strings.SplitSeq(log.String(), "\n") {
			n := 0
			for _, w := range want {
				if strings.Contains(l, w) {
					n++
				}
			}
			if n == len(want) {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no log line has all of %q within 5s:\n%s", want, log.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// echoes reports whether a round trip through addr works.
func echoes(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		return false
	}
	got := make([]byte, 4)
	_, err = io.ReadFull(c, got)
	return err == nil && string(got) == "ping"
}

// syncBuffer is a bytes.Buffer safe for the child's writes and our reads.
type syncBuffer = testutil.SyncBuffer
