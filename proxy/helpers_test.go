package proxy

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
)

// waitReadmitted waits until addr has been excluded and readmitted by a
// probe: an exclusion may last less than one poll of the state.
func (h *harness) waitReadmitted(addr string, within time.Duration) {
	h.t.Helper()
	deadline := time.Now().Add(within)
	for {
		for _, ep := range h.p.Endpoints() {
			if ep.Endpoint == addr && ep.State == "healthy" && ep.Reason == health.ReasonProbeOK {
				return
			}
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("%s is %s after %v, want readmitted by a probe", addr, h.stateOf(addr), within)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// peersOn starts a fault peer on each host, all on one port.
func peersOn(t *testing.T, b faultpeer.Behavior, hosts ...string) ([]*faultpeer.Server, []string) {
	t.Helper()
	port := commonPort(t, hosts...)
	var peers []*faultpeer.Server
	var addrs []string
	for _, h := range hosts {
		addr := fmt.Sprintf("%s:%d", h, port)
		peers = append(peers, faultpeer.New(t, b, faultpeer.Options{Addr: addr}))
		addrs = append(addrs, addr)
	}
	return peers, addrs
}

// commonPort returns a port free on every host (any 127/8 address works
// on Linux without setup).
func commonPort(t *testing.T, hosts ...string) int {
	t.Helper()
	for range 50 {
		ln, err := net.Listen("tcp", net.JoinHostPort(hosts[0], "0"))
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		free := true
		for _, h := range hosts {
			l, err := net.Listen("tcp", fmt.Sprintf("%s:%d", h, port))
			if err != nil {
				free = false
				break
			}
			l.Close()
		}
		if free {
			return port
		}
	}
	t.Fatalf("no port free on all of %v", hosts)
	return 0
}

// expectRefusedSoon waits (2s at most) until a connect to addr is refused.
func expectRefusedSoon(t *testing.T, addr string) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		c, err := net.Dial("tcp", addr)
		if err != nil && errors.Is(err, syscall.ECONNREFUSED) {
			return
		}
		if c != nil {
			c.Close()
		}
		if time.Now().After(deadline) {
			t.Fatalf("connect to %s: %v, want it refused", addr, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// onlyLink returns the listener's one link once it has its upstream.
func (h *harness) onlyLink(within time.Duration) *link {
	h.t.Helper()
	l := h.p.listeners[0]
	for deadline := time.Now().Add(within); ; time.Sleep(5 * time.Millisecond) {
		l.mu.Lock()
		for lk := range l.links {
			lk.connMu.Lock()
			up := lk.upRaw()
			lk.connMu.Unlock()
			if up != nil {
				l.mu.Unlock()
				return lk
			}
		}
		l.mu.Unlock()
		if time.Now().After(deadline) {
			h.t.Fatalf("no link with an upstream within %v", within)
		}
	}
}

// serveConns serves each connection ln accepts with serve, in its own
// goroutine; serve returns when done is closed (or its connection
// fails). The test's cleanup closes ln, done and the connections, and
// waits for them. It returns ln's address.
func serveConns(t *testing.T, ln net.Listener, serve func(c net.Conn, done <-chan struct{})) string {
	t.Helper()
	done := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		close(done)
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() {
				defer c.Close()
				serve(c, done)
			})
		}
	})
	return ln.Addr().String()
}

// excludedUnanswered waits up to within for the endpoint's exclusion and
// fails the test unless it was for unanswered requests and came no
// earlier than atLeast after sent (the request's own deadline), as the
// proxy's own record of it says.
func (h *harness) excludedUnanswered(sent time.Time, atLeast, within time.Duration) EndpointStatus {
	h.t.Helper()
	ep := h.waitState("excluded", within)
	if ep.Reason != string(CloseUnanswered) {
		h.t.Fatalf("excluded for %q, want unanswered", ep.Reason)
	}
	if d := ep.Since.Sub(sent); d < atLeast {
		h.t.Fatalf("excluded %v after the request, before its deadline (%v)", d, atLeast)
	}
	return ep
}

// startProxy starts a proxy from cfg with opts; the test's cleanup closes
// it.
func startProxy(t *testing.T, cfg policy.Config, opts Options) *Proxy {
	t.Helper()
	p := New(cfg, opts)
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// meterStalls measures, until the function it returns is called, the time
// this process could not run: a tick of its own more than a step late
// counts the time past the step, as the heartbeat's does (mesh.silence).
func meterStalls(t *testing.T) (stop func() time.Duration) {
	const step = 10 * time.Millisecond
	quit, done := make(chan struct{}), make(chan struct{})
	var stalled time.Duration
	go func() {
		defer close(done)
		tk := time.NewTicker(step)
		defer tk.Stop()
		prev := time.Now()
		for {
			select {
			case <-quit:
				return
			case <-tk.C:
			}
			now := time.Now()
			if gap := now.Sub(prev); gap > 2*step {
				stalled += gap - step
			}
			prev = now
		}
	}()
	var once sync.Once
	stop = func() time.Duration {
		once.Do(func() { close(quit); <-done })
		return stalled
	}
	t.Cleanup(func() { stop() })
	return stop
}
