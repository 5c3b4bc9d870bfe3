package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
)

// ctl runs `livenessproxy ctl args...` in process and returns its exit
// code, stdout and stderr.
func ctl(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := realMain(append([]string{"ctl"}, args...), &out, &errb)
	return code, out.String(), errb.String()
}

// mustCtl runs ctl and fails the test unless it exits 0.
func mustCtl(t *testing.T, args ...string) string {
	t.Helper()
	code, out, errb := ctl(t, args...)
	if code != 0 {
		t.Fatalf("ctl %q: exit %d\nstdout: %s\nstderr: %s", args, code, out, errb)
	}
	return out
}

// rowOf returns the table row that starts with key, as fields.
func rowOf(t *testing.T, table, key string) []string {
	t.Helper()
	for _, l := range strings.Split(table, "\n") {
		if f := strings.Fields(l); len(f) > 0 && f[0] == key {
			return f
		}
	}
	t.Fatalf("no row %s in:\n%s", key, table)
	return nil
}

// Every verb of ctl against the real binary over real sockets: the
// listings as tables and as JSON, the actions with their effect on the
// data plane (a drain keeps the open link, a disable evicts it), the log
// level changed without a restart, the configuration in force, the
// control address found from --config, wait-ready, and each action in the
// proxy's audit log with who asked and the outcome.
func TestCtlAgainstARunningProxy(t *testing.T) {
	a := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	b := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	var adminAddr, controlAddr, echoAddr, poolAddr, cfgPath string
	p := startProcReady(t, func() (string, string) {
		adminAddr, controlAddr, echoAddr, poolAddr = testutil.ClosedAddr(t), testutil.ClosedAddr(t), testutil.ClosedAddr(t), testutil.ClosedAddr(t)
		cfgPath = writeConfig(t, fmt.Sprintf(`admin: {listen: %q, control_listen: %q}
shutdown_grace: 0s
drain_timeout: 100ms
listeners:
  - {name: echo, listen: %q, upstream: %q}
  - {name: pool, listen: %q, pool: {endpoints: [%q, %q]}}
`, adminAddr, controlAddr, echoAddr, a.Addr(), poolAddr, a.Addr(), b.Addr()))
		return cfgPath, controlAddr
	})
	ctlAt := func(args ...string) string { return mustCtl(t, append([]string{"--control", controlAddr}, args...)...) }

	if out := mustCtl(t, "wait-ready", "--control", controlAddr, "--timeout", "10s"); out != "ready\n" {
		t.Fatalf("wait-ready: %q", out)
	}

	table := ctlAt("endpoints")
	if !strings.HasPrefix(table, "ENDPOINT ") {
		t.Fatalf("endpoints table without a header:\n%s", table)
	}
	if row := rowOf(t, table, a.Addr()); row[1] != "healthy" || row[6] != "echo,pool" {
		t.Errorf("endpoints row %q: want healthy, listeners echo,pool", row)
	}
	var eps struct{ Endpoints []map[string]any }
	if err := json.Unmarshal([]byte(ctlAt("endpoints", "-o", "json")), &eps); err != nil || len(eps.Endpoints) != 2 {
		t.Fatalf("-o json endpoints: %v, %v", eps, err)
	}
	if row := rowOf(t, ctlAt("pools"), "pool"); row[1] != "round_robin" || row[4] != a.Addr()+","+b.Addr() && row[4] != b.Addr()+","+a.Addr() {
		t.Errorf("pools row %q", row)
	}

	// A drain keeps the open link; no new link reaches the member.
	c, err := net.Dial("tcp", echoAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	echoOn(t, c, "open")
	if out := ctlAt("drain", a.Addr()); out != a.Addr()+": draining (changed), 1 links left to finish\n" {
		t.Errorf("drain: %q", out)
	}
	if row := rowOf(t, ctlAt("endpoints"), a.Addr()); row[4] != "1" || row[5] != "yes" {
		t.Errorf("after drain, row %q: want 1 link, draining yes", row)
	}
	echoOn(t, c, "still served")
	before := b.Accepted()
	for range 3 {
		if !echoes(poolAddr) {
			t.Fatal("the pool refused a link with a member left")
		}
	}
	if got := b.Accepted() - before; got != 3 {
		t.Errorf("the undrained member took %d of 3 new pool links", got)
	}
	if out := ctlAt("enable", a.Addr()); out != a.Addr()+": enabled (changed)\n" {
		t.Errorf("enable: %q", out)
	}
	echoOn(t, c, "kept across enable")

	// disable evicts; evict counts; an unknown endpoint is an error.
	if out := ctlAt("disable", a.Addr()); out != a.Addr()+": disabled (changed)\n" {
		t.Errorf("disable: %q", out)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("the link to a disabled endpoint is still open")
	}
	ctlAt("enable", a.Addr())
	// (The pool's links to b may still be ending: any count.)
	if out := ctlAt("evict", b.Addr()); !regexp.MustCompile(`^` + regexp.QuoteMeta(b.Addr()) + `: evicted, \d+ links closed\n$`).MatchString(out) {
		t.Errorf("evict: %q", out)
	}
	code, _, errb := ctl(t, "--control", controlAddr, "disable", "10.9.9.9:1")
	if code != 1 || !strings.Contains(errb, `unknown endpoint "10.9.9.9:1"`) || !strings.Contains(errb, "HTTP 404") {
		t.Errorf("disable an unknown endpoint: exit %d, %q", code, errb)
	}

	// The log level, changed without a restart.
	if out := ctlAt("log-level"); out != "info\n" {
		t.Errorf("log-level: %q", out)
	}
	if out := ctlAt("log-level", "debug"); out != "log level debug (was info)\n" {
		t.Errorf("log-level debug: %q", out)
	}
	waitFor(t, 5*time.Second, func() bool { return echoes(echoAddr) }) // the listener binds again after the enable
	waitForLog(t, p.stderr, `"level":"debug"`, `"message":"link closed"`)
	code, _, errb = ctl(t, "--control", controlAddr, "log-level", "trace")
	if code != 1 || !strings.Contains(errb, `"trace" is not one of debug, info, warn, error`) {
		t.Errorf("log-level trace: exit %d, %q", code, errb)
	}

	// The configuration in force, defaults filled in: it parses back.
	y := ctlAt("config")
	cfg, err := policy.Parse([]byte(y))
	if err != nil {
		t.Fatalf("ctl config does not parse back: %v\n%s", err, y)
	}
	if cfg.DrainTimeout.D() != 100*time.Millisecond || cfg.Defaults.WriteTimeout.D() != 10*time.Second || cfg.Log.Level != "debug" || len(cfg.Listeners) != 2 {
		t.Errorf("ctl config: drain %v, write_timeout %v, log.level %s, %d listeners", cfg.DrainTimeout, cfg.Defaults.WriteTimeout, cfg.Log.Level, len(cfg.Listeners))
	}
	var j map[string]any
	if err := json.Unmarshal([]byte(ctlAt("config", "-o", "json")), &j); err != nil || j["drain_timeout"] != "100ms" {
		t.Errorf("ctl config -o json: drain_timeout %v, %v", j["drain_timeout"], err)
	}

	// --config finds the control server (flags after the verb too).
	if out := mustCtl(t, "endpoints", "--config", cfgPath); !strings.Contains(out, b.Addr()) {
		t.Errorf("ctl endpoints --config: %q", out)
	}

	// The audit log: every action, who asked, the outcome.
	waitForLog(t, p.stderr, `"message":"control action"`, `"action":"drain"`, `"endpoint":"`+a.Addr()+`"`,
		`"who":"127.0.0.1:`, `"status":200`, `"outcome":"draining, 1 links left to finish"`)
	waitForLog(t, p.stderr, `"message":"control action"`, `"action":"disable"`, `"outcome":"refused: unknown endpoint"`, `"status":404`)
	waitForLog(t, p.stderr, `"message":"control action"`, `"path":"/v1/log-level"`, `"outcome":"log level info -> debug"`)
}

// ctl over a Unix socket with a token: --config supplies both; without
// the token the server refuses and ctl says why.
func TestCtlUnixSocketAndToken(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	dir := t.TempDir()
	sock, token := filepath.Join(dir, "control.sock"), filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var cfgPath string
	p := startProcUntil(t, func() (string, func() error) {
		cfgPath = writeConfig(t, fmt.Sprintf(`admin: {listen: "", control_listen: "unix:%s", token_file: %q}
shutdown_grace: 0s
listeners:
  - {name: echo, listen: %q, upstream: %q}
`, sock, token, testutil.ClosedAddr(t), peer.Addr()))
		return cfgPath, ctlReady(t, "--config", cfgPath)
	}, nil)
	if out := mustCtl(t, "--config", cfgPath, "disable", peer.Addr()); out != peer.Addr()+": disabled (changed)\n" {
		t.Errorf("disable over the socket: %q", out)
	}
	waitForLog(t, p.stderr, `"action":"disable"`, fmt.Sprintf(`"who":"unix:pid=%d,uid=%d`, os.Getpid(), os.Getuid()))
	wrong := filepath.Join(dir, "wrong")
	if err := os.WriteFile(wrong, []byte("nope"), 0o600); err != nil {
		t.Fatal(err)
	}
	code, _, errb := ctl(t, "--control", "unix:"+sock, "--token-file", wrong, "enable", peer.Addr())
	if code != 1 || !strings.Contains(errb, "a bearer token (admin.token_file) is required (HTTP 401)") {
		t.Errorf("a wrong token: exit %d, %q", code, errb)
	}
	waitForLog(t, p.stderr, `"action":"enable"`, `"status":401`, `"outcome":"refused: no valid bearer token"`)
}

// A broken configuration file (a ConfigMap with a bad key, which the
// proxy rejects while it keeps serving its last good one) does not stop
// ctl: it takes the file's admin section and says why on stderr, and with
// --control given it needs nothing else from the file. Before, every ctl
// call in the pod failed on the file, exactly when an operator needs it.
func TestCtlWithABrokenConfig(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	dir := t.TempDir()
	sock, token := filepath.Join(dir, "control.sock"), filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var good, cfgPath string
	startProcUntil(t, func() (string, func() error) {
		good = fmt.Sprintf(`admin: {listen: "", control_listen: "unix:%s", token_file: %q}
shutdown_grace: 0s
listeners:
  - {name: echo, listen: %q, upstream: %q}
`, sock, token, testutil.ClosedAddr(t), peer.Addr())
		cfgPath = writeConfig(t, good)
		return cfgPath, ctlReady(t, "--config", cfgPath)
	}, nil)
	if err := os.WriteFile(cfgPath, []byte(good+"  - {name: typo, listen: 127.0.0.1:1, upstreem: 127.0.0.1:2}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out, errb := ctl(t, "--config", cfgPath, "disable", peer.Addr())
	if code != 0 || out != peer.Addr()+": disabled (changed)\n" {
		t.Fatalf("ctl disable with a broken --config: exit %d, %q, %q", code, out, errb)
	}
	if !strings.Contains(errb, "using its admin section") || !strings.Contains(errb, "upstreem") {
		t.Errorf("stderr %q: want the file's problem and that its admin section was used", errb)
	}
	// --control and --token-file given: the file is not needed at all;
	// --control alone takes the token from the file's admin section.
	mustCtl(t, "--config", cfgPath, "--control", "unix:"+sock, "--token-file", token, "enable", peer.Addr())
	mustCtl(t, "--config", cfgPath, "--control", "unix:"+sock, "endpoints")

	// A file whose admin section itself is broken is still an error.
	if err := os.WriteFile(cfgPath, []byte("admin: [not, a, mapping]\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, _, errb := ctl(t, "--config", cfgPath, "endpoints"); code != 1 || !strings.Contains(errb, "--config "+cfgPath) {
		t.Errorf("a broken admin section: exit %d, %q; want 1 naming the file", code, errb)
	}
}

// Bad usage exits 2 and says what is wrong; a server that is not there
// exits 1 naming the address.
func TestCtlUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{nil, 2, "a verb is required"},
		{[]string{"reboot"}, 2, `unknown verb "reboot"`},
		{[]string{"disable"}, 2, "disable takes one ENDPOINT"},
		{[]string{"endpoints", "extra"}, 2, `endpoints: unexpected argument "extra"`},
		{[]string{"-o", "yaml", "endpoints"}, 2, `-o "yaml" is not table or json`},
		{[]string{"--bogus", "endpoints"}, 2, "flag provided but not defined: -bogus"},
		{[]string{"--control", "nowhere", "endpoints"}, 1, `--control "nowhere" is not a host:port or unix:/path`},
		{[]string{"--control", testutil.ClosedAddr(t), "endpoints"}, 1, "the control server 127.0.0.1:"},
	} {
		code, _, errb := ctl(t, tc.args...)
		if code != tc.code || !strings.Contains(errb, tc.want) {
			t.Errorf("ctl %q: exit %d, %q; want %d with %q", tc.args, code, errb, tc.code, tc.want)
		}
	}
	if code, out, _ := ctl(t, "--help"); code != 0 || !strings.Contains(out, "drain ENDPOINT") || !strings.Contains(out, "--token-file FILE") || !strings.Contains(out, "  -o FORMAT") {
		t.Errorf("ctl --help: exit %d\n%s", code, out)
	}
}
