package proxy

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// admittedSessions is the ingress's own count of the sessions it holds.
func (in *ingressProxy) admittedSessions() int {
	ig := in.p.listeners[0].ingress
	ig.mu.Lock()
	defer ig.mu.Unlock()
	return ig.admitted
}

// An ingress holds at most max_sessions sessions over all its peers:
// peers at distinct addresses (127.0.1.x, Linux's loopback takes them
// all), each below max_sessions_per_peer, are refused at the handshake
// past it and counted (sessions). Before (found by an audit), only the
// per-peer limit held: every address of a network could hold 16
// sessions, each with its descriptor, mux state and goroutines.
//
// The twin: below the limit every session is taken, and once one ends a
// new peer's session is taken again.
func TestMeshIngressSessionsAreBoundedInAll(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) {
		l.Ingress.MaxSessionsPerPeer = 2
		l.Ingress.MaxSessions = 5
	})
	var held []*yamux.Session
	var codes []byte
	for i := range 8 { // four peers, two sessions each: none over its own limit
		sess, code := rawSessionFrom(t, net.IPv4(127, 0, 1, byte(10+i/2)), in.addr())
		codes = append(codes, code)
		if sess != nil {
			held = append(held, sess)
		}
	}
	t.Logf("handshake codes %v; the ingress holds %d sessions; refused for sessions %v, for sessions_per_peer %v",
		codes, in.admittedSessions(), in.limitHits(mesh.LimitSessions), in.limitHits(mesh.LimitSessionsPerPeer))
	want := []byte{mesh.OK, mesh.OK, mesh.OK, mesh.OK, mesh.OK, mesh.Refused, mesh.Refused, mesh.Refused}
	if !bytes.Equal(codes, want) {
		t.Fatalf("handshake codes %v, want five ok (max_sessions 5) then refused: the ingress's sessions are not bounded in all", codes)
	}
	if n := in.admittedSessions(); n != 5 {
		t.Fatalf("the ingress counts %d sessions, want 5", n)
	}
	if got := in.limitHits(mesh.LimitSessions); got != 3 {
		t.Fatalf("%v sessions refusals, want 3", got)
	}
	if got := in.limitHits(mesh.LimitSessionsPerPeer); got != 0 {
		t.Fatalf("%v sessions_per_peer refusals, want none (no peer held 2)", got)
	}

	_ = held[0].Close()
	waitFor(t, 5*time.Second, "the ended session released", func() bool { return in.admittedSessions() == 4 })
	if _, code, _ := rawHandshakeFrom(t, net.IPv4(127, 0, 1, 20), in.addr()); code != mesh.OK {
		t.Fatalf("with 4 sessions of 5 held, a new peer's handshake got code %d, want ok", code)
	}
	if n := in.admittedSessions(); n != 5 {
		t.Fatalf("the ingress counts %d sessions, want 5", n)
	}
}

// rawSessionFrom makes a mesh session to the ingress at addr from the
// local address from, as a peer sidecar would (a preface, then yamux
// without keepalives), closed at the test's end; nil with the handshake's
// code if the ingress did not take it.
func rawSessionFrom(t *testing.T, from net.IP, addr string) (*yamux.Session, byte) {
	t.Helper()
	c, code, _ := rawHandshakeFrom(t, from, addr)
	if code != mesh.OK {
		return nil, code
	}
	cfg := yamux.DefaultConfig()
	cfg.EnableKeepAlive, cfg.LogOutput = false, io.Discard
	sess, err := yamux.Client(c, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sess.Close() })
	return sess, code
}
