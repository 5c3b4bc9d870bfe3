//go:build linux

package proxy

import (
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	lptestutil "github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
)

// slowHeartbeat: a mesh whose heartbeat pings every 10s (ping_timeout
// 30s), far above keepalive's idle (keepaliveSettings: 1s, interval 1s,
// count 3, tcp_user_timeout 1s): an operator who wants little ping
// traffic. Keepalive then probes a live session between the pings.
func slowHeartbeat(s *policy.Settings) {
	s.Mesh.PingInterval = policy.Duration(10 * time.Second)
	s.Mesh.PingTimeout = policy.Duration(30 * time.Second)
	s.Mesh.WriteTimeout = policy.Duration(2 * time.Second)
}

// slowHeartbeatMesh starts an ingress sidecar in front of an echo server
// and an egress sidecar that reaches it through the ingress, both with
// slowHeartbeat (the ingress's port checks as slow), the egress with
// keepaliveSettings; their sessions over mutual TLS with tls.
func slowHeartbeatMesh(t *testing.T, tls bool) (*ingressProxy, *harness) {
	t.Helper()
	var inFiles, egFiles policy.MeshTLS
	if tls {
		ca, dir := lptestutil.NewCA(t), t.TempDir()
		inFiles, _ = issue(t, ca, filepath.Join(dir, "ingress"), ingressID)
		inFiles.Peers = policy.NewIdentities(egressID)
		egFiles, _ = issue(t, ca, filepath.Join(dir, "egress"), egressID)
		egFiles.Peers = policy.NewIdentities(ingressID)
	}
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) {
		slowHeartbeat(&l.Settings)
		l.Settings.Mesh.TLS = inFiles
		l.Ingress.CheckInterval = policy.Duration(10 * time.Second)
	})
	return in, startEgress(t, srv.Addr(), in.port, func(s *policy.Settings) {
		keepaliveSettings(s)
		slowHeartbeat(s)
		s.Mesh.TLS = egFiles
	})
}

// meshLinkPastFirstPing makes a link through the mesh and a round trip
// on it once the session's heartbeat has sent its first ping (its
// first tick, a quarter ping_interval after the session opened: 2.5s
// here): the session then sends nothing but keepalive probes until the
// next ping, 10s later. It returns the client's connection and the times
// just before the last round trip and just after it.
func meshLinkPastFirstPing(t *testing.T, eg *harness) (c *net.TCPConn, before, after time.Time) {
	t.Helper()
	c = eg.dial()
	roundTrip(t, c, []byte("hello through the mesh"))
	time.Sleep(3 * time.Second)
	before = time.Now()
	roundTrip(t, c, []byte("past the first ping"))
	after = time.Now()
	time.Sleep(300 * time.Millisecond) // the round trip's delayed ACKs
	return c, before, after
}

// egressSessionPort is the local port of the egress proxy's only mesh
// session.
func egressSessionPort(t *testing.T, p *Proxy) int {
	t.Helper()
	p.meshMu.Lock()
	defer p.meshMu.Unlock()
	for _, pr := range p.peers {
		pr.mu.Lock()
		defer pr.mu.Unlock()
		if len(pr.sessions) == 1 {
			return pr.sessions[0].Conn.LocalAddr().(*net.TCPAddr).Port
		}
	}
	t.Fatal("premise: not one egress session")
	return 0
}

// One keepalive probe lost on a live mesh session does not end it: with
// a heartbeat slower than keepalive (slowHeartbeat) the session's socket
// keeps keepalive's count, as an idle upstream link's does. The test's
// namespace drops, at its input, the first segment the egress session's
// socket sends after the link's round trip (an nft quota of one segment:
// between the pings it sends nothing but keepalive probes).
func TestMeshLostKeepaliveProbeKeepsTheSession(t *testing.T) {
	for _, tls := range []bool{false, true} {
		t.Run(map[bool]string{false: "plain", true: "tls"}[tls], func(t *testing.T) {
			if !netns.Reexec(t, "nft") {
				return
			}
			lostProbeKeepsSession(t, tls)
		})
	}
}

func lostProbeKeepsSession(t *testing.T, tls bool) {
	in, eg := slowHeartbeatMesh(t, tls)
	c, _, _ := meshLinkPastFirstPing(t, eg)
	port := egressSessionPort(t, eg.p)
	localNFT(t, `table inet lpka {
		chain in { type filter hook input priority 0; policy accept;
			tcp sport %d tcp dport %d quota until 80 bytes counter drop; }
	}`, port, in.port)
	var lost time.Time
	waitFor(t, 10*time.Second, "the first keepalive probe dropped", func() bool {
		lost = time.Now()
		return localDropped(t) == 1
	})
	for time.Since(lost) < kaInterval*kaCount+time.Second {
		select {
		case s := <-eg.ended:
			t.Fatalf("the link on the mesh session ended (%s, %v) %v after the session's one keepalive probe was lost (count %d); %v egress sessions",
				s.Reason, s.Err, time.Since(lost).Round(time.Millisecond), kaCount, testutil.ToFloat64(eg.m.MeshSessions(metrics.MeshEgress)))
		case <-time.After(100 * time.Millisecond):
		}
	}
	if n := localDropped(t); n != 1 {
		t.Fatalf("dropped %d segments, want the one", n)
	}
	roundTrip(t, c, []byte("still here"))
}

// localNFT applies the nft script format (with args) in the test's own
// namespace (Reexec).
func localNFT(t *testing.T, format string, args ...any) {
	t.Helper()
	if err := netns.LocalNFT(fmt.Sprintf(format, args...)); err != nil {
		t.Fatal(err)
	}
}

// localDropped is what the counter of the test namespace's table lpka
// counted.
func localDropped(t *testing.T) int {
	t.Helper()
	out, err := exec.Command("nft", "list", "table", "inet", "lpka").CombinedOutput() // the test's own namespace (Reexec)
	if err != nil {
		t.Fatalf("nft list: %v: %s", err, out)
	}
	m := droppedPackets.FindSubmatch(out)
	if m == nil {
		t.Fatalf("no counter in\n%s", out)
	}
	var n int
	_, _ = fmt.Sscan(string(m[1]), &n)
	return n
}

// The dead twin: a peer sidecar gone for good while the session idles
// between slowHeartbeat's pings (every segment dropped both ways) is cut
// by keepalive idle + interval x count (4s) after the last segment it
// sent, not before (count probes unanswered), within a second more; the
// heartbeat would wait for ping_timeout (30s). Before, with the session's
// TCP_USER_TIMEOUT at tcp_user_timeout (1s), the kernel cut it after its
// first unanswered probe, 2s after the last segment.
func TestMeshDeadPeerCutAfterKeepaliveCount(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	in, eg := slowHeartbeatMesh(t, false)
	_, before, after := meshLinkPastFirstPing(t, eg)
	localNFT(t, `table inet lpka {
		chain in { type filter hook input priority 0; policy accept;
			tcp sport %d tcp dport %d counter drop;
			tcp sport %[2]d tcp dport %[1]d drop; }
	}`, egressSessionPort(t, eg.p), in.port)
	// The path died here; the last segment came at after or, where the
	// rule took over a keepalive idle to apply (a loaded machine), at a
	// probe's answer before now: the kernel counts from that one.
	died := time.Now()
	end := eg.linkEnd(kaDeadAfter + 20*time.Second)
	at := end.Opened.Add(end.Duration)
	t.Logf("the link on the session ended (%s, %v) %v after the last segment, %v after the path died; %d segments dropped",
		end.Reason, end.Err, at.Sub(after).Round(time.Millisecond), at.Sub(died).Round(time.Millisecond), localDropped(t))
	if d := at.Sub(before); d < kaDeadAfter-500*time.Millisecond {
		t.Fatalf("the session was cut %v after the last segment, before keepalive's %v", d, kaDeadAfter)
	}
	if d := at.Sub(died); d > kaDeadAfter+time.Second {
		t.Fatalf("the session was cut %v after the path died, want within %v", d, kaDeadAfter+time.Second)
	}
	if n := localDropped(t); n < kaCount {
		t.Fatalf("dropped %d segments, want at least keepalive's %d probes", n, kaCount)
	}
}
