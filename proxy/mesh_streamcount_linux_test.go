package proxy

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// lateStatus holds back every ingress's open of a session's status
// stream by d (testHookIngressStatus), as a busy ingress does.
func lateStatus(t *testing.T, d time.Duration) {
	t.Helper()
	hook := func() { time.Sleep(d) }
	testHookIngressStatus.Store(&hook)
	t.Cleanup(func() { testHookIngressStatus.Store(nil) })
}

// echoed writes msg to c and reads it back (5 s at most).
func echoed(c net.Conn, msg string) error {
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	defer func() { _ = c.SetDeadline(time.Time{}) }()
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	_, err := io.ReadFull(c, make([]byte, len(msg)))
	return err
}

// oneFullSession starts an ingress that takes one session of a peer
// (max_sessions_per_peer 1) with one stream on it (max_streams_per_session
// 1) in front of an echo server, and an egress to it (tune: its
// settings), and fills the session with a link, c1.
func oneFullSession(t *testing.T, tune func(*policy.Settings)) (*ingressProxy, *harness, net.Conn) {
	t.Helper()
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) {
		l.Ingress.MaxSessionsPerPeer, l.Ingress.MaxStreamsPerSession = 1, 1
	})
	eg := startEgress(t, srv.Addr(), in.port, tune)
	c1 := eg.dial()
	if err := echoed(c1, "c1 through the mesh"); err != nil {
		t.Fatalf("c1: %v", err)
	}
	return in, eg, c1
}

// fullSessionKept checks what a link refused beside oneFullSession's c1
// left: no stream put on the full session (the ingress refused none for
// max_streams_per_session), c1 still served, the endpoint healthy.
func fullSessionKept(t *testing.T, in *ingressProxy, eg *harness, c1 net.Conn) {
	t.Helper()
	if got := in.limitHits(mesh.LimitStreamsPerSession); got != 0 {
		t.Fatalf("the ingress refused %v streams for max_streams_per_session: a link went on a session it holds full", got)
	}
	if err := echoed(c1, "c1 still"); err != nil {
		t.Fatalf("c1 after c2: %v", err)
	}
	if ep := eg.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s), want healthy", ep.State, ep.Reason)
	}
}

// A session carries as many link streams as its ingress takes
// (max_streams_per_session), counted without the ingress's status
// stream whether or not it has arrived yet. Before, the egress took the
// status stream for granted (full: NumStreams > max): while it was late,
// a session carrying max links looked to have room for one more, a link
// went on it, the ingress reset its stream, and the link, retrying on the
// same session (the second session refused: max_sessions_per_peer),
// ended dial_error after its attempts for a healthy server: refused by
// the proxy's own accounting ("c2 ... connection reset by peer", link
// dial_error, the ingress's streams_per_session limit hit). Now a new
// session is given to links once its status stream is open, and c2,
// finding the one session full, goes directly (mesh.fallback direct) as
// for any session its ingress refuses.
func TestMeshLateStatusStreamPutsNoLinkOnAFullSession(t *testing.T) {
	lateStatus(t, time.Second)           // within the connect budget (2 s)
	in, eg, c1 := oneFullSession(t, nil) // mesh.sessions 2, fallback direct
	c2 := eg.dial()
	if err := echoed(c2, "c2, the one session full"); err != nil {
		s := eg.linkEndOf(c2, 5*time.Second)
		t.Fatalf("c2 to a healthy server: %v; link ended %s (%v) after %d connect attempts; the ingress refused %v streams for max_streams_per_session",
			err, s.Reason, s.Err, s.ConnectAttempts, in.limitHits(mesh.LimitStreamsPerSession))
	}
	if got := testutil.ToFloat64(eg.m.MeshFallbacks("test")); got != 1 {
		t.Fatalf("%v links went directly, want 1 (c2)", got)
	}
	fullSessionKept(t, in, eg, c1)
}

// refusedLink connects a client to eg, expects it not to be served, and
// returns how its link ended. The proxy may reset it before the client's
// connect has returned (its refusal is that quick): the connect fails
// then, and the link's end is the next one eg reports (the others' links
// live on).
func refusedLink(t *testing.T, eg *harness) LinkStats {
	t.Helper()
	c, err := net.Dial("tcp", eg.addr)
	if err != nil {
		t.Logf("the connect failed: %v", err)
		return eg.linkEnd(5 * time.Second)
	}
	t.Cleanup(func() { _ = c.Close() })
	if err := echoed(c, "c2"); err == nil {
		t.Fatal("c2 was served by a peer whose ingress is full and takes no second session")
	}
	return eg.linkEndOf(c, 5*time.Second)
}

// The twin: a peer whose ingress is really full (its one session at
// max_streams_per_session, max_sessions_per_peer reached), status stream
// late or not, refuses the next link at once under mesh.fallback refuse:
// the link ends refused, well within its connect budget, no stream is put
// on the full session, and the server is not held to account.
func TestMeshReallyFullPeerRefusesALinkPromptly(t *testing.T) {
	for _, late := range []bool{false, true} {
		t.Run(map[bool]string{false: "status on time", true: "status late"}[late], func(t *testing.T) {
			if late {
				lateStatus(t, time.Second)
			}
			const budget = 2 * time.Second
			in, eg, c1 := oneFullSession(t, func(s *policy.Settings) {
				s.Mesh.Fallback, s.ConnectTimeout = policy.MeshFallbackRefuse, policy.Duration(budget)
			})
			s := refusedLink(t, eg)
			if s.Reason != CloseRefused || s.ConnectAttempts != 1 {
				t.Fatalf("c2 ended %s (%v) after %d connect attempts, want refused after 1", s.Reason, s.Err, s.ConnectAttempts)
			}
			if s.Duration >= budget {
				t.Fatalf("c2 refused %v after it opened, want within its connect budget %v", s.Duration, budget)
			}
			fullSessionKept(t, in, eg, c1)
		})
	}
}

// A session whose links have all ended takes the next link; the status
// stream is not a link's. Before, the grow rule counted it (NumStreams >
// 0, always true once it is open): with mesh.sessions 2 the next link
// dialled a second session though the first carried nothing, and an
// ingress at max_sessions_per_peer 1 refused it (a session dial and a
// refusal per link).
func TestMeshIdleSessionTakesTheNextLinkWithoutADial(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) { l.Ingress.MaxSessionsPerPeer = 1 })
	eg := startEgress(t, srv.Addr(), in.port, nil) // mesh.sessions 2
	c1 := eg.dial()
	if err := echoed(c1, "c1 through the mesh"); err != nil {
		t.Fatalf("c1: %v", err)
	}
	_ = c1.Close()
	eg.linkEndOf(c1, 5*time.Second)
	pr := eg.p.meshPeer("127.0.0.2", in.port)
	waitFor(t, 5*time.Second, "the session carries no link stream", func() bool {
		pr.mu.Lock()
		defer pr.mu.Unlock()
		return len(pr.sessions) == 1 && pr.sessions[0].Usable() && pr.sessions[0].unused()
	})
	before := in.limitHits(mesh.LimitSessionsPerPeer)
	c2 := eg.dial()
	if err := echoed(c2, "c2 on the idle session"); err != nil {
		t.Fatalf("c2: %v", err)
	}
	if got := in.limitHits(mesh.LimitSessionsPerPeer); got != before {
		t.Fatalf("the ingress refused %v sessions for max_sessions_per_peer (%v before c2): c2 dialled a second session beside an idle one", got, before)
	}
	if got := testutil.ToFloat64(eg.m.MeshFallbacks("test")); got != 0 {
		t.Fatalf("%v links went directly, want 0", got)
	}
}

// A probe through the mesh opens no stream: a peer whose one session is
// full (max_streams_per_session) and that takes no second one
// (max_sessions_per_peer) is proved through the full session once its
// ingress refused the second. Before, the probe asked for a session with
// room as a link does and failed with the refusal, "no ingress": under
// mesh.fallback refuse a probe failure, the healthy server kept excluded
// (or excluded) for the proxy's own accounting.
func TestMeshProbeThroughAFullSession(t *testing.T) {
	in, eg, _ := oneFullSession(t, func(s *policy.Settings) { s.Mesh.Fallback = policy.MeshFallbackRefuse })
	before := in.limitHits(mesh.LimitSessionsPerPeer)
	ep := eg.p.lookupEndpoint(eg.endpoint().Endpoint)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if handled, err := ep.meshProbe(ctx, ""); !handled || err != nil {
		t.Fatalf("probe through the mesh: handled %v, %v; the ingress refused %v sessions for max_sessions_per_peer (%v before)",
			handled, err, in.limitHits(mesh.LimitSessionsPerPeer), before)
	}
}

// A new session whose status stream comes after the link's connect
// budget, while its ingress answers every ping (a busy ingress), is given
// to the link: the wait for it is the budget plus a ping_timeout, as the
// wait for a stream's acknowledgement (awaitAck) is; the heartbeat judges
// the peer meanwhile. Before, the wait was the budget alone: the link
// ended upstream_error ("opened no status stream ... within the connect
// budget") and the healthy session was closed, where without the wait the
// link, its stream acknowledged, was served.
func TestMeshStatusStreamLaterThanTheBudgetServesTheLink(t *testing.T) {
	lateStatus(t, 700*time.Millisecond)
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, func(s *policy.Settings) {
		s.ConnectTimeout = policy.Duration(200 * time.Millisecond)
		s.Mesh.PingTimeout = policy.Duration(5 * time.Second)
	})
	c := eg.dial()
	if err := echoed(c, "status late, the session alive"); err != nil {
		s := eg.linkEndOf(c, 5*time.Second)
		t.Fatalf("link to a healthy server over a live session: %v; link ended %s (%v)", err, s.Reason, s.Err)
	}
	if ep := eg.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s), want healthy", ep.State, ep.Reason)
	}
}

// silentAfterReply plays a peer sidecar's ingress that answers the
// session handshake and then stops (its host frozen): it reads and
// writes nothing more, opens no status stream. Its connections are held
// until the test ends.
func silentAfterReply(t *testing.T, host string) int {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var conns []net.Conn
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
			var pre [mesh.PrefaceLen]byte
			if _, err := io.ReadFull(c, pre[:]); err == nil {
				_, _ = c.Write(mesh.Reply(mesh.OK, 16))
			}
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		<-done
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return ln.Addr().(*net.TCPAddr).Port
}

// The twin: a peer sidecar that stops right after its handshake reply is
// dead, and judged so by the session's heartbeat within ping_timeout
// (and a second) of the dial, though the link's connect budget is
// shorter: the link ends mesh_dead and the endpoint is excluded. Before,
// the wait for the status stream gave up at the budget and closed the
// session: the link ended upstream_error, "no evidence", and the dead
// peer's endpoint stayed in.
func TestMeshPeerSilentAfterTheReplyIsDead(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	port := silentAfterReply(t, "127.0.0.2")
	const pingTimeout = time.Second
	eg := startEgress(t, srv.Addr(), port, func(s *policy.Settings) {
		s.ConnectTimeout = policy.Duration(200 * time.Millisecond)
		s.Mesh.PingTimeout = policy.Duration(pingTimeout)
		s.Mesh.Fallback = policy.MeshFallbackRefuse
	})
	began := time.Now()
	c := eg.dial()
	s := eg.linkEndOf(c, 10*time.Second)
	if s.Reason != CloseMeshDead {
		t.Fatalf("link to a dead peer sidecar ended %s (%v) after %v, want mesh_dead", s.Reason, s.Err, time.Since(began))
	}
	ep := eg.waitState("excluded", pingTimeout+time.Second)
	if ep.Reason != string(CloseMeshDead) {
		t.Fatalf("endpoint excluded for %s, want mesh_dead", ep.Reason)
	}
}
