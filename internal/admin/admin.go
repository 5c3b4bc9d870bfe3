// Package admin serves livenessproxy's admin HTTP API in two servers: a
// read-only one (/metrics, /healthz, /readyz, GET /v1/endpoints,
// /v1/pools, /v1/config, /v1/log-level) that may listen on the pod
// address, and a control one for the operator's actions (disable, enable,
// evict, drain, the log level), on loopback or a Unix socket unless an
// operator opts into a network address with a bearer token. Every route
// answers JSON, its errors too; GET / lists the routes.
package admin

import (
	"bytes"
	"cmp"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/proxy"
)

// Endpoints is the data plane's endpoint API (implemented by *proxy.Proxy).
type Endpoints interface {
	Endpoints() []proxy.EndpointStatus
	Pools() []proxy.PoolStatus
	Disable(endpoint string) (bool, error)
	Enable(endpoint string) (bool, error)
	Evict(endpoint string) (int, error)
	Drain(endpoint string) (changed bool, links int, err error)
}

// Runtime is what the admin servers show and change of the process beyond
// the endpoints; each part may be nil (its routes are then absent).
type Runtime struct {
	// Config returns the configuration in force, every default filled in,
	// as YAML (GET /v1/config).
	Config func() ([]byte, error)
	// Level is the run-time log level (GET /v1/log-level; POST on the
	// control server).
	Level Level
}

// Level is a log level changed at run time, without a restart.
type Level interface {
	Get() string
	// Set changes the level; an unknown name is an error naming the levels.
	Set(name string) error
}

// route is one route as GET / lists it.
type route struct {
	Method string `json:"method"`
	Path   string `json:"path"`
	What   string `json:"what"`
}

// routes is a mux and the list GET / shows; every handler answers a 404
// or 405 of the mux's own in JSON too (jsonErrors).
type routes struct {
	mux    *http.ServeMux
	list   []route
	server string
}

func newRoutes(server string) *routes {
	return &routes{mux: http.NewServeMux(), server: server}
}

// handle registers h for method and path (method "" : any, the handler
// checks) and lists it unless what is empty.
func (rs *routes) handle(method, path, what string, h http.HandlerFunc) {
	pattern := path
	if method != "" {
		pattern = method + " " + path
	}
	rs.mux.HandleFunc(pattern, h)
	if what != "" {
		rs.list = append(rs.list, route{Method: cmp.Or(method, "GET"), Path: path, What: what})
	}
}

// handler is the mux behind the index (GET /) and JSON 404s and 405s.
func (rs *routes) handler() http.Handler {
	list := slices.Clone(rs.list)
	rs.mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"server": rs.server, "routes": list})
	})
	return jsonErrors(rs.mux)
}

// jsonErrors answers in JSON what the mux itself answers in plain text: a
// path no route matches (404) and a method a route does not take (405,
// with its Allow header).
func jsonErrors(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, pattern := mux.Handler(r); pattern != "" {
			mux.ServeHTTP(w, r)
			return
		}
		mux.ServeHTTP(&jsonError{ResponseWriter: w, path: r.URL.Path}, r)
	})
}

// jsonError replaces the mux's plain-text 404 or 405 with a JSON one.
type jsonError struct {
	http.ResponseWriter
	path     string
	replaced bool
}

func (w *jsonError) WriteHeader(code int) {
	switch code {
	case http.StatusNotFound:
		w.replaced = true
		writeError(w.ResponseWriter, code, fmt.Sprintf("no such route %q; GET / lists the routes", w.path))
	case http.StatusMethodNotAllowed:
		w.replaced = true
		writeError(w.ResponseWriter, code, "method not allowed; use "+w.Header().Get("Allow"))
	default:
		w.ResponseWriter.WriteHeader(code)
	}
}

func (w *jsonError) Write(b []byte) (int, error) {
	if w.replaced {
		return len(b), nil
	}
	return w.ResponseWriter.Write(b)
}

// onControl is the read-only server's answer to what only the control
// server does.
func onControl(w http.ResponseWriter, _ *http.Request) {
	writeError(w, http.StatusNotFound, "the actions are served on admin.control_listen (loopback by default), not here")
}

// ReadHandler returns the read-only routes, which may be served on the pod
// address: /metrics, /healthz, /readyz, GET / (the routes) and, when eps
// is not nil, GET /v1/endpoints and /v1/pools; GET /v1/config and
// /v1/log-level when rt has them. The operator actions are not among
// them: a POST to an action answers 404 and names admin.control_listen.
// ready reports whether the data plane can take traffic.
func ReadHandler(reg *prometheus.Registry, ready func() bool, eps Endpoints, rt Runtime) http.Handler {
	rs := newRoutes("read")
	rs.handle("GET", "/metrics", "Prometheus metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}).ServeHTTP)
	healthRoutes(rs, ready)
	if eps != nil {
		readRoutes(rs, eps)
		rs.handle("", "/v1/endpoints/{endpoint}/{action}", "", onControl)
	}
	runtimeRoutes(rs, rt)
	if rt.Level != nil {
		rs.handle("POST", "/v1/log-level", "", onControl)
	}
	return rs.handler()
}

func healthRoutes(rs *routes, ready func() bool) {
	rs.handle("GET", "/healthz", "liveness: the process serves HTTP", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	rs.handle("GET", "/readyz", "readiness: every listener bound and accepting (503 until then and while shutting down)", func(w http.ResponseWriter, _ *http.Request) {
		if !ready() {
			http.Error(w, "not ready", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
}

// ControlOptions are the control server's settings beyond the endpoints.
type ControlOptions struct {
	// TokenFile, when set, holds the bearer token every request must carry.
	TokenFile string
	// Loopback says the server listens on a loopback address: a request's
	// Host must then name loopback too (no DNS rebinding).
	Loopback bool
	// Ready is /readyz's answer (nil: always ready).
	Ready func() bool
	// Runtime adds /v1/config and /v1/log-level.
	Runtime Runtime
	// Log receives the audit line of every action.
	Log zerolog.Logger
}

// ControlHeader is the header every request that changes something must
// carry (any value): a browser cannot send it cross-origin without a CORS
// preflight, which the control server never grants. livenessproxy ctl
// sends it.
const ControlHeader = "X-Livenessproxy-Control"

// ControlHandler returns the operator's routes: POST
// /v1/endpoints/{endpoint}/{disable|enable|evict|drain}, POST
// /v1/log-level, and the read-only listings. With opts.TokenFile every
// request must carry "Authorization: Bearer <token>", the token being the
// file's content (read at each request, so a rotated Secret takes effect
// at once; leading and trailing white space ignored), compared in constant
// time. What a browser could send (browserGuard) is refused, and every
// action is logged with who asked and what came of it (audit).
func ControlHandler(eps Endpoints, opts ControlOptions) http.Handler {
	rs := newRoutes("control")
	ready := opts.Ready
	if ready == nil {
		ready = func() bool { return true }
	}
	healthRoutes(rs, ready)
	readRoutes(rs, eps)
	runtimeRoutes(rs, opts.Runtime)
	if lv := opts.Runtime.Level; lv != nil {
		rs.handle("POST", "/v1/log-level", `set the log level: body {"level": "debug"} (debug, info, warn, error)`, func(w http.ResponseWriter, r *http.Request) {
			setLevel(w, r, lv)
		})
	}
	rs.handle("", "/v1/endpoints/{endpoint}/{action}", "", func(w http.ResponseWriter, r *http.Request) {
		endpointAction(w, r, eps)
	})
	for _, a := range actions {
		rs.list = append(rs.list, route{Method: "POST", Path: "/v1/endpoints/{endpoint}/" + a.name, What: a.what})
	}
	h := rs.handler()
	if opts.TokenFile != "" {
		h = bearer(opts.TokenFile, h)
	}
	return audit(opts.Log, browserGuard(opts.Loopback, h))
}

// bearer lets through only requests with the token of tokenFile.
func bearer(tokenFile string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		want, err := os.ReadFile(tokenFile)
		want = bytes.TrimSpace(want)
		if err != nil || len(want) == 0 {
			outcome(r, "refused: admin.token_file cannot be read or is empty")
			writeError(w, http.StatusServiceUnavailable, "admin.token_file cannot be read or is empty: no action is allowed")
			return
		}
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(strings.TrimSpace(got)), want) != 1 {
			outcome(r, "refused: no valid bearer token")
			w.Header().Set("WWW-Authenticate", `Bearer realm="livenessproxy"`)
			writeError(w, http.StatusUnauthorized, "a bearer token (admin.token_file) is required")
			return
		}
		next.ServeHTTP(w, r)
	})
}

func readRoutes(rs *routes, eps Endpoints) {
	rs.handle("", "/v1/endpoints", "every endpoint: state, reason, probes, live links, draining", getOnly(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"endpoints": eps.Endpoints()})
	}))
	rs.handle("", "/v1/pools", "every pool listener: members, balance, fail-open", getOnly(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"pools": eps.Pools()})
	}))
}

// runtimeRoutes adds GET /v1/config and GET /v1/log-level when rt has them.
func runtimeRoutes(rs *routes, rt Runtime) {
	if rt.Config != nil {
		rs.handle("", "/v1/config", "the configuration in force, defaults filled in (JSON; ?format=yaml for YAML)", getOnly(func(w http.ResponseWriter, r *http.Request) {
			serveConfig(w, r, rt.Config)
		}))
	}
	if rt.Level != nil {
		rs.handle("GET", "/v1/log-level", "the log level now", func(w http.ResponseWriter, _ *http.Request) {
			writeJSON(w, http.StatusOK, map[string]string{"level": rt.Level.Get()})
		})
	}
}

// getOnly answers 405 (in JSON) to anything but GET and HEAD.
func getOnly(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			methodNotAllowed(w, "GET")
			return
		}
		h(w, r)
	}
}

func serveConfig(w http.ResponseWriter, r *http.Request, config func() ([]byte, error)) {
	y, err := config()
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	if r.URL.Query().Get("format") == "yaml" {
		w.Header().Set("Content-Type", "application/yaml")
		_, _ = w.Write(y)
		return
	}
	var v any
	if err := yaml.Unmarshal(y, &v); err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, v)
}

func setLevel(w http.ResponseWriter, r *http.Request, lv Level) {
	var body struct {
		Level string `json:"level"`
	}
	dec := json.NewDecoder(io.LimitReader(r.Body, 4<<10))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&body); err != nil {
		outcome(r, "refused: bad body")
		writeError(w, http.StatusBadRequest, `the body must be {"level": "debug|info|warn|error"}: `+err.Error())
		return
	}
	old := lv.Get()
	if err := lv.Set(body.Level); err != nil {
		outcome(r, "refused: "+err.Error())
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	outcome(r, fmt.Sprintf("log level %s -> %s", old, body.Level))
	writeJSON(w, http.StatusOK, map[string]any{"level": body.Level, "previous": old, "changed": old != body.Level})
}

// actions are the endpoint actions, in the order GET / lists them.
var actions = []struct{ name, what string }{
	{"disable", "no new links, not even fail-open; open links are evicted"},
	{"enable", "end a disable (a readmission: links opened before it are evicted) or a drain"},
	{"evict", "close every link to the endpoint now"},
	{"drain", "no new links, not even fail-open; open links finish"},
}

func endpointAction(w http.ResponseWriter, r *http.Request, eps Endpoints) {
	ep, action := r.PathValue("endpoint"), r.PathValue("action")
	if !slices.ContainsFunc(actions, func(a struct{ name, what string }) bool { return a.name == action }) {
		outcome(r, "refused: unknown action")
		writeError(w, http.StatusNotFound, fmt.Sprintf("unknown action %q (disable, enable, evict or drain)", action))
		return
	}
	if r.Method != http.MethodPost {
		methodNotAllowed(w, "POST")
		return
	}
	body := map[string]any{"endpoint": ep, "action": action}
	var err error
	var result string
	switch action {
	case "disable", "enable":
		var changed bool
		if action == "disable" {
			changed, err = eps.Disable(ep)
		} else {
			changed, err = eps.Enable(ep)
		}
		body["changed"], result = changed, map[bool]string{true: "changed", false: "unchanged"}[changed]
	case "evict":
		var n int
		n, err = eps.Evict(ep)
		body["links_closed"], result = n, fmt.Sprintf("%d links closed", n)
	case "drain":
		var changed bool
		var n int
		changed, n, err = eps.Drain(ep)
		body["changed"], body["live_links"] = changed, n
		result = fmt.Sprintf("%s, %d links left to finish", map[bool]string{true: "draining", false: "already draining"}[changed], n)
	}
	if errors.Is(err, proxy.ErrUnknownEndpoint) {
		outcome(r, "refused: unknown endpoint")
		writeError(w, http.StatusNotFound, fmt.Sprintf("unknown endpoint %q: no listener routes to it", ep))
		return
	}
	if err != nil {
		outcome(r, "failed: "+err.Error())
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	outcome(r, result)
	writeJSON(w, http.StatusOK, body)
}

func methodNotAllowed(w http.ResponseWriter, allow string) {
	w.Header().Set("Allow", allow)
	writeError(w, http.StatusMethodNotAllowed, "method not allowed; use "+allow)
}

func writeError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, map[string]string{"error": msg})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	h := w.Header()
	h.Del("X-Content-Type-Options")
	h.Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// Config says where the admin servers listen.
type Config struct {
	// Listen is the read-only server's host:port ("" disables it): it may
	// be the pod address, for kubelet probes and Prometheus.
	Listen string
	// ControlListen is the operator actions' host:port or unix:/path (""
	// disables them): loopback or a Unix socket unless an operator opts in.
	ControlListen string
	// TokenFile, when set, holds the bearer token every control request
	// must carry (policy requires it for a control address off loopback).
	TokenFile string
	// MaxConns caps each server's open connections (0: 256): past it new
	// connections wait in the kernel's accept queue.
	MaxConns int
	// IdleTimeout closes a keep-alive connection idle this long (0: 60s).
	IdleTimeout time.Duration
	// Runtime adds GET /v1/config and /v1/log-level (both servers) and
	// POST /v1/log-level (the control server).
	Runtime Runtime
}

// Server is the running admin servers.
type Server struct {
	read, control *server
}

// server is one HTTP server on its own listener.
type server struct {
	srv  *http.Server
	ln   net.Listener
	done chan struct{}
}

// Start binds the read-only server on cfg.Listen and the control server on
// cfg.ControlListen (each when set) and serves until Shutdown.
func Start(cfg Config, reg *prometheus.Registry, ready func() bool, eps Endpoints, log zerolog.Logger) (*Server, error) {
	s := &Server{}
	var err error
	if cfg.Listen != "" {
		if s.read, err = serve(cfg, cfg.Listen, ReadHandler(reg, ready, eps, cfg.Runtime), log.With().Str("server", "read").Logger()); err != nil {
			return nil, fmt.Errorf("admin.listen %s: %w", cfg.Listen, err)
		}
	}
	if cfg.ControlListen != "" && eps != nil {
		clog := log.With().Str("server", "control").Logger()
		h := ControlHandler(eps, ControlOptions{
			TokenFile: cfg.TokenFile,
			Loopback:  loopbackListen(cfg.ControlListen),
			Ready:     ready,
			Runtime:   cfg.Runtime,
			Log:       clog,
		})
		if s.control, err = serve(cfg, cfg.ControlListen, h, clog); err != nil {
			_ = s.Shutdown(context.Background())
			return nil, fmt.Errorf("admin.control_listen %s: %w", cfg.ControlListen, err)
		}
	}
	return s, nil
}

// listen binds addr: a host:port, or unix:/path (a stale socket file from
// an earlier run is removed first; the socket is made 0600).
func listen(addr string) (net.Listener, error) {
	path, ok := strings.CutPrefix(addr, "unix:")
	if !ok {
		return net.Listen("tcp", addr)
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
		_ = os.Remove(path)
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o600); err != nil {
		_ = ln.Close()
		return nil, err
	}
	return ln, nil
}

func serve(cfg Config, addr string, h http.Handler, log zerolog.Logger) (*server, error) {
	ln, err := listen(addr)
	if err != nil {
		return nil, err
	}
	idle := cfg.IdleTimeout
	if idle <= 0 {
		idle = 60 * time.Second
	}
	max := cfg.MaxConns
	if max <= 0 {
		max = 256
	}
	s := &server{
		srv: &http.Server{
			Handler:           h,
			ReadHeaderTimeout: 5 * time.Second,
			ReadTimeout:       10 * time.Second,
			WriteTimeout:      30 * time.Second,
			IdleTimeout:       idle,
			MaxHeaderBytes:    16 << 10,
			ConnContext:       withPeer,
		},
		ln:   limitListener(ln, max),
		done: make(chan struct{}),
	}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(s.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error().Err(err).Msg("admin server failed")
		}
	}()
	log.Info().Str("listen", ln.Addr().String()).Msg("admin listening")
	return s, nil
}

// Addr is the read-only server's bound address (nil when off).
func (s *Server) Addr() net.Addr {
	if s.read == nil {
		return nil
	}
	return s.read.ln.Addr()
}

// ControlAddr is the control server's bound address (nil when off).
func (s *Server) ControlAddr() net.Addr {
	if s.control == nil {
		return nil
	}
	return s.control.ln.Addr()
}

// Shutdown stops the servers, waiting for in-flight requests until ctx
// ends.
func (s *Server) Shutdown(ctx context.Context) error {
	var errs []error
	for _, x := range []*server{s.read, s.control} {
		if x == nil {
			continue
		}
		if err := x.srv.Shutdown(ctx); err != nil {
			_ = x.srv.Close()
			errs = append(errs, err)
		}
		<-x.done
	}
	return errors.Join(errs...)
}

// limitListener accepts at most n connections at a time: Accept waits for
// a slot, so past the cap new connections wait in the kernel's queue
// instead of each holding a goroutine and buffers.
func limitListener(ln net.Listener, n int) net.Listener {
	return &limited{Listener: ln, sem: make(chan struct{}, n), done: make(chan struct{})}
}

type limited struct {
	net.Listener
	sem       chan struct{}
	done      chan struct{}
	closeOnce sync.Once
}

func (l *limited) Accept() (net.Conn, error) {
	select {
	case l.sem <- struct{}{}:
	case <-l.done:
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.sem
		return nil, err
	}
	return &limitedConn{Conn: c, release: func() { <-l.sem }}, nil
}

func (l *limited) Close() error {
	l.closeOnce.Do(func() { close(l.done) })
	return l.Listener.Close()
}

type limitedConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}
