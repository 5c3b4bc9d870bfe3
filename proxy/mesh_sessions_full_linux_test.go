package proxy

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// An ingress's max_sessions (b395d50) is shared by every peer: once other
// peers fill it, a sidecar that holds no session at all is refused at the
// handshake. Its clients' links to a healthy server must still be served:
// the refusal is no ingress for this sidecar, and mesh.fallback (direct,
// the default) takes them to the server directly. Before the refusal was
// a mesh.ErrNoIngress, it was ErrStream and every such link ended
// upstream_error (no fallback, no other member, not reported) for as long
// as the others held their sessions; at the default 1024 that is a server
// with more than 512 client sidecars at mesh.sessions 2. The twin: one
// session below the cap, the same link is served through the mesh.
func TestMeshIngressFullOfOtherPeersServesANewPeer(t *testing.T) {
	for _, full := range []bool{false, true} {
		name := map[bool]string{false: "below max_sessions", true: "max_sessions held by other peers"}[full]
		t.Run(name, func(t *testing.T) {
			srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
			in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) { l.Ingress.MaxSessions = 3 })
			others := 2
			if full {
				others = 3
			}
			for i := range others { // other peers, one session each
				if _, code := rawSessionFrom(t, net.IPv4(127, 0, 1, byte(10+i)), in.addr()); code != mesh.OK {
					t.Fatalf("another peer's handshake got code %d", code)
				}
			}
			eg := startEgress(t, srv.Addr(), in.port, nil)
			c := eg.dial()
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			msg := []byte("hello through the mesh")
			if _, err := c.Write(msg); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, len(msg))
			if _, err := io.ReadFull(c, buf); err != nil {
				s := eg.linkEndOf(c, 5*time.Second)
				ep := eg.endpoint()
				t.Fatalf("a new peer's link to a healthy server failed: %v; link ended %s (%v); endpoint %s; the ingress refused %v sessions for max_sessions",
					err, s.Reason, s.Err, ep.State, in.limitHits(mesh.LimitSessions))
			}
			want := 0.0 // through the mesh
			if full {
				want = 1 // directly: the ingress refused the session
			}
			if got := testutil.ToFloat64(eg.m.MeshFallbacks("test")); got != want {
				t.Fatalf("%v links fell back to a direct connection, want %v", got, want)
			}
			if ep := eg.endpoint(); ep.State != "healthy" {
				t.Fatalf("endpoint %s (%s), want healthy: a refused session is no evidence against the server", ep.State, ep.Reason)
			}
		})
	}
}

// A session the ingress refuses while this sidecar holds a live session
// to the peer (full: the ingress's max_streams_per_session) is no "no
// ingress" for the peer: once the live session has room again, the next
// link goes on it, through the mesh. Before, the refusal set the peer's
// noIngressUntil (10 s) whatever lived, and every link in those 10 s went
// directly, with the plain enforcement only, the peer's live session
// idle, and was counted a fallback to a peer "without an ingress
// sidecar". The refused link itself (c2) may go directly, as it does.
func TestMeshSessionRefusedWithALiveSessionKeepsTheMesh(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) {
		l.Ingress.MaxSessionsPerPeer, l.Ingress.MaxStreamsPerSession = 1, 1
	})
	eg := startEgress(t, srv.Addr(), in.port, nil) // mesh.sessions 2
	fallbacks := func() float64 { return testutil.ToFloat64(eg.m.MeshFallbacks("test")) }
	echo := func(c net.Conn, msg string) {
		t.Helper()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(c, buf); err != nil {
			t.Fatalf("%s: %v", msg, err)
		}
	}
	c1 := eg.dial()
	echo(c1, "c1 through the mesh")
	if got := fallbacks(); got != 0 {
		t.Fatalf("premise: %v fallbacks for the first link, want 0", got)
	}
	pr := eg.p.meshPeer("127.0.0.2", in.port)
	// c2's one dial is the one refusal it brings, once the egress counts
	// c1's session full. The egress counts the ingress's status stream
	// among the session's streams (full: more than the ingress's
	// max_streams_per_session); until that stream has arrived, the
	// session looks to it as having room: a link then opens a stream
	// there, the ingress resets it, and each of the link's next attempts
	// dials a session again, refused (with the status stream held back 20
	// ms in a scratch build: 2 refused, 40 ms: 3). c1 may bring one too:
	// the ingress counts its status stream a moment before it knows it is
	// the status stream (startSession), and refuses c1's stream then;
	// c1's next attempt finds its session carrying a stream, dials a
	// second (mesh.sessions 2), refused, and takes the first.
	sessionFull := func(full bool) func() bool {
		return func() bool {
			pr.mu.Lock()
			defer pr.mu.Unlock()
			for _, es := range pr.sessions {
				if es.Usable() && es.statusOpen.Load() == 1 && es.full() == full {
					return true
				}
			}
			return false
		}
	}
	waitFor(t, 5*time.Second, "the egress counts c1's session full", sessionFull(true))
	refused := in.limitHits(mesh.LimitSessionsPerPeer)
	c2 := eg.dial()
	echo(c2, "c2, its session refused") // the one session is full: a second is refused
	if got := in.limitHits(mesh.LimitSessionsPerPeer) - refused; got != 1 {
		t.Fatalf("premise: the ingress refused %v sessions for max_sessions_per_peer for c2, want 1", got)
	}
	_ = c1.Close()
	eg.linkEndOf(c1, 5*time.Second)
	waitFor(t, 5*time.Second, "the live session has room again", sessionFull(false))
	before := fallbacks()
	c3 := eg.dial()
	echo(c3, "c3 on the live session")
	if got := fallbacks(); got != before {
		t.Fatalf("c3 fell back to a direct connection (%v fallbacks, %v before) with a live session to the peer that had room", got, before)
	}
}
