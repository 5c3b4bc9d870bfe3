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
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// firstOnly relays the first connection both ways and leaves every later
// one unanswered (read, never written to): a peer sidecar whose running
// session carries its bytes while its ingress takes no new connection in
// time (its handshakes queued, a TLS handshake starved).
func firstOnly() relay.Handler { return firstOnlyMuted(new(atomic.Bool)) }

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

// firstOnlyMuted is firstOnly whose first connection drops every byte,
// both ways, while mute is set: a peer sidecar gone silent on the session
// it carries too.
func firstOnlyMuted(mute *atomic.Bool) relay.Handler {
	var n atomic.Int32
	pass := func(dst, src net.Conn) {
		b := make([]byte, 32<<10)
		for {
			k, err := src.Read(b)
			if k > 0 && !mute.Load() {
				if _, werr := dst.Write(b[:k]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}
	return func(down, up net.Conn) {
		if n.Add(1) > 1 {
			_, _ = io.Copy(io.Discard, down)
			return
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			pass(up, down)
			_ = up.Close()
		}()
		pass(down, up)
		_ = down.Close()
		<-done
	}
}

// A session handshake unanswered for ping_timeout while another session to
// the same peer sidecar lives but has been quiet since the handshake began
// (a session of the settings before a reload, which pings every 10 s):
// that session, pinged at the verdict, answers, so the sidecar runs and
// only its ingress did not take the new connection. Nothing is excluded,
// no session death is counted; the new link, which cannot go on a session
// of other settings, fails upstream_error, and the old link lives on.
// Before, every endpoint behind the peer was excluded mesh_dead (the
// other session had carried none of its bytes since the handshake
// began). The twin: the peer sidecar silent on the other session too
// (its bytes dropped both ways): the link ends mesh_dead and the endpoint
// is excluded mesh_dead within ping_timeout and a second of the dial.
func TestMeshSilentHandshakeBesideAQuietLiveSession(t *testing.T) {
	for _, twin := range []bool{false, true} {
		name := map[bool]string{false: "the other session answers", true: "twin: silent on both"}[twin]
		t.Run(name, func(t *testing.T) { silentHandshakeBesideAQuietSession(t, twin) })
	}
}

func silentHandshakeBesideAQuietSession(t *testing.T, twin bool) {
	const slow, pingTimeout = 10 * time.Second, 300 * time.Millisecond
	slowMesh := func(s *policy.Settings) {
		s.Mesh.PingInterval = policy.Duration(slow)
		s.Mesh.PingTimeout = policy.Duration(3 * slow)
	}
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.1:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), slowMesh)
	var mute atomic.Bool
	rl, err := relay.Start(in.addr(), time.Second, firstOnlyMuted(&mute))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rl.Close)
	eg, cfg := egressWithConfig(t, srv.Addr(), portOfInt(t, rl.Addr()), func(s *policy.Settings) {
		slowMesh(s)
		s.ConnectTimeout = policy.Duration(2 * time.Second) // outlasts ping_timeout
		s.ConnectAttempts = 1
	})
	a := eg.dial()
	roundTrip(t, a, []byte("a")) // on the first session, of the slow settings
	cfg.Listeners[0].Settings.Mesh.PingInterval = policy.Duration(50 * time.Millisecond)
	cfg.Listeners[0].Settings.Mesh.PingTimeout = policy.Duration(pingTimeout)
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if _, err := eg.p.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	ss := eg.p.meshPeer("127.0.0.1", portOfInt(t, rl.Addr())).liveSessions()
	if len(ss) != 1 {
		t.Fatalf("%d sessions to the peer, want 1", len(ss))
	}
	// Both sides ping at their heartbeat's first step (2.5 s), then every
	// 10 s: past the first, the session stays quiet.
	time.Sleep(3 * time.Second)
	waitFor(t, 10*time.Second, "the first session quiet for 400 ms", func() bool {
		return !ss[0].HeardSince(flow.Mono() - int64(400*time.Millisecond))
	})
	mute.Store(twin)
	stalls := meterStalls(t)
	began := time.Now()
	b := eg.dial() // a session of the new settings is dialled: its handshake goes unanswered
	s := eg.linkEndOf(b, 5*time.Second)
	took := s.Opened.Add(s.Duration).Sub(began)
	ep := eg.endpoint()
	deaths := testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress))
	t.Logf("%s: link ended %s %v after the dial (%v); endpoint %s (%s); %v session deaths", t.Name(), s.Reason, took.Round(time.Millisecond), s.Err, ep.State, ep.Reason, deaths)
	if twin {
		if bound := pingTimeout + time.Second + stalls(); s.Reason != CloseMeshDead || ep.State != "excluded" || ep.Reason != string(reasonMeshDead) || took > bound {
			t.Fatalf("a peer sidecar silent on both sessions: link ended %s %v after the dial, endpoint %s (%s); want mesh_dead, excluded mesh_dead, within %v", s.Reason, took, ep.State, ep.Reason, bound)
		}
		return
	}
	if s.Reason != CloseUpstreamError || ep.State != "healthy" || ep.Reason != health.ReasonRegistered || deaths != 0 {
		t.Fatalf("link ended %s, endpoint %s (%s), %v session deaths; want upstream_error, never excluded, 0: the other session answers", s.Reason, ep.State, ep.Reason, deaths)
	}
	roundTrip(t, a, []byte("a lives on"))
}
