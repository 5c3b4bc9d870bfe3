package proxy

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// ownTLSPair is tlsPair with the egress's mesh.fallback set to fallback.
func ownTLSPair(t *testing.T, ca *testutil.CA, fallback string) (*ingressProxy, *harness, policy.MeshTLS) {
	t.Helper()
	dir := t.TempDir()
	inFiles, _ := issue(t, ca, filepath.Join(dir, "ingress"), ingressID)
	egFiles, _ := issue(t, ca, filepath.Join(dir, "egress"), egressID)
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"}).Addr()
	in := startIngress(t, "127.0.0.2", srv, func(s *policy.Settings) { s.Mesh.TLS = inFiles })
	eg := startEgress(t, srv, in.port, func(s *policy.Settings) {
		s.Mesh.TLS = egFiles
		s.Mesh.Fallback = fallback
	})
	return in, eg, egFiles
}

// expectOwnTLSFailure dials a link through eg, whose own mesh.tls files
// are not usable, and checks that it was the proxy's own failure
// (expectOwnLinkFailure), its error naming want (the file), and that the
// ingress was not dialled: it counts no TLS refusal against the egress
// and holds no session.
func expectOwnTLSFailure(t *testing.T, in *ingressProxy, eg *harness, want string) {
	t.Helper()
	expectOwnLinkFailure(t, in, eg, func(s LinkStats) bool {
		return errors.Is(s.Err, mesh.ErrOwnTLS) && strings.Contains(s.Err.Error(), want)
	}, "this sidecar's own files, naming "+want)
	if got := in.limitHits(mesh.LimitTLS); got != 0 {
		t.Fatalf("the ingress counted %v TLS refusals: the egress's own failure reached it", got)
	}
	if got := promtest.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)); got != 0 {
		t.Fatalf("%v ingress sessions, want none", got)
	}
}

// This sidecar's own mesh.tls files not usable, with no good set read
// before (the certificate file missing; a certificate that expired), is
// its own failure, under mesh.fallback direct and refuse alike: the link
// ends local_error with an error naming the file, no link goes around
// the mesh or is refused as for a peer without an ingress, the peer gets
// no no-ingress mark, the endpoint stays healthy, and the peer's ingress
// is not dialled (it counts no TLS refusal against this sidecar). Once
// the files are good again, the next link goes through the mesh. Before,
// the handshake's error made the peer a foreign one: under direct the
// link went around the mesh ("the client read 30 bytes back"), under
// refuse it ended refused.
func TestMeshTLSOwnFilesAreNoForeignPeer(t *testing.T) {
	ca := testutil.NewCA(t)
	for _, fallback := range []string{policy.MeshFallbackDirect, policy.MeshFallbackRefuse} {
		t.Run("missing/"+fallback, func(t *testing.T) {
			in, eg, files := ownTLSPair(t, ca, fallback)
			if err := os.Rename(files.CertFile, files.CertFile+".gone"); err != nil {
				t.Fatal(err)
			}
			expectOwnTLSFailure(t, in, eg, files.CertFile)
			if err := os.Rename(files.CertFile+".gone", files.CertFile); err != nil {
				t.Fatal(err)
			}
			roundTrip(t, eg.dial(), []byte("through the mesh"))
			if got := promtest.ToFloat64(eg.m.MeshSessions(metrics.MeshEgress)); got != 1 {
				t.Fatalf("%v egress sessions once the file is back, want 1", got)
			}
		})
		t.Run("expired/"+fallback, func(t *testing.T) {
			in, eg, files := ownTLSPair(t, ca, fallback)
			ca.IssueValid(t, filepath.Dir(files.CertFile), egressID, time.Now().Add(-2*time.Hour), time.Now().Add(-time.Hour))
			expectOwnTLSFailure(t, in, eg, "expired")
			issue(t, ca, filepath.Dir(files.CertFile), egressID) // renewed
			roundTrip(t, eg.dial(), []byte("through the mesh"))
			if got := promtest.ToFloat64(eg.m.MeshFallbacks("test")); got != 0 {
				t.Fatalf("%v fallbacks, want none", got)
			}
		})
	}
}

// A rotation that leaves a broken certificate file, after a good set was
// read, keeps the last good set: a new session is dialled with it and
// the link goes through the mesh, no fallback.
func TestMeshTLSBrokenRotationKeepsLastGood(t *testing.T) {
	ca := testutil.NewCA(t)
	in, eg, files := ownTLSPair(t, ca, policy.MeshFallbackRefuse)
	roundTrip(t, eg.dial(), []byte("first"))
	pr := eg.p.meshPeer("127.0.0.2", in.port)
	pr.mu.Lock()
	first := pr.sessions[0]
	pr.mu.Unlock()
	first.Retire("test: the next link dials a new session")
	if err := os.WriteFile(files.CertFile, []byte("-----BEGIN CERT"), 0o600); err != nil {
		t.Fatal(err)
	}
	roundTrip(t, eg.dial(), []byte("second, on a new session"))
	pr.mu.Lock()
	var fresh bool
	for _, es := range pr.sessions {
		fresh = fresh || es != first && es.Usable()
	}
	pr.mu.Unlock()
	if !fresh {
		t.Fatal("no new session: the link did not go through one dialled after the rotation")
	}
	if got := promtest.ToFloat64(eg.m.MeshFallbacks("test")); got != 0 {
		t.Fatalf("%v fallbacks, want none", got)
	}
}

// An ingress whose own files are not usable does not count its peers'
// handshakes as TLS refusals (mesh_limits_total{limit="tls"}): the peer
// did nothing wrong. The egress, answered with an internal_error alert,
// finds no ingress there that takes it, and falls back (direct), as for
// any peer without a working ingress. The twin: an egress whose
// certificate another CA signed is still counted.
func TestMeshTLSIngressOwnFilesCountNoPeer(t *testing.T) {
	ca := testutil.NewCA(t)
	in, eg, _ := ownTLSPair(t, ca, policy.MeshFallbackDirect)
	inFiles := in.cfg.Listeners[0].Settings.Mesh.TLS
	if err := os.Rename(inFiles.KeyFile, inFiles.KeyFile+".gone"); err != nil {
		t.Fatal(err)
	}
	roundTrip(t, eg.dial(), []byte("directly"))
	if got := promtest.ToFloat64(eg.m.MeshFallbacks("test")); got != 1 {
		t.Fatalf("%v fallbacks, want 1", got)
	}
	if got := in.limitHits(mesh.LimitTLS); got != 0 {
		t.Fatalf("the ingress counted %v TLS refusals for its own missing key", got)
	}
	if err := os.Rename(inFiles.KeyFile+".gone", inFiles.KeyFile); err != nil {
		t.Fatal(err)
	}
	// The twin.
	foreign, _ := issue(t, testutil.NewCA(t), filepath.Join(t.TempDir(), "foreign"), egressID)
	other := startEgress(t, in.cfg.Listeners[0].Ingress.Local, in.port, func(s *policy.Settings) { s.Mesh.TLS = foreign })
	roundTrip(t, other.dial(), []byte("directly"))
	waitFor(t, 5*time.Second, "the TLS refusal counted", func() bool { return in.limitHits(mesh.LimitTLS) == 1 })
}
