package proxy

import (
	"io"
	"net"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/relay"
	lptestutil "github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
)

// tlsDownload is a download from a streaming server through a mesh over
// mutual TLS, on a relayed path that pc slows down or darkens: pc's
// ingress-to-egress direction starts at full speed. It returns the
// egress and the client, once the client has received its first bytes
// (the link is connected); got counts what the client receives, read
// until the link ends. The slow direction moves 1 KiB steps: at
// 16 KiB/s a step comes every 62 ms, well within ping_timeout (300 ms)
// on a loaded machine too, while a 16 KiB record still takes a second.
func tlsDownload(t *testing.T, pc *pathCtl) (eg *harness, c net.Conn, got *atomic.Int64) {
	t.Helper()
	ca := lptestutil.NewCA(t)
	dir := t.TempDir()
	inFiles, _ := issue(t, ca, filepath.Join(dir, "ingress"), ingressID)
	egFiles, _ := issue(t, ca, filepath.Join(dir, "egress"), egressID)
	srv := streamingServer(t, "127.0.0.1:0")
	in := startIngress(t, "127.0.0.2", srv, func(s *policy.Settings) {
		s.Mesh.TLS = inFiles
		s.Mesh.TLS.Peers = policy.NewIdentities(egressID)
	})
	rl, err := relay.Start(in.addr(), time.Second, pc.handler)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rl.Close)
	eg = startEgress(t, srv, portOfInt(t, rl.Addr()), func(s *policy.Settings) {
		s.Mesh.TLS = egFiles
		s.Mesh.TLS.Peers = policy.NewIdentities(ingressID)
		s.Mesh.Sessions = 1
	})
	c = eg.dial()
	first := make([]byte, 1)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, first); err != nil {
		t.Fatalf("the download did not start: %v", err)
	}
	_ = c.SetReadDeadline(time.Time{})
	got = new(atomic.Int64)
	go func() { // ends when the link does, or at the test's end (the harness closes c)
		buf := make([]byte, 32<<10)
		for {
			n, err := c.Read(buf)
			got.Add(int64(n))
			if err != nil {
				return
			}
		}
	}()
	return eg, c, got
}

// Over TLS, bytes that keep arriving are life, as over plain TCP
// (TestMeshSlowDownloadKeepsEgressPinging): the heartbeat must count them
// when they come off the socket, not when TLS hands on a whole record. A
// download on a path that moves 16 KiB/s brings a 16 KiB record (the size
// Go's TLS writes once a connection has sent a few) in about a second,
// three ping_timeouts here (300 ms); TLS reads the record's bytes out of
// the socket as they come and hands nothing on until the last. The
// heartbeat saw neither (nothing handed on, the socket's receive queue
// empty) and declared the live peer dead within about 300 ms: the link
// was reset, the endpoint excluded.
func TestMeshTLSSlowRecordsAreLife(t *testing.T) {
	pc := &pathCtl{chunk: 1 << 10}
	eg, _, got := tlsDownload(t, pc)
	pc.rate.Store(16 << 10)
	before := got.Load()
	select {
	case s := <-eg.ended:
		t.Fatalf("the link ended %s (%v) on a path where bytes keep moving", s.Reason, s.Err)
	case <-time.After(5 * time.Second):
	}
	if d := testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)); d != 0 {
		t.Fatalf("%v egress session deaths on a path where bytes keep moving, want none", d)
	}
	// Bytes moved meanwhile: what was in flight when the path slowed, then
	// what 16 KiB/s brings.
	if moved := got.Load() - before; moved < 16<<10 {
		t.Fatalf("the client received %d bytes in 5 s of the slow path: the premise (bytes keep moving) does not hold", moved)
	} else {
		t.Logf("the client received %d bytes in 5 s of the slow path", moved)
	}
}

// The twin: the same download's path goes dark, most likely in the middle
// of a record (a part of it came, the rest never does). The session is
// dead within ping_timeout and a second: the bytes of a record that never
// completes count when they came, not after.
func TestMeshTLSPathDarkMidRecordIsDetected(t *testing.T) {
	pc := &pathCtl{chunk: 1 << 10}
	eg, c, _ := tlsDownload(t, pc)
	pc.rate.Store(16 << 10)
	select {
	case s := <-eg.ended:
		t.Fatalf("the link ended %s (%v) before the path went dark", s.Reason, s.Err)
	case <-time.After(2 * time.Second):
	}
	pc.dark.Store(true)
	began := time.Now()
	s := eg.linkEndOf(c, 5*time.Second)
	took := time.Since(began)
	t.Logf("link ended %s %v after the path went dark", s.Reason, took.Round(time.Millisecond))
	if s.Reason != CloseMeshDead {
		t.Fatalf("link ended %s (%v), want %s", s.Reason, s.Err, CloseMeshDead)
	}
	if bound := 300*time.Millisecond + time.Second; took > bound {
		t.Fatalf("link ended %v after the path went dark, want within %v", took, bound)
	}
}
