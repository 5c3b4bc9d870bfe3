package admin

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"go.uber.org/goleak"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var client = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}

type fixture struct {
	t     *testing.T
	url   string // the read-only server
	ctl   string // the control server
	p     *proxy.Proxy
	peer  *faultpeer.Server
	level *testLevel
	audit *testutil.SyncBuffer // the control server's log
}

// testLevel is a run-time log level for the handlers' tests.
type testLevel struct {
	mu   sync.Mutex
	name string
}

func (l *testLevel) Get() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.name
}

func (l *testLevel) Set(name string) error {
	if !slices.Contains([]string{"debug", "info", "warn", "error"}, name) {
		return fmt.Errorf("log level %q is not one of debug, info, warn, error", name)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.name = name
	return nil
}

func setup(t *testing.T) *fixture {
	t.Helper()
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{{Name: "echo", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: cfg.Defaults}}
	reg := prometheus.NewRegistry()
	p := proxy.New(cfg, proxy.Options{Registerer: reg})
	var ready atomic.Bool
	level := &testLevel{name: "info"}
	rt := Runtime{Level: level, Config: cfg.Effective}
	ts := httptest.NewServer(ReadHandler(reg, ready.Load, p, rt))
	t.Cleanup(ts.Close)
	audit := &testutil.SyncBuffer{}
	cs := httptest.NewServer(ControlHandler(p, ControlOptions{Loopback: true, Ready: ready.Load, Runtime: rt, Log: zerolog.New(audit)}))
	t.Cleanup(cs.Close)
	t.Cleanup(func() { _ = p.Close() })
	f := &fixture{t: t, url: ts.URL, ctl: cs.URL, p: p, peer: peer, level: level, audit: audit}
	if code, _ := f.do("GET", "/readyz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz before start = %d, want 503", code)
	}
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	ready.Store(p.Ready())
	return f
}

func (f *fixture) do(method, path string) (int, string) {
	f.t.Helper()
	return f.doAt(f.url, method, path)
}

// control sends a request to the control server.
func (f *fixture) control(method, path string) (int, string) {
	f.t.Helper()
	return f.doAt(f.ctl, method, path)
}

func (f *fixture) doAt(base, method, path string) (int, string) {
	f.t.Helper()
	code, body, _ := f.send(base, method, path, "", http.Header{ControlHeader: {"1"}})
	return code, body
}

// send sends one request with header and body and returns the status,
// body and headers of the answer.
func (f *fixture) send(base, method, path, body string, header http.Header) (int, string, http.Header) {
	f.t.Helper()
	req, _ := http.NewRequest(method, base+path, strings.NewReader(body))
	for k, vs := range header {
		if k == "Host" {
			req.Host = vs[0]
			continue
		}
		req.Header[k] = vs
	}
	resp, err := client.Do(req)
	if err != nil {
		f.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header
}

func (f *fixture) endpoints() []proxy.EndpointStatus {
	f.t.Helper()
	code, body := f.do("GET", "/v1/endpoints")
	if code != 200 {
		f.t.Fatalf("GET /v1/endpoints = %d %s", code, body)
	}
	var out struct{ Endpoints []proxy.EndpointStatus }
	if err := json.Unmarshal([]byte(body), &out); err != nil {
		f.t.Fatalf("decoding %s: %v", body, err)
	}
	return out.Endpoints
}

func TestHealthAndReadiness(t *testing.T) {
	f := setup(t)
	for path, want := range map[string]string{"/healthz": "ok\n", "/readyz": "ready\n"} {
		if code, body := f.do("GET", path); code != 200 || body != want {
			t.Errorf("GET %s = %d %q, want 200 %q", path, code, body, want)
		}
	}
	code, body := f.do("GET", "/metrics")
	if code != 200 || !strings.Contains(body, `livenessproxy_endpoint_state{endpoint="`+f.peer.Addr()+`",listener="echo",state="healthy"} 1`) {
		t.Errorf("GET /metrics = %d, endpoint_state missing:\n%.2000s", code, body)
	}
}

func TestEndpointsAPI(t *testing.T) {
	f := setup(t)
	ep := f.peer.Addr()
	c := f.link()

	eps := f.endpoints()
	if len(eps) != 1 || eps[0].Endpoint != ep || eps[0].State != "healthy" || eps[0].LiveLinks != 1 ||
		len(eps[0].Listeners) != 1 || eps[0].Listeners[0] != "echo" {
		t.Fatalf("GET /v1/endpoints = %+v", eps)
	}

	for _, tc := range []struct {
		method, path string
		code         int
		body         string // a substring
	}{
		{"POST", "/v1/endpoints", 405, `"error": "method not allowed; use GET"`},
		{"GET", "/v1/endpoints/" + ep + "/disable", 405, `"error": "method not allowed; use POST"`},
		{"POST", "/v1/endpoints/" + ep + "/reboot", 404, `unknown action \"reboot\"`},
		{"POST", "/v1/endpoints/10.9.9.9:1/disable", 404, `unknown endpoint \"10.9.9.9:1\"`},
		{"POST", "/v1/endpoints/" + ep + "/disable", 200, `"changed": true`},
		{"POST", "/v1/endpoints/" + ep + "/disable", 200, `"changed": false`},
	} {
		code, body := f.control(tc.method, tc.path)
		if code != tc.code || !strings.Contains(body, tc.body) {
			t.Errorf("%s %s = %d %s, want %d with %s", tc.method, tc.path, code, body, tc.code, tc.body)
		}
	}
	if eps := f.endpoints(); eps[0].State != "disabled" {
		t.Fatalf("after disable: %+v", eps[0])
	}
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("link to a disabled endpoint still open")
	}
	if code, body := f.control("POST", "/v1/endpoints/"+ep+"/enable"); code != 200 || !strings.Contains(body, `"changed": true`) {
		t.Fatalf("enable = %d %s", code, body)
	}
	if eps := f.endpoints(); eps[0].State != "healthy" {
		t.Fatalf("after enable: %+v", eps[0])
	}
	if code, body := f.control("POST", "/v1/endpoints/"+ep+"/evict"); code != 200 || !strings.Contains(body, `"links_closed": 0`) {
		t.Fatalf("evict = %d %s", code, body)
	}
}

// The read-only server never runs an action, whatever the caller sends: it
// points at the control server instead.
func TestReadServerRefusesActions(t *testing.T) {
	f := setup(t)
	ep := f.peer.Addr()
	for _, action := range []string{"disable", "enable", "evict"} {
		code, body := f.do("POST", "/v1/endpoints/"+ep+"/"+action)
		if code != http.StatusNotFound || !strings.Contains(body, "admin.control_listen") {
			t.Errorf("POST %s on the read-only server = %d %s, want 404 naming admin.control_listen", action, code, body)
		}
	}
	if eps := f.endpoints(); eps[0].State != "healthy" {
		t.Fatalf("endpoint %s after actions sent to the read-only server", eps[0].State)
	}
	if code, body := f.do("GET", "/v1/pools"); code != 200 || !strings.Contains(body, `"listener": "echo"`) {
		t.Fatalf("GET /v1/pools = %d %s", code, body)
	}
}

// startLog is the admin servers' log in startAdmin: a test that reads it
// sets it (none runs in parallel).
var startLog = zerolog.Nop()

// startAdmin starts the admin servers for a real proxy in front of an echo
// peer; it returns them and the proxy.
func startAdmin(t *testing.T, cfg Config) (*Server, *proxy.Proxy, string) {
	t.Helper()
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	pc := policy.DefaultConfig()
	pc.Listeners = []policy.Listener{{Name: "echo", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: pc.Defaults}}
	reg := prometheus.NewRegistry()
	p := proxy.New(pc, proxy.Options{Registerer: reg})
	t.Cleanup(func() { _ = p.Close() })
	s, err := Start(cfg, reg, func() bool { return true }, p, startLog)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Shutdown(context.Background()) })
	return s, p, peer.Addr()
}

// The actions on a Unix socket: reachable only through the file system.
func TestControlOnUnixSocket(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "control.sock")
	_, _, ep := startAdmin(t, Config{ControlListen: "unix:" + sock})
	fi, err := os.Stat(sock)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket %v (%v), want mode 0600", fi, err)
	}
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}}}
	defer c.CloseIdleConnections()
	req, _ := http.NewRequest("POST", "http://control/v1/endpoints/"+ep+"/disable", nil)
	req.Header.Set(ControlHeader, "1")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"changed": true`) {
		t.Fatalf("disable over the socket = %d %s", resp.StatusCode, b)
	}
}

// Each server holds at most MaxConns connections: idle keep-alive clients
// cannot pin descriptors and memory without bound, and IdleTimeout frees
// their slots.
func TestAdminConnectionCap(t *testing.T) {
	s, _, _ := startAdmin(t, Config{Listen: "127.0.0.1:0", MaxConns: 2, IdleTimeout: 300 * time.Millisecond})
	addr := s.Addr().String()
	get := func(c net.Conn) error {
		if _, err := io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			return err
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.Body.Close()
	}
	var idle []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := get(c); err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c) // kept alive, idle
	}
	third, err := net.Dial("tcp", addr) // the kernel completes it; the server does not take it yet
	if err != nil {
		t.Fatal(err)
	}
	defer third.Close()
	_ = third.SetDeadline(time.Now().Add(10 * time.Second))
	if err := get(third); err != nil {
		t.Fatalf("third connection: %v", err)
	}
	// It was served only once an idle one was closed by the server.
	closed := 0
	for _, c := range idle {
		_ = c.SetReadDeadline(time.Now().Add(time.Second))
		if _, err := c.Read(make([]byte, 1)); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			closed++
		}
	}
	if closed == 0 {
		t.Fatal("the third connection was served while both idle ones were still open: no cap")
	}
}
