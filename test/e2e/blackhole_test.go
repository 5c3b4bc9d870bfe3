//go:build linux

// Package e2e holds end-to-end tests of the proxy against real network
// faults, in network namespaces the tests create themselves (no root
// needed: each test re-executes itself into a new user and network
// namespace, see internal/netns).
package e2e

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/harness"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// echoIn serves an echo server inside ns until the test ends
// (netns.Echo) and returns its address.
func echoIn(t *testing.T, ns *netns.NS, addr string) string { return netns.Echo(t, ns, addr).String() }

// waitReachable dials addr until it answers: a fresh veth may take a
// moment before it carries traffic.
func waitReachable(t *testing.T, addr string) {
	t.Helper()
	if err := harness.WaitReachable(addr, 5*time.Second); err != nil {
		t.Fatal(err)
	}
}

// blackhole9000 drops every segment to and from port 9000: in a peer
// namespace, a remote blackhole.
const blackhole9000 = `table inet lpfault {
	chain in { type filter hook input priority 0; policy accept; tcp dport 9000 drop; }
	chain out { type filter hook output priority 0; policy accept; tcp sport 9000 drop; }
}
`

// blackholeSetup builds: proxy and client in this namespace, an echo server
// in a peer namespace over a veth pair, one link established through the
// proxy, and then a drop of the server's port in the peer's namespace (a
// remote blackhole: the proxy's kernel retransmits into silence).
func blackholeSetup(t *testing.T, tune func(*policy.Settings)) (net.Conn, chan proxy.LinkStats) {
	return blackholeSetupWith(t, tune, nil, proxy.Options{})
}

// blackholeSetupWith is blackholeSetup with the process's limits tuned by
// limits (nil: the defaults) and the proxy made with opts.
func blackholeSetupWith(t *testing.T, tune func(*policy.Settings), limits func(*policy.Limits), opts proxy.Options) (net.Conn, chan proxy.LinkStats) {
	testutil.RequireCommand(t, "ip")
	testutil.RequireCommand(t, "nft")
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.231.7.1/24", "10.231.7.2/24")
	srv := echoIn(t, peer, net.JoinHostPort(link.PeerIP().String(), "9000"))
	waitReachable(t, srv)

	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	tune(&s)
	if limits != nil {
		limits(&cfg.Limits)
	}
	cfg.Listeners = []policy.Listener{{Name: "bh", Listen: "127.0.0.1:0", Upstream: srv, Settings: s}}
	ended := make(chan proxy.LinkStats, 4)
	opts.OnLinkEnd = func(s proxy.LinkStats) { ended <- s }
	p := proxy.New(cfg, opts)
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })

	c, err := net.Dial("tcp", p.Addr("bh").String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	msg := []byte("before the blackhole")
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, len(msg))); err != nil {
		t.Fatalf("round trip before the fault: %v", err)
	}
	if err := peer.NFT(blackhole9000); err != nil {
		t.Fatalf("installing the drop in the peer namespace: %v", err)
	}
	return c, ended
}

// With tcp_user_timeout: 2s, a link whose upstream path is black-holed
// after establishment closes within about 3 s of the next write; the
// kernel default would retransmit for ~15 minutes.
func TestBlackholedUpstreamClosesWithinUserTimeout(t *testing.T) {
	if !netns.Reexec(t) {
		return
	}
	c, ended := blackholeSetup(t, func(s *policy.Settings) {
		s.TCPUserTimeout = policy.Duration(2 * time.Second)
		s.WriteTimeout = policy.Duration(10 * time.Second)
	})
	begin := time.Now()
	if _, err := c.Write([]byte("into the blackhole")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := c.Read(make([]byte, 64))
	elapsed := time.Since(begin)
	if errors.Is(err, os.ErrDeadlineExceeded) || err == nil {
		t.Fatalf("client link still open %v after the write (err %v)", elapsed, err)
	}
	t.Logf("client saw %v %v after writing into the blackhole", err, elapsed.Round(time.Millisecond))
	if elapsed < 2*time.Second || elapsed > 3500*time.Millisecond {
		t.Fatalf("link closed after %v, want about tcp_user_timeout (2s) plus RTO slack", elapsed)
	}
	select {
	case s := <-ended:
		if s.Reason != proxy.CloseUpstreamTimeout {
			t.Fatalf("reason %q (%v), want %q", s.Reason, s.Err, proxy.CloseUpstreamTimeout)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("link did not end")
	}
}

// An idle link parks its pumps (limits.park_idle_after): nothing waits in
// a goroutine on its sockets. When its upstream's path dies while it idles,
// keepalive still finds it, and the socket's error wakes the parked pump,
// which ends the link as upstream_timeout within keepalive's own bound, as
// it would unparked: idle + count x interval = 5 s, with tcp_user_timeout
// (2 s) too: the window guard raises the bound of an idle link to
// keepalive's, so that the kernel does not end it at its first probe
// unanswered past tcp_user_timeout, 2 s after the last byte (one lost
// probe would end a healthy link so). With tcp_user_timeout the window
// guard sets both a quarter of the shorter after the connect (flow.DialRaw
// leaves them): the verdict is the same as with them set at the connect.
// The healthy twin is TestIdleLinkToALiveUpstreamStaysOpen (proxy), whose
// link parks for the second half of its idle time.
func TestBlackholedParkedLinkEndsByKeepalive(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	for _, tc := range []struct {
		name  string
		ut    time.Duration
		bound time.Duration // keepalive's, from the last byte
	}{
		{"keepalive alone", 0, 5 * time.Second},
		{"with tcp_user_timeout", 2 * time.Second, 5 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			parkedEndsByKeepalive(t, tc.ut, tc.bound)
		})
	}
}

func parkedEndsByKeepalive(t *testing.T, ut, bound time.Duration) {
	reg := prometheus.NewRegistry()
	c, ended := blackholeSetupWith(t, func(s *policy.Settings) {
		s.TCPUserTimeout = policy.Duration(ut)
		s.Keepalive = policy.Keepalive{Idle: policy.Duration(time.Second), Interval: policy.Duration(time.Second), Count: 4}
	}, func(l *policy.Limits) { l.ParkIdleAfter = policy.Duration(100 * time.Millisecond) }, proxy.Options{Registerer: reg})
	begin := time.Now()
	for parked := 0.0; parked != 2; {
		if time.Since(begin) > 10*time.Second {
			t.Fatalf("%v pumps parked after 10s, want 2", parked)
		}
		time.Sleep(10 * time.Millisecond)
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "livenessproxy_parked_pumps" {
				parked = mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
	}
	select {
	case s := <-ended:
		elapsed := time.Since(begin)
		if s.Reason != proxy.CloseUpstreamTimeout {
			t.Fatalf("reason %q (%v), want %q", s.Reason, s.Err, proxy.CloseUpstreamTimeout)
		}
		t.Logf("the parked link ended %v after the blackhole (%s)", elapsed.Round(time.Millisecond), s.Reason)
		// bound from the last byte, which came before begin.
		if elapsed > bound+time.Second {
			t.Fatalf("the parked link ended %v after the blackhole, want within keepalive's %v and a second", elapsed, bound)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the parked link to a dead path did not end within 10 s")
	}
	if err, _ := readUntilClosed(c, 5*time.Second); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the client's side still open after the link ended: %v", err)
	}
}

// readUntilClosed reads c until it fails, within d.
func readUntilClosed(c net.Conn, d time.Duration) (error, time.Time) {
	_ = c.SetReadDeadline(time.Now().Add(d))
	buf := make([]byte, 4096)
	for {
		if _, err := c.Read(buf); err != nil {
			return err, time.Now()
		}
	}
}

// The control: with tcp_user_timeout and write_timeout disabled, the same
// blackhole leaves the link open (the kernel keeps retransmitting), so the
// test above measures the option, not the fault.
func TestBlackholedUpstreamStaysOpenWithoutUserTimeout(t *testing.T) {
	if !netns.Reexec(t) {
		return
	}
	c, ended := blackholeSetup(t, func(s *policy.Settings) {
		s.TCPUserTimeout = 0
		s.WriteTimeout = 0
		s.Keepalive = policy.Keepalive{}
	})
	if _, err := c.Write([]byte("into the blackhole")); err != nil {
		t.Fatal(err)
	}
	const watch = 4 * time.Second
	_ = c.SetReadDeadline(time.Now().Add(watch))
	_, err := c.Read(make([]byte, 64))
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("without tcp_user_timeout the link ended anyway: %v", err)
	}
	select {
	case s := <-ended:
		t.Fatal(fmt.Sprintf("link ended without tcp_user_timeout: %+v", s))
	default:
	}
}

// zeroWindowProxy starts a proxy in front of ln (tcp_user_timeout 1s,
// write_timeout wt), closes ln and the connection its server sends on
// served when the test ends, and returns the proxy's address and its
// links' ends.
func zeroWindowProxy(t *testing.T, ln net.Listener, served <-chan net.Conn, wt time.Duration) (string, <-chan proxy.LinkStats) {
	t.Helper()
	t.Cleanup(func() {
		_ = ln.Close()
		select {
		case c := <-served:
			_ = c.Close()
		default:
		}
	})
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	s.TCPUserTimeout = policy.Duration(time.Second)
	s.WriteTimeout = policy.Duration(wt)
	cfg.Listeners = []policy.Listener{{Name: "zw", Listen: "127.0.0.1:0", Upstream: ln.Addr().String(), Settings: s}}
	ended := make(chan proxy.LinkStats, 4)
	p := proxy.New(cfg, proxy.Options{OnLinkEnd: func(s proxy.LinkStats) { ended <- s }})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p.Addr("zw").String(), ended
}

// A path that dies while the upstream's window is zero (a server that
// stopped reading, then its node went away): the proxy has lifted
// TCP_USER_TIMEOUT from the socket while the server's kernel answered the
// window probes (a peer not reading is not a dead one), so what ends the
// link is the write-progress rule: nothing acknowledged for write_timeout.
// Never a hang: the kernel alone would probe the window for many minutes.
func TestBlackholeAtZeroWindowIsAWriteTimeout(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.231.12.1/24", "10.231.12.2/24")
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 4096) }); err != nil {
			return err
		}
		return serr
	}}
	ln, err := peer.ListenConfig(t.Context(), &lc, "tcp", net.JoinHostPort(link.PeerIP().String(), "9000"))
	if err != nil {
		t.Fatal(err)
	}
	held := make(chan net.Conn, 1)
	go func() { // accepts one connection and never reads it
		if c, err := ln.Accept(); err == nil {
			held <- c
		}
	}()
	addr, ended := zeroWindowProxy(t, ln, held, 4*time.Second)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	go func() { _, _ = c.Write(make([]byte, 1<<20)) }() // fills the window
	select {
	case s := <-ended:
		t.Fatalf("the link to a server that only stopped reading ended (%s, %v) within 2.5 tcp_user_timeouts", s.Reason, s.Err)
	case <-time.After(2500 * time.Millisecond):
	}
	pathDiesToAWriteTimeout(t, peer, ended, 20*time.Second)
}

// pathDiesToAWriteTimeout drops the peer's port 9000 and waits up to
// within for the link to end with write_timeout.
func pathDiesToAWriteTimeout(t *testing.T, peer *netns.NS, ended <-chan proxy.LinkStats, within time.Duration) {
	t.Helper()
	if err := peer.NFT(blackhole9000); err != nil {
		t.Fatalf("installing the drop in the peer namespace: %v", err)
	}
	dead := time.Now()
	select {
	case s := <-ended:
		t.Logf("ended %s %v after the path died", s.Reason, time.Since(dead).Round(time.Millisecond))
		if s.Reason != proxy.CloseWriteTimeout {
			t.Fatalf("reason %s (%v), want write_timeout", s.Reason, s.Err)
		}
	case <-time.After(within):
		t.Fatalf("the link to a dead path is still open %v on", within)
	}
}

// serveSerial answers each 4-byte length-prefixed frame on c with itself
// before it reads the next (a server with one request in hand per
// connection: it stops reading while it cannot send).
func serveSerial(c net.Conn) {
	defer c.Close()
	var hdr [4]byte
	for {
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return
		}
		frame := make([]byte, 4+int(binary.BigEndian.Uint32(hdr[:])))
		copy(frame, hdr[:])
		if _, err := io.ReadFull(c, frame[4:]); err != nil {
			return
		}
		if _, err := c.Write(frame); err != nil {
			return
		}
	}
}

// A client that pipelines requests and reads nothing stalls a server that
// answers one request at a time: its answers wait unread in the proxy,
// it stops reading, nothing is acknowledged. That is no write stall (the
// twin of TestBlackholeAtZeroWindowIsAWriteTimeout, over a real network):
// the link lives through several write_timeouts. Then the server's path
// dies: its kernel leaves the window probes unanswered, the excuse ends,
// and write_timeout ends the link.
func TestBlackholeBehindAStalledClientIsAWriteTimeout(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.231.13.1/24", "10.231.13.2/24")
	ln, err := peer.Listen("tcp", net.JoinHostPort(link.PeerIP().String(), "9000"))
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan net.Conn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			served <- c
			serveSerial(c)
		}
	}()
	addr, ended := zeroWindowProxy(t, ln, served, 2*time.Second)
	d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 16<<10) }); err != nil {
			return err
		}
		return serr
	}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	frames := make([]byte, 0, 48<<20)
	for range 48 { // 1 MiB frames, more than the buffers between hold
		frames = append(frames, 0, 0x0f, 0xff, 0xfc)
		frames = append(frames, make([]byte, 1<<20-4)...)
	}
	go func() { _, _ = c.Write(frames) }() // ends with the link
	select {
	case s := <-ended:
		t.Fatalf("the link to a server its client stalled ended (%s, %v) within 3 write_timeouts", s.Reason, s.Err)
	case <-time.After(3 * 2 * time.Second):
	}
	pathDiesToAWriteTimeout(t, peer, ended, 60*time.Second)
}
