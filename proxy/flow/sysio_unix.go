//go:build unix

package flow

import (
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// SysRead and SysWrite are recv(2) and send(2) (see SysWrite) on a
// non-blocking socket without the Go runtime's system call bookkeeping
// (entersyscall and exitsyscall), as syscall.RawSyscall makes them.
//
// Why it is safe: the data plane's sockets are non-blocking, so neither
// call waits for the peer (the runtime's poller does the waiting, in
// RawConn.Read and RawConn.Write); a call the runtime does not see lasts
// about as long as one copy of at most a chunk. The kernel may still put
// the thread to sleep for a moment (the socket's lock, held by another
// thread's call on the same socket when limits.procs is above 1; memory
// reclaim while it allocates buffers), and meanwhile the P is not handed
// to another thread: bounded, and the price of not waking sysmon.
//
// Why it matters: the proxy runs one P by default (limits.procs), and
// between two requests that P is idle, so the runtime's sysmon thread
// goes to sleep waiting for work. entersyscall wakes it (a futex wake),
// and it then polls every 20 µs until the process idles again: a thread
// woken and put to sleep for every request on a core the proxy shares
// with its clients and servers. These calls do not wake it (see
// docs/performance.md, "System calls the runtime does not see").
func SysRead(fd int, p []byte) (int, error) {
	// recvfrom(2) without an address (recv(2)), not read(2): see SysWrite.
	r, _, e := syscall.RawSyscall6(syscall.SYS_RECVFROM, uintptr(fd), uintptr(bufPtr(p)), uintptr(len(p)), 0, 0, 0)
	if e != 0 {
		return -1, e
	}
	raceAcquireIO()
	raceWrote(p[:r])
	return int(r), nil
}

// SysWrite writes p to the socket fd: see SysRead. It is sendto(2)
// without an address (send(2)), not write(2): the same bytes go out the
// same way, but write(2) passes through the file layer first (its file
// position lock and checks; about 4% of the proxy's CPU on rr64, see
// docs/performance.md, "send, not write"), and send(2) takes flags: with
// MSG_NOSIGNAL (all but darwin) a write to a connection the peer
// reset fails (ECONNRESET, the reset's error, if no other call took it;
// else EPIPE) without a SIGPIPE for the runtime to field.
// Sockets only, as SysRead: on any other descriptor they fail with
// ENOTSOCK.
func SysWrite(fd int, p []byte) (int, error) {
	raceReleaseIO()
	raceRead(p)
	r, _, e := syscall.RawSyscall6(syscall.SYS_SENDTO, uintptr(fd), uintptr(bufPtr(p)), uintptr(len(p)), sendFlags, 0, 0)
	if e != 0 {
		return -1, e
	}
	return int(r), nil
}

// bufPtr is p's first byte, or nil for an empty p (as syscall.Read and
// syscall.Write pass it).
func bufPtr(p []byte) unsafe.Pointer {
	if len(p) == 0 {
		return nil
	}
	return unsafe.Pointer(&p[0])
}

// SysWritev writes bufs in order to the socket fd, as writev(2) would,
// made as SysWrite is (sendmsg(2), for the same reasons): iov is scratch
// space for the vector, returned for reuse. It returns what the kernel
// took (possibly less than all) or the error.
func SysWritev(fd int, bufs [][]byte, iov []unix.Iovec) (int, []unix.Iovec, error) {
	iov = iov[:0]
	for _, b := range bufs {
		if len(b) == 0 {
			continue
		}
		v := unix.Iovec{Base: &b[0]}
		v.SetLen(len(b))
		iov = append(iov, v)
		raceRead(b)
		if len(iov) == maxIovecs {
			break
		}
	}
	if len(iov) == 0 {
		return 0, iov, nil
	}
	raceReleaseIO()
	msg := unix.Msghdr{Iov: &iov[0]}
	msg.SetIovlen(len(iov))
	r, _, e := syscall.RawSyscall(syscall.SYS_SENDMSG, uintptr(fd), uintptr(unsafe.Pointer(&msg)), sendFlags)
	clear(iov) // drop the pointers into the chunks
	if e != 0 {
		return -1, iov, e
	}
	return int(r), iov, nil
}

// maxIovecs is the most buffers one sendmsg takes (IOV_MAX is 1024).
const maxIovecs = 1024

// Writer writes all of some buffers to a non-blocking socket, as
// net.Buffers.WriteTo does on a net.Conn (waiting on the runtime's poller,
// under the socket's write deadline, while the socket takes nothing), with
// SysWritev's sendmsg(2). One goroutine writes with a Writer
// at a time; it keeps its vector and callback between writes, so a write
// allocates nothing.
type Writer struct {
	rc   syscall.RawConn
	fn   func(fd uintptr) bool // call
	fn1  func(fd uintptr) bool // call1
	p    []byte
	bufs net.Buffers
	iov  []unix.Iovec
	n    int64
	err  error
}

// Init has w write to rc's socket.
func (w *Writer) Init(rc syscall.RawConn) { w.rc, w.fn, w.fn1 = rc, w.call, w.call1 }

// InitWrite and InitWriteBuffers are Init for a writer that only Writes
// (a link's client) or only WritesBuffers (its upstream, which tryWrite
// also writes): each binds the one callback it needs, where Init binds
// both, an allocation each, per socket. The other method still works,
// binding its callback at its first call.
func (w *Writer) InitWrite(rc syscall.RawConn) { w.rc, w.fn1 = rc, w.call1 }

// InitWriteBuffers: see InitWrite.
func (w *Writer) InitWriteBuffers(rc syscall.RawConn) { w.rc, w.fn = rc, w.call }

// Write writes all of p, as WriteBuffers does, with SysWrite's send(2).
//
// It is WriteBuffers without the vector, and for a reason: the response
// pump writes to the client inside its read of the upstream (under
// RawConn.Read's frames, see SockReader.call), and a pump's goroutine
// should not outgrow its first 2 KiB stack there. A stack that has grown
// stays grown while the link idles (the runtime shrinks a parked stack
// only when it uses under a quarter of it, its guard counted), so one
// frame too many is 2 KiB more per idle link. WriteBuffers and SysWritev
// together went past the first 2 KiB (docs/performance.md, "Idle links:
// the pumps' stacks"). An empty p writes nothing: (0, nil).
func (w *Writer) Write(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if w.fn1 == nil {
		w.fn1 = w.call1 // InitWriteBuffers's writer
	}
	w.p, w.n, w.err = p, 0, nil
	err := w.rc.Write(w.fn1)
	n, werr := w.n, w.err
	w.p, w.err = nil, nil
	if err == nil && werr != nil {
		err = os.NewSyscallError("write", werr)
	}
	return int(n), err
}

// call1 is Write's RawConn.Write callback, as call is WriteBuffers': the
// same loop with send(2) for sendmsg(2), kept apart rather than shared
// because a shared step would be one more frame on the path above.
func (w *Writer) call1(fd uintptr) bool {
	for len(w.p) > 0 {
		n, err := SysWrite(int(fd), w.p)
		if n > 0 {
			w.n += int64(n)
			w.p = w.p[n:]
		}
		switch {
		case err == syscall.EINTR:
		case err == syscall.EAGAIN:
			return false
		case err != nil:
			w.err = err
			return true
		case n == 0:
			w.err = io.ErrUnexpectedEOF
			return true
		}
	}
	return true
}

// WriteBuffers writes all of bufs, in order, and returns how many bytes
// went out: all of them, or fewer and the error (the socket's as an
// os.SyscallError; a closed socket's or a passed deadline's as
// RawConn.Write gives it). bufs's elements are consumed.
func (w *Writer) WriteBuffers(bufs net.Buffers) (int64, error) {
	if w.fn == nil {
		w.fn = w.call // InitWrite's writer
	}
	w.bufs, w.n, w.err = bufs, 0, nil
	err := w.rc.Write(w.fn)
	n, werr := w.n, w.err
	w.bufs, w.err = nil, nil
	if err == nil && werr != nil {
		err = os.NewSyscallError("writev", werr)
	}
	return n, err
}

// call is the RawConn.Write callback: it writes what is left and asks the
// poller to wait when the socket takes nothing more now.
func (w *Writer) call(fd uintptr) bool {
	for len(w.bufs) > 0 && len(w.bufs[0]) == 0 {
		w.bufs = w.bufs[1:] // nothing to write: Write of an empty p is (0, nil)
	}
	for len(w.bufs) > 0 {
		var n int
		var err error
		n, w.iov, err = SysWritev(int(fd), w.bufs, w.iov)
		if n > 0 {
			w.n += int64(n)
			w.bufs = discard(w.bufs, n)
		}
		switch {
		case err == syscall.EINTR:
		case err == syscall.EAGAIN:
			return false
		case err != nil:
			w.err = err
			return true
		case n == 0 && len(w.bufs) > 0:
			w.err = io.ErrUnexpectedEOF
			return true
		}
	}
	return true
}

// discard drops the first n bytes of bufs, and the empty buffers after
// them.
func discard(bufs net.Buffers, n int) net.Buffers {
	for len(bufs) > 0 && n >= len(bufs[0]) {
		n -= len(bufs[0])
		bufs = bufs[1:]
	}
	if len(bufs) > 0 {
		bufs[0] = bufs[0][n:]
	}
	return bufs
}

// setsockoptInt is setsockopt(2) of an int option, made as SysRead is
// (setsockopt never waits): the liveness options of every upstream socket
// and TCP_NODELAY.
func setsockoptInt(fd, level, opt, value int) error {
	v := int32(value)
	_, _, e := syscall.RawSyscall6(syscall.SYS_SETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(unsafe.Pointer(&v)), 4, 0)
	if e != 0 {
		return os.NewSyscallError("setsockopt", e)
	}
	return nil
}

// getsockopt is getsockopt(2) into the size bytes at p, made as SysRead is:
// TCP_INFO, read while writing under a deadline.
func getsockopt(fd, level, opt int, p unsafe.Pointer, size uint32) error {
	_, err := getsockoptLen(fd, level, opt, p, size)
	return err
}

// getsockoptLen is getsockopt that also returns how many bytes of p the
// kernel filled (an older kernel fills less of a struct that grew).
func getsockoptLen(fd, level, opt int, p unsafe.Pointer, size uint32) (uint32, error) {
	l := size
	_, _, e := syscall.RawSyscall6(syscall.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(p), uintptr(unsafe.Pointer(&l)), 0)
	if e != 0 {
		return 0, os.NewSyscallError("getsockopt", e)
	}
	return l, nil
}

// ShutdownWrite passes a FIN on rc's socket (shutdown(2) with SHUT_WR),
// made as SysRead is: what net.TCPConn.CloseWrite does, and fails as it
// fails.
func ShutdownWrite(rc syscall.RawConn) error {
	c := shutdownCalls.Get().(*shutdownCall)
	c.e = 0
	err := rc.Control(c.fn)
	e := c.e
	shutdownCalls.Put(c)
	if err == nil && e != 0 {
		err = os.NewSyscallError("shutdown", e)
	}
	if err != nil {
		if oe, ok := err.(*net.OpError); ok {
			err = oe.Err
		}
		return &net.OpError{Op: "close", Net: "tcp", Err: err}
	}
	return nil
}

// shutdownCall is ShutdownWrite's RawConn.Control callback and its
// result, pooled: a closure over a local errno was two heap allocations
// per call (rc is an interface: the closure escapes, and the errno with
// it).
type shutdownCall struct {
	e  syscall.Errno
	fn func(fd uintptr) // call, bound once
}

func (c *shutdownCall) call(fd uintptr) {
	raceReleaseIO()
	_, _, c.e = syscall.RawSyscall(syscall.SYS_SHUTDOWN, fd, syscall.SHUT_WR, 0)
}

var shutdownCalls = sync.Pool{New: func() any {
	c := new(shutdownCall)
	c.fn = c.call
	return c
}}

// LocalAddr is the local address of the socket behind rc (getsockname,
// made as SysRead is), as net's TCPConn.LocalAddr gives it; nil when the
// kernel does not say.
func LocalAddr(rc syscall.RawConn) net.Addr {
	var ap netip.AddrPort
	var err error
	if cerr := rc.Control(func(fd uintptr) { ap, err = sockname(int(fd)) }); cerr != nil || err != nil {
		return nil
	}
	return net.TCPAddrFromAddrPort(ap)
}

// sockname is the socket's local address (getsockname(2), made as SysRead
// is); an IPv4 socket's is an IPv4 address.
func sockname(fd int) (netip.AddrPort, error) {
	var rsa syscall.RawSockaddrAny
	size := uint32(syscall.SizeofSockaddrAny)
	_, _, e := syscall.RawSyscall(syscall.SYS_GETSOCKNAME, uintptr(fd), uintptr(unsafe.Pointer(&rsa)), uintptr(unsafe.Pointer(&size)))
	if e != 0 {
		return netip.AddrPort{}, os.NewSyscallError("getsockname", e)
	}
	switch rsa.Addr.Family {
	case syscall.AF_INET:
		sa := (*syscall.RawSockaddrInet4)(unsafe.Pointer(&rsa))
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), netOrder(sa.Port)), nil
	case syscall.AF_INET6:
		sa := (*syscall.RawSockaddrInet6)(unsafe.Pointer(&rsa))
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), netOrder(sa.Port)), nil
	}
	return netip.AddrPort{}, os.NewSyscallError("getsockname", syscall.EAFNOSUPPORT)
}

// SetLinger0 makes the socket's coming close a reset (SO_LINGER 0), as
// net's TCPConn.SetLinger(0) does.
func SetLinger0(rc syscall.RawConn) error {
	var serr error
	err := rc.Control(func(fd uintptr) {
		l := syscall.Linger{Onoff: 1}
		_, _, e := syscall.RawSyscall6(syscall.SYS_SETSOCKOPT, fd, syscall.SOL_SOCKET, syscall.SO_LINGER,
			uintptr(unsafe.Pointer(&l)), unsafe.Sizeof(l), 0)
		if e != 0 {
			serr = os.NewSyscallError("setsockopt", e)
		}
	})
	if err != nil {
		return err
	}
	return serr
}

// netOrder swaps a port between the host's byte order and the network's
// (a sockaddr's port field): the same swap both ways.
func netOrder(port uint16) uint16 {
	b := (*[2]byte)(unsafe.Pointer(&port))
	return uint16(b[0])<<8 | uint16(b[1])
}
