package flow

import (
	"errors"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// RawAcceptSupported: a Listener accepts with raw system calls (Linux).
const RawAcceptSupported = true

// Listener accepts a listening socket's connections without net: a raw
// accept4 in a RawConn.Read callback, and each socket put on the
// runtime's poller with os.NewFile. Against net's accept, per connection:
//
//   - no getsockname (net asks for the local address of every socket it
//     accepts; a link never uses it but in an error message, where the
//     client asks for it then);
//   - no TCP_NODELAY: the listening socket has it, and a socket accepted
//     from a TCP listener inherits it from there (TestListenerAccepts
//     reads it back from an accepted socket);
//   - no entersyscall: net's accept4 and setsockopt go through
//     syscall.Syscall, whose entersyscall wakes the runtime's sysmon
//     thread whenever it sleeps (as it does while the process idles
//     between connections): a context switch per new connection.
//
// A net listener's RawConn has no Read (it returns EINVAL), so the
// Listener holds the duplicate of the socket that TCPListener.File makes,
// which the runtime's poller takes, and closes net's: the socket stays
// open through the duplicate and closes with it.
//
// One goroutine accepts at a time (the fields the callback fills are the
// Listener's own); Close may come from any.
type Listener struct {
	f      *os.File
	rc     syscall.RawConn
	addr   net.Addr
	closed atomic.Bool
	fn     func(fd uintptr) bool

	// What the accept4 in fn returned.
	nfd   int
	errno syscall.Errno
	sa    unix.RawSockaddrAny
}

// NewListener takes ln's socket, which ListenControl prepared: ln is
// closed, whatever the outcome, and the Listener accepts on the socket
// from then on.
func NewListener(ln *net.TCPListener) (*Listener, error) {
	addr := ln.Addr()
	f, err := ln.File()
	_ = ln.Close()
	if err != nil {
		return nil, err
	}
	l := &Listener{f: f, addr: addr}
	l.fn = l.accept
	if l.rc, err = f.SyscallConn(); err != nil {
		_ = f.Close()
		return nil, err
	}
	// A file the poller refused would make every Read fail: say so now.
	if err := f.SetReadDeadline(time.Time{}); err != nil {
		_ = f.Close()
		return nil, errors.New("the runtime's poller refused the listening socket")
	}
	nodelay := 0
	if err := l.rc.Control(func(fd uintptr) {
		nodelay, _ = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NODELAY)
	}); err != nil || nodelay == 0 {
		_ = f.Close()
		return nil, errors.New("the listening socket has no TCP_NODELAY for its connections to inherit: bind it with ListenControl")
	}
	return l, nil
}

// ListenControl is the net.ListenConfig Control of a socket that a
// Listener will take: it sets TCP_NODELAY before the socket is bound and
// listens, so that every connection the kernel completes, even one
// completed before NewListener, inherits it.
func ListenControl(_, _ string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = setsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	}); err != nil {
		return err
	}
	if serr != nil {
		return os.NewSyscallError("setsockopt TCP_NODELAY", serr)
	}
	return nil
}

// Addr is the address the socket is bound to.
func (l *Listener) Addr() net.Addr { return l.addr }

// Close closes the socket: the address is free again once it returns,
// and an Accept waiting meanwhile returns net.ErrClosed.
func (l *Listener) Close() error {
	if l.closed.Swap(true) {
		return net.ErrClosed
	}
	return l.f.Close()
}

// accept is the RawConn.Read callback: one accept4, false to wait.
func (l *Listener) accept(fd uintptr) bool {
	for {
		size := uint32(unix.SizeofSockaddrAny)
		r, _, e := syscall.RawSyscall6(unix.SYS_ACCEPT4, fd, uintptr(unsafe.Pointer(&l.sa)),
			uintptr(unsafe.Pointer(&size)), unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
		switch e {
		case syscall.EINTR, syscall.ECONNABORTED:
			// As net's accept: a connection reset while it waited in the
			// queue is not the listener's error.
			continue
		case syscall.EAGAIN:
			return false
		}
		l.nfd, l.errno = int(r), e
		return true
	}
}

// Accept waits for a connection and returns its socket, on the runtime's
// poller, and the client's address. Its errors are net's: a closed
// listener's is net.ErrClosed, others (out of descriptors) an accept
// *net.OpError around the errno.
func (l *Listener) Accept() (*os.File, *net.TCPAddr, error) {
	l.nfd, l.errno = -1, 0
	if err := l.rc.Read(l.fn); err != nil {
		if l.closed.Load() {
			return nil, nil, net.ErrClosed
		}
		return nil, nil, &net.OpError{Op: "accept", Net: "tcp", Addr: l.addr, Err: err}
	}
	if l.errno != 0 {
		return nil, nil, &net.OpError{Op: "accept", Net: "tcp", Addr: l.addr, Err: os.NewSyscallError("accept4", l.errno)}
	}
	remote := peerAddr(&l.sa)
	f := os.NewFile(uintptr(l.nfd), "client")
	// os.NewFile leaves a descriptor the poller refused (out of epoll
	// watches) blocking-less and unpollable: such a socket is useless to
	// a link, and the failure is the proxy's own.
	if err := f.SetReadDeadline(time.Time{}); err != nil {
		_ = SetLinger0(mustRaw(f))
		_ = f.Close()
		return nil, nil, &net.OpError{Op: "accept", Net: "tcp", Addr: l.addr,
			Err: errors.New("the runtime's poller refused the accepted socket")}
	}
	return f, remote, nil
}

// mustRaw is f's RawConn; an *os.File always has one.
func mustRaw(f *os.File) syscall.RawConn {
	rc, _ := f.SyscallConn()
	return rc
}

// peerAddr is the address accept4 wrote, as net gives it (an IPv6 zone by
// its interface's name).
func peerAddr(rsa *unix.RawSockaddrAny) *net.TCPAddr {
	switch rsa.Addr.Family {
	case unix.AF_INET:
		sa := (*unix.RawSockaddrInet4)(unsafe.Pointer(rsa))
		ip := sa.Addr // a copy: rsa is the Listener's, for its next accept
		return &net.TCPAddr{IP: ip[:], Port: int(netOrder(sa.Port))}
	case unix.AF_INET6:
		sa := (*unix.RawSockaddrInet6)(unsafe.Pointer(rsa))
		ip := sa.Addr
		a := &net.TCPAddr{IP: ip[:], Port: int(netOrder(sa.Port))}
		if sa.Scope_id != 0 {
			a.Zone = zoneName(int(sa.Scope_id))
		}
		return a
	}
	return &net.TCPAddr{}
}

// zoneName names interface index i as net does: its name, or the number
// where the interface is unknown. Only a link-local client asks.
func zoneName(i int) string { return zones.name(i) }

// zones caches interface names by index, as net's own zone cache does
// (refreshed at most once a minute), so that a link-local client's
// accept does not cost a netlink dump of the interfaces each time.
var zones = zoneCache{lookup: net.Interfaces, maxAge: time.Minute}

type zoneCache struct {
	lookup func() ([]net.Interface, error)
	maxAge time.Duration

	mu      sync.Mutex
	names   map[int]string
	fetched time.Time
}

// name is index i's interface name; an index the cache does not know
// refreshes it once its entries are older than maxAge.
func (z *zoneCache) name(i int) string {
	z.mu.Lock()
	defer z.mu.Unlock()
	if n, ok := z.names[i]; ok {
		return n
	}
	if z.names == nil || time.Since(z.fetched) >= z.maxAge {
		if ifs, err := z.lookup(); err == nil {
			z.names = make(map[int]string, len(ifs))
			for _, ifi := range ifs {
				z.names[ifi.Index] = ifi.Name
			}
			z.fetched = time.Now()
			if n, ok := z.names[i]; ok {
				return n
			}
		}
	}
	return strconv.Itoa(i)
}
