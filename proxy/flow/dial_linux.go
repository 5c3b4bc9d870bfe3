package flow

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/policy"
)

// RawDialSupported reports whether DialRaw connects here (Linux); where it
// does not, the proxy dials through net.
const RawDialSupported = true

// DialRaw connects to ap as a net.Dialer with UpstreamControl(s), TCP
// keepalive left to UpstreamControl and Timeout timeout would, with the
// socket outside Go's net: socket(2), SO_MARK (the upstream options
// but TCP_NOTSENT_LOWAT and the liveness options, which the caller sets
// when they can first matter: SetNotsentLowat, SetLiveness; but
// TCP_USER_TIMEOUT where it bounds the connect, at or below timeout or
// with no timeout, since the kernel applies it to the SYN's
// retransmissions), TCP_NODELAY
// (as net sets it on every TCP connection) and connect(2) are raw system
// calls (see SysRead: they do not wake the runtime's sysmon thread, and
// connect, which on a local peer runs the whole handshake, does not hand
// the P to another thread), and the socket joins the runtime's poller
// through os.NewFile (whose fcntl(F_GETFL) the runtime makes raw too).
// What net does per connection and this does not: the getsockname after
// the connect (the proxy asks for its local address only where it uses
// it), the getsockopt(SO_ERROR) when the connect has completed by the
// first look (getpeername alone says so; a connect still under way costs
// getpeername and SO_ERROR, a wait, and getpeername again), and net's own
// address bookkeeping. See docs/performance.md, "The upstream's socket
// outside net".
//
// ap must be an IP address without a zone (net handles the others). The
// errors are net.Dialer's: a *net.OpError with Op "dial" wrapping the
// system call's errno (ECONNREFUSED, EMFILE, an option refused) or
// os.ErrDeadlineExceeded when timeout passed with the connect still under
// way when looked at after it (one that completed or failed by then, the
// proxy frozen past the deadline, is that: see awaitConnect), or ctx's
// error when ctx ended first. A timeout of 0 or less sets no deadline of
// ours. As net does, a socket that connected to itself (a local destination's port
// taken as the connect's own while nothing listens there) is closed and
// the connect made again, as is one the kernel refused a spurious
// EADDRNOTAVAIL; twice at most, within the one timeout.
func DialRaw(ctx context.Context, ap netip.AddrPort, s *policy.Settings, timeout time.Duration) (*os.File, error) {
	return DialRawGuarded(ctx, ap, s, timeout, nil)
}

// DialRawGuarded is DialRaw with g told of each connect(2) as it is made
// (see ConnectGuard); g nil is DialRaw.
func DialRawGuarded(ctx context.Context, ap netip.AddrPort, s *policy.Settings, timeout time.Duration, g ConnectGuard) (*os.File, error) {
	var deadline time.Time
	if timeout > 0 {
		deadline = time.Now().Add(timeout)
	}
	// TCP_USER_TIMEOUT bounds the SYN's retransmissions too: where the
	// dial's own timeout would not end the connect first, it is set before
	// the connect, as UpstreamControl sets it (and SetLiveness again).
	synBound := s.TCPUserTimeout.D() > 0 && (timeout <= 0 || timeout >= s.TCPUserTimeout.D())
	for retries := 0; ; retries++ {
		f, err := dialOnce(ctx, ap, s, deadline, synBound, g)
		if err != nil {
			if retries < 2 && errors.Is(err, syscall.EADDRNOTAVAIL) && ctx.Err() == nil {
				continue
			}
			return nil, &net.OpError{Op: "dial", Net: "tcp", Addr: net.TCPAddrFromAddrPort(ap), Err: err}
		}
		if !selfConnected(f, ap) {
			return f, nil
		}
		if g != nil {
			g.Abandoned()
		}
		_ = f.Close()
		if retries == 2 {
			// net would hand the socket over by now; but nothing listens
			// at ap, or the connect could not have met itself: refused.
			return nil, &net.OpError{Op: "dial", Net: "tcp", Addr: net.TCPAddrFromAddrPort(ap),
				Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
		}
	}
}

// SockName is fd's local address (getsockname(2), made raw as SysRead
// is); an IPv4 socket's is an IPv4 address.
func SockName(fd int) (netip.AddrPort, error) { return sockname(fd) }

// dialOnce is one connect of DialRaw's, its error not yet net's.
func dialOnce(ctx context.Context, ap netip.AddrPort, s *policy.Settings, deadline time.Time, synBound bool, g ConnectGuard) (*os.File, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var sas sockaddrs // on the stack: connect(2) reads it and keeps nothing
	family, sa, salen := sas.of(ap)
	r, _, e := syscall.RawSyscall(syscall.SYS_SOCKET, uintptr(family), syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
	if e != 0 {
		return nil, os.NewSyscallError("socket", e)
	}
	fd := int(r)
	if err := setUpstreamOptions(fd, s, false, false); err != nil {
		rawClose(fd)
		return nil, err
	}
	if synBound {
		if err := setsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(s.TCPUserTimeout.D().Milliseconds())); err != nil {
			rawClose(fd)
			return nil, os.NewSyscallError("setsockopt TCP_USER_TIMEOUT", err)
		}
	}
	// net ignores a refusal of TCP_NODELAY; so does this.
	_ = setsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	if g != nil {
		g.Connecting()
	}
	_, _, e = syscall.RawSyscall(syscall.SYS_CONNECT, r, uintptr(sa), uintptr(salen))
	switch e {
	case 0, syscall.EINPROGRESS, syscall.EINTR:
		// EINTR: the connect goes on in the background, as EINPROGRESS.
		if g != nil {
			g.Connected(fd, true)
		}
	default:
		if g != nil {
			g.Connected(fd, false)
		}
		rawClose(fd)
		return nil, os.NewSyscallError("connect", e)
	}
	f := os.NewFile(r, "tcp") // registers the socket with the runtime's poller
	// abandon closes f after a failure; the guard forgets it first, while
	// its port is still f's own.
	abandon := func() {
		if g != nil {
			g.Abandoned()
		}
		_ = f.Close()
	}
	// os.NewFile keeps a socket the poller refused (epoll_ctl: ENOSPC at
	// max_user_watches, ENOMEM); its deadlines then fail, and so does the
	// dial, as net's would: the proxy's own failure, not the upstream's.
	// Clearing a deadline that is not set asks only that (no timer).
	if err := f.SetWriteDeadline(time.Time{}); err != nil {
		abandon()
		return nil, fmt.Errorf("the runtime's poller did not take the socket: %w", err)
	}
	rc, err := f.SyscallConn()
	if err != nil {
		abandon()
		return nil, err
	}
	if err := awaitConnect(ctx, f, rc, deadline); err != nil {
		abandon()
		return nil, err
	}
	return f, nil
}

// awaitConnect waits until the connect of f (on rc) completes or fails,
// deadline (if not zero) passes or ctx ends; the error is the connect's,
// the deadline's or ctx's. The caller closes f on an error.
//
// A connect that has completed or failed by the first look (a local
// peer: connect(2) ran the whole handshake) costs that look alone (and
// a look at ctx, which may have ended meanwhile). Only
// one still under way arms the wait's deadline and the watch on ctx, from
// inside the wait's first call: the socket's readiness was reset before
// that call (RawConn.Write), so an edge that comes after the look ends
// the wait, and the wait starts after both are armed.
//
// A wait that ends on the deadline looks at the socket once more before
// it reports a timeout: only a connect still under way (SYN_SENT) has
// timed out. A process that could not run when the deadline passed (CPU
// throttling, a host under contention) wakes to an expired timer and a
// ready socket at once, and the runtime runs its timers before it polls
// the network: the wait then ends on the deadline though the handshake
// completed, or the connect was refused, meanwhile. The kernel went on
// while the proxy did not: what it did is the dial's result.
func awaitConnect(ctx context.Context, f *os.File, rc syscall.RawConn, deadline time.Time) error {
	w := connectWaits.Get().(*connectWait)
	w.ctx, w.f, w.deadline = ctx, f, deadline
	err := rc.Write(w.fn)
	stop, cerr := w.stop, w.cerr
	*w = connectWait{fn: w.fn}
	connectWaits.Put(w)
	if stop == nil {
		if err == nil && cerr == nil {
			return ctx.Err() // as when the wait ends: ctx ended first (an atomic load)
		}
		return cmp.Or(err, cerr)
	}
	if !stop() {
		// ctx ended: its deadline may have landed on the socket, whatever
		// the wait's end was.
		return ctx.Err()
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		// The deadline's, since ctx's watch never ran: look once more.
		// (Control, not Write, which fails on the deadline before its
		// call.)
		var done bool
		var lerr error
		if rc.Control(func(fd uintptr) { done, lerr = connectLook(int(fd)) }) == nil && done {
			err, cerr = nil, lerr
		}
	}
	if err != nil {
		return err
	}
	if cerr == nil && !deadline.IsZero() {
		_ = f.SetWriteDeadline(time.Time{})
	}
	return cerr
}

// connectWait is awaitConnect's RawConn.Write callback and its state,
// pooled: a closure over awaitConnect's locals was three heap allocations
// per dial (the closure, and the stop and the error it sets: rc is an
// interface, so all of them escape).
type connectWait struct {
	ctx      context.Context
	f        *os.File
	deadline time.Time
	stop     func() bool           // the watch on ctx, once the connect is found under way
	cerr     error                 // the last look's
	fn       func(fd uintptr) bool // call, bound once
}

var connectWaits = sync.Pool{New: func() any {
	w := new(connectWait)
	w.fn = w.call
	return w
}}

// call looks at the connect. The wait is the poller's: RawConn.Write
// resets the socket's readiness before the first call, and a connect that
// completes after it raises a new edge (EPOLLOUT, or EPOLLERR and
// EPOLLHUP for a refused one); a wake with the connect still under way (a
// readiness from before the connect went out) waits on.
func (w *connectWait) call(fd uintptr) bool {
	var done bool
	if done, w.cerr = connectLook(int(fd)); done {
		return true
	}
	if w.stop == nil {
		if !w.deadline.IsZero() {
			_ = w.f.SetWriteDeadline(w.deadline)
		}
		// The dial's context (the proxy's shutdown) ends the wait at once.
		f := w.f
		w.stop = context.AfterFunc(w.ctx, func() { _ = f.SetWriteDeadline(time.Unix(1, 0)) })
		if hook := testHookConnectPending.Load(); hook != nil {
			(*hook)(int(fd))
		}
	}
	return false
}

// connectLook looks at the socket fd whose connect went out: done once
// the kernel names the peer (a nil error; getpeername alone, the whole
// cost of a connect that completed), or once the socket's error
// (SO_ERROR, which the look clears) says the connect failed (that
// error). Neither: the connect is under way (SYN_SENT); the kernel sets
// the socket's error whenever it ends a connect.
func connectLook(fd int) (done bool, err error) {
	if getpeername(fd) == nil {
		return true, nil
	}
	var v int32
	if err := getsockopt(fd, unix.SOL_SOCKET, unix.SO_ERROR, unsafe.Pointer(&v), 4); err != nil {
		return true, err
	}
	if v != 0 {
		return true, os.NewSyscallError("connect", syscall.Errno(v))
	}
	return false, nil
}

// testHookConnectPending, when set (by a test), runs in awaitConnect
// after the wait's deadline is armed, before the wait: a test holds the
// dialling goroutine there, as a process frozen past the deadline is.
var testHookConnectPending atomic.Pointer[func(fd int)]

// selfConnected reports whether f, connected to ap, is connected to
// itself: its local address is ap. That takes a destination on this host
// whose port lies in the kernel's range for local ports, so only such a
// destination costs the getsockname.
func selfConnected(f *os.File, ap netip.AddrPort) bool {
	if lo, hi := LocalPortRange(); ap.Port() < lo || ap.Port() > hi {
		return false
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return false
	}
	var local netip.AddrPort
	_ = rc.Control(func(fd uintptr) { local, _ = sockname(int(fd)) })
	// A connect to the unspecified address goes to this host's loopback
	// address, which is then the socket's own too.
	return local.IsValid() && local.Port() == ap.Port() &&
		(ap.Addr().IsUnspecified() || local.Addr().Unmap() == ap.Addr().Unmap())
}

var portRange struct {
	once   sync.Once
	lo, hi uint16
}

// LocalPortRange is net.ipv4.ip_local_port_range (both families take
// their connects' ports from it), read once; all ports when it cannot
// be read. A range changed later by sysctl is not seen: a destination
// port moved into it meanwhile is not checked for a self-connect.
func LocalPortRange() (lo, hi uint16) {
	portRange.once.Do(func() {
		portRange.lo, portRange.hi = 1, 65535
		b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
		if err != nil {
			return
		}
		f := strings.Fields(string(b))
		if len(f) != 2 {
			return
		}
		l, err1 := strconv.ParseUint(f[0], 10, 16)
		h, err2 := strconv.ParseUint(f[1], 10, 16)
		if err1 == nil && err2 == nil && l <= h {
			portRange.lo, portRange.hi = uint16(l), uint16(h)
		}
	})
	return portRange.lo, portRange.hi
}

// sockaddrs is the room for a connect's address, either family.
type sockaddrs struct {
	v4 unix.RawSockaddrInet4
	v6 unix.RawSockaddrInet6
}

// of is ap as the kernel takes it (its family, the address in s, its
// size); an IPv4-mapped IPv6 address is IPv4.
func (s *sockaddrs) of(ap netip.AddrPort) (family int, sa unsafe.Pointer, size int) {
	ip, port := ap.Addr().Unmap(), ap.Port()
	if ip.Is4() {
		s.v4 = unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: ip.As4(), Port: netOrder(port)}
		return unix.AF_INET, unsafe.Pointer(&s.v4), unix.SizeofSockaddrInet4
	}
	s.v6 = unix.RawSockaddrInet6{Family: unix.AF_INET6, Addr: ip.As16(), Port: netOrder(port)}
	return unix.AF_INET6, unsafe.Pointer(&s.v6), unix.SizeofSockaddrInet6
}

// getpeername reports whether the socket is connected (nil) or the
// kernel's error (ENOTCONN while the connect goes on or after it failed).
func getpeername(fd int) error {
	var sa unix.RawSockaddrAny
	size := uint32(unix.SizeofSockaddrAny)
	_, _, e := syscall.RawSyscall(syscall.SYS_GETPEERNAME, uintptr(fd), uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&size)))
	if e != 0 {
		return e
	}
	return nil
}

func rawClose(fd int) { syscall.RawSyscall(syscall.SYS_CLOSE, uintptr(fd), 0, 0) }
