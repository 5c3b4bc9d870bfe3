//go:build linux

package proxy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"regexp"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	lptestutil "github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// Short liveness settings for the keepalive tests: an idle upstream whose
// peer is gone is cut keepalive's idle + interval x count (4s) after the
// last segment it sent; data it leaves unacknowledged, tcp_user_timeout
// (1s) after it was sent.
const (
	kaIdle, kaInterval, kaCount = time.Second, time.Second, 3
	kaUserTimeout               = time.Second
	kaDeadAfter                 = kaIdle + kaInterval*kaCount
)

func keepaliveSettings(s *policy.Settings) {
	s.TCPUserTimeout = policy.Duration(kaUserTimeout)
	s.Keepalive = policy.Keepalive{Idle: policy.Duration(kaIdle), Interval: policy.Duration(kaInterval), Count: kaCount}
}

// idleLinkOverVeth starts, in the test's own network namespace, a proxy
// (keepaliveSettings) in front of an echo server in a peer namespace
// joined by a veth, and makes one link through it with one round trip.
// It returns the harness, the client's connection, the peer namespace,
// the proxy's local port on the upstream connection and the times just
// before the request was written and just after its echo was read (the
// upstream's last segment arrived between them).
func idleLinkOverVeth(t *testing.T, set func(*policy.Settings)) (h *harness, c *net.TCPConn, peer *netns.NS, port int, before, after time.Time) {
	t.Helper()
	peer = netns.NewNS(t)
	netns.Veth(t, peer, "10.251.0.1/24", "10.251.0.2/24")
	ln, err := peer.Listen("tcp", "10.251.0.2:9000")
	if err != nil {
		t.Fatal(err)
	}
	netns.ServeEcho(t, ln)
	waitFor(t, 5*time.Second, "the echo server reachable over the veth", func() bool {
		c, err := net.DialTimeout("tcp", "10.251.0.2:9000", time.Second)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	})
	h = start(t, "10.251.0.2:9000", set)
	c = h.dial()
	before = time.Now()
	roundTrip(t, c, []byte("hello over the veth"))
	after = time.Now()
	lk := h.onlyLink(5 * time.Second)
	lk.connMu.Lock()
	raw := lk.upRaw()
	lk.connMu.Unlock()
	if err := raw.Control(func(fd uintptr) {
		sa, err := unix.Getsockname(int(fd))
		if err == nil {
			port = sa.(*unix.SockaddrInet4).Port
		}
	}); err != nil || port == 0 {
		t.Fatalf("the upstream socket's local port: %v", err)
	}
	return h, c, peer, port, before, after
}

// blackholePeer drops every segment of the peer's server (port 9000)
// both ways, and counts those that arrive (see dropped).
func blackholePeer(t *testing.T, peer *netns.NS) {
	t.Helper()
	if err := peer.NFT(`table inet lpka {
		chain in { type filter hook input priority 0; policy accept; tcp dport 9000 counter drop; }
		chain out { type filter hook output priority 0; policy accept; tcp sport 9000 drop; }
	}`); err != nil {
		t.Fatal(err)
	}
}

var droppedPackets = regexp.MustCompile(`counter packets (\d+)`)

// dropped is what the counter of the peer's table lpka counted.
func dropped(t *testing.T, peer *netns.NS) int {
	t.Helper()
	out, err := peer.Run("", "nft", "list", "table", "inet", "lpka")
	if err != nil {
		t.Fatalf("nft list: %v: %s", err, out)
	}
	m := droppedPackets.FindSubmatch(out)
	if m == nil {
		t.Fatalf("no counter in\n%s", out)
	}
	n, _ := strconv.Atoi(string(m[1]))
	return n
}

// One keepalive probe lost on a healthy path is not a dead upstream:
// with keepalive.count 3, the next probe, answered, keeps the link, and
// the endpoint stays in. The peer's namespace drops the first segment the
// idle link's socket sends it after the round trip (an nft quota of one
// segment: the link sends nothing but keepalive probes then), whenever
// it goes; its counter says it dropped it. Before, with tcp_user_timeout
// (1s) set below idle + interval x count, the kernel failed the socket at
// its first keepalive timer after the lost probe, interval (1s) after it
// (tcp_keepalive_timer: with TCP_USER_TIMEOUT set, it gives up once that
// much has passed since the last segment received with a probe
// unanswered, instead of after count probes): upstream_timeout, and the
// endpoint excluded.
func TestLostKeepaliveProbeKeepsTheLink(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	h, c, peer, port, _, _ := idleLinkOverVeth(t, keepaliveSettings)
	// A segment without data is 52 bytes here (timestamps): the quota
	// lets through every segment after the first.
	if err := peer.NFT(fmt.Sprintf(`table inet lpka {
		chain in { type filter hook input priority 0; policy accept;
			tcp dport 9000 tcp sport %d quota until 80 bytes counter drop; }
	}`, port)); err != nil {
		t.Fatal(err)
	}
	var lost time.Time
	waitFor(t, 10*time.Second, "the first keepalive probe dropped", func() bool {
		lost = time.Now()
		return dropped(t, peer) == 1
	})
	// The next probe goes interval after the lost one; before, the link
	// ended then. Count probes and a second more have passed by now:
	// judged by then, the link would have ended.
	for time.Since(lost) < kaInterval*kaCount+time.Second {
		select {
		case s := <-h.ended:
			t.Fatalf("the link ended (%s, %v) %v after its one keepalive probe was lost (count %d)",
				s.Reason, s.Err, time.Since(lost).Round(time.Millisecond), kaCount)
		case <-time.After(100 * time.Millisecond):
		}
	}
	if n := dropped(t, peer); n != 1 {
		t.Fatalf("the peer dropped %d segments, want the one", n)
	}
	if ep := h.endpoint(); ep.State != "healthy" || ep.LiveLinks != 1 {
		t.Fatalf("endpoint %s (%s), %d live links; want healthy with its link", ep.State, ep.Reason, ep.LiveLinks)
	}
	roundTrip(t, c, []byte("still here"))
}

// The dead twin: a peer gone for good while its link idles (every segment
// dropped both ways, kept dropped) is cut by keepalive idle + interval x
// count after the last segment it sent, and not before (count probes
// unanswered), within a second more; upstream_timeout, and the endpoint
// excluded. Where tcp_user_timeout is the longer, the kernel probes on
// past count and cuts it at tcp_user_timeout (its keepalive timer gives
// up at its first run with a probe unanswered that long after the last
// segment received): 6s here, not keepalive's 4s.
func TestIdleDeadPeerCutAfterKeepaliveCount(t *testing.T) {
	for _, c := range []struct {
		name     string
		ut, want time.Duration
	}{
		{"tcp_user_timeout below keepalive's", kaUserTimeout, kaDeadAfter},
		{"tcp_user_timeout above keepalive's", kaDeadAfter + 2*time.Second, kaDeadAfter + 2*time.Second},
	} {
		t.Run(c.name, func(t *testing.T) {
			if !netns.Reexec(t, "nft") {
				return
			}
			idleDeadPeerCut(t, c.ut, c.want)
		})
	}
}

func idleDeadPeerCut(t *testing.T, ut, want time.Duration) {
	h, _, peer, _, before, after := idleLinkOverVeth(t, func(s *policy.Settings) {
		keepaliveSettings(s)
		s.TCPUserTimeout = policy.Duration(ut)
	})
	blackholePeer(t, peer)
	// The path died here; the last segment came at after or, where the
	// rule took over a keepalive idle to apply (a loaded machine), at a
	// probe's answer before now: the kernel counts from that one.
	died := time.Now()
	end := h.linkEnd(want + 20*time.Second)
	ep := h.waitState("excluded", 10*time.Second)
	t.Logf("link ended (%s) and endpoint excluded %v after the last byte, %v after the path died; the peer dropped %d segments",
		end.Reason, ep.Since.Sub(after).Round(time.Millisecond), ep.Since.Sub(died).Round(time.Millisecond), dropped(t, peer))
	if end.Reason != CloseUpstreamTimeout || ep.Reason != string(CloseUpstreamTimeout) {
		t.Fatalf("link ended for %s, endpoint excluded for %s; want %s", end.Reason, ep.Reason, CloseUpstreamTimeout)
	}
	// The kernel's timers do not fire early: count probes went
	// unanswered, interval apart, the first idle after the last byte.
	if d := ep.Since.Sub(before); d < want-500*time.Millisecond {
		t.Fatalf("excluded %v after the last byte, before %v", d, want)
	}
	if d := ep.Since.Sub(died); d > want+time.Second {
		t.Fatalf("excluded %v after the path died, want within %v", d, want+time.Second)
	}
	if n := dropped(t, peer); n < kaCount {
		t.Fatalf("the peer dropped %d segments, want at least keepalive's %d probes", n, kaCount)
	}
}

// TCP_USER_TIMEOUT still bounds data on a link that idled: while it idled
// the bound was raised to idle + interval x count (so that keepalive's
// count holds), and the window guard's sample after the send sets it back
// to tcp_user_timeout; the kernel counts it from the send and clamps its
// retransmission timer to what is left, so the blackholed link is cut
// within tcp_user_timeout and a second of the send, as on a link that
// never idled (1.43-1.45s here either way), and its endpoint excluded.
// Without the set-back: 4.4s.
func TestDataBlackholeAfterIdleCutByUserTimeout(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	blackholeAfterIdle(t, func(c *net.TCPConn) error {
		_, err := c.Write([]byte("into the blackhole"))
		return err
	})
}

// The same for the client's FIN passed on (its retransmissions are
// bounded by TCP_USER_TIMEOUT too): the half-close arms the guard as a
// send does.
func TestFinBlackholeAfterIdleCutByUserTimeout(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	blackholeAfterIdle(t, (*net.TCPConn).CloseWrite)
}

// blackholeAfterIdle: an idle link over a veth whose bound the guard
// raised; the peer blackholed, send makes the proxy send it something,
// which must cut the link within tcp_user_timeout and a second.
func blackholeAfterIdle(t *testing.T, send func(*net.TCPConn) error) {
	h, c, peer, _, _, _ := idleLinkOverVeth(t, keepaliveSettings)
	waitFor(t, 10*time.Second, "the idle link's bound raised to keepalive's", func() bool {
		return userTimeout(h) == int(kaDeadAfter.Milliseconds())
	})
	blackholePeer(t, peer)
	sent := time.Now()
	if err := send(c); err != nil {
		t.Fatal(err)
	}
	end := h.linkEnd(kaDeadAfter + 20*time.Second)
	ep := h.waitState("excluded", 10*time.Second)
	took := ep.Since.Sub(sent)
	t.Logf("link ended (%s) %v and endpoint excluded %v after the send",
		end.Reason, end.Opened.Add(end.Duration).Sub(sent).Round(time.Millisecond), took.Round(time.Millisecond))
	if end.Reason != CloseUpstreamTimeout || ep.Reason != string(CloseUpstreamTimeout) {
		t.Fatalf("link ended for %s, endpoint excluded for %s; want %s", end.Reason, ep.Reason, CloseUpstreamTimeout)
	}
	if took > kaUserTimeout+time.Second {
		t.Fatalf("excluded %v after the send, want within tcp_user_timeout %v and a second", took, kaUserTimeout)
	}
}

// A link that idles from its connect on (nothing sent either way) has its
// bound raised too, by the guard's first sample: on a socket flow.DialRaw
// made (an address), which sets the liveness options then, and on one net
// dialled (an address with a zone), whose options were set at the
// connect. Without that first sample the second kept tcp_user_timeout
// while it idled, and one lost keepalive probe ended it.
func TestLinkIdleFromTheConnectHasTheRaisedBound(t *testing.T) {
	ln, err := net.Listen("tcp", "[::1]:0")
	if err != nil {
		lptestutil.SkipOrFail(t, "no IPv6 loopback: %v", err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	netns.ServeEcho(t, ln)
	for _, c := range []struct{ upstream, dial string }{
		{fmt.Sprintf("[::1]:%d", port), "raw"},
		{fmt.Sprintf("[::1%%lo]:%d", port), "net"},
	} {
		t.Run(c.dial, func(t *testing.T) {
			h := start(t, c.upstream, keepaliveSettings)
			_ = h.dial()
			lk := h.onlyLink(5 * time.Second)
			lk.connMu.Lock()
			_, raw := lk.up.(*tcpEnd).conn.(*os.File)
			lk.connMu.Unlock()
			if raw != (c.dial == "raw") {
				t.Fatalf("premise: %s dialled raw %v", c.upstream, raw)
			}
			waitFor(t, 10*time.Second, "the idle link's bound raised to keepalive's", func() bool {
				return userTimeout(h) == int(kaDeadAfter.Milliseconds())
			})
		})
	}
}

// Bytes the writer sends after the guard's sample found the socket idle
// and raised its bound are under tcp_user_timeout again: the writer arms
// the guard for each batch, as the request pump does for its direct
// writes. Here the kernel takes a part of a request (the
// upstream's window is small, its receive buffer 4 KiB;
// TCP_NOTSENT_LOWAT 16 KiB) and the pump
// queues the rest, which waits for the memory budget (a reload lowered it
// to nothing). The kernel sends its part and the peer acknowledges it:
// the guard's sample finds the socket idle, raises the bound and stops.
// The peer is then blackholed and the budget given back: the writer sends
// the rest, and the link is cut upstream_timeout with tcp_user_timeout
// on the socket (here 1.22-1.25s after the rest was let go). Without the
// writer's arm nothing sampled the socket after it: the raised bound
// (keepalive's 4s) stayed on it and cut the link 4.2s after. Asserted on
// the bound the guard left on the socket, not on the time (the kernel's
// first retransmission timeout is not clamped to the bound, and a loaded
// machine inflates it).
func TestQueuedBytesAfterIdleUnderUserTimeout(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	peer := netns.NewNS(t)
	netns.Veth(t, peer, "10.251.0.1/24", "10.251.0.2/24")
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 4096) })
		return cmp.Or(err, serr)
	}}
	ln, err := peer.ListenConfig(context.Background(), &lc, "tcp", "10.251.0.2:9000")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	accepted := make(chan net.Conn, 1)
	wg.Go(func() { // a server that reads everything
		if c, err := ln.Accept(); err == nil {
			accepted <- c
			_, _ = io.Copy(io.Discard, c)
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		select {
		case c := <-accepted:
			_ = c.Close() // the proxy's close was blackholed
		default:
		}
		wg.Wait()
	})
	h := start(t, "10.251.0.2:9000", func(s *policy.Settings) {
		keepaliveSettings(s)
		// TCP_NOTSENT_LOWAT 16 KiB: the kernel takes a part of a
		// request of 60 KiB.
		s.WriteBuffer.HighWaterMark, s.WriteBuffer.LowWaterMark = 64<<10, 32<<10
	})
	c := h.dial()
	lk := h.onlyLink(5 * time.Second)
	lk.connMu.Lock()
	e := lk.up.(*tcpEnd)
	lk.connMu.Unlock()
	h.p.budget.SetLimit(1) // no chunk fits: a queue's push waits
	t.Cleanup(func() { h.p.budget.SetLimit(0) })
	if _, err := c.Write(make([]byte, 60<<10)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the rest of the request waiting for the budget", func() bool {
		return h.p.budget.Nwait.Load() == 1
	})
	raised := int(kaDeadAfter.Milliseconds())
	waitFor(t, 10*time.Second, "the socket idle, its bound raised and the guard stopped", func() bool {
		w, ok := flow.SampleSendWindow(e.raw)
		return ok && w.Idle && userTimeout(h) == raised && !e.win.armed.Load()
	})
	blackholePeer(t, peer)
	sent := time.Now()
	h.p.budget.SetLimit(0) // the writer sends the rest into the blackhole
	end := h.linkEnd(kaDeadAfter + 20*time.Second)
	took := end.Opened.Add(end.Duration).Sub(sent)
	t.Logf("link ended (%s) %v after the queued rest was let go; the peer dropped %d segments",
		end.Reason, took.Round(time.Millisecond), dropped(t, peer))
	// ETIMEDOUT, or, where the writer's write took the socket's error
	// first, the response pump's end of stream taken for a reset.
	if end.Reason != CloseUpstreamTimeout && end.Reason != CloseUpstreamError {
		t.Fatalf("link ended for %s (%v), want %s", end.Reason, end.Err, CloseUpstreamTimeout)
	}
	e.win.mu.Lock()
	bound := e.win.bound
	e.win.mu.Unlock()
	if bound != kaUserTimeout {
		t.Fatalf("the link ended with TCP_USER_TIMEOUT %v on its socket under the queued bytes, want tcp_user_timeout %v", bound, kaUserTimeout)
	}
}

// Bytes in the link's queue are bytes in flight for the window guard: a
// sample that finds the kernel idle while the writer holds a batch (after
// its arm, before its write) keeps tcp_user_timeout on the socket and
// samples on. Before, it raised the bound to keepalive's and stopped, and
// a write that then blocked (its send buffer full) sent its batch under
// the raised bound until it returned, the guard armed only after it: a
// path that died then was cut at keepalive's bound (or write_timeout),
// not tcp_user_timeout. Here the state is made as that interleaving
// leaves it: an idle link whose bound was raised, bytes pushed onto its
// queue with no writer yet, and the guard's pending sample run. Before:
// "a sample with 8192 bytes queued for the upstream left TCP_USER_TIMEOUT
// 4000 ms on the socket". The twin: once the writer sends the batch and
// the upstream acknowledges it, the idle link's bound is raised again
// (keepalive's count holds) and the guard stops.
func TestQueuedBatchKeepsUserTimeout(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	h, c, _, _, _, _ := idleLinkOverVeth(t, keepaliveSettings)
	lk := h.onlyLink(5 * time.Second)
	lk.connMu.Lock()
	e := lk.up.(*tcpEnd)
	lk.connMu.Unlock()
	raised, ut := int(kaDeadAfter.Milliseconds()), int(kaUserTimeout.Milliseconds())
	stopped := func() bool {
		w, ok := flow.SampleSendWindow(e.raw)
		return ok && w.Idle && userTimeout(h) == raised && !e.win.armed.Load()
	}
	waitFor(t, 10*time.Second, "the idle link's bound raised and the guard stopped", stopped)
	batch := make([]byte, 8<<10)
	if r := lk.q.Push(batch, 0); r != flow.PushedStartWriter {
		t.Fatalf("premise: push %v, want the writer to start", r)
	}
	e.win.arm()
	due := e.win.due.Load()
	waitFor(t, 10*time.Second, "the guard's sample with the batch queued", func() bool {
		e.win.mu.Lock()
		defer e.win.mu.Unlock()
		return e.win.due.Load() != due // run: stopped (0), or re-armed for the next
	})
	e.win.mu.Lock()
	bound, armed := e.win.bound, e.win.armed.Load()
	e.win.mu.Unlock()
	if got := userTimeout(h); got != ut || bound != kaUserTimeout || !armed {
		t.Fatalf("a sample with %d bytes queued for the upstream left TCP_USER_TIMEOUT %d ms on the socket (guard's %v, armed %v); want tcp_user_timeout %d ms, sampling on",
			len(batch), got, bound, armed, ut)
	}
	lk.live.Add(1) // as the pump does when it starts the writer
	go e.writeUpstreamOwned()
	if _, err := io.ReadFull(c, batch); err != nil {
		t.Fatalf("the batch's echo: %v", err)
	}
	waitFor(t, 10*time.Second, "the bound raised again once the batch was acknowledged, the guard stopped", stopped)
}

// A probe's connection waiting for a slow answer within probe_timeout
// (10s here) survives one lost keepalive probe: probeConfig's dialer
// gives it keepalive's bound (policy.Settings.ProbeUserTimeout), as the
// window guard gives an idle link. The test's namespace drops the first
// segment the probe's connection sends after its request was
// acknowledged (the keepalive probe); the server answers count
// intervals later. Before, the kernel failed the connection a keepalive
// interval after the lost probe (ETIMEDOUT): a failed probe of a server
// that answered in time.
func TestProbeSurvivesALostKeepaliveProbe(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	ln, c := probeConnection(t)
	got, answer, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	go func() { // a server slow to answer
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		if _, err := c.Read(make([]byte, 64)); err != nil {
			return
		}
		close(got)
		<-answer
		_, _ = c.Write([]byte("answered"))
	}()
	defer func() { <-done }()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second)) // the probe's own deadline
	if _, err := c.Write([]byte("are you there?")); err != nil {
		t.Fatal(err)
	}
	<-got
	time.Sleep(100 * time.Millisecond) // the request's ACK
	localNFT(t, `table inet lpka {
		chain in { type filter hook input priority 0; policy accept;
			tcp sport %d tcp dport %d quota until 80 bytes counter drop; }
	}`, c.LocalAddr().(*net.TCPAddr).Port, ln.Addr().(*net.TCPAddr).Port)
	var lost time.Time
	waitFor(t, 5*time.Second, "the first keepalive probe dropped", func() bool {
		lost = time.Now()
		return localDropped(t) == 1
	})
	// The answer comes when, before, the connection was long failed.
	time.AfterFunc(time.Until(lost.Add(2*kaInterval+500*time.Millisecond)), func() { close(answer) })
	b := make([]byte, 16)
	n, err := c.Read(b)
	if err != nil {
		t.Fatalf("the probe's connection failed (%v) %v after its one keepalive probe was lost (count %d), before its answer",
			err, time.Since(lost).Round(time.Millisecond), kaCount)
	}
	if string(b[:n]) != "answered" {
		t.Fatalf("read %q", b[:n])
	}
}

// probeConnection is a listener and a connection to it dialled as an
// HTTP probe's (probeConfig, through health.ProbeConfig.Dial as the
// detector dials) with waitingProbeSettings.
func probeConnection(t *testing.T) (net.Listener, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	pc := probeConfig(waitingProbeSettings(policy.ProbeKindHTTP)) // one that waits for an answer
	c, err := pc.Dial(t.Context(), "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return ln, c
}

// waitingProbeSettings are keepaliveSettings with probe_timeout 10s,
// longer than the kernel's cut after one lost keepalive probe (2s): a
// probe of kind that waits for its answer gets keepalive's bound
// (policy.Settings.ProbeUserTimeout).
func waitingProbeSettings(kind string) policy.Settings {
	s := policy.DefaultSettings()
	keepaliveSettings(&s)
	s.Detector.ProbeTimeout = policy.Duration(10 * time.Second)
	s.Detector.Probe = kind
	return s
}

// A probe's connect keeps tcp_user_timeout: keepalive's bound, given to
// a probe that waits for its answer, is set once it is connected, and
// never on a connect probe (one a Kafka probe became because the
// endpoint's clients speak TLS). The kernel bounds a SYN by
// TCP_USER_TIMEOUT: a probe of an endpoint whose SYNs are lost (still
// down, or its path) ends at tcp_user_timeout and the detector's next
// probe comes, as before keepalive's bound. Before (the bound set at the
// socket's creation), both failed at keepalive's 4s: "the http probe's
// connect to an unreachable endpoint failed (... connection timed out)
// 4.0s after it began, want within tcp_user_timeout 1s + 1s".
func TestProbeConnectKeepsUserTimeout(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	addr, err := lptestutil.PickClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(addr)
	localNFT(t, `table inet lpka {
		chain in { type filter hook input priority 0; policy accept;
			tcp dport %s tcp flags syn counter drop; }
	}`, port)
	kafka := waitingProbeSettings(policy.ProbeKindAuto)
	kafka.Framing.Type = policy.FramingKafka
	tlsClients := &endpoint{}
	tlsClients.settings.Store(&kafka)
	tlsClients.tls.Store(true)
	for _, c := range []struct {
		name string
		pc   health.ProbeConfig
		kind string
	}{
		{"http", probeConfig(waitingProbeSettings(policy.ProbeKindHTTP)), health.ProbeHTTP},
		{"kafka, a connect under TLS", tlsClients.probeConfig(), health.ProbeConnect},
	} {
		if c.pc.Kind != c.kind {
			t.Fatalf("premise: the %s probe is of kind %q, want %q", c.name, c.pc.Kind, c.kind)
		}
		began := time.Now()
		conn, err := c.pc.Dial(t.Context(), "tcp", addr)
		took := time.Since(began)
		if err == nil {
			_ = conn.Close()
			t.Fatalf("premise: the %s probe connected through the blackhole", c.name)
		}
		t.Logf("the %s probe's connect failed (%v) %v after it began; %d SYNs dropped", c.name, err, took.Round(time.Millisecond), localDropped(t))
		if !errors.Is(err, syscall.ETIMEDOUT) || took > kaUserTimeout+time.Second {
			t.Errorf("the %s probe's connect to an unreachable endpoint failed (%v) %v after it began, want ETIMEDOUT within tcp_user_timeout %v + 1s",
				c.name, err, took.Round(100*time.Millisecond), kaUserTimeout)
		}
	}
}

// The dead twin: a probe's connection whose server is gone while it
// waits for the answer (every segment dropped both ways) fails
// keepalive idle + interval x count (4s) after the last segment, within a
// second more, before probe_timeout (10s): the probe still fails on a
// dead server, later than after one lost probe (2s before) but sooner
// than its own deadline.
func TestProbeOfADeadServerCutAfterKeepaliveCount(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	ln, c := probeConnection(t)
	sc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	before := time.Now()
	if _, err := c.Write([]byte("are you there?")); err != nil {
		t.Fatal(err)
	}
	if _, err := sc.Read(make([]byte, 64)); err != nil {
		t.Fatal(err)
	}
	after := time.Now()
	localNFT(t, `table inet lpka {
		chain in { type filter hook input priority 0; policy accept;
			tcp sport %d tcp dport %d counter drop;
			tcp sport %[2]d tcp dport %[1]d drop; }
	}`, c.LocalAddr().(*net.TCPAddr).Port, ln.Addr().(*net.TCPAddr).Port)
	// The path died here; the last segment came at after or, where the
	// rule took over a keepalive idle to apply (a loaded machine), at a
	// probe's answer before now: the kernel counts from that one.
	died := time.Now()
	_, err = c.Read(make([]byte, 16))
	t.Logf("the probe's connection failed (%v) %v after the last segment, %v after the path died; %d dropped",
		err, time.Since(after).Round(time.Millisecond), time.Since(died).Round(time.Millisecond), localDropped(t))
	if !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("read %v, want ETIMEDOUT", err)
	}
	if d := time.Since(before); d < kaDeadAfter-500*time.Millisecond {
		t.Fatalf("failed %v after the last segment, before keepalive's %v", d, kaDeadAfter)
	}
	if d := time.Since(died); d > kaDeadAfter+time.Second {
		t.Fatalf("failed %v after the path died, want within %v", d, kaDeadAfter+time.Second)
	}
}
