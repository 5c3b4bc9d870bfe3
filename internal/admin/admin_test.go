package admin

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var client = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}

type fixture struct {
	t    *testing.T
	url  string
	p    *proxy.Proxy
	peer *faultpeer.Server
}

func setup(t *testing.T) *fixture {
	t.Helper()
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{{Name: "echo", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: cfg.Defaults}}
	m := metrics.New()
	p := proxy.New(cfg, proxy.Options{Metrics: m})
	var ready atomic.Bool
	ts := httptest.NewServer(Handler(m.Registry, ready.Load, p))
	t.Cleanup(ts.Close)
	t.Cleanup(func() { _ = p.Close() })
	f := &fixture{t: t, url: ts.URL, p: p, peer: peer}
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
	req, _ := http.NewRequest(method, f.url+path, nil)
	resp, err := client.Do(req)
	if err != nil {
		f.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
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
	c, err := net.Dial("tcp", f.p.Addr("echo").String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}

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
		code, body := f.do(tc.method, tc.path)
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
	if code, body := f.do("POST", "/v1/endpoints/"+ep+"/enable"); code != 200 || !strings.Contains(body, `"changed": true`) {
		t.Fatalf("enable = %d %s", code, body)
	}
	if eps := f.endpoints(); eps[0].State != "healthy" {
		t.Fatalf("after enable: %+v", eps[0])
	}
	if code, body := f.do("POST", "/v1/endpoints/"+ep+"/evict"); code != 200 || !strings.Contains(body, `"links_closed": 0`) {
		t.Fatalf("evict = %d %s", code, body)
	}
}
