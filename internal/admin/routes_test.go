package admin

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// Every answer is JSON, the mux's own 404s and 405s too (a path no route
// has, a route's trailing slash, a method a route does not take), on both
// servers; GET / lists each server's routes.
func TestJSONErrorsAndIndex(t *testing.T) {
	f := setup(t)
	for _, base := range []string{f.url, f.ctl} {
		for _, tc := range []struct {
			method, path string
			code         int
			body         string
		}{
			{"GET", "/v1/nope", 404, `no such route \"/v1/nope\"; GET / lists the routes`},
			{"GET", "/metrics/", 404, `no such route \"/metrics/\"`},
			{"GET", "/nope", 404, `"error"`},
			{"POST", "/healthz", 405, `"error": "method not allowed; use GET, HEAD"`},
			{"DELETE", "/v1/endpoints", 405, `"error": "method not allowed; use GET"`},
			{"PUT", "/v1/config", 405, `"error": "method not allowed; use GET"`},
		} {
			code, body, h := f.send(base, tc.method, tc.path, "", http.Header{ControlHeader: {"1"}})
			if code != tc.code || !strings.Contains(body, tc.body) || h.Get("Content-Type") != "application/json" {
				t.Errorf("%s %s %s = %d %s (%s), want %d JSON with %s", base, tc.method, tc.path, code, body, h.Get("Content-Type"), tc.code, tc.body)
			}
			var v map[string]any
			if err := json.Unmarshal([]byte(body), &v); err != nil {
				t.Errorf("%s %s %s: not JSON: %v", base, tc.method, tc.path, err)
			}
		}
	}

	index := func(base string) (server string, paths []string) {
		code, body := f.doAt(base, "GET", "/")
		var v struct {
			Server string
			Routes []route
		}
		if err := json.Unmarshal([]byte(body), &v); code != 200 || err != nil {
			t.Fatalf("GET / = %d %s (%v)", code, body, err)
		}
		for _, r := range v.Routes {
			if r.What == "" {
				t.Errorf("route %s %s has no description", r.Method, r.Path)
			}
			paths = append(paths, r.Method+" "+r.Path)
		}
		return v.Server, paths
	}
	server, read := index(f.url)
	if server != "read" {
		t.Errorf("read server calls itself %q", server)
	}
	for _, want := range []string{"GET /metrics", "GET /healthz", "GET /readyz", "GET /v1/endpoints", "GET /v1/pools", "GET /v1/config", "GET /v1/log-level"} {
		if !strings.Contains(strings.Join(read, "\n")+"\n", want+"\n") {
			t.Errorf("the read server's GET / lacks %s: %q", want, read)
		}
	}
	for _, p := range read {
		if strings.HasPrefix(p, "POST") {
			t.Errorf("the read server lists an action: %s", p)
		}
	}
	server, control := index(f.ctl)
	if server != "control" {
		t.Errorf("control server calls itself %q", server)
	}
	for _, want := range []string{"POST /v1/endpoints/{endpoint}/disable", "POST /v1/endpoints/{endpoint}/enable",
		"POST /v1/endpoints/{endpoint}/evict", "POST /v1/endpoints/{endpoint}/drain", "POST /v1/log-level", "GET /v1/config"} {
		if !strings.Contains(strings.Join(control, "\n")+"\n", want+"\n") {
			t.Errorf("the control server's GET / lacks %s: %q", want, control)
		}
	}
}

// The control server on loopback without a token refuses what a web page
// could make a browser send (issue 20, item 7): a request with an Origin
// or a cross-site Sec-Fetch-Site, a Host that is not loopback (DNS
// rebinding), a change without ControlHeader (a "simple" cross-origin
// POST, which needs no preflight), and it grants no preflight. Nothing
// changes; the refusals are in the audit log. Its healthy twin: curl-style
// reads need nothing, and a change with the header is served.
func TestControlRefusesBrowserRequests(t *testing.T) {
	f := setup(t)
	ep := f.peer.Addr()
	action := "/v1/endpoints/" + ep + "/disable"
	for _, tc := range []struct {
		name   string
		method string
		header http.Header
		body   string
		want   string
	}{
		{"form post from a page", "POST", http.Header{"Origin": {"https://evil.example"}, "Content-Type": {"application/x-www-form-urlencoded"}}, "a=b", "Origin header"},
		{"origin with the header", "POST", http.Header{"Origin": {"null"}, ControlHeader: {"1"}}, "", "Origin header"},
		{"fetch no-cors", "POST", http.Header{"Sec-Fetch-Site": {"cross-site"}, "Content-Type": {"text/plain"}}, "x", "Sec-Fetch-Site: cross-site"},
		{"dns rebinding", "POST", http.Header{"Host": {"evil.example:9902"}, ControlHeader: {"1"}}, "", "Host evil.example:9902 is not a loopback address"},
		{"simple post without the header", "POST", http.Header{"Content-Type": {"text/plain"}}, "x", "needs the header " + ControlHeader},
	} {
		code, body, _ := f.send(f.ctl, tc.method, action, tc.body, tc.header)
		if code != http.StatusForbidden || !strings.Contains(body, tc.want) {
			t.Errorf("%s: %d %s, want 403 with %q", tc.name, code, body, tc.want)
		}
	}
	// A preflight is never granted.
	code, _, h := f.send(f.ctl, "OPTIONS", action, "", http.Header{"Origin": {"https://evil.example"},
		"Access-Control-Request-Method": {"POST"}, "Access-Control-Request-Headers": {ControlHeader}})
	if code/100 == 2 || h.Get("Access-Control-Allow-Origin") != "" || h.Get("Access-Control-Allow-Headers") != "" {
		t.Errorf("preflight: %d, Access-Control-Allow-Origin %q: granted", code, h.Get("Access-Control-Allow-Origin"))
	}
	if st := f.endpoints()[0].State; st != "healthy" {
		t.Fatalf("endpoint %s after refused requests", st)
	}
	if !strings.Contains(f.audit.String(), `"outcome":"refused: a request with an Origin header`) {
		t.Errorf("refusals not in the audit log:\n%s", f.audit.String())
	}

	// The healthy twins: reads with nothing special (Host 127.0.0.1,
	// localhost or [::1]); a change with the header.
	for _, host := range []string{"", "localhost:9902", "[::1]:9902", "127.0.0.9"} {
		hdr := http.Header{}
		if host != "" {
			hdr.Set("Host", host)
		}
		if code, body, _ := f.send(f.ctl, "GET", "/v1/endpoints", "", hdr); code != 200 {
			t.Errorf("GET /v1/endpoints with Host %q = %d %s", host, code, body)
		}
	}
	if code, body := f.control("POST", action); code != 200 || !strings.Contains(body, `"changed": true`) {
		t.Fatalf("disable with %s = %d %s", ControlHeader, code, body)
	}
}

// drain over the API: the open link is kept and listed, the endpoint
// shows draining; enable ends it. The audit line says who and what.
func TestDrainAPI(t *testing.T) {
	f := setup(t)
	ep := f.peer.Addr()
	c := f.link()
	code, body := f.control("POST", "/v1/endpoints/"+ep+"/drain")
	if code != 200 || !strings.Contains(body, `"changed": true`) || !strings.Contains(body, `"live_links": 1`) {
		t.Fatalf("drain = %d %s", code, body)
	}
	roundTrip(t, c) // not evicted
	if e := f.endpoints()[0]; !e.Draining || e.LiveLinks != 1 || e.State != "healthy" {
		t.Fatalf("after drain: %+v", e)
	}
	if code, body := f.do("POST", "/v1/endpoints/"+ep+"/drain"); code != 404 || !strings.Contains(body, "admin.control_listen") {
		t.Errorf("drain on the read-only server = %d %s", code, body)
	}
	if code, body := f.control("POST", "/v1/endpoints/"+ep+"/enable"); code != 200 || !strings.Contains(body, `"changed": true`) {
		t.Fatalf("enable = %d %s", code, body)
	}
	roundTrip(t, c)
	if f.endpoints()[0].Draining {
		t.Fatal("still draining after enable")
	}
	for _, want := range []string{`"action":"drain"`, `"endpoint":"` + ep + `"`, `"who":"127.0.0.1:`, `"status":200`, `"outcome":"draining, 1 links left to finish"`} {
		if !strings.Contains(f.audit.String(), want) {
			t.Errorf("audit log lacks %s:\n%s", want, f.audit.String())
		}
	}
}

// The log level: read on both servers, set on the control server only; a
// bad level or body is refused with the reason.
func TestLogLevelAPI(t *testing.T) {
	f := setup(t)
	if code, body := f.do("GET", "/v1/log-level"); code != 200 || !strings.Contains(body, `"level": "info"`) {
		t.Fatalf("GET /v1/log-level = %d %s", code, body)
	}
	hdr := http.Header{ControlHeader: {"1"}, "Content-Type": {"application/json"}}
	if code, body, _ := f.send(f.ctl, "POST", "/v1/log-level", `{"level": "debug"}`, hdr); code != 200 ||
		!strings.Contains(body, `"previous": "info"`) || !strings.Contains(body, `"changed": true`) {
		t.Fatalf("POST /v1/log-level = %d %s", code, body)
	}
	if f.level.Get() != "debug" {
		t.Fatalf("level %s after the POST", f.level.Get())
	}
	for _, bad := range []string{`{"level": "trace"}`, `{"lvl": "info"}`, `debug`} {
		if code, body, _ := f.send(f.ctl, "POST", "/v1/log-level", bad, hdr); code != 400 {
			t.Errorf("POST /v1/log-level %s = %d %s, want 400", bad, code, body)
		}
	}
	if code, body, _ := f.send(f.url, "POST", "/v1/log-level", `{"level": "error"}`, hdr); code != 404 || !strings.Contains(body, "admin.control_listen") {
		t.Errorf("POST /v1/log-level on the read-only server = %d %s", code, body)
	}
	if f.level.Get() != "debug" {
		t.Fatalf("level %s: changed by a refused request", f.level.Get())
	}
	if !strings.Contains(f.audit.String(), `"outcome":"log level info -> debug"`) {
		t.Errorf("audit log lacks the change:\n%s", f.audit.String())
	}
}

// GET /v1/config: the configuration as JSON, or as YAML.
func TestConfigAPI(t *testing.T) {
	f := setup(t)
	code, body := f.do("GET", "/v1/config")
	var v map[string]any
	if err := json.Unmarshal([]byte(body), &v); code != 200 || err != nil || v["listeners"] == nil || v["defaults"] == nil {
		t.Fatalf("GET /v1/config = %d %.300s (%v)", code, body, err)
	}
	code, body, h := f.send(f.ctl, "GET", "/v1/config?format=yaml", "", nil)
	if code != 200 || h.Get("Content-Type") != "application/yaml" || !strings.Contains(body, "listeners:") {
		t.Fatalf("GET /v1/config?format=yaml = %d %s %.300s", code, h.Get("Content-Type"), body)
	}
}

// link opens a link through the listener "echo" and makes a round trip.
func (f *fixture) link() net.Conn {
	f.t.Helper()
	c, err := net.Dial("tcp", f.p.Addr("echo").String())
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { _ = c.Close() })
	roundTrip(f.t, c)
	return c
}

// roundTrip sends a byte on c and reads the echo.
func roundTrip(t *testing.T, c net.Conn) {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
}
