package proxy

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
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
				c, code, _ := rawHandshakeFrom(t, net.IPv4(127, 0, 1, byte(10+i)), in.addr())
				if code != mesh.OK {
					t.Fatalf("another peer's handshake got code %d", code)
				}
				cfg := yamux.DefaultConfig()
				cfg.EnableKeepAlive, cfg.LogOutput = false, io.Discard
				sess, err := yamux.Client(c, cfg)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = sess.Close() })
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
