// Package admin serves livenessproxy's admin HTTP API: /metrics, /healthz,
// /readyz and the endpoint API. It binds to loopback by default (see
// policy.Admin).
package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
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

// Handler returns the admin routes. ready reports whether the data plane
// can take traffic (every listener bound); eps may be nil (no endpoint API).
func Handler(reg *prometheus.Registry, ready func() bool, eps Endpoints) http.Handler {
	mux := http.NewServeMux()
	if eps != nil {
		mux.HandleFunc("/v1/endpoints", func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodGet && r.Method != http.MethodHead {
				methodNotAllowed(w, "GET")
				return
			}
			writeJSON(w, http.StatusOK, map[string]any{"endpoints": eps.Endpoints()})
		})
		mux.HandleFunc("/v1/endpoints/{endpoint}/{action}", func(w http.ResponseWriter, r *http.Request) {
			endpointAction(w, r, eps)
		})
		mux.HandleFunc("/v1/pools", func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodGet && r.Method != http.MethodHead {
				methodNotAllowed(w, "GET")
				return
			}
			writeJSON(w, http.StatusOK, map[string]any{"pools": eps.Pools()})
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

// Server is a running admin server.
type Server struct {
	srv  *http.Server
	ln   net.Listener
	done chan struct{}
}

// Start binds addr and serves h until Shutdown.
func Start(addr string, h http.Handler, log zerolog.Logger) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	s := &Server{
		srv: &http.Server{
			Handler:           h,
			ReadHeaderTimeout: 5 * time.Second,
			ErrorLog:          nil,
		},
		ln:   ln,
		done: make(chan struct{}),
	}
	go s.serve(log)
	log.Info().Str("listen", ln.Addr().String()).Msg("admin listening")
	return s, nil
}

func (s *Server) serve(log zerolog.Logger) {
	defer close(s.done)
	if err := s.srv.Serve(s.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Error().Err(err).Msg("admin server failed")
	}
}

// Addr is the bound address.
func (s *Server) Addr() net.Addr { return s.ln.Addr() }

// Shutdown stops the server, waiting for in-flight requests until ctx ends.
func (s *Server) Shutdown(ctx context.Context) error {
	err := s.srv.Shutdown(ctx)
	if err != nil {
		_ = s.srv.Close()
	}
	<-s.done
	return err
}
