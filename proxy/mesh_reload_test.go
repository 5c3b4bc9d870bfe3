package proxy

import (
	"net"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// A reload that only tunes an ingress (check_interval, its limits, one
// more port) keeps its listener, its sessions, its boot id and its ports'
// epochs: the egress sees no restart, and its links live on.
func TestMeshReloadKeepsIngress(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	extra := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, nil)
	c := eg.dial()
	roundTrip(t, c, []byte("before"))
	port := portOf(t, srv.Addr())
	pr := eg.p.meshPeer("127.0.0.2", in.port)
	epoch := waitEpoch(t, pr, port)
	ing := in.p.listeners[0].ingress
	boot := ing.boot

	cfg := in.cfg
	cfg.Listeners[0].Ingress.CheckInterval = policy.Duration(80 * time.Millisecond)
	cfg.Listeners[0].Ingress.MaxStreams = 500
	cfg.Listeners[0].Ingress.Ports = []int{int(portOf(t, extra.Addr()))}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	ch, err := in.p.Apply(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(ch.ListenersRetuned) != 1 || len(ch.ListenersAdded) != 0 || len(ch.ListenersRemoved) != 0 {
		t.Fatalf("reload changes %+v, want the ingress retuned, none added or removed", ch)
	}
	if in.p.listeners[0].ingress != ing || ing.boot != boot {
		t.Fatal("the reload rebuilt the ingress")
	}
	// The new port is announced once checked; the old one kept its epoch.
	waitFor(t, 5*time.Second, "the added port announced ready", func() bool {
		pr.mu.Lock()
		defer pr.mu.Unlock()
		return pr.status[portOf(t, extra.Addr())].Ready
	})
	if e := pr.epochOf(port); e != epoch {
		t.Fatalf("epoch %x after the reload, want %x kept", e, epoch)
	}
	roundTrip(t, c, []byte("after"))
	select {
	case s := <-eg.ended:
		t.Fatalf("a link ended across the reload: %+v", s)
	default:
	}
	if got := testutil.ToFloat64(eg.m.MeshSessions(metrics.MeshEgress)); got != 1 {
		t.Fatalf("%v egress sessions, want the one from before", got)
	}
	if st := eg.stateOf(srv.Addr()); st != "healthy" {
		t.Fatalf("endpoint %s after the reload, want healthy", st)
	}
	// A link to the added port goes through the same session.
	eg2 := startEgress(t, extra.Addr(), in.port, nil)
	roundTrip(t, eg2.dial(), []byte("the added port"))
}

// An ingress port a reload removes leaves the proxy's endpoints, the
// detector and /v1/endpoints (its links finish on their own), as a pool
// member that leaves is forgotten; the ports kept stay. Before, its
// endpoint stayed registered, and probed for good if it was excluded,
// until the listener itself went.
func TestMeshReloadForgetsARemovedPort(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	extra := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) {
		l.Ingress.Ports = []int{int(portOf(t, extra.Addr()))}
	})
	listed := func(addr string) bool {
		return slices.ContainsFunc(in.p.Endpoints(), func(s EndpointStatus) bool { return s.Endpoint == addr })
	}
	if !listed(srv.Addr()) || !listed(extra.Addr()) {
		t.Fatalf("endpoints %+v, want both ports", in.p.Endpoints())
	}
	in.p.det.Report(extra.Addr(), string(CloseDialError)) // excluded: probed until it is forgotten

	cfg := in.cfg
	cfg.Listeners[0].Ingress.Ports = nil
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	ch, err := in.p.Apply(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(ch.ListenersRetuned) != 1 || len(ch.ListenersAdded) != 0 {
		t.Fatalf("reload changes %+v, want the ingress retuned in place", ch)
	}
	if listed(extra.Addr()) {
		t.Fatalf("endpoints %+v after the reload removed port %s, want it gone", in.p.Endpoints(), extra.Addr())
	}
	if _, ok := in.p.det.State(extra.Addr()); ok {
		t.Fatal("the detector still holds the removed port")
	}
	if !listed(srv.Addr()) {
		t.Fatalf("endpoints %+v, want the local port kept", in.p.Endpoints())
	}
}

// Peers with no session that nothing asked for in peerIdleFor are
// forgotten when new ones come (pod addresses churn); a peer whose session
// lives is kept, and a retired endpoint is dropped from it.
func TestMeshIdlePeersForgotten(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, nil)
	roundTrip(t, eg.dial(), []byte("hello"))
	p := eg.p
	live := p.meshPeer("127.0.0.2", in.port)
	gone := &endpoint{addr: "127.0.0.2:1"} // no longer the proxy's
	live.mu.Lock()
	live.endpoints[gone] = struct{}{}
	live.mu.Unlock()
	old := flow.Mono() - int64(peerIdleFor) - int64(time.Second)
	for i := range 1000 {
		p.meshPeer("10.9."+strconv.Itoa(i/250)+"."+strconv.Itoa(i%250), 17400).used.Store(old)
	}
	live.used.Store(old)
	p.meshMu.Lock()
	p.peersSwept = old
	p.meshMu.Unlock()
	p.meshPeer("10.9.9.9", 17400) // a new peer: the sweep runs
	p.meshMu.Lock()
	n, kept := len(p.peers), p.peers[live.addr] == live
	p.meshMu.Unlock()
	if n != 2 || !kept {
		t.Fatalf("%d peers after the sweep (the live one kept: %v), want 2: the live one and the new one", n, kept)
	}
	live.mu.Lock()
	_, stale := live.endpoints[gone]
	live.mu.Unlock()
	if stale {
		t.Fatal("a retired endpoint is still held by its peer")
	}
}

// Sessions are keyed by the settings they were dialled with: a listener
// with other ping settings gets a session of its own, not the first
// dialler's.
func TestMeshSessionsKeyedBySettings(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, nil)
	pr := eg.p.meshPeer("127.0.0.2", in.port)
	st := eg.p.listeners[0].spec().settings
	m := st.Mesh.OrDefaults()
	ctx := t.Context()
	a, err := pr.session(ctx, &st, &net.Dialer{})
	if err != nil {
		t.Fatal(err)
	}
	st2 := st
	st2.Mesh.PingInterval = policy.Duration(70 * time.Millisecond)
	b, err := pr.session(ctx, &st2, &net.Dialer{})
	if err != nil {
		t.Fatal(err)
	}
	if a == b || b.Interval != 70*time.Millisecond || a.Interval != m.PingInterval.D() {
		t.Fatalf("sessions %p (%v) and %p (%v), want two, each with its own ping interval", a, a.Interval, b, b.Interval)
	}
	if c, _ := pr.session(ctx, &st2, &net.Dialer{}); c == nil || c.key != b.key {
		t.Fatalf("a session of other settings was taken")
	}
}
