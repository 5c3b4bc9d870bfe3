package proxy

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/relay"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// replyAfterAStall relays its first connection both ways, but holds the
// ingress's answer to the session handshake until this process has run
// again after a stall of at least a second (its own ticker comes that
// late) and then for after, or, with never, for good: a peer sidecar
// stalled with this one (two sidecars on one host), whose answer comes
// shortly after both run again, or one that stays silent. got is closed
// once the answer is held. Later connections are relayed as they are.
// quit ends a hold.
func replyAfterAStall(got chan<- struct{}, never bool, after time.Duration, quit <-chan struct{}) relay.Handler {
	first := make(chan struct{}, 1)
	first <- struct{}{}
	return func(down, up net.Conn) {
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = io.Copy(up, down)
			_ = up.Close()
		}()
		defer func() { <-done }()
		defer func() { _ = down.Close() }()
		select {
		case <-first:
			b := make([]byte, mesh.ReplyLen)
			if _, err := io.ReadFull(up, b); err != nil {
				return
			}
			close(got)
			if never || !awaitStall(quit) {
				<-quit
				return
			}
			select {
			case <-time.After(after):
			case <-quit:
				return
			}
			if _, err := down.Write(b); err != nil {
				return
			}
		default:
		}
		_, _ = io.Copy(down, up)
	}
}

// awaitStall returns true once a 10 ms ticker of this process has come a
// second or more late, false at quit.
func awaitStall(quit <-chan struct{}) bool {
	tk := time.NewTicker(10 * time.Millisecond)
	defer tk.Stop()
	prev := time.Now()
	for {
		select {
		case <-quit:
			return false
		case <-tk.C:
		}
		now := time.Now()
		if now.Sub(prev) >= time.Second {
			return true
		}
		prev = now
	}
}

// A stall of this process (SIGSTOP here; CPU throttling, a frozen host,
// a long GC pause in production) that spans the session handshake's
// ping_timeout and ends less than ping_timeout after it, while the peer
// sidecar's answer waits for this process to run again (here its relay
// is stalled with it; the answer could as well wait in the socket): the
// handshake reads the answer, the session opens and the link works;
// nothing is excluded and no session death is counted. Before, the
// handshake's wall-clock deadline, past when the process ran again, ended
// the read at once (the runtime runs expired timers before it polls the
// network), and since the proxy noticed it less than ping_timeout late,
// the peer was declared dead and every endpoint behind it excluded
// mesh_dead. The twin: a peer that stays silent after the stall has a
// ping interval of this process's running time to answer, and is then
// dead: excluded mesh_dead within a second of the stall's end.
func TestMeshHandshakeAcrossAStallOfTheProxysOwn(t *testing.T) {
	const (
		pingInterval = 250 * time.Millisecond
		pingTimeout  = 3 * time.Second
		// Past the handshake's ping_timeout (the freeze begins a few
		// ms after the handshake), less than two of it.
		freeze = pingTimeout + pingTimeout/3
	)
	for _, never := range []bool{false, true} {
		name := map[bool]string{false: "the answer comes once both run", true: "twin: the peer stays silent"}[never]
		t.Run(name, func(t *testing.T) {
			srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.1:0"})
			tune := func(s *policy.Settings) {
				s.Mesh.PingInterval = policy.Duration(pingInterval)
				s.Mesh.PingTimeout = policy.Duration(pingTimeout)
			}
			in := startIngress(t, "127.0.0.2", srv.Addr(), tune)
			got, quit := make(chan struct{}), make(chan struct{})
			// The answer comes half a ping interval after the stall: the
			// watch's first ticks after it find the whole silence past
			// ping_timeout and nothing unread; only the ping interval the
			// peer gets after a stall of this process's own spares it.
			rl, err := relay.Start(in.addr(), time.Second, replyAfterAStall(got, never, pingInterval/2, quit))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(rl.Close)
			t.Cleanup(func() { close(quit) }) // before the relay's Close
			eg := startEgress(t, srv.Addr(), portOfInt(t, rl.Addr()), func(s *policy.Settings) {
				tune(s)
				// The link's connect budget outlasts the freeze: the
				// handshake's own verdict is what this tests.
				s.ConnectTimeout = policy.Duration(3 * freeze)
				s.ConnectAttempts = 1
			})
			c := eg.dial()
			select {
			case <-got:
			case <-time.After(10 * time.Second):
				t.Fatal("the ingress's answer never reached the relay")
			}
			freezeProcess(t, freeze)
			ran := time.Now()
			if never {
				// The watch counts the peer's silence in this process's
				// running time: the time it could not run after the
				// freeze (a loaded machine) is added to the bound.
				stalls := meterStalls(t)
				s := eg.linkEndOf(c, pingTimeout+5*time.Second)
				ep := eg.waitState("excluded", 5*time.Second)
				stalled := stalls()
				t.Logf("%s: link ended %s %v after the freeze (%v); endpoint excluded (%s); stalls since %v", name, s.Reason, s.Opened.Add(s.Duration).Sub(ran).Round(time.Millisecond), s.Err, ep.Reason, stalled)
				if took := s.Opened.Add(s.Duration).Sub(ran); s.Reason != CloseMeshDead || ep.Reason != string(reasonMeshDead) || took > pingInterval+time.Second+stalled {
					t.Fatalf("a peer silent after the stall: link ended %s %v after it, endpoint excluded %s; want mesh_dead within ping_interval and a second (+ %v stalls)", s.Reason, took, ep.Reason, stalled)
				}
				return
			}
			msg := []byte("answered while both could not run")
			_, err = c.Write(msg)
			if err == nil {
				_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
				_, err = io.ReadFull(c, msg)
			}
			if err != nil {
				s := eg.linkEndOf(c, 5*time.Second)
				ep := eg.endpoint()
				t.Fatalf("the link failed (%v): it ended %s (%v); endpoint %s (%s), %v session deaths: the peer blamed for the proxy's own stall", err, s.Reason, s.Err, ep.State, ep.Reason, testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)))
			}
			t.Logf("%s: the link works %v after the freeze", name, time.Since(ran).Round(time.Millisecond))
			if ep := eg.endpoint(); ep.State != "healthy" || ep.Reason != health.ReasonRegistered {
				t.Fatalf("endpoint %s (%s), want healthy and never excluded", ep.State, ep.Reason)
			}
			if got := testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)); got != 0 {
				t.Fatalf("%v egress session deaths, want 0", got)
			}
		})
	}
}
