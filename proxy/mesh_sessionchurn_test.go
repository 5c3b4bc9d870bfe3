package proxy

import (
	"net"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// Two listeners whose socket options differ (here tcp_user_timeout),
// routed to one peer sidecar, each get sessions of their own (sessions
// are keyed by them), and keep them: a link of one listener does not
// retire the other listener's idle session as if a reload had left it
// behind. Links of the two that take turns, each ending before the next
// opens (short requests), go on the two sessions dialled first. Before,
// each link retired the other listener's idle session, so every link
// dialled a session of its own: its connect, its handshake (TLS where
// set), a heartbeat, for one request.
func TestMeshListenersOfOtherSocketOptionsKeepTheirSessions(t *testing.T) {
	eg, cfg, pr := egressOfOneSession(t)
	other := cfg.Listeners[0]
	other.Name, other.Settings.TCPUserTimeout = "other", policy.Duration(3*time.Second)
	cfg.Listeners = append(cfg.Listeners, other)
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if _, err := eg.p.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	seen := map[*mesh.Session]bool{}
	for i, name := range []string{"test", "other", "test", "other", "test", "other"} {
		c, err := net.Dial("tcp", eg.p.Addr(name).String())
		if err != nil {
			t.Fatal(err)
		}
		roundTrip(t, c, []byte("request"))
		for _, ms := range pr.liveSessions() {
			seen[ms] = true
		}
		_ = c.Close()
		if s := eg.linkEnd(5 * time.Second); s.Reason != CloseClientClosed {
			t.Fatalf("link %d (%s) ended %s, want client_closed", i, name, s.Reason)
		}
	}
	t.Logf("6 links, 3 on each of two listeners taking turns: %d sessions dialled", len(seen))
	if len(seen) != 2 {
		t.Fatalf("%d sessions dialled for 6 links of two listeners, want 2 (one each)", len(seen))
	}
}

// egressOfOneSession is an egress (and its config) whose listener has
// tcp_user_timeout 2 s and mesh.sessions 1, its link's peer sidecar an
// ingress to an echo server.
func egressOfOneSession(t *testing.T) (*harness, policy.Config, *meshPeer) {
	t.Helper()
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg, cfg := egressWithConfig(t, srv.Addr(), in.port, func(s *policy.Settings) {
		s.TCPUserTimeout = policy.Duration(2 * time.Second)
		s.Mesh.Sessions = 1
	})
	return eg, cfg, eg.p.meshPeer("127.0.0.2", in.port)
}
