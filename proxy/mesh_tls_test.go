package proxy

import (
	"crypto/tls"
	"math/big"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/mesh"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
)

// issue has ca issue a certificate for id into dir, as mesh.tls.
func issue(t *testing.T, ca *testutil.CA, dir, id string) (policy.MeshTLS, *big.Int) {
	t.Helper()
	f := ca.Issue(t, dir, id)
	return policy.MeshTLS{CertFile: f.CertFile, KeyFile: f.KeyFile, CAFile: f.CAFile}, f.Serial
}

const (
	egressID  = "spiffe://cluster.local/ns/pinot/sa/pinot-broker"
	ingressID = "spiffe://cluster.local/ns/pinot/sa/pinot-server"
)

// tlsPair is an ingress and an egress whose sessions run over mutual
// TLS, each allowing the other's identity.
func tlsPair(t *testing.T, ca *testutil.CA, egressAs string) (*faultpeer.Server, *ingressProxy, *harness, policy.MeshTLS) {
	t.Helper()
	dir := t.TempDir()
	inFiles, _ := issue(t, ca, filepath.Join(dir, "ingress"), ingressID)
	egFiles, _ := issue(t, ca, filepath.Join(dir, "egress"), egressAs)
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), func(s *policy.Settings) {
		s.Mesh.TLS = inFiles
		s.Mesh.TLS.Peers = policy.NewIdentities(egressID)
	})
	eg := startEgress(t, srv.Addr(), in.port, func(s *policy.Settings) {
		s.Mesh.TLS = egFiles
		s.Mesh.TLS.Peers = policy.NewIdentities(ingressID)
	})
	return srv, in, eg, egFiles
}

// Over mutual TLS a link round-trips as over plain TCP, and the session
// carries the peers' certificates.
func TestMeshTLSRoundTrip(t *testing.T) {
	ca := testutil.NewCA(t)
	srv, in, eg, _ := tlsPair(t, ca, egressID)
	c := eg.dial()
	roundTrip(t, c, []byte("over TLS"))
	if got := promtest.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)); got != 1 {
		t.Fatalf("%v ingress sessions, want 1", got)
	}
	pr := eg.p.meshPeer("127.0.0.2", in.port)
	pr.mu.Lock()
	es := pr.sessions[0]
	pr.mu.Unlock()
	tc, ok := es.Guard.Conn.(*tls.Conn)
	if !ok {
		t.Fatalf("the session runs over %T, want TLS", es.Guard.Conn)
	}
	if st := tc.ConnectionState(); st.Version != tls.VersionTLS13 || st.PeerCertificates[0].URIs[0].String() != ingressID {
		t.Fatalf("TLS version %x, peer %v; want TLS 1.3 with the ingress's identity", st.Version, st.PeerCertificates[0].URIs)
	}
	if srv.Accepted() == 0 {
		t.Fatal("the server saw no connection")
	}
}

// A peer without a valid certificate is refused before any stream opens:
// one signed by another CA, one with an identity the ingress does not
// allow, and one that speaks no TLS. Each egress, refused, falls back to
// the server directly (mesh.fallback: direct).
func TestMeshTLSRefusesInvalidPeers(t *testing.T) {
	ca := testutil.NewCA(t)
	other := testutil.NewCA(t)
	srv, in, _, _ := tlsPair(t, ca, egressID)
	dir := t.TempDir()
	foreign, _ := issue(t, other, filepath.Join(dir, "foreign"), egressID)
	stranger, _ := issue(t, ca, filepath.Join(dir, "stranger"), "spiffe://cluster.local/ns/x/sa/intruder")
	for _, tc := range []struct {
		name string
		tls  policy.MeshTLS
	}{{"another CA", foreign}, {"an identity not allowed", stranger}, {"no TLS", policy.MeshTLS{}}} {
		t.Run(tc.name, func(t *testing.T) {
			before := in.limitHits(mesh.LimitTLS)
			eg := startEgress(t, srv.Addr(), in.port, func(s *policy.Settings) { s.Mesh.TLS = tc.tls })
			roundTrip(t, eg.dial(), []byte("direct"))
			if got := promtest.ToFloat64(eg.m.MeshFallbacks("test")); got != 1 {
				t.Fatalf("%v fallbacks, want 1 (refused by the ingress, the link goes directly)", got)
			}
			waitFor(t, 5*time.Second, "the TLS refusal counted", func() bool { return in.limitHits(mesh.LimitTLS) == before+1 })
			if got := promtest.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)); got != 0 {
				t.Fatalf("%v ingress sessions, want none", got)
			}
			if n := len(in.p.listeners[0].snapshotLinks()); n != 0 {
				t.Fatalf("the ingress carries %d links, want none", n)
			}
		})
	}
	// The egress checks the ingress too: an ingress whose identity is not
	// the allowed one is refused by the egress.
	eg := startEgress(t, srv.Addr(), in.port, func(s *policy.Settings) {
		s.Mesh.TLS, _ = issue(t, ca, filepath.Join(dir, "picky"), egressID)
		s.Mesh.TLS.Peers = policy.NewIdentities("spiffe://cluster.local/ns/pinot/sa/someone-else")
	})
	roundTrip(t, eg.dial(), []byte("direct"))
	if got := promtest.ToFloat64(eg.m.MeshFallbacks("test")); got != 1 {
		t.Fatalf("%v fallbacks, want 1 (the egress refused the ingress's identity)", got)
	}
}

// Certificate rotation under load keeps every session: the files are
// replaced while links stream; the open sessions and their links carry on,
// and a new session shows the new certificate.
func TestMeshTLSRotationKeepsSessions(t *testing.T) {
	ca := testutil.NewCA(t)
	dir := t.TempDir()
	inFiles, _ := issue(t, ca, filepath.Join(dir, "ingress"), ingressID)
	egFiles, _ := issue(t, ca, filepath.Join(dir, "egress"), egressID)
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), func(s *policy.Settings) { s.Mesh.TLS = inFiles })
	eg := startEgress(t, srv.Addr(), in.port, func(s *policy.Settings) {
		s.Mesh.TLS = egFiles
		s.Mesh.Sessions = 1
	})
	const links = 8
	var conns []*net.TCPConn
	for range links {
		c := eg.dial()
		roundTrip(t, c, []byte("before"))
		conns = append(conns, c)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, links)
	for _, c := range conns {
		wg.Add(1)
		go func() { // load: round trips until told to stop
			defer wg.Done()
			buf := make([]byte, 4096)
			for i := 0; i < 10000; i++ {
				select {
				case <-stop:
					return
				default:
				}
				_ = c.SetDeadline(time.Now().Add(10 * time.Second))
				if _, err := c.Write(buf); err != nil {
					errs <- err
					return
				}
				if _, err := readFull(c, buf); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	time.Sleep(200 * time.Millisecond)
	_, newInSerial := issue(t, ca, filepath.Join(dir, "ingress"), ingressID)
	_, _ = issue(t, ca, filepath.Join(dir, "egress"), egressID)
	time.Sleep(300 * time.Millisecond)
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("a link under load failed across the rotation: %v", err)
	}
	for _, c := range conns {
		roundTrip(t, c, []byte("after"))
	}
	if got := promtest.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)); got != 1 {
		t.Fatalf("%v ingress sessions after the rotation, want the one from before", got)
	}
	select {
	case s := <-eg.ended:
		t.Fatalf("a link ended across the rotation: %+v", s)
	default:
	}
	// A new session (another egress) is served with the new certificate.
	eg2 := startEgress(t, srv.Addr(), in.port, func(s *policy.Settings) { s.Mesh.TLS = egFiles })
	roundTrip(t, eg2.dial(), []byte("new session"))
	pr := eg2.p.meshPeer("127.0.0.2", in.port)
	pr.mu.Lock()
	es := pr.sessions[0]
	pr.mu.Unlock()
	if got := es.Guard.Conn.(*tls.Conn).ConnectionState().PeerCertificates[0].SerialNumber; got.Cmp(newInSerial) != 0 {
		t.Fatalf("a new session got the ingress certificate %v, want the rotated one %v", got, newInSerial)
	}
}

func readFull(c net.Conn, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		k, err := c.Read(b[n:])
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}
