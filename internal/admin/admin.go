// Package admin serves livenessproxy's admin HTTP API in two servers: a
// read-only one (/metrics, /healthz, /readyz, GET /v1/endpoints and
// /v1/pools) that may listen on the pod address, and a control one for the
// operator's actions (disable, enable, evict), on loopback or a Unix socket
// unless an operator opts into a network address with a bearer token.
package admin

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

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
}

// ReadHandler returns the read-only routes, which may be served on the pod
// address: /metrics, /healthz, /readyz and, when eps is not nil, GET
// /v1/endpoints and /v1/pools. The operator actions are not among them:
// a POST to an action answers 404 and names admin.control_listen. ready
// reports whether the data plane can take traffic.
func ReadHandler(reg *prometheus.Registry, ready func() bool, eps Endpoints) http.Handler {
	mux := http.NewServeMux()
	if eps != nil {
		readRoutes(mux, eps)
		mux.HandleFunc("/v1/endpoints/{endpoint}/{action}", func(w http.ResponseWriter, _ *http.Request) {
			writeError(w, http.StatusNotFound, "the endpoint actions are served on admin.control_listen (loopback by default), not here")
		})
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !ready() {
			http.Error(w, "not ready", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	return mux
}

// ControlHandler returns the operator's routes: POST
// /v1/endpoints/{endpoint}/{disable|enable|evict}, and the read-only
// endpoint and pool listings. With a tokenFile every request must carry
// "Authorization: Bearer <token>", the token being the file's content
// (read at each request, so a rotated Secret takes effect at once; leading
// and trailing white space ignored), compared in constant time.
func ControlHandler(eps Endpoints, tokenFile string) http.Handler {
	mux := http.NewServeMux()
	readRoutes(mux, eps)
	mux.HandleFunc("/v1/endpoints/{endpoint}/{action}", func(w http.ResponseWriter, r *http.Request) {
		endpointAction(w, r, eps)
	})
	if tokenFile == "" {
		return mux
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		want, err := os.ReadFile(tokenFile)
		want = bytes.TrimSpace(want)
		if err != nil || len(want) == 0 {
			writeError(w, http.StatusServiceUnavailable, "admin.token_file cannot be read or is empty: no action is allowed")
			return
		}
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(strings.TrimSpace(got)), want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="livenessproxy"`)
			writeError(w, http.StatusUnauthorized, "a bearer token (admin.token_file) is required")
			return
		}
		mux.ServeHTTP(w, r)
	})
}

func readRoutes(mux *http.ServeMux, eps Endpoints) {
	mux.HandleFunc("/v1/endpoints", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			methodNotAllowed(w, "GET")
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"endpoints": eps.Endpoints()})
	})
	mux.HandleFunc("/v1/pools", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			methodNotAllowed(w, "GET")
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"pools": eps.Pools()})
	})
}

func endpointAction(w http.ResponseWriter, r *http.Request, eps Endpoints) {
	ep, action := r.PathValue("endpoint"), r.PathValue("action")
	switch action {
	case "disable", "enable", "evict":
	default:
		writeError(w, http.StatusNotFound, fmt.Sprintf("unknown action %q (disable, enable or evict)", action))
		return
	}
	if r.Method != http.MethodPost {
		methodNotAllowed(w, "POST")
		return
	}
	body := map[string]any{"endpoint": ep, "action": action}
	var err error
	switch action {
	case "disable":
		body["changed"], err = eps.Disable(ep)
	case "enable":
		body["changed"], err = eps.Enable(ep)
	case "evict":
		body["links_closed"], err = eps.Evict(ep)
	}
	if errors.Is(err, proxy.ErrUnknownEndpoint) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("unknown endpoint %q: no listener routes to it", ep))
		return
	}
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
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
	w.Header().Set("Content-Type", "application/json")
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
		if s.read, err = serve(cfg, cfg.Listen, ReadHandler(reg, ready, eps), log.With().Str("server", "read").Logger()); err != nil {
			return nil, fmt.Errorf("admin.listen %s: %w", cfg.Listen, err)
		}
	}
	if cfg.ControlListen != "" && eps != nil {
		if s.control, err = serve(cfg, cfg.ControlListen, ControlHandler(eps, cfg.TokenFile), log.With().Str("server", "control").Logger()); err != nil {
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
