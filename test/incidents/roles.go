//go:build linux

package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/admin"
	"github.com/livenessproxy/livenessproxy/internal/harness"
	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// The replays run the server and the proxy as separate processes, as they
// are in production: a server can then be killed (kill -9) or stopped
// (SIGSTOP) for real, and the proxy's memory is its own process's RSS. Both
// are this binary (the test binary or the main) re-executed with roleEnv
// set; init dispatches before main or TestMain runs.
const (
	roleEnv   = "LIVENESSPROXY_INCIDENTS_ROLE"
	addrEnv   = "LIVENESSPROXY_INCIDENTS_ADDR"   // server role: pinotsim listen address
	healthEnv = "LIVENESSPROXY_INCIDENTS_HEALTH" // server role: /health listen address (optional)
	configEnv = "LIVENESSPROXY_INCIDENTS_CONFIG" // proxy role: the YAML configuration
)

func init() {
	switch role := os.Getenv(roleEnv); role {
	case "":
	case "server":
		os.Exit(serverRole(os.Getenv(addrEnv), os.Getenv(healthEnv)))
	case "proxy":
		os.Exit(proxyRole(os.Getenv(configEnv)))
	default:
		fmt.Fprintf(os.Stderr, "%s=%q: unknown role\n", roleEnv, role)
		os.Exit(2)
	}
}

// serverHello is the first line a server process prints.
type serverHello struct {
	Listening string `json:"listening"`
	Health    string `json:"health,omitempty"`
}

// serverRole runs a pinotsim server (and, if health is set, a GET /health
// endpoint served by the same process, like a Pinot server's admin port)
// until its stdin closes. Each "stats" line on stdin is answered with the
// server's counters as one JSON line.
func serverRole(addr, health string) int {
	srv, err := pinotsim.NewServer(pinotsim.ServerConfig{Addr: addr})
	if err != nil {
		fmt.Fprintf(os.Stderr, "pinotsim server on %s: %v\n", addr, err)
		return 1
	}
	defer srv.Close()
	hello := serverHello{Listening: srv.Addr()}
	if health != "" {
		hln, err := net.Listen("tcp", health)
		if err != nil {
			fmt.Fprintf(os.Stderr, "health listener on %s: %v\n", health, err)
			return 1
		}
		defer harness.ServeHealth(hln)()
		hello.Health = hln.Addr().String()
	}
	enc := json.NewEncoder(os.Stdout)
	_ = enc.Encode(hello)
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		if sc.Text() == "stats" {
			_ = enc.Encode(srv.Stats())
		}
	}
	return 0
}

// proxyHello is the first line a proxy process prints.
type proxyHello struct {
	Admin     string            `json:"admin"`
	Control   string            `json:"control"`
	Listeners map[string]string `json:"listeners"`
}

// proxyLine is one line of a proxy process's output.
type proxyLine struct {
	Ready *proxyHello `json:"ready,omitempty"`
	harness.LinkEndLine
}

// proxyRole runs livenessproxy with the YAML configuration cfg, wired as
// `livenessproxy run` wires it (proxy plus the admin server), until its
// stdin closes. It prints a ready line with the admin and listener
// addresses, then one line per link that ends.
func proxyRole(yaml string) int {
	cfg, err := policy.Parse([]byte(yaml))
	if err != nil {
		fmt.Fprintf(os.Stderr, "proxy configuration: %v\n", err)
		return 1
	}
	var mu sync.Mutex
	enc := json.NewEncoder(os.Stdout)
	emit := func(l proxyLine) {
		mu.Lock()
		_ = enc.Encode(l)
		mu.Unlock()
	}
	log := zerolog.New(os.Stderr).Level(zerolog.WarnLevel).With().Timestamp().Logger()
	reg := prometheus.NewRegistry()
	p := proxy.New(cfg, proxy.Options{Logger: &log, Registerer: reg, OnLinkEnd: func(s proxy.LinkStats) {
		e := harness.EndOf(s, time.Now())
		emit(proxyLine{LinkEndLine: harness.LinkEndLine{LinkEnd: &e}})
	}})
	// Both admin servers on ports of their own (the control default,
	// 9902, could clash between replays).
	adm, err := admin.Start(admin.Config{Listen: cfg.Admin.Listen, ControlListen: "127.0.0.1:0"}, reg, p.Ready, p, log)
	if err != nil {
		fmt.Fprintf(os.Stderr, "admin server: %v\n", err)
		return 1
	}
	if err := p.Start(); err != nil {
		fmt.Fprintf(os.Stderr, "proxy: %v\n", err)
		_ = adm.Shutdown(context.Background())
		return 1
	}
	hello := &proxyHello{Admin: adm.Addr().String(), Control: adm.ControlAddr().String(), Listeners: map[string]string{}}
	for _, l := range cfg.Listeners {
		hello.Listeners[l.Name] = p.Addr(l.Name).String()
	}
	emit(proxyLine{Ready: hello})
	_, _ = io.Copy(io.Discard, os.Stdin)
	_ = p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = adm.Shutdown(ctx)
	return 0
}
