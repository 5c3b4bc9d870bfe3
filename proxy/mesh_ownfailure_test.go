package proxy

import (
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
)

// ownFailConn fails every write as a socket does when the kernel has no
// buffers for it (ENOBUFS): the process's own want, nothing the peer did.
type ownFailConn struct{ net.Conn }

func (c ownFailConn) Write([]byte) (int, error) {
	return 0, &net.OpError{Op: "write", Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(),
		Err: os.NewSyscallError("write", syscall.ENOBUFS)}
}

// A mesh session handshake that fails for this process's own want
// (ENOBUFS on its write; testHookMeshHandshake makes the write fail so,
// which no loopback socket can be made to) is the proxy's own failure:
// the link ends local_error, it does not go around the mesh to the server
// (mesh.fallback: direct), the peer is not taken for one without an
// ingress, and the next link, the write no longer failing, goes through
// the mesh. Before 65402ef (plain) and 4b1e67e (TLS: the TLS branch took
// the handshake's error for a foreign peer first), the failure made the
// peer foreign: the link and, for noIngressFor, every other went directly
// to the server. The twin: a real foreign peer on the mesh port (another
// protocol answers) is still one, and its links fall back.
func TestMeshHandshakeOwnFailureIsNoForeignPeer(t *testing.T) {
	for _, withTLS := range []bool{false, true} {
		name := "plain"
		if withTLS {
			name = "TLS"
		}
		t.Run(name, func(t *testing.T) {
			var srv *faultpeer.Server
			var in *ingressProxy
			var eg *harness
			ca := testutil.NewCA(t)
			if withTLS {
				srv, in, eg, _ = tlsPair(t, ca, egressID)
			} else {
				srv = faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
				in = startIngress(t, "127.0.0.2", srv.Addr(), nil)
				eg = startEgress(t, srv.Addr(), in.port, nil)
			}
			wrap := func(c net.Conn) net.Conn { return ownFailConn{c} }
			testHookMeshHandshake.Store(&wrap)
			t.Cleanup(func() { testHookMeshHandshake.Store(nil) })

			expectOwnLinkFailure(t, in, eg, func(s LinkStats) bool { return errors.Is(s.Err, syscall.ENOBUFS) }, "ENOBUFS")

			testHookMeshHandshake.Store(nil)
			roundTrip(t, eg.dial(), []byte("through the mesh"))
			if got := promtest.ToFloat64(eg.m.MeshSessions(metrics.MeshEgress)); got != 1 {
				t.Fatalf("%v egress sessions after the failure passed, want 1: the next link goes through the mesh", got)
			}
			if got := promtest.ToFloat64(eg.m.MeshFallbacks("test")); got != 0 {
				t.Fatalf("%v fallbacks, want none", got)
			}

			// The twin: something else answers on the mesh port.
			foreign := startEgress(t, srv.Addr(), foreignPeer(t, "127.0.0.2"), func(s *policy.Settings) {
				if withTLS {
					s.Mesh.TLS, _ = issue(t, ca, filepath.Join(t.TempDir(), "twin"), egressID)
				}
			})
			roundTrip(t, foreign.dial(), []byte("directly"))
			if got := promtest.ToFloat64(foreign.m.MeshFallbacks("test")); got != 1 {
				t.Fatalf("%v fallbacks to a foreign peer, want 1", got)
			}
		})
	}
}

// expectOwnLinkFailure dials a link through eg, whose session handshake
// to the ingress in fails for this process's own reasons (own tells the
// link's error apart, what names it), and checks that it was the proxy's
// own failure: the client reads nothing back (its link did not go around
// the mesh to the server), the link ends local_error, no fallback and no
// no-ingress mark, the endpoint healthy, no session death. The client is
// reset, sometimes before its own connect completed (the handshake fails
// in microseconds).
func expectOwnLinkFailure(t *testing.T, in *ingressProxy, eg *harness, own func(LinkStats) bool, what string) {
	t.Helper()
	if c, err := net.Dial("tcp", eg.addr); err == nil {
		msg := []byte("through the mesh or not at all")
		_, _ = c.Write(msg)
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := io.ReadFull(c, make([]byte, len(msg))); err == nil {
			t.Fatalf("the client read %d bytes back: its link went around the mesh to the server", n)
		} else if !isCloseSignal(err) {
			t.Fatalf("the client saw %v, want its connection closed", err)
		}
		_ = c.Close()
	} else if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("dial: %v, want a connection, or one reset at once", err)
	}
	s := eg.linkEnd(5 * time.Second)
	if s.Reason != CloseLocalError || !own(s) {
		t.Fatalf("link ended %s (%v), want local_error (%s)", s.Reason, s.Err, what)
	}
	pr := eg.p.meshPeer("127.0.0.2", in.port)
	if got := promtest.ToFloat64(eg.m.MeshFallbacks("test")); got != 0 || pr.noIngressUntil.Load() != 0 {
		t.Fatalf("%v fallbacks, no-ingress mark %d: the peer was taken for one without an ingress", got, pr.noIngressUntil.Load())
	}
	if ep := eg.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s), want healthy", ep.State, ep.Reason)
	}
	if got := promtest.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)); got != 0 {
		t.Fatalf("%v egress session deaths, want none", got)
	}
}
