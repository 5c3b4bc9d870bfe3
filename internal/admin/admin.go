// Package admin serves livenessproxy's admin HTTP API: /metrics, /healthz
// and /readyz. It binds to loopback by default (see policy.Admin).
package admin

import (
	"context"
	"errors"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"
)

// Handler returns the admin routes. ready reports whether the data plane
// can take traffic (every listener bound).
func Handler(reg *prometheus.Registry, ready func() bool) http.Handler {
	mux := http.NewServeMux()
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
