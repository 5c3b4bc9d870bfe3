//go:build linux

package netns_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// TestMain fails the (parent or child) test binary if goroutines leak, in
// particular the namespace goroutines of netns.NS.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const (
	localCIDR  = "10.231.0.1/24"
	peerCIDR   = "10.231.0.2/24"
	local6CIDR = "fd31::1/64"
	peer6CIDR  = "fd31::2/64"

	userTimeout = 1500 * time.Millisecond
)

// dialUserTimeout dials address from the current namespace with
// TCP_USER_TIMEOUT set and Go's keepalive disabled.
func dialUserTimeout(t *testing.T, address string, ut time.Duration) *net.TCPConn {
	t.Helper()
	d := net.Dialer{
		Timeout:   3 * time.Second,
		KeepAlive: -1,
		Control: func(_, _ string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) {
				serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(ut.Milliseconds()))
			})
			return errors.Join(err, serr)
		},
	}
	c, err := d.Dial("tcp", address)
	if err != nil {
		t.Fatalf("dial %s: %v", address, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c.(*net.TCPConn)
}

// roundTrip writes msg and expects it echoed back within a second.
func roundTrip(c net.Conn, msg []byte) error {
	if err := c.SetDeadline(time.Now().Add(time.Second)); err != nil {
		return err
	}
	defer func() { _ = c.SetDeadline(time.Time{}) }()
	if _, err := c.Write(msg); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if !bytes.Equal(got, msg) {
		return fmt.Errorf("echo mismatch: got %q want %q", got, msg)
	}
	return nil
}

func port(a net.Addr) int { return a.(*net.TCPAddr).Port }

// TestBlackholeWithUserTimeout drops one established connection in the
// peer's namespace (both directions) and checks that TCP_USER_TIMEOUT=1500ms
// turns the silent blackhole into ETIMEDOUT within 1.5s..4s.
func TestBlackholeWithUserTimeout(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, localCIDR, peerCIDR)
	srv := netns.Echo(t, peer, net.JoinHostPort(link.PeerIP().String(), "0"))

	c := dialUserTimeout(t, srv.String(), userTimeout)
	if err := roundTrip(c, []byte("hello before the fault")); err != nil {
		t.Fatalf("round trip before the fault: %v", err)
	}

	sport, cport := port(srv), port(c.LocalAddr())
	if err := peer.NFT(fmt.Sprintf(`table inet lpfault {
	chain in {
		type filter hook input priority 0; policy accept;
		tcp dport %[1]d tcp sport %[2]d counter drop
	}
	chain out {
		type filter hook output priority 0; policy accept;
		tcp sport %[1]d tcp dport %[2]d counter drop
	}
}
`, sport, cport)); err != nil {
		t.Fatalf("installing drop rules in the peer namespace: %v", err)
	}

	// Reader: a pending read must fail as well. The deadline bounds it.
	readErr := make(chan error, 1)
	if err := c.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	go func() {
		buf := make([]byte, 4096)
		for range 1000 {
			if _, err := c.Read(buf); err != nil {
				readErr <- err
				return
			}
		}
		readErr <- errors.New("read loop bound reached")
	}()

	payload := bytes.Repeat([]byte("x"), 100)
	start := time.Now()
	var (
		firstErr error
		firstAt  time.Duration
		werr     error
		rerr     error
		writes   int
	)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for i := 0; i < 60 && firstErr == nil; i++ { // at most ~6s
		if err := c.SetWriteDeadline(time.Now().Add(time.Second)); err != nil {
			t.Fatal(err)
		}
		if _, werr = c.Write(payload); werr != nil {
			firstErr, firstAt = werr, time.Since(start)
			break
		}
		writes++
		select {
		case rerr = <-readErr:
			firstErr, firstAt = rerr, time.Since(start)
		case <-tick.C:
		}
	}
	if firstErr == nil {
		t.Fatalf("no error after %v and %d writes through the blackhole", time.Since(start), writes)
	}
	// The kernel reports ETIMEDOUT once (to whichever call comes first);
	// the other call then sees EPIPE (write) or EOF (read).
	if rerr == nil {
		select {
		case rerr = <-readErr:
		case <-time.After(2 * time.Second):
			_ = c.Close()
			rerr = <-readErr
		}
	}
	t.Logf("first error after %v (%d writes): %v; write error: %v; read error: %v",
		firstAt.Round(time.Millisecond), writes, firstErr, werr, rerr)
	if !errors.Is(werr, unix.ETIMEDOUT) && !errors.Is(rerr, unix.ETIMEDOUT) {
		t.Errorf("want ETIMEDOUT from the write or the pending read, got write=%v read=%v", werr, rerr)
	}
	if firstAt < userTimeout || firstAt > 4*time.Second {
		t.Errorf("error after %v, want within [%v, 4s]", firstAt, userTimeout)
	}
	if out, err := peer.Run("", "nft", "list", "table", "inet", "lpfault"); err != nil {
		t.Errorf("listing the fault table: %v", err)
	} else if !strings.Contains(string(out), "packets") {
		t.Errorf("no counters in the fault table:\n%s", out)
	} else {
		t.Logf("peer fault table after the test:\n%s", out)
	}
}

// TestNoFaultKeepsWorking is the control for TestBlackholeWithUserTimeout:
// the same connection without the drop keeps echoing for twice the user
// timeout, over IPv4 and IPv6.
func TestNoFaultKeepsWorking(t *testing.T) {
	if !netns.Reexec(t, "ip") {
		return
	}
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, localCIDR, peerCIDR)
	link.AddAddr(t, local6CIDR, peer6CIDR)

	for i, name := range []string{"IPv4", "IPv6"} {
		t.Run(name, func(t *testing.T) {
			srv := netns.Echo(t, peer, net.JoinHostPort(link.PeerAddrs[i].Addr().String(), "0"))
			c := dialUserTimeout(t, srv.String(), userTimeout)
			start := time.Now()
			n := 0
			for time.Since(start) < 2*userTimeout && n < 100 { // ~30 iterations
				msg := fmt.Appendf(nil, "%03d%s", n, bytes.Repeat([]byte("y"), 97))
				if err := roundTrip(c, msg); err != nil {
					t.Fatalf("round trip %d after %v: %v", n, time.Since(start), err)
				}
				n++
				time.Sleep(100 * time.Millisecond)
			}
			t.Logf("%d round trips of 100 B over %v via %s, no error", n, time.Since(start).Round(time.Millisecond), c.RemoteAddr())
		})
	}
}

// TestNSIsolation checks the mechanics of NS: the thread is in another
// namespace, sockets created in Do stay there, commands started in Do run
// there, and Close destroys thread, namespace and veth.
func TestNSIsolation(t *testing.T) {
	if !netns.Reexec(t, "ip", "readlink") {
		return
	}

	self, err := os.Readlink("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	ns, err := netns.New()
	if err != nil {
		testutil.SkipOrFail(t, "netns.New: %v", err)
	}
	defer ns.Close() // after the explicit Close below this is a no-op

	viaPath, err := os.Readlink(ns.Path())
	if err != nil {
		t.Fatalf("readlink %s: %v", ns.Path(), err)
	}
	var inDo string
	if err := ns.Do(func() (err error) {
		inDo, err = os.Readlink("/proc/thread-self/ns/net")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	out, err := ns.Run("", "readlink", "/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	inCmd := strings.TrimSpace(string(out))
	t.Logf("child ns %s; peer: path %s -> %s, Do %s, command %s", self, ns.Path(), viaPath, inDo, inCmd)
	if viaPath == self || inDo != viaPath || inCmd != viaPath {
		t.Fatalf("namespaces do not line up: self=%s path=%s do=%s cmd=%s", self, viaPath, inDo, inCmd)
	}

	// A listener created in Do stays in the peer namespace: 127.0.0.1 there
	// is not 127.0.0.1 here.
	ln, err := ns.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			_ = c.Close()
		}
		accepted <- err
	}()
	if c, err := net.DialTimeout("tcp", ln.Addr().String(), time.Second); err == nil {
		_ = c.Close()
		t.Errorf("dial %s from the child namespace succeeded; the listener leaked out of the peer namespace", ln.Addr())
	} else if !errors.Is(err, unix.ECONNREFUSED) {
		t.Errorf("dial from the child namespace: want ECONNREFUSED, got %v", err)
	}
	c, err := ns.DialContext(context.Background(), &net.Dialer{Timeout: time.Second}, "tcp", ln.Addr().String())
	if err != nil {
		t.Fatalf("dial inside the peer namespace: %v", err)
	}
	_ = c.Close()
	if err := <-accepted; err != nil {
		t.Fatalf("accept: %v", err)
	}
	_ = ln.Close()

	// The veth's peer end is visible only in the peer namespace.
	link := netns.Veth(t, ns, localCIDR, peerCIDR)
	if out, err := ns.Run("", "ip", "-o", "link", "show"); err != nil || !strings.Contains(string(out), link.Peer+"@") {
		t.Fatalf("peer end %s not in the peer namespace (err %v):\n%s", link.Peer, err, out)
	}

	// Panics inside Do become errors and the namespace keeps working.
	if err := ns.Do(func() error { panic("boom") }); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Errorf("panic in Do: got %v", err)
	}
	if err := ns.Do(func() error { return nil }); err != nil {
		t.Errorf("Do after a panic: %v", err)
	}

	// Close: thread gone at once, namespace (seen through its veth) soon after.
	closed := time.Now()
	if err := ns.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ns.Do(func() error { return nil }); !errors.Is(err, netns.ErrClosed) {
		t.Errorf("Do after Close: want ErrClosed, got %v", err)
	}
	task := strings.TrimSuffix(ns.Path(), "/ns/net")
	if !waitFor(2*time.Second, func() bool { _, err := os.Stat(task); return errors.Is(err, os.ErrNotExist) }) {
		t.Errorf("thread %s still exists 2s after Close", task)
	}
	threadGone := time.Since(closed)
	if !waitFor(10*time.Second, func() bool {
		_, err := net.InterfaceByName(link.Local)
		return err != nil
	}) {
		t.Errorf("veth %s still present 10s after Close: the peer namespace was not destroyed", link.Local)
	}
	t.Logf("after Close: thread gone in %v, namespace (veth %s) gone in %v",
		threadGone.Round(time.Microsecond), link.Local, time.Since(closed).Round(time.Millisecond))

	// The namespace thread is never the main thread (which the runtime
	// cannot destroy), and the process's own namespace never changes.
	for i := range 20 {
		ns, err := netns.New()
		if err != nil {
			t.Fatal(err)
		}
		if want := fmt.Sprintf("/proc/%d/task/%d/", os.Getpid(), os.Getpid()); strings.HasPrefix(ns.Path(), want) {
			t.Errorf("namespace %d is held by the main thread: %s", i, ns.Path())
		}
		task := strings.TrimSuffix(ns.Path(), "/ns/net")
		_ = ns.Close()
		if !waitFor(2*time.Second, func() bool { _, err := os.Stat(task); return errors.Is(err, os.ErrNotExist) }) {
			t.Errorf("namespace %d: thread %s still exists 2s after Close", i, task)
		}
	}
	for _, p := range []string{"/proc/self/ns/net", "/proc/thread-self/ns/net"} {
		if got, err := os.Readlink(p); err != nil || got != self {
			t.Errorf("%s = %s (%v), want the child's namespace %s", p, got, err, self)
		}
	}
}

// waitFor polls cond every 10ms until it is true or timeout passes.
func waitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for range 10000 {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	return false
}
