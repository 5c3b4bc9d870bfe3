package proxy

import (
	"bytes"
	"context"
	"os"
	"syscall"

	"github.com/livenessproxy/livenessproxy/proxy/mesh"

	"errors"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// testLogger logs to stderr when LP_TEST_LOG is set.
func testLogger() *zerolog.Logger {
	l := zerolog.Nop()
	if os.Getenv("LP_TEST_LOG") != "" {
		l = zerolog.New(os.Stderr)
	}
	return &l
}

// Fast mesh settings for tests: a session silent for 300 ms is dead.
func fastMesh(s *policy.Settings) {
	s.Mesh.PingInterval = policy.Duration(50 * time.Millisecond)
	s.Mesh.PingTimeout = policy.Duration(300 * time.Millisecond)
	s.Mesh.WriteTimeout = policy.Duration(200 * time.Millisecond)
	s.Detector.InitialDelay = policy.Duration(50 * time.Millisecond)
	s.Detector.MaxDelay = policy.Duration(200 * time.Millisecond)
	s.Detector.Jitter = 0
}

// ingressProxy is a sidecar whose ingress listener, on host, serves the
// local server at local.
type ingressProxy struct {
	p    *Proxy
	m    *metrics.Metrics
	port int // the mesh port
	cfg  policy.Config
}

func startIngress(t *testing.T, host, local string, tune func(*policy.Settings)) *ingressProxy {
	t.Helper()
	return startIngressL(t, host, local, func(l *policy.Listener) {
		if tune != nil {
			tune(&l.Settings)
		}
	})
}

// startIngressL is startIngress with the whole listener to tune.
func startIngressL(t *testing.T, host, local string, tune func(*policy.Listener)) *ingressProxy {
	t.Helper()
	return startIngressC(t, host, local, func(c *policy.Config) {
		if tune != nil {
			tune(&c.Listeners[0])
		}
	})
}

// startIngressC is startIngress with the whole config to tune (its one
// listener is the ingress).
func startIngressC(t *testing.T, host, local string, tune func(*policy.Config)) *ingressProxy {
	t.Helper()
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	fastMesh(&s)
	cfg.Listeners = []policy.Listener{{Name: "ingress", Listen: net.JoinHostPort(host, "0"),
		Ingress: policy.Ingress{Local: local, CheckInterval: policy.Duration(50 * time.Millisecond)}, Settings: s}}
	if tune != nil {
		tune(&cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	in := &ingressProxy{m: metrics.New(), cfg: cfg}
	in.p = New(cfg, Options{metrics: in.m, Logger: testLogger()})
	if err := in.p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = in.p.Close() })
	in.port = in.p.Addr("ingress").(*net.TCPAddr).Port
	return in
}

// startEgress is a sidecar whose listener reaches upstream through the
// mesh port.
func startEgress(t *testing.T, upstream string, meshPort int, tune func(*policy.Settings)) *harness {
	t.Helper()
	return start(t, upstream, func(s *policy.Settings) {
		fastMesh(s)
		s.Mesh.Port = meshPort
		if tune != nil {
			tune(s)
		}
	})
}

// A link through the mesh carries its bytes both ways and ends cleanly;
// both sides count one session and one link.
func TestMeshRoundTrip(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, nil)

	c := eg.dial()
	msg := bytes.Repeat([]byte("mesh "), 40000) // 200 KB: several frames, within one window
	roundTrip(t, c, msg)
	if got := testutil.ToFloat64(eg.m.MeshSessions(metrics.MeshEgress)); got != 1 {
		t.Errorf("egress sessions = %v, want 1", got)
	}
	if got := testutil.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)); got != 1 {
		t.Errorf("ingress sessions = %v, want 1", got)
	}
	_ = c.CloseWrite()
	waitClosed(t, c, 5*time.Second)
	s := eg.linkEnd(5 * time.Second)
	if s.Reason != CloseUpstreamClosed && s.Reason != CloseClientClosed {
		t.Fatalf("link ended %s (%v), want a clean end", s.Reason, s.Err)
	}
	if s.BytesUp != int64(len(msg)) || s.BytesDown != int64(len(msg)) {
		t.Fatalf("bytes up %d down %d, want %d both", s.BytesUp, s.BytesDown, len(msg))
	}
	if got := testutil.ToFloat64(eg.m.MeshFallbacks("test")); got != 0 {
		t.Fatalf("%v fallbacks, want none", got)
	}
}

// An idle session stays up for many ping timeouts: the peer sidecar
// answers the pings, so a link that carries nothing is never cut.
func TestMeshIdleSessionLives(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, nil)

	c := eg.dial()
	roundTrip(t, c, []byte("before"))
	// Twenty ping timeouts of silence on the link; the session pings on.
	time.Sleep(20 * 300 * time.Millisecond)
	roundTrip(t, c, []byte("after"))
	for _, m := range []*metrics.Metrics{eg.m, in.m} {
		for _, role := range []string{metrics.MeshEgress, metrics.MeshIngress} {
			if got := testutil.ToFloat64(m.MeshSessionDeaths(role)); got != 0 {
				t.Fatalf("%v %s session deaths, want 0", got, role)
			}
		}
	}
	if st := eg.stateOf(srv.Addr()); st != "healthy" {
		t.Fatalf("endpoint %s, want healthy", st)
	}
}

// frozenSidecar accepts on the mesh port and never reads nor answers, as
// a SIGSTOPped sidecar's kernel does.
func frozenSidecar(t *testing.T) int {
	fz := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Addr: "127.0.0.2:0"})
	_, port, _ := net.SplitHostPort(fz.Addr())
	n, _ := strconv.Atoi(port)
	return n
}

// A peer sidecar that stops answering is detected by the heartbeat alone:
// the link waiting on its session ends mesh_dead, the endpoint is
// excluded, and new links are refused until it answers again. (An idle
// link that was established first: the e2e SIGSTOP test.)
func TestMeshFrozenSidecarClosesLinks(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	eg := startEgress(t, srv.Addr(), frozenSidecar(t), nil)

	c := eg.dial()
	t0 := time.Now()
	s := eg.linkEndOf(c, 10*time.Second)
	if s.Reason != CloseMeshDead {
		t.Fatalf("link ended %s (%v), want mesh_dead", s.Reason, s.Err)
	}
	t.Logf("link on a frozen sidecar's session closed after %v (ping_timeout 300ms)", time.Since(t0).Round(time.Millisecond))
	if got := testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)); got < 1 {
		t.Fatalf("%v egress session deaths, want at least 1", got)
	}
	eg.waitStateOf(srv.Addr(), "excluded", 5*time.Second)
	expectRefusedSoon(t, eg.addr)
	// No link went around the mesh to the server.
	if srv.Accepted() != 0 {
		t.Fatalf("the server accepted %d connections, want none", srv.Accepted())
	}
}

// A peer with no ingress sidecar is reached directly under fallback:
// direct (counted), and refused under fallback: refuse.
func TestMeshFallback(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	noSidecar := refusingPort(t, "127.0.0.2")

	eg := startEgress(t, srv.Addr(), noSidecar, nil)
	c := eg.dial()
	roundTrip(t, c, []byte("direct"))
	c2 := eg.dial()
	roundTrip(t, c2, []byte("direct again"))
	if got := testutil.ToFloat64(eg.m.MeshFallbacks("test")); got != 2 {
		t.Fatalf("%v fallbacks, want 2", got)
	}
	if st := eg.stateOf(srv.Addr()); st != "healthy" {
		t.Fatalf("endpoint %s, want healthy: no sidecar is no fault of the server", st)
	}

	refusing := startEgress(t, srv.Addr(), noSidecar, func(s *policy.Settings) { s.Mesh.Fallback = policy.MeshFallbackRefuse })
	expectClosedSoon(t, refusing.addr)
	if s := refusing.linkEnd(5 * time.Second); s.Reason != CloseRefused {
		t.Fatalf("link ended %s, want refused", s.Reason)
	}
}

// expectClosedSoon connects to addr and expects the connection closed
// (reset or FIN) before any answer; the reset may come before the
// client's connect completes.
func expectClosedSoon(t *testing.T, addr string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		if !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("dial: %v, want a connection, or one reset at once", err)
		}
		return
	}
	defer c.Close()
	_, _ = c.Write([]byte("hello"))
	if err, _ := waitClosed(t, c, 5*time.Second); !isCloseSignal(err) {
		t.Fatalf("client saw %v, want its connection closed", err)
	}
}

// refusingPort is a port on host that refuses connections.
func refusingPort(t *testing.T, host string) int {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	return port
}

// The local server going down makes the ingress announce it not ready:
// the egress excludes the endpoint and refuses new links at once, without
// waiting for any request to time out; when the server is back, the
// probe through the mesh readmits it and links work again.
func TestMeshLocalServerDownThenBack(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	addr := srv.Addr()
	in := startIngress(t, "127.0.0.2", addr, nil)
	eg := startEgress(t, addr, in.port, nil)
	c := eg.dial()
	roundTrip(t, c, []byte("up"))

	srv.Close()
	// The server's FIN reaches the client through both sidecars.
	if err, _ := waitClosed(t, c, 5*time.Second); !isCloseSignal(err) {
		t.Fatalf("client saw %v, want the server's end", err)
	}
	_ = c.Close()
	s := eg.linkEndOf(c, 5*time.Second)
	t.Logf("link ended %s when the server went", s.Reason)
	eg.waitStateOf(addr, "excluded", 5*time.Second)
	expectRefusedSoon(t, eg.addr)

	// Back on the same port: the ingress announces it ready under a new
	// epoch, and the probe through the mesh readmits it at once, not when
	// the backoff (grown meanwhile, up to an hour here) says.
	eg.p.mu.Lock()
	ep := eg.p.endpoints[addr]
	eg.p.mu.Unlock()
	s2 := *ep.settings.Load()
	s2.Detector.InitialDelay, s2.Detector.MaxDelay = policy.Duration(time.Hour), policy.Duration(time.Hour)
	pc := probeConfig(s2)
	pc.Override = ep.meshProbe
	eg.p.det.Register(addr, pc) // the wait after the next failed probe is an hour
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if st := eg.p.det.Statuses(); len(st) == 1 && time.Until(st[0].NextProbe) > 30*time.Minute {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the probe schedule did not take the hour")
		}
	}
	faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: addr})
	eg.waitStateOf(addr, "healthy", 10*time.Second)
	c2 := eg.dialWhenReadmitted(5 * time.Second)
	roundTrip(t, c2, []byte("back"))
}

// A new epoch from the peer evicts the links opened under the old one
// and leaves those opened under the new one alone. The ingress is made to
// announce a new epoch the way it does when its server started afresh,
// here without the old links noticing (as when a restart is quicker than
// their sockets learn of it).
func TestMeshNewEpochEvictsOldLinks(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, nil)
	old := eg.dial()
	roundTrip(t, old, []byte("old"))

	pr := eg.p.meshPeer("127.0.0.2", in.port)
	_, sp, _ := net.SplitHostPort(srv.Addr())
	n, _ := strconv.Atoi(sp)
	port := uint16(n)
	first := waitEpoch(t, pr, port)
	second := in.bumpEpoch(t, port)
	if second == first {
		t.Fatal("the new epoch is the old one")
	}
	s := eg.linkEndOf(old, 5*time.Second)
	if s.Reason != CloseEvicted {
		t.Fatalf("old link ended %s, want evicted", s.Reason)
	}
	if got := pr.epochOf(port); got != second {
		t.Fatalf("egress knows epoch %d, want the new %d", got, second)
	}
	fresh := eg.dial()
	roundTrip(t, fresh, []byte("fresh"))
	another := eg.dial() // may open the second session, which announces the same epoch
	roundTrip(t, another, []byte("another"))
	roundTrip(t, fresh, []byte("still"))
	select {
	case s := <-eg.ended:
		t.Fatalf("a link opened under the new epoch ended: %+v", s)
	default:
	}
}

// waitEpoch waits for the first status from the peer, which its status
// stream delivers on its own, and returns port's epoch.
func waitEpoch(t *testing.T, pr *meshPeer, port uint16) uint64 {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if e := pr.epochOf(port); e != 0 {
			return e
		}
		if time.Now().After(deadline) {
			t.Fatal("no status from the peer within 5s")
		}
	}
}

// bumpEpoch makes the ingress announce a new epoch for port.
func (in *ingressProxy) bumpEpoch(t *testing.T, port uint16) uint64 {
	t.Helper()
	ing := in.p.listeners[0].ingress
	e := mesh.NewEpoch()
	ing.mu.Lock()
	ing.status[port] = mesh.PortStatus{Ready: true, Epoch: e}
	ing.memo.setEpoch(port, e)
	ing.gen = ing.memo.gen.Add(1)
	for is := range ing.sessions {
		is.notify()
	}
	ing.mu.Unlock()
	return e
}

// A stream that names a port the ingress does not serve is refused: the
// ingress is no open relay, and the egress resets its client as for a
// refused dial.
func TestMeshIngressRefusesOtherPorts(t *testing.T) {
	served := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	other := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", served.Addr(), nil)
	eg := startEgress(t, other.Addr(), in.port, nil)
	expectClosedSoon(t, eg.addr)
	if s := eg.linkEnd(5 * time.Second); s.Reason != CloseDialError {
		t.Fatalf("link ended %s (%v), want dial_error", s.Reason, s.Err)
	}
	if other.Accepted() != 0 {
		t.Fatal("the ingress relayed to a port it does not serve")
	}
}

func TestMeshStatusRoundTrip(t *testing.T) {
	want := mesh.StatusMsg{Boot: 3, Gen: 5, Ports: map[uint16]mesh.PortStatus{8098: {Ready: true, Epoch: 7}, 8097: {Ready: false, Epoch: 9}}}
	var b bytes.Buffer
	if err := mesh.WriteStatus(&b, want); err != nil {
		t.Fatal(err)
	}
	got, err := mesh.ReadStatus(&b)
	if err != nil {
		t.Fatal(err)
	}
	if got.Boot != 3 || got.Gen != 5 || len(got.Ports) != 2 || got.Ports[8098] != want.Ports[8098] || got.Ports[8097] != want.Ports[8097] {
		t.Fatalf("status %+v, want %+v", got, want)
	}
	if !got.Newer(3, 4) || got.Newer(3, 5) || got.Newer(3, 6) || !got.Newer(2, 9) {
		t.Fatal("newer: a later generation of the same boot, or another boot")
	}
	if _, err := mesh.ReadStatus(bytes.NewReader([]byte{0, 5, 1, 2, 3, 4, 5})); !errors.Is(err, mesh.ErrBadStatus) {
		t.Fatalf("a length shorter than the head: %v, want errBadStatus", err)
	}
	if _, err := mesh.ReadStatus(bytes.NewReader(append([]byte{0, 17}, make([]byte, 17)...))); !errors.Is(err, mesh.ErrBadStatus) {
		t.Fatalf("a length that is no whole entry: %v, want errBadStatus", err)
	}
	if _, err := mesh.ReadHeader(bytes.NewReader([]byte("HTTP/1"))); err == nil {
		t.Fatal("a stream that is not the mesh's was accepted")
	}
	if p, err := mesh.ReadHeader(bytes.NewReader(mesh.Header(8098))); err != nil || p != 8098 {
		t.Fatalf("header: %d, %v", p, err)
	}
}

// A transparent listener reaches a match entry's destinations through
// the entry's own mesh port, the others through the listener's; the
// endpoint remembers it for its probes.
func TestMeshPortOfMatchEntry(t *testing.T) {
	p, l := transparentProxy(t, func(tr *policy.Transparent) {
		tr.Match[0].Mesh.Port = 15008
	})
	meshed := p.transparentEndpoint("10.9.0.1:8098", l)
	other := p.transparentEndpoint("10.8.0.1:9092", l)
	lk := newLink(l, meshed, nil)
	if got := lk.meshPortFor(meshed); got != 15008 {
		t.Fatalf("mesh port of the first entry's destination = %d, want 15008", got)
	}
	if got := lk.meshPortFor(other); got != 0 {
		t.Fatalf("mesh port of the second entry's destination = %d, want 0 (the listener's)", got)
	}
	if meshed.meshPort.Load() != 15008 || other.meshPort.Load() != 0 {
		t.Fatalf("endpoints remember %d and %d", meshed.meshPort.Load(), other.meshPort.Load())
	}
	s := *lk.settings   // the link's settings are its listener's spec's: change a copy
	s.Mesh.Port = 15009 // the listener's, for entries without their own
	lk.settings = &s
	if got := lk.meshPortFor(other); got != 15009 {
		t.Fatalf("mesh port = %d, want the listener's 15009", got)
	}
	// Not reached through the mesh: the probe is the endpoint's own kind.
	if handled, _ := (&endpoint{}).meshProbe(t.Context(), ""); handled {
		t.Fatal("an endpoint without a mesh port had its probe taken over")
	}
}

// A dead session's links end; the links on another, live session to the
// same peer are judged by their own session's heartbeat, and survive both
// the exclusion and the readmission that follows.
func TestMeshDeadSessionSparesTheOther(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, func(s *policy.Settings) { s.Mesh.Sessions = 2 })
	a := eg.dial()
	roundTrip(t, a, []byte("a"))
	b := eg.dial()
	roundTrip(t, b, []byte("b"))
	pr := eg.p.meshPeer("127.0.0.2", in.port)
	pr.mu.Lock()
	ss := append([]*egressSession(nil), pr.sessions...)
	pr.mu.Unlock()
	if len(ss) != 2 {
		t.Fatalf("%d sessions, want 2 (one per link)", len(ss))
	}
	var dying *egressSession
	for _, es := range ss {
		es.mu.Lock()
		for lk := range es.links {
			if lk.client.RemoteAddr().String() == a.LocalAddr().String() {
				dying = es
			}
		}
		es.mu.Unlock()
	}
	if dying == nil {
		t.Fatal("no session carries link a")
	}
	dying.DeclareDead(time.Second) // the heartbeat's verdict, as after ping_timeout of silence
	if s := eg.linkEndOf(a, 5*time.Second); s.Reason != CloseMeshDead {
		t.Fatalf("link a ended %s (%v), want mesh_dead", s.Reason, s.Err)
	}
	// Excluded, then readmitted by the probe through the live session
	// (the exclusion may last less than a poll of the state).
	eg.waitReadmitted(srv.Addr(), 10*time.Second)
	roundTrip(t, b, []byte("b lives on"))
	select {
	case s := <-eg.ended:
		t.Fatalf("another link ended: %+v", s)
	default:
	}
}

// A session the peer closes is no clean end of its streams: the client
// is reset (a FIN would pass a cut-short response for a whole one) at
// once, not after half_close_timeout.
func TestMeshClosedSessionResetsClient(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, nil)
	c := eg.dial()
	roundTrip(t, c, []byte("hello"))
	ing := in.p.listeners[0].ingress
	ing.mu.Lock()
	for is := range ing.sessions {
		_ = is.Sess.Close()
	}
	ing.mu.Unlock()
	err, _ := waitClosed(t, c, 5*time.Second)
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("client saw %v, want a reset", err)
	}
	if s := eg.linkEndOf(c, 5*time.Second); s.Reason != CloseUpstreamError {
		t.Fatalf("link ended %s (%v), want upstream_error", s.Reason, s.Err)
	}
}

// A status that arrives after a newer one (on a busier session) is
// ignored: it would undo the newer one.
func TestMeshStaleStatusIgnored(t *testing.T) {
	p := &Proxy{}
	pr := &meshPeer{p: p, host: "127.0.0.9", statusCh: make(chan struct{}), endpoints: map[*endpoint]struct{}{}}
	pr.applyStatus(mesh.StatusMsg{Boot: 1, Gen: 2, Ports: map[uint16]mesh.PortStatus{80: {Ready: true, Epoch: 5}}})
	pr.applyStatus(mesh.StatusMsg{Boot: 1, Gen: 1, Ports: map[uint16]mesh.PortStatus{80: {Ready: false, Epoch: 4}}})
	if pr.epochOf(80) != 5 || !pr.status[80].Ready {
		t.Fatalf("status %+v after a stale message, want the newer one", pr.status)
	}
	pr.applyStatus(mesh.StatusMsg{Boot: 7, Gen: 1, Ports: map[uint16]mesh.PortStatus{80: {Ready: true, Epoch: 9}}})
	if pr.epochOf(80) != 9 {
		t.Fatalf("a new boot's first message was ignored: %+v", pr.status)
	}
}

// A port that the ingress's own detector took out and readmitted, while
// its server kept listening, keeps its epoch: nothing restarted, so the
// egress evicts nothing on its account. A port that refused connections
// in between gets a new one (TestMeshLocalServerDownThenBack).
func TestMeshEpochSurvivesAFlap(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, nil)
	roundTrip(t, eg.dial(), []byte("hello"))
	pr := eg.p.meshPeer("127.0.0.2", in.port)
	_, sp, _ := net.SplitHostPort(srv.Addr())
	n, _ := strconv.Atoi(sp)
	first := waitEpoch(t, pr, uint16(n))

	in.p.det.Report(srv.Addr(), "unanswered")
	eg.waitReadmittedOf(srv.Addr(), 10*time.Second) // excluded on the ingress's word, then readmitted
	if got := pr.epochOf(uint16(n)); got != first {
		t.Fatalf("epoch %d after a flap of the ingress's detector, want %d kept", got, first)
	}
	roundTrip(t, eg.dialWhenReadmitted(5*time.Second), []byte("again"))
}

// An ingress that stops accepting (shutdown, or its listener removed by a
// reload) announces its ports not ready: the egress refuses new links at
// once and lets the open ones finish within the drain.
func TestMeshIngressDrainAnnouncesNotReady(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, nil)
	c := eg.dial()
	roundTrip(t, c, []byte("hello"))
	done := make(chan error, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	go func() { done <- in.p.Shutdown(ctx) }()
	eg.waitStateOf(srv.Addr(), "excluded", 5*time.Second)
	roundTrip(t, c, []byte("the open link finishes its work"))
	_ = c.Close()
	if err := <-done; err != nil {
		t.Fatalf("the ingress's drain was cut: %v", err)
	}
}

// endpoints.disabled takes an ingress's local port out as it does any
// endpoint: the ingress announces it not ready, so the egress refuses new
// links to it.
func TestMeshIngressDisabledLocalPort(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	fastMesh(&s)
	cfg.Endpoints.Disabled = []string{srv.Addr()}
	cfg.Listeners = []policy.Listener{{Name: "ingress", Listen: "127.0.0.2:0",
		Ingress: policy.Ingress{Local: srv.Addr(), CheckInterval: policy.Duration(50 * time.Millisecond)}, Settings: s}}
	in := New(cfg, Options{metrics: metrics.New()})
	if err := in.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = in.Close() })
	if st, _ := in.det.State(srv.Addr()); st != health.Disabled {
		t.Fatalf("local port %v, want disabled", st)
	}
	eg := startEgress(t, srv.Addr(), in.Addr("ingress").(*net.TCPAddr).Port, nil)
	expectClosedSoon(t, eg.addr)
	eg.waitStateOf(srv.Addr(), "excluded", 5*time.Second)
	if srv.Accepted() != 0 {
		t.Fatalf("the disabled local port was dialled %d times (checks included)", srv.Accepted())
	}
}

// With the default timeouts (connect_timeout 2 s, ping_timeout 3 s) the
// link's connect budget ends a silent sidecar's session handshake before
// ping_timeout: the silence is a connect that timed out, weak evidence as
// any (README, "Handshake"). One alone excludes nothing; the second in a
// row excludes the endpoint as dial_error, and no session death is
// counted.
func TestMeshSilentSidecarWithDefaultTimeouts(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	silent := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Addr: "127.0.0.2:0"})
	_, port, _ := net.SplitHostPort(silent.Addr())
	meshPort, _ := strconv.Atoi(port)
	d := policy.DefaultSettings()
	h := startEgress(t, srv.Addr(), meshPort, func(s *policy.Settings) {
		s.Mesh.PingInterval, s.Mesh.PingTimeout = d.Mesh.PingInterval, d.Mesh.PingTimeout
		s.ConnectTimeout = d.ConnectTimeout
		s.ConnectAttempts = 1
	})
	if s := h.linkEndOf(h.dial(), 10*time.Second); s.Reason != CloseDialError || !dialTimedOut(s.Err) {
		t.Fatalf("first link ended %s (%v), want dial_error on connect_timeout", s.Reason, s.Err)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s) after one handshake timeout, want healthy", ep.State, ep.Reason)
	}
	h.dial()
	if ep := h.waitState("excluded", 10*time.Second); ep.Reason != string(CloseDialError) {
		t.Fatalf("excluded for %s, want %s", ep.Reason, CloseDialError)
	}
	if got := testutil.ToFloat64(h.m.MeshSessionDeaths(metrics.MeshEgress)); got != 0 {
		t.Fatalf("%v egress session deaths, want 0: connect_timeout ended the handshake first", got)
	}
}

// The series a mesh listener can produce exist at zero from its start, so
// that the first one is an increase: an egress listener's
// mesh_fallbacks_total, an ingress listener's capacity and no_match
// closes (and no loop series, which it can never produce).
func TestMeshListenersSeriesAtZero(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, nil)
	if !hasLabel(family(t, eg.m, "mesh_fallbacks_total"), "listener", "test") {
		t.Error("no mesh_fallbacks_total{listener=test} at zero on a mesh egress listener")
	}
	closes := family(t, in.m, "link_closes_total")
	for _, want := range []CloseReason{CloseCapacity, CloseNoMatch} {
		if !hasLabel(closes, "reason", string(want)) {
			t.Errorf("no link_closes_total{reason=%s} at zero on the ingress listener", want)
		}
	}
	if hasLabel(closes, "reason", string(CloseLoop)) {
		t.Error("the ingress listener has a loop series it can never produce")
	}
}
