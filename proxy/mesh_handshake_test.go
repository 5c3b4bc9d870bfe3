package proxy

import (
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/relay"
	"github.com/livenessproxy/livenessproxy/policy"
)

// firstOnly relays the first connection both ways and leaves every later
// one unanswered (read, never written to): a peer sidecar whose running
// session carries its bytes while its ingress takes no new connection in
// time (its handshakes queued, a TLS handshake starved).
func firstOnly() relay.Handler {
	var n atomic.Int32
	return func(down, up net.Conn) {
		if n.Add(1) > 1 {
			_, _ = io.Copy(io.Discard, down)
			return
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = io.Copy(up, down)
			_ = up.Close()
		}()
		_, _ = io.Copy(down, up)
		_ = down.Close()
		<-done
	}
}

// A session handshake that goes unanswered for ping_timeout while another
// session to the same peer sidecar answers its pings is no dead peer:
// nothing is excluded and no session death is counted; the link goes on
// the live session. (Before, every endpoint reached through the peer was
// excluded as mesh_dead, and readmitted by the next probe.) Its twin, a
// sidecar that answers nothing at all, is TestMeshFrozenSidecarClosesLinks.
func TestMeshSilentHandshakeBesideALiveSession(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.1:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	rl, err := relay.Start(in.addr(), time.Second, firstOnly())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rl.Close)
	// connect_timeout (2 s) outlasts ping_timeout (300 ms): the
	// handshake's silence is judged as the heartbeat's.
	eg := startEgress(t, srv.Addr(), portOfInt(t, rl.Addr()), func(s *policy.Settings) { s.Mesh.Sessions = 2 })

	a := eg.dial()
	roundTrip(t, a, []byte("a"))
	b := eg.dial() // a second session is dialled: its handshake goes unanswered
	roundTrip(t, b, []byte("b"))
	if got := testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)); got != 0 {
		t.Errorf("%v egress session deaths, want 0: the peer's other session answered meanwhile", got)
	}
	if ep := eg.endpoint(); ep.State != "healthy" || ep.Reason == health.ReasonProbeOK {
		t.Errorf("endpoint %s (%s), want healthy and never excluded", ep.State, ep.Reason)
	}
	roundTrip(t, a, []byte("a lives on"))
}
