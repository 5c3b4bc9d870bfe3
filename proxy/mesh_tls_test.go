package proxy

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// testCA signs certificates for the mesh TLS tests.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

var serial = struct {
	sync.Mutex
	n int64
}{n: 1}

func nextSerial() *big.Int {
	serial.Lock()
	defer serial.Unlock()
	serial.n++
	return big.NewInt(serial.n)
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: nextSerial(), Subject: pkix.Name{CommonName: "mesh test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue writes a certificate for identity id (a URI SAN when it has a
// scheme, else a DNS SAN) and its key into dir, with the CA bundle, as a
// Kubernetes TLS Secret (cert-manager's) is mounted: tls.crt, tls.key,
// ca.crt. It returns the files as mesh.tls and the certificate's serial.
func (ca *testCA) issue(t *testing.T, dir, id string) (policy.MeshTLS, *big.Int) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: nextSerial(), Subject: pkix.Name{CommonName: id},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	if u, err := url.Parse(id); err == nil && u.Scheme != "" {
		tmpl.URIs = []*url.URL{u}
	} else {
		tmpl.DNSNames = []string{id}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	files := policy.MeshTLS{CertFile: filepath.Join(dir, "tls.crt"), KeyFile: filepath.Join(dir, "tls.key"), CAFile: filepath.Join(dir, "ca.crt")}
	// Each written to a new file then renamed over the old: a reader never
	// sees half a file (a Secret's update is an atomic symlink swap).
	for f, b := range map[string][]byte{
		files.CertFile: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		files.KeyFile:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}),
		files.CAFile:   ca.pem,
	} {
		if err := os.WriteFile(f+".new", b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(f+".new", f); err != nil {
			t.Fatal(err)
		}
	}
	return files, tmpl.SerialNumber
}

const (
	egressID  = "spiffe://cluster.local/ns/pinot/sa/pinot-broker"
	ingressID = "spiffe://cluster.local/ns/pinot/sa/pinot-server"
)

// tlsPair is an ingress and an egress whose sessions run over mutual
// TLS, each allowing the other's identity.
func tlsPair(t *testing.T, ca *testCA, egressAs string) (*faultpeer.Server, *ingressProxy, *harness, policy.MeshTLS) {
	t.Helper()
	dir := t.TempDir()
	inFiles, _ := ca.issue(t, filepath.Join(dir, "ingress"), ingressID)
	egFiles, _ := ca.issue(t, filepath.Join(dir, "egress"), egressAs)
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
	ca := newTestCA(t)
	srv, in, eg, _ := tlsPair(t, ca, egressID)
	c := eg.dial()
	roundTrip(t, c, []byte("over TLS"))
	if got := testutil.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)); got != 1 {
		t.Fatalf("%v ingress sessions, want 1", got)
	}
	pr := eg.p.meshPeer("127.0.0.2", in.port)
	pr.mu.Lock()
	es := pr.sessions[0]
	pr.mu.Unlock()
	tc, ok := es.guard.conn.(*tls.Conn)
	if !ok {
		t.Fatalf("the session runs over %T, want TLS", es.guard.conn)
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
	ca := newTestCA(t)
	other := newTestCA(t)
	srv, in, _, _ := tlsPair(t, ca, egressID)
	dir := t.TempDir()
	foreign, _ := other.issue(t, filepath.Join(dir, "foreign"), egressID)
	stranger, _ := ca.issue(t, filepath.Join(dir, "stranger"), "spiffe://cluster.local/ns/x/sa/intruder")
	for _, tc := range []struct {
		name string
		tls  policy.MeshTLS
	}{{"another CA", foreign}, {"an identity not allowed", stranger}, {"no TLS", policy.MeshTLS{}}} {
		t.Run(tc.name, func(t *testing.T) {
			before := in.limitHits(limitTLS)
			eg := startEgress(t, srv.Addr(), in.port, func(s *policy.Settings) { s.Mesh.TLS = tc.tls })
			roundTrip(t, eg.dial(), []byte("direct"))
			if got := testutil.ToFloat64(eg.m.MeshFallbacks("test")); got != 1 {
				t.Fatalf("%v fallbacks, want 1 (refused by the ingress, the link goes directly)", got)
			}
			waitFor(t, 5*time.Second, "the TLS refusal counted", func() bool { return in.limitHits(limitTLS) == before+1 })
			if got := testutil.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)); got != 0 {
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
		s.Mesh.TLS, _ = ca.issue(t, filepath.Join(dir, "picky"), egressID)
		s.Mesh.TLS.Peers = policy.NewIdentities("spiffe://cluster.local/ns/pinot/sa/someone-else")
	})
	roundTrip(t, eg.dial(), []byte("direct"))
	if got := testutil.ToFloat64(eg.m.MeshFallbacks("test")); got != 1 {
		t.Fatalf("%v fallbacks, want 1 (the egress refused the ingress's identity)", got)
	}
}

// Certificate rotation under load keeps every session: the files are
// replaced while links stream; the open sessions and their links carry on,
// and a new session shows the new certificate.
func TestMeshTLSRotationKeepsSessions(t *testing.T) {
	ca := newTestCA(t)
	dir := t.TempDir()
	inFiles, _ := ca.issue(t, filepath.Join(dir, "ingress"), ingressID)
	egFiles, _ := ca.issue(t, filepath.Join(dir, "egress"), egressID)
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
	_, newInSerial := ca.issue(t, filepath.Join(dir, "ingress"), ingressID)
	_, _ = ca.issue(t, filepath.Join(dir, "egress"), egressID)
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
	if got := testutil.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)); got != 1 {
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
	if got := es.guard.conn.(*tls.Conn).ConnectionState().PeerCertificates[0].SerialNumber; got.Cmp(newInSerial) != 0 {
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
