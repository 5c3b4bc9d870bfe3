package flow

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
)

func dialSettings() *policy.Settings {
	s := policy.Settings{TCPUserTimeout: policy.Duration(7 * time.Second)}
	s.Keepalive.Idle = policy.Duration(11 * time.Second)
	s.Keepalive.Interval = policy.Duration(4 * time.Second)
	s.Keepalive.Count = 5
	s.WriteBuffer.HighWaterMark = 256 << 10
	return &s
}

func sockoptOf(t *testing.T, f *os.File, level, opt int) int {
	t.Helper()
	rc, err := f.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var v int32
	var gerr error
	if err := rc.Control(func(fd uintptr) { gerr = getsockopt(int(fd), level, opt, unsafe.Pointer(&v), 4) }); err != nil {
		t.Fatal(err)
	}
	if gerr != nil {
		t.Fatal(gerr)
	}
	return int(v)
}

// sockoptWant is a socket option and the value a test wants of it.
type sockoptWant struct {
	name       string
	level, opt int
	want       int
}

// checkSockopts reports each option of f that is not as wanted, when.
func checkSockopts(t *testing.T, f *os.File, when string, opts []sockoptWant) {
	t.Helper()
	for _, o := range opts {
		if got := sockoptOf(t, f, o.level, o.opt); got != o.want {
			t.Errorf("%s %s = %d, want %d", when, o.name, got, o.want)
		}
	}
}

// TestDialRawConnectsWithTheUpstreamOptions: the socket DialRaw makes
// carries net's TCP_NODELAY and none of the options UpstreamControl sets
// that its caller sets later (TCP_NOTSENT_LOWAT, tcp_user_timeout and
// keepalive: SetNotsentLowat and SetLiveness set them), moves
// bytes both ways through the runtime's poller (a read that has to wait
// is woken), and names its local address as net would.
func TestDialRawConnectsWithTheUpstreamOptions(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			host := "127.0.0.1:0"
			if network == "tcp6" {
				host = "[::1]:0"
			}
			ln, err := net.Listen(network, host)
			if err != nil {
				testutil.SkipOrFail(t, "no %s loopback: %v", network, err)
			}
			defer ln.Close()
			accepted := make(chan net.Conn, 1)
			go func() {
				c, err := ln.Accept()
				if err == nil {
					accepted <- c
				}
				close(accepted)
			}()
			s := dialSettings()
			f, err := DialRaw(context.Background(), ln.Addr().(*net.TCPAddr).AddrPort(), s, 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			srv := <-accepted
			if srv == nil {
				t.Fatal("accept failed")
			}
			defer srv.Close()

			// Not set by the dial: TCP_NOTSENT_LOWAT (0, the kernel's
			// tcp_notsent_lowat), tcp_user_timeout and keepalive, the
			// caller's to set (SetNotsentLowat, SetLiveness).
			checkSockopts(t, f, "after the dial", []sockoptWant{
				{"TCP_NODELAY", unix.IPPROTO_TCP, unix.TCP_NODELAY, 1},
				{"TCP_USER_TIMEOUT", unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, 0},
				{"SO_KEEPALIVE", unix.SOL_SOCKET, unix.SO_KEEPALIVE, 0},
				{"TCP_NOTSENT_LOWAT", unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT, 0},
			})
			rc, err := f.SyscallConn()
			if err != nil {
				t.Fatal(err)
			}
			if err := SetLiveness(rc, s); err != nil {
				t.Fatal(err)
			}
			checkSockopts(t, f, "after SetLiveness", []sockoptWant{
				{"TCP_USER_TIMEOUT", unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, 7000},
				{"SO_KEEPALIVE", unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
				{"TCP_KEEPIDLE", unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, 11},
				{"TCP_KEEPINTVL", unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, 4},
				{"TCP_KEEPCNT", unix.IPPROTO_TCP, unix.TCP_KEEPCNT, 5},
			})
			if err := SetNotsentLowat(rc, 256<<10); err != nil {
				t.Fatal(err)
			}
			if got, want := sockoptOf(t, f, unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT), NotsentLowat(256<<10); got != want {
				t.Errorf("TCP_NOTSENT_LOWAT after SetNotsentLowat = %d, want %d", got, want)
			}
			if got, want := LocalAddr(rc).String(), srv.RemoteAddr().String(); got != want {
				t.Errorf("LocalAddr %s, the server sees %s", got, want)
			}
			if _, err := f.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 4)
			if _, err := io.ReadFull(srv, buf); err != nil || string(buf) != "ping" {
				t.Fatalf("server read %q, %v", buf, err)
			}
			// The answer comes after the read began to wait.
			go func() {
				time.Sleep(20 * time.Millisecond)
				_, _ = srv.Write([]byte("pong"))
			}()
			_ = f.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.ReadFull(f, buf); err != nil || string(buf) != "pong" {
				t.Fatalf("read %q, %v", buf, err)
			}
		})
	}
}

// TestDialRawRefused: a refused connect is net's error, ECONNREFUSED
// inside a dial OpError, so the proxy blames the endpoint as before.
func TestDialRawRefused(t *testing.T) {
	addr, err := testutil.PickClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	f, err := DialRaw(context.Background(), netip.MustParseAddrPort(addr), dialSettings(), 5*time.Second)
	if err == nil {
		f.Close()
		t.Fatal("dial to a closed port succeeded")
	}
	var oe *net.OpError
	if !errors.As(err, &oe) || oe.Op != "dial" || !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("err %#v (%v), want a dial OpError with ECONNREFUSED", err, err)
	}
}

// fullListener is a listening socket whose accept queue is full: a connect
// to it gets no answer (the kernel drops its SYN) until the test accepts.
// It returns the address, the descriptor and a close of the listener
// (once; the test's cleanup closes it otherwise).
func fullListener(t *testing.T) (netip.AddrPort, int, func()) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	closeFD := func() { once.Do(func() { unix.Close(fd) }) }
	t.Cleanup(closeFD)
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 0); err != nil { // one connection fills it
		t.Fatal(err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	ap := netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 1}), uint16(sa.(*unix.SockaddrInet4).Port))
	c, err := net.Dial("tcp", ap.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	// The client is connected when the server's SYN-ACK is in; the queue
	// is full once the client's ACK is: wait for the listener to say so
	// (a listening socket's tcpi_unacked is its accept queue's length).
	for start := time.Now(); ; time.Sleep(time.Millisecond) {
		ti, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
		if err != nil {
			t.Fatal(err)
		}
		if ti.Unacked >= 1 {
			break
		}
		if time.Since(start) > 10*time.Second {
			t.Fatal("the connection never reached the accept queue")
		}
	}
	return ap, fd, closeFD
}

// TestSelfConnectedTellsASocketConnectedToItself: DialRaw's guard against
// the connect that meets itself (net's selfConnect) sees a socket bound to
// the port it connects to, and not an ordinary connection.
func TestSelfConnectedTellsASocketConnectedToItself(t *testing.T) {
	lo, hi := LocalPortRange()
	if lo < 1 || hi < lo {
		t.Fatalf("local port range %d-%d", lo, hi)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	// A port of the local range that is free now: bind to it, then connect
	// to it, a simultaneous open with itself.
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	port := sa.(*unix.SockaddrInet4).Port
	if err := unix.Connect(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}, Port: port}); err != nil && err != unix.EINPROGRESS {
		unix.Close(fd)
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "self")
	defer f.Close()
	ap := netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 1}), uint16(port))
	if uint16(port) < lo || uint16(port) > hi {
		t.Fatalf("the kernel bound port %d, outside its range %d-%d", port, lo, hi)
	}
	if !selfConnected(f, ap) {
		t.Fatal("a socket connected to itself was not told")
	}
	// A connect to 0.0.0.0 goes to this host: the same socket, named so.
	if !selfConnected(f, netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(port))) {
		t.Fatal("a self-connect through the unspecified address was not told")
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	g, err := DialRaw(context.Background(), ln.Addr().(*net.TCPAddr).AddrPort(), dialSettings(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if selfConnected(g, ln.Addr().(*net.TCPAddr).AddrPort()) {
		t.Fatal("an ordinary connection taken for a self-connect")
	}
}

// TestDialRawTimesOut: a connect that gets no answer ends at the timeout
// with the deadline's error, which the proxy reads as connect_timeout.
func TestDialRawTimesOut(t *testing.T) {
	ap, _, _ := fullListener(t)
	f, err := DialRaw(context.Background(), ap, dialSettings(), 150*time.Millisecond)
	if err == nil {
		f.Close()
		t.Fatal("dial to a full accept queue succeeded")
	}
	var ne net.Error
	if !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("err %v, want the deadline's", err)
	}
}

// TestDialRawWaitsForASlowHandshake is TestDialRawTimesOut's twin: a
// connect whose SYN was dropped and answered on the kernel's retransmit
// (about a second later, or three under load) completes within the
// timeout, and leaves no deadline on the socket: a write after the
// timeout has passed does not time out.
func TestDialRawWaitsForASlowHandshake(t *testing.T) {
	ap, lfd, _ := fullListener(t)
	go func() {
		time.Sleep(100 * time.Millisecond)
		if nfd, _, err := unix.Accept(lfd); err == nil { // room for the retransmitted SYN
			unix.Close(nfd)
		}
	}()
	const timeout = 4 * time.Second
	start := time.Now()
	f, err := DialRaw(context.Background(), ap, dialSettings(), timeout)
	if err != nil {
		t.Fatalf("a slow handshake failed: %v", err)
	}
	defer f.Close()
	time.Sleep(time.Until(start.Add(timeout + 100*time.Millisecond)))
	if _, err := f.Write([]byte("x")); errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a write after the dial's timeout: %v (the dial left its deadline)", err)
	}
}

// TestDialRawLeavesNoDeadline: a connect that completed at once (a local
// peer) leaves neither the dial's timeout nor its context on the socket:
// a write after both have passed goes through.
func TestDialRawLeavesNoDeadline(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	f, err := DialRaw(ctx, netip.MustParseAddrPort(ln.Addr().String()), dialSettings(), 50*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cancel()
	time.Sleep(100 * time.Millisecond) // past the dial's timeout
	if _, err := f.Write([]byte("x")); err != nil {
		t.Fatalf("write after the dial's timeout and context: %v", err)
	}
	b := make([]byte, 1)
	if _, err := io.ReadFull(c, b); err != nil || b[0] != 'x' {
		t.Fatalf("the peer read %q, %v", b, err)
	}
}

// TestDialRawEndsWithItsContext: the proxy's shutdown (the dial's context)
// ends a connect that is waiting, with the context's error.
func TestDialRawEndsWithItsContext(t *testing.T) {
	ap, _, _ := fullListener(t)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	f, err := DialRaw(ctx, ap, dialSettings(), time.Minute)
	if err == nil {
		f.Close()
		t.Fatal("dial succeeded")
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v, want the context's", err)
	}
}

// guardLog records what a ConnectGuard was told, in order.
type guardLog struct {
	calls []string
	local netip.AddrPort // SockName of the socket Connected saw
}

func (g *guardLog) Connecting() { g.calls = append(g.calls, "connecting") }

func (g *guardLog) Connected(fd int, ok bool) {
	if ok {
		g.local, _ = SockName(fd)
		g.calls = append(g.calls, "connected")
		return
	}
	g.calls = append(g.calls, "failed")
}

func (g *guardLog) Abandoned() { g.calls = append(g.calls, "abandoned") }

// The guard hears of the connect as it is made, with the socket's local
// address already known, before the handshake is waited for; a connect
// that fails after going out is abandoned, one that succeeds is not.
func TestDialRawGuardedTellsTheGuard(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var g guardLog
	f, err := DialRawGuarded(context.Background(), netip.MustParseAddrPort(ln.Addr().String()), dialSettings(), 5*time.Second, &g)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if got := strings.Join(g.calls, ","); got != "connecting,connected" {
		t.Fatalf("guard told %s, want connecting,connected", got)
	}
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if peer := c.RemoteAddr().(*net.TCPAddr).AddrPort(); peer != g.local {
		t.Fatalf("Connected saw local address %v; the server sees the connection from %v", g.local, peer)
	}

	addr, err := testutil.PickClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	g = guardLog{}
	if f, err := DialRawGuarded(context.Background(), netip.MustParseAddrPort(addr), dialSettings(), 5*time.Second, &g); err == nil {
		f.Close()
		t.Fatal("dial to a closed port succeeded")
	}
	if got := strings.Join(g.calls, ","); got != "connecting,connected,abandoned" {
		t.Fatalf("refused: guard told %s, want connecting,connected,abandoned", got)
	}
}
