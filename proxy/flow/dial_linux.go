package flow

import (
	"context"
	"net"
	"net/netip"
	"os"
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
// socket outside Go's net: socket(2), the upstream options, TCP_NODELAY
// (as net sets it on every TCP connection) and connect(2) are raw system
// calls (see SysRead: they do not wake the runtime's sysmon thread, and
// connect, which on a local peer runs the whole handshake, does not hand
// the P to another thread), and the socket joins the runtime's poller
// through os.NewFile. What net does per connection and this does not: the
// getsockname and the getsockopt(SO_ERROR) after the connect (the proxy
// asks for its local address only where it uses it, and getpeername
// alone says whether the connect completed), and net's own address
// bookkeeping. See docs/performance.md, "The upstream's socket outside
// net".
//
// ap must be an IP address without a zone (net handles the others). The
// errors are net.Dialer's: a *net.OpError with Op "dial" wrapping the
// system call's errno (ECONNREFUSED, EMFILE, an option refused) or
// os.ErrDeadlineExceeded when timeout passed, or ctx's error when ctx
// ended first. A timeout of 0 or less sets no deadline of ours.
func DialRaw(ctx context.Context, ap netip.AddrPort, s policy.Settings, timeout time.Duration) (*os.File, error) {
	addr := net.TCPAddrFromAddrPort(ap)
	fail := func(call string, err error) error {
		if errno, ok := err.(syscall.Errno); ok {
			err = os.NewSyscallError(call, errno)
		}
		return &net.OpError{Op: "dial", Net: "tcp", Addr: addr, Err: err}
	}
	if err := ctx.Err(); err != nil {
		return nil, fail("", err)
	}
	family, sa, salen := sockaddr(ap)
	r, _, e := syscall.RawSyscall(syscall.SYS_SOCKET, uintptr(family), syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
	if e != 0 {
		return nil, fail("socket", e)
	}
	fd := int(r)
	if err := setUpstreamOptions(fd, s); err != nil {
		rawClose(fd)
		return nil, fail("setsockopt", err)
	}
	if err := setsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1); err != nil {
		rawClose(fd)
		return nil, fail("setsockopt", err)
	}
	_, _, e = syscall.RawSyscall(syscall.SYS_CONNECT, r, uintptr(sa), uintptr(salen))
	switch e {
	case 0, syscall.EINPROGRESS, syscall.EINTR:
		// EINTR: the connect goes on in the background, as EINPROGRESS.
	default:
		rawClose(fd)
		return nil, fail("connect", e)
	}
	f := os.NewFile(r, "tcp") // registers the socket with the runtime's poller
	rc, err := f.SyscallConn()
	if err != nil {
		_ = f.Close()
		return nil, fail("", err)
	}
	if timeout > 0 {
		_ = f.SetWriteDeadline(time.Now().Add(timeout))
	}
	// The dial's context (the proxy's shutdown) ends the wait at once.
	stop := context.AfterFunc(ctx, func() { _ = f.SetWriteDeadline(time.Unix(1, 0)) })
	var cerr error
	err = rc.Write(func(fd uintptr) bool {
		// Connected once the kernel names the peer. Until then the
		// socket's error says whether the connect failed; a wake with
		// neither (a readiness from before the connect went out) waits
		// on. The wait is the poller's: RawConn.Write resets the
		// socket's readiness before the first call, and a connect that
		// completes after it raises a new edge (EPOLLOUT, or EPOLLERR and
		// EPOLLHUP for a refused one).
		if getpeername(int(fd)) == nil {
			return true
		}
		var v int32
		if err := getsockopt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR, unsafe.Pointer(&v), 4); err != nil {
			cerr = err
			return true
		}
		if v != 0 {
			cerr = os.NewSyscallError("connect", syscall.Errno(v))
			return true
		}
		return false
	})
	if !stop() {
		// ctx ended: its deadline may have landed on the socket, whatever
		// the wait's end was.
		_ = f.Close()
		return nil, fail("", ctx.Err())
	}
	switch {
	case err != nil:
		_ = f.Close()
		return nil, fail("", err)
	case cerr != nil:
		_ = f.Close()
		return nil, fail("", cerr)
	}
	if timeout > 0 {
		_ = f.SetWriteDeadline(time.Time{})
	}
	return f, nil
}

// sockaddr is ap as the kernel takes it (its family, the address, its
// size); an IPv4-mapped IPv6 address is IPv4.
func sockaddr(ap netip.AddrPort) (family int, sa unsafe.Pointer, size int) {
	ip, port := ap.Addr().Unmap(), ap.Port()
	if ip.Is4() {
		s := &unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: ip.As4()}
		p := (*[2]byte)(unsafe.Pointer(&s.Port))
		p[0], p[1] = byte(port>>8), byte(port) // network byte order
		return unix.AF_INET, unsafe.Pointer(s), unix.SizeofSockaddrInet4
	}
	s := &unix.RawSockaddrInet6{Family: unix.AF_INET6, Addr: ip.As16()}
	p := (*[2]byte)(unsafe.Pointer(&s.Port))
	p[0], p[1] = byte(port>>8), byte(port)
	return unix.AF_INET6, unsafe.Pointer(s), unix.SizeofSockaddrInet6
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
