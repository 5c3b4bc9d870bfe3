package flow

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
)

// keepaliveTimer is what /proc/net/tcp says of the timer of the IPv4
// socket from local to remote: whether the pending one is keepalive's
// (timer_active 2) and when it expires (in clock ticks of 10 ms).
func keepaliveTimer(t *testing.T, local, remote netip.AddrPort) (keepalive bool, left time.Duration) {
	t.Helper()
	f, err := os.Open("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	hex := func(ap netip.AddrPort) string {
		a := ap.Addr().As4()
		return fmt.Sprintf("%02X%02X%02X%02X:%04X", a[3], a[2], a[1], a[0], ap.Port())
	}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 6 || fs[1] != hex(local) || fs[2] != hex(remote) {
			continue
		}
		tr, when, ok := strings.Cut(fs[5], ":")
		if !ok {
			t.Fatalf("/proc/net/tcp timer field %q", fs[5])
		}
		ticks, err := strconv.ParseUint(when, 16, 64)
		if err != nil {
			t.Fatal(err)
		}
		return tr == "02", time.Duration(ticks) * 10 * time.Millisecond
	}
	t.Fatalf("no socket %s -> %s in /proc/net/tcp", local, remote)
	return false, 0
}

// TestSetLivenessLateKeepsKeepalivesClock: keepalive set on a connection
// that has idled a while (SetLiveness, as the window guard does after the
// connect) is due its idle time after the last segment received, not
// after the call: the first probe goes out when it would have had
// keepalive been on since the connect.
func TestSetLivenessLateKeepsKeepalivesClock(t *testing.T) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	s := policy.Settings{Keepalive: policy.Keepalive{Idle: policy.Duration(3 * time.Second), Interval: policy.Duration(time.Second), Count: 3}}
	f, err := DialRaw(context.Background(), ln.Addr().(*net.TCPAddr).AddrPort(), &s, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	srv, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	if _, err := f.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(srv, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(f, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	lastByte := time.Now() // the last segment came before this
	rc, err := f.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	local, remote := LocalAddr(rc).(*net.TCPAddr).AddrPort(), srv.LocalAddr().(*net.TCPAddr).AddrPort()
	const idled = 700 * time.Millisecond
	time.Sleep(idled)
	set := time.Now()
	if err := SetLiveness(rc, &s); err != nil {
		t.Fatal(err)
	}
	keepalive, left := keepaliveTimer(t, local, remote)
	read := time.Since(set)
	if !keepalive {
		t.Fatal("no keepalive timer pending after SetLiveness")
	}
	idle := s.Keepalive.Idle.D()
	t.Logf("keepalive due in %v, set %v after the last byte, read %v after", left, set.Sub(lastByte).Round(time.Millisecond), read.Round(time.Millisecond))
	// Due idle after the last segment, which came before lastByte; set at
	// least idled after it: at most idle-idled left (a tick of rounding
	// and a delayed ACK's 40 ms of slack), however late this goroutine
	// ran. Counted from the call instead, idle less the time this read
	// took would be left, above the bound whenever the read took less
	// than 500 ms.
	if bound := idle - idled + 100*time.Millisecond; left > bound {
		t.Fatalf("keepalive due in %v, want at most %v: its idle time counted from the call, not from the last segment received", left, bound)
	}
}

// TestSetLivenessLateKeepsTheUserTimeoutsClock: tcp_user_timeout set
// while the kernel already retransmits to a dead path (black-holed in a
// peer namespace) fails the connection when the same bound set at the
// connect does: the kernel counts it from the first unacknowledged send,
// not from the call, so a bound the window guard sets late judges as one
// set at the connect. Two connections write into the blackhole together,
// one with tcp_user_timeout (3 s) set before, one 1.5 s into the
// retransmissions; counted from the call, the second would fail 1.5 s
// after the first.
func TestSetLivenessLateKeepsTheUserTimeoutsClock(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.231.9.1/24", "10.231.9.2/24")
	addr := netns.Echo(t, peer, net.JoinHostPort(link.PeerIP().String(), "9000"))
	// The first connection over a fresh veth may lose a segment of its
	// handshake (the path is not quite up): its connect completes on a
	// retransmission a second later, its first RTT sample holds that
	// second and its RTO is three times it (3 s), and the kernel counts
	// tcp_user_timeout from the first retransmission, an RTO after the
	// send: that connection failed at 8.2 s, the other at 3.4 s. The two
	// compared must not differ so: dial until the path answers at once.
	waitPathUp(t, addr.String())
	s := policy.Settings{TCPUserTimeout: policy.Duration(3 * time.Second)}
	var conns [2]*os.File
	var raws [2]syscall.RawConn
	for i := range conns {
		// A dial timeout below the bound: DialRaw leaves TCP_USER_TIMEOUT
		// unset (at or above it, it sets it before the connect, and the
		// second connection's bound would not be set late).
		f, err := DialRaw(context.Background(), addr.(*net.TCPAddr).AddrPort(), &s, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		_ = f.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadFull(f, make([]byte, 4)); err != nil {
			t.Fatalf("round trip before the fault: %v", err)
		}
		if raws[i], err = f.SyscallConn(); err != nil {
			t.Fatal(err)
		}
		conns[i] = f
	}
	if err := SetLiveness(raws[0], &s); err != nil {
		t.Fatal(err)
	}
	if err := peer.NFT(`table inet lpfault {
	chain in { type filter hook input priority 0; policy accept; tcp dport 9000 drop; }
	chain out { type filter hook output priority 0; policy accept; tcp sport 9000 drop; }
}
`); err != nil {
		t.Fatalf("installing the drop in the peer namespace: %v", err)
	}
	sent := time.Now()
	failed := make(chan [2]any, 2)
	for i, f := range conns {
		if _, err := f.Write([]byte("into the blackhole")); err != nil {
			t.Fatal(err)
		}
		_ = f.SetReadDeadline(time.Now().Add(10 * time.Second))
		go func() {
			_, err := f.Read(make([]byte, 64))
			failed <- [2]any{i, err}
		}()
	}
	time.Sleep(time.Until(sent.Add(1500 * time.Millisecond)))
	if err := SetLiveness(raws[1], &s); err != nil {
		t.Fatal(err)
	}
	var at [2]time.Duration
	for range conns {
		r := <-failed
		i, err := r[0].(int), r[1]
		at[i] = time.Since(sent)
		if err, _ := err.(error); !errors.Is(err, syscall.ETIMEDOUT) {
			t.Fatalf("connection %d: read %v after %v, want ETIMEDOUT", i, err, at[i])
		}
	}
	t.Logf("ETIMEDOUT %v after the send with tcp_user_timeout set at the connect, %v with it set 1.5 s into the retransmissions",
		at[0].Round(time.Millisecond), at[1].Round(time.Millisecond))
	if d := at[1] - at[0]; d > 700*time.Millisecond || d < -700*time.Millisecond {
		t.Fatalf("the bound set late failed the connection %v after the one set at the connect, want together", d)
	}
}

// waitPathUp dials addr until a connect completes at once (within 500
// ms, before any SYN retransmission), for up to 10 s.
func waitPathUp(t *testing.T, addr string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		c, err := net.DialTimeout("tcp", addr, 500*time.Millisecond)
		if err == nil {
			_ = c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not reachable over the veth: %v", addr, err)
		}
	}
}

// TestDialRawBoundsTheConnectByUserTimeout: the kernel applies
// TCP_USER_TIMEOUT to the SYN's retransmissions, so DialRaw sets it before
// the connect wherever the dial's own timeout would not end the connect
// first (no timeout, or one at or above the bound), as a dial through net
// with UpstreamControl does: a connect whose SYNs a peer namespace drops
// fails with ETIMEDOUT at tcp_user_timeout (1.5 s), not at the dial's
// timeout (6 s) or the kernel's SYN retries (about 2 minutes). Where the
// timeout is the shorter (1 s), the timeout ends it.
func TestDialRawBoundsTheConnectByUserTimeout(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.231.10.1/24", "10.231.10.2/24")
	if err := peer.NFT(`table inet lpfault {
	chain in { type filter hook input priority 0; policy accept; tcp dport 9000 drop; }
}
`); err != nil {
		t.Fatalf("installing the drop in the peer namespace: %v", err)
	}
	ap := netip.AddrPortFrom(link.PeerIP(), 9000)
	ut := policy.Duration(1500 * time.Millisecond)
	type result struct {
		name    string
		err     error
		elapsed time.Duration
	}
	cases := []struct {
		name    string
		timeout time.Duration
		want    func(error) bool
		within  [2]time.Duration
	}{
		{"no timeout", 0, func(err error) bool { return errors.Is(err, syscall.ETIMEDOUT) }, [2]time.Duration{1400 * time.Millisecond, 4 * time.Second}},
		{"timeout above the bound", 6 * time.Second, func(err error) bool { return errors.Is(err, syscall.ETIMEDOUT) }, [2]time.Duration{1400 * time.Millisecond, 4 * time.Second}},
		{"timeout below the bound", time.Second, func(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }, [2]time.Duration{900 * time.Millisecond, 2900 * time.Millisecond}},
	}
	// Together: the three connects wait out the same seconds.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	results := make(chan result, len(cases))
	for _, tc := range cases {
		s := policy.Settings{TCPUserTimeout: ut}
		if tc.timeout == time.Second {
			s.TCPUserTimeout = policy.Duration(3 * time.Second)
		}
		go func() {
			begin := time.Now()
			f, err := DialRaw(ctx, ap, &s, tc.timeout)
			if err == nil {
				_ = f.Close()
			}
			results <- result{tc.name, err, time.Since(begin)}
		}()
	}
	got := map[string]result{}
	for range cases {
		r := <-results
		got[r.name] = r
	}
	for _, tc := range cases {
		r := got[tc.name]
		t.Logf("%s: %v after %v", tc.name, r.err, r.elapsed.Round(time.Millisecond))
		if !tc.want(r.err) {
			t.Errorf("%s: the connect ended with %v after %v", tc.name, r.err, r.elapsed)
		}
		// The lower bound is the kernel's (or the deadline's); the upper
		// leaves a goroutine's wake-up on a loaded machine a second and
		// more, below what a connect the bound did not end would take.
		if r.elapsed < tc.within[0] || r.elapsed > tc.within[1] {
			t.Errorf("%s: the connect ended after %v, want within %v", tc.name, r.elapsed, tc.within)
		}
	}
}
