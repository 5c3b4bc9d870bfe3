//go:build linux

// Command floor is a minimal TCP relay for the bench (test/bench, paths
// floor-goroutines, floor-raw, floor-own and floor-epoll): the floor of each data-plane design
// that issue 25 weighs, in Go, with none of livenessproxy's liveness
// features (no framing, tracking, timeouts, metrics, config or logs).
//
//   - -design goroutines is what livenessproxy does today: a goroutine per
//     direction per link, reading and writing through syscall.RawConn on
//     Go's netpoller;
//   - -design goroutines-raw is the same with its sockets outside Go's
//     net: raw accept4, socket and connect, each socket on the runtime's
//     poller through os.NewFile;
//   - -design goroutines-own keeps the goroutines and takes the sockets
//     out of the runtime's poller too: an edge-triggered epoll set of its
//     own, readiness kept per socket (own.go);
//   - -design epoll is one edge-triggered epoll event loop for the whole
//     process, owning its sockets outright, with HAProxy's rule of no
//     read after a short read (see end.hup). With FLOOR_RUNTIME_POLLER=1
//     in its environment (the bench passes its own on) each socket is
//     also in the runtime's poller, through a duplicate never read: what
//     that registration costs a loop (docs/performance.md).
//
// It is a measuring instrument, not a product: it prints nothing per
// connection, bounds nothing, trusts its peers, and runs until SIGTERM or
// SIGINT.
//
//	floor -listen 127.0.0.1:9000 -upstream 127.0.0.1:8000 -design epoll [-procs 1]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

func main() {
	listen := flag.String("listen", "", "address to listen on (127.0.0.1:PORT)")
	upstream := flag.String("upstream", "", "address every link is relayed to (127.0.0.1:PORT)")
	design := flag.String("design", "goroutines", "data plane: goroutines | goroutines-raw | goroutines-own | epoll")
	procs := flag.Int("procs", 1, "GOMAXPROCS (livenessproxy's default limits.procs is 1; 0: the runtime's default)")
	flag.Parse()
	if *procs > 0 {
		runtime.GOMAXPROCS(*procs)
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
	listenAP, err1 := netip.ParseAddrPort(*listen)
	upAP, err2 := netip.ParseAddrPort(*upstream)
	if err1 != nil || err2 != nil || !listenAP.Addr().Is4() || !upAP.Addr().Is4() {
		fail(fmt.Errorf("-listen %q and -upstream %q must be IPv4 ADDR:PORT", *listen, *upstream))
	}
	failed := make(chan error, 1)
	switch *design {
	case "goroutines":
		ln, err := (&net.ListenConfig{KeepAlive: -1}).Listen(context.Background(), "tcp", *listen)
		if err != nil {
			fail(err)
		}
		go serveGoroutines(ln, *upstream)
	case "goroutines-raw":
		ln, err := (&net.ListenConfig{KeepAlive: -1}).Listen(context.Background(), "tcp", *listen)
		if err != nil {
			fail(err)
		}
		go serveRaw(ln.(*net.TCPListener), sockaddr4(upAP))
	case "goroutines-own":
		ln, err := (&net.ListenConfig{KeepAlive: -1}).Listen(context.Background(), "tcp", *listen)
		if err != nil {
			fail(err)
		}
		go serveOwn(ln.(*net.TCPListener), sockaddr4(upAP))
	case "epoll":
		lp, err := newLoop(listenAP, upAP)
		if err != nil {
			fail(err)
		}
		go func() { failed <- lp.run() }()
	default:
		fail(errors.New("-design must be goroutines, goroutines-raw, goroutines-own or epoll"))
	}
	select {
	case <-sig:
	case err := <-failed:
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "floor:", err)
	os.Exit(1)
}

// chunkSize is the buffer of one direction while it holds bytes, as
// livenessproxy's (flow.ChunkSize).
const chunkSize = 64 << 10

var chunks = sync.Pool{New: func() any { b := make([]byte, chunkSize); return &b }}

// ---- -design goroutines ----

// serveGoroutines accepts links and relays each on goroutines of its own.
func serveGoroutines(ln net.Listener, upstream string) {
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(time.Millisecond) // out of descriptors: let links end
			continue
		}
		go relay(c.(*net.TCPConn), upstream)
	}
}

// relay dials the upstream for client and starts a pump per direction.
func relay(client *net.TCPConn, upstream string) {
	c, err := (&net.Dialer{KeepAlive: -1}).Dial("tcp", upstream)
	if err != nil {
		_ = client.SetLinger(0)
		_ = client.Close()
		return
	}
	lk := &glink{client: client, server: c.(*net.TCPConn)}
	go lk.pump(client, lk.server)
	go lk.pump(lk.server, client)
}

// glink is a link of the goroutines design: two pumps, and the count of
// directions that have passed their EOF on.
type glink struct {
	client, server *net.TCPConn
	eofs           atomic.Int32
	closing        sync.Once
}

// pump relays src to dst until EOF, which it passes on as a FIN; the
// second direction to get there closes both. An error resets both.
func (lk *glink) pump(src, dst *net.TCPConn) {
	if err := copyRaw(src, dst); err != nil {
		lk.close(true)
		return
	}
	if err := dst.CloseWrite(); err != nil {
		lk.close(true)
		return
	}
	if lk.eofs.Add(1) == 2 {
		lk.close(false)
	}
}

func (lk *glink) close(reset bool) {
	lk.closing.Do(func() {
		if reset {
			_ = lk.client.SetLinger(0)
			_ = lk.server.SetLinger(0)
		}
		_ = lk.client.Close()
		_ = lk.server.Close()
	})
}

// copyRaw copies src to dst until src's EOF (nil) or an error. It waits
// on the runtime's poller through RawConn.Read and RawConn.Write, and
// makes read(2) and write(2) with syscall.RawSyscall, without the
// runtime's system call bookkeeping, as livenessproxy does (see
// proxy/flow/sysio_unix.go): the sockets are non-blocking, so no call
// waits in the kernel. A chunk is taken from the pool only for a read,
// and given back when the read found nothing: an idle direction holds
// no buffer.
func copyRaw(src, dst syscall.Conn) error {
	rc, err := src.SyscallConn()
	if err != nil {
		return err
	}
	wc, err := dst.SyscallConn()
	if err != nil {
		return err
	}
	var (
		bp   *[]byte // the chunk read, nil at EOF
		n    int
		rerr error
		out  []byte // what is left to write
		werr error
	)
	read := func(fd uintptr) bool {
		b := chunks.Get().(*[]byte)
		for {
			r, e := rawRead(int(fd), *b)
			switch {
			case e == syscall.EINTR:
				continue
			case e == syscall.EAGAIN:
				chunks.Put(b)
				return false // wait until readable
			case e != 0:
				rerr = e
			case r > 0:
				bp, n = b, r
				return true
			}
			chunks.Put(b) // EOF or error
			return true
		}
	}
	write := func(fd uintptr) bool {
		for len(out) > 0 {
			r, e := rawWrite(int(fd), out)
			switch e {
			case 0:
				out = out[r:]
			case syscall.EINTR:
			case syscall.EAGAIN:
				return false // wait until writable
			default:
				werr = e
				return true
			}
		}
		return true
	}
	for {
		bp, n, rerr = nil, 0, nil
		if err := rc.Read(read); err != nil {
			return err
		}
		if rerr != nil {
			return rerr
		}
		if bp == nil {
			return nil // EOF
		}
		out = (*bp)[:n]
		err := wc.Write(write)
		out = nil
		chunks.Put(bp)
		if err != nil {
			return err
		}
		if werr != nil {
			return werr
		}
	}
}

// ---- -design goroutines-raw ----
//
// The goroutines design with its sockets outside Go's net: accept4,
// socket, connect and the options are raw system calls, and each socket
// joins the runtime's poller through os.NewFile. What net does per
// connection and this does not: getsockname after the accept and the
// connect, TCP_NODELAY on the accepted socket (inherited from the
// listening socket), and entersyscall (the sysmon wake-ups, the P handed
// on during a long connect) on every call but the two closes. What it adds:
// os.NewFile's fcntl(F_GETFL) per socket.

func sockaddr4(ap netip.AddrPort) *unix.RawSockaddrInet4 {
	sa := &unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: ap.Addr().As4()}
	port := (*[2]byte)(unsafe.Pointer(&sa.Port))
	port[0], port[1] = byte(ap.Port()>>8), byte(ap.Port()) // network byte order
	return sa
}

func serveRaw(ln *net.TCPListener, upstream *unix.RawSockaddrInet4) {
	acceptRaw(ln, func(nfd int) { go relayRawSock(nfd, upstream) })
}

// acceptRaw hands each socket accepted on ln to relay, with raw accept4
// calls, until ln fails.
func acceptRaw(ln *net.TCPListener, relay func(nfd int)) {
	// A net listener's RawConn has no Read (EINVAL): accept on the
	// duplicate of its descriptor that File makes, which is on the poller
	// (O_NONBLOCK belongs to the open file, so the duplicate has it too).
	lf, err := ln.File()
	if err != nil {
		fail(err)
	}
	lrc, err := lf.SyscallConn()
	if err != nil {
		fail(err)
	}
	_ = lrc.Control(func(fd uintptr) { setNoDelay(int(fd)) }) // accepted sockets inherit it
	for {
		nfd, e := -1, syscall.Errno(0)
		err := lrc.Read(func(fd uintptr) bool {
			r, _, en := syscall.RawSyscall6(unix.SYS_ACCEPT4, fd, 0, 0, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
			if en == syscall.EAGAIN {
				return false
			}
			nfd, e = int(r), en
			return true
		})
		if err != nil {
			return
		}
		if e != 0 {
			time.Sleep(time.Millisecond) // out of descriptors: let links end
			continue
		}
		relay(nfd)
	}
}

// rawLink is a link of the goroutines-raw design.
type rawLink struct {
	client, server *os.File
	eofs           atomic.Int32
	closing        sync.Once
}

func relayRawSock(cfd int, upstream *unix.RawSockaddrInet4) {
	client := os.NewFile(uintptr(cfd), "client")
	r, _, e := syscall.RawSyscall(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if e != 0 {
		setLinger0(cfd)
		_ = client.Close()
		return
	}
	sfd := int(r)
	setNoDelay(sfd)
	server := os.NewFile(uintptr(sfd), "upstream")
	lk := &rawLink{client: client, server: server}
	if err := rawConnect(server, upstream); err != nil {
		lk.close(true)
		return
	}
	go lk.pump(client, server)
	go lk.pump(server, client)
}

// rawConnect connects f inside its RawConn's Write, so that the poller's
// readiness is reset before the connect starts and its completion's edge
// wakes the wait; a wake with SO_ERROR 0 is confirmed with getpeername, as
// net does (a socket registered before its connect is writable at once).
func rawConnect(f *os.File, sa *unix.RawSockaddrInet4) error {
	wc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	started := false
	var cerr syscall.Errno
	err = wc.Write(func(fd uintptr) bool {
		if !started {
			started = true
			_, _, e := syscall.RawSyscall(unix.SYS_CONNECT, fd, uintptr(unsafe.Pointer(sa)), unix.SizeofSockaddrInet4)
			switch e {
			case 0:
				return true
			case syscall.EINPROGRESS:
				return false
			default:
				cerr = e
				return true
			}
		}
		if e := soError(int(fd)); e != 0 {
			cerr = e
			return true
		}
		var rsa unix.RawSockaddrAny
		size := uint32(unix.SizeofSockaddrAny)
		_, _, e := syscall.RawSyscall(unix.SYS_GETPEERNAME, fd, uintptr(unsafe.Pointer(&rsa)), uintptr(unsafe.Pointer(&size)))
		return e != syscall.ENOTCONN
	})
	if err != nil {
		return err
	}
	if cerr != 0 {
		return cerr
	}
	return nil
}

func (lk *rawLink) pump(src, dst *os.File) {
	if err := copyRaw(src, dst); err != nil {
		lk.close(true)
		return
	}
	wc, err := dst.SyscallConn()
	if err == nil {
		var e syscall.Errno
		err = wc.Control(func(fd uintptr) {
			_, _, e = syscall.RawSyscall(unix.SYS_SHUTDOWN, fd, unix.SHUT_WR, 0)
		})
		if err == nil && e != 0 {
			err = e
		}
	}
	if err != nil {
		lk.close(true)
		return
	}
	if lk.eofs.Add(1) == 2 {
		lk.close(false)
	}
}

func (lk *rawLink) close(reset bool) {
	lk.closing.Do(func() {
		for _, f := range []*os.File{lk.client, lk.server} {
			if reset {
				if rc, err := f.SyscallConn(); err == nil {
					_ = rc.Control(func(fd uintptr) { setLinger0(int(fd)) })
				}
			}
			_ = f.Close()
		}
	})
}

// ---- raw system calls (all designs) ----
//
// syscall.RawSyscall makes the call without entersyscall/exitsyscall,
// which would wake the runtime's sysmon thread when the one P is idle (see
// "System calls the runtime does not see" in docs/performance.md). Every
// socket here is non-blocking, so no call waits in the kernel.

func rawRead(fd int, p []byte) (int, syscall.Errno) {
	r, _, e := syscall.RawSyscall(syscall.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	return int(r), e
}

func rawWrite(fd int, p []byte) (int, syscall.Errno) {
	r, _, e := syscall.RawSyscall(syscall.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	return int(r), e
}

func rawClose(fd int) { syscall.RawSyscall(syscall.SYS_CLOSE, uintptr(fd), 0, 0) }

func setNoDelay(fd int) syscall.Errno {
	one := int32(1)
	_, _, e := syscall.RawSyscall6(syscall.SYS_SETSOCKOPT, uintptr(fd), unix.IPPROTO_TCP, unix.TCP_NODELAY,
		uintptr(unsafe.Pointer(&one)), 4, 0)
	return e
}

// setLinger0 makes the next close send a reset.
func setLinger0(fd int) {
	l := unix.Linger{Onoff: 1}
	syscall.RawSyscall6(syscall.SYS_SETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_LINGER,
		uintptr(unsafe.Pointer(&l)), unix.SizeofLinger, 0)
}

// soError is the socket's pending error (SO_ERROR): how a non-blocking
// connect ended.
func soError(fd int) syscall.Errno {
	var v int32
	size := uint32(4)
	_, _, e := syscall.RawSyscall6(syscall.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_ERROR,
		uintptr(unsafe.Pointer(&v)), uintptr(unsafe.Pointer(&size)), 0)
	if e != 0 {
		return e
	}
	return syscall.Errno(v)
}

// ---- -design epoll ----

const (
	batch = 128 // events per epoll_wait
	// edge: every socket is registered once, for everything, edge-triggered.
	edge = unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET
)

// end is one socket of a link, and the direction from it to its peer.
type end struct {
	fd   int
	gen  int32 // tells this socket's events from an earlier one's on the same fd
	peer *end
	// buf holds bytes read from fd and not yet written to peer:
	// (*buf)[off:n]. Taken from the pool only while bytes are pending.
	buf    *[]byte
	off, n int
	// canRead and canWrite: an edge said so and no call has since
	// returned EAGAIN (edge-triggered: no new edge comes until then).
	canRead, canWrite bool
	// hup: an edge said the peer sent its FIN (or the socket is shut
	// down both ways). Until then a read that returned less than it
	// asked for drained the socket, and the next byte raises a new edge
	// (HAProxy's rule: no read after a short read); after it, a short
	// read may have left the EOF behind, and reading goes on to EAGAIN.
	hup        bool
	connecting bool // the upstream's connect has not completed
	eof        bool // fd has sent its FIN
	done       bool // ... and it went on: peer is shut down for writing
	closed     bool
	// rt is a duplicate of fd in the runtime's poller, never read, with
	// FLOOR_RUNTIME_POLLER=1: what the runtime's poller costs a loop whose
	// sockets are in it too (docs/performance.md).
	rt *os.File
}

// alsoRuntimePoller: FLOOR_RUNTIME_POLLER=1 (see end.rt).
var alsoRuntimePoller = os.Getenv("FLOOR_RUNTIME_POLLER") == "1"

// loop is the event loop: the listening socket, the epoll instance, and
// every link's sockets by descriptor.
type loop struct {
	epfd, lfd int
	upstream  unix.RawSockaddrInet4
	ends      []*end // by fd; nil for a descriptor that is not a link's
	gen       int32
	events    [batch]unix.EpollEvent
	err       error
}

func newLoop(listen, upstream netip.AddrPort) (*loop, error) {
	lp := &loop{upstream: unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: upstream.Addr().As4()}}
	port := (*[2]byte)(unsafe.Pointer(&lp.upstream.Port))
	port[0], port[1] = byte(upstream.Port()>>8), byte(upstream.Port()) // network byte order

	lfd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	lp.lfd = lfd
	if err := unix.SetsockoptInt(lfd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
		return nil, err
	}
	if err := unix.Bind(lfd, &unix.SockaddrInet4{Port: int(listen.Port()), Addr: listen.Addr().As4()}); err != nil {
		return nil, err
	}
	if err := unix.Listen(lfd, 4096); err != nil {
		return nil, err
	}
	if lp.epfd, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
		return nil, err
	}
	// Non-blocking, so that os.NewFile registers it in the runtime's
	// poller (see run).
	if err := unix.SetNonblock(lp.epfd, true); err != nil {
		return nil, err
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLET, Fd: int32(lfd)}
	if err := unix.EpollCtl(lp.epfd, unix.EPOLL_CTL_ADD, lfd, &ev); err != nil {
		return nil, err
	}
	return lp, nil
}

// run serves until an epoll_wait fails. The loop's epoll descriptor is
// itself registered in the Go runtime's poller (os.NewFile of a
// non-blocking descriptor), and the loop runs as a RawConn.Read callback
// on it: it takes what epoll_wait has now (timeout 0), and when that was
// less than a full batch returns false, and the runtime parks the
// goroutine until the epoll descriptor is readable again. No OS thread
// ever blocks in epoll_wait, which matters with GOMAXPROCS 1: the loop is
// one goroutine among the runtime's, woken by the runtime's own netpoll.
//
// No wake-up is lost: an event that arrives after the callback's last
// epoll_wait puts its socket on this epoll's ready list, which makes the
// epoll descriptor readable, an edge the runtime's epoll records for it.
// RawConn.Read clears the recorded readiness only once, when it starts
// (the one call run makes); its wait after the callback returns false
// sees an edge recorded since, and calls the callback again at once.
func (lp *loop) run() error {
	if err := waitEpoll(lp.epfd, lp.poll); err != nil {
		return err
	}
	return lp.err
}

// waitEpoll runs poll, a RawConn.Read callback, on the epoll descriptor
// epfd (non-blocking) through the runtime's poller, until poll says done
// or the wait fails (see loop.run).
func waitEpoll(epfd int, poll func(uintptr) bool) error {
	f := os.NewFile(uintptr(epfd), "epoll")
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	err = rc.Read(poll)
	runtime.KeepAlive(f) // its finalizer would close the epoll descriptor
	if err != nil {
		return fmt.Errorf("waiting on the epoll descriptor: %w", err)
	}
	return nil
}

// poll is the RawConn.Read callback (see run).
func (lp *loop) poll(uintptr) bool {
	for {
		r, _, e := syscall.RawSyscall6(syscall.SYS_EPOLL_PWAIT, uintptr(lp.epfd),
			uintptr(unsafe.Pointer(&lp.events[0])), batch, 0, 0, 0)
		if e == syscall.EINTR {
			continue
		}
		if e != 0 {
			lp.err = os.NewSyscallError("epoll_pwait", e)
			return true
		}
		for i := range int(r) {
			lp.handle(lp.events[i])
		}
		if int(r) < batch {
			return false
		}
	}
}

func (lp *loop) handle(ev unix.EpollEvent) {
	fd := int(ev.Fd)
	if fd == lp.lfd {
		lp.accept()
		return
	}
	if fd >= len(lp.ends) {
		return
	}
	e := lp.ends[fd]
	if e == nil || e.gen != ev.Pad {
		return // the socket closed earlier in this batch (and the fd was perhaps reused)
	}
	if e.connecting {
		if ev.Events&(unix.EPOLLERR|unix.EPOLLHUP) != 0 || soError(fd) != 0 {
			lp.closeLink(e, true) // the connect failed: reset the client
			return
		}
		if ev.Events&unix.EPOLLOUT == 0 {
			return
		}
		e.connecting = false // connected
	} else if ev.Events&unix.EPOLLERR != 0 {
		lp.closeLink(e, true)
		return
	}
	// EPOLLHUP alone is no error on a TCP socket: it says both directions
	// are shut down, as after a half-close each way, and bytes may still
	// wait to be read; the read and write calls tell what is left.
	if ev.Events&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP) != 0 {
		e.canRead = true
	}
	if ev.Events&(unix.EPOLLRDHUP|unix.EPOLLHUP) != 0 {
		e.hup = true
	}
	if ev.Events&(unix.EPOLLOUT|unix.EPOLLHUP) != 0 {
		e.canWrite = true
	}
	// e readable moves e -> peer; e writable moves peer -> e.
	if lp.flow(e) {
		lp.flow(e.peer)
	}
}

// accept takes every pending connection (until EAGAIN: the listener is
// edge-triggered) and opens a link for each. Out of descriptors, the rest
// wait for the next connection's edge.
func (lp *loop) accept() {
	for {
		r, _, e := syscall.RawSyscall6(unix.SYS_ACCEPT4, uintptr(lp.lfd), 0, 0,
			unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
		switch e {
		case 0:
			lp.open(int(r))
		case syscall.EINTR, syscall.ECONNABORTED:
		default:
			return
		}
	}
}

// open starts the upstream's connect for the client cfd; its completion
// comes as EPOLLOUT on the upstream socket.
func (lp *loop) open(cfd int) {
	r, _, e := syscall.RawSyscall(syscall.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if e != 0 {
		setLinger0(cfd)
		rawClose(cfd)
		return
	}
	ufd := int(r)
	setNoDelay(cfd)
	setNoDelay(ufd)
	_, _, e = syscall.RawSyscall(syscall.SYS_CONNECT, uintptr(ufd), uintptr(unsafe.Pointer(&lp.upstream)), unix.SizeofSockaddrInet4)
	if e != 0 && e != syscall.EINPROGRESS && e != syscall.EINTR {
		setLinger0(cfd)
		rawClose(cfd)
		rawClose(ufd)
		return
	}
	client, up := &end{fd: cfd}, &end{fd: ufd, connecting: e != 0}
	client.peer, up.peer = up, client
	for _, x := range [2]*end{client, up} {
		lp.gen++
		x.gen = lp.gen
		if x.fd >= len(lp.ends) {
			lp.ends = append(lp.ends, make([]*end, x.fd+1-len(lp.ends)+1024)...)
		}
		lp.ends[x.fd] = x
	}
	for _, x := range [2]*end{client, up} {
		ev := unix.EpollEvent{Events: edge, Fd: int32(x.fd), Pad: x.gen}
		_, _, e := syscall.RawSyscall6(syscall.SYS_EPOLL_CTL, uintptr(lp.epfd), unix.EPOLL_CTL_ADD, uintptr(x.fd),
			uintptr(unsafe.Pointer(&ev)), 0, 0)
		if e != 0 {
			lp.closeLink(client, true)
			return
		}
	}
	if alsoRuntimePoller {
		for _, x := range [2]*end{client, up} {
			r, _, e := syscall.RawSyscall(syscall.SYS_FCNTL, uintptr(x.fd), syscall.F_DUPFD_CLOEXEC, 0)
			if e == 0 {
				x.rt = os.NewFile(r, "runtime-poller") // non-blocking: the runtime's poller takes it
			}
		}
	}
}

// flow moves src -> src.peer as far as the two sockets allow: write what
// is pending, then read src again (its edge was consumed: it stays
// readable until a read says EAGAIN), until a call says EAGAIN. Bytes
// that dst does not take whole stay in src.buf, and src is not read
// until EPOLLOUT on dst lets them go; so do client bytes that arrive
// before the upstream's connect completes. At src's EOF, once nothing is
// pending, dst is shut down for writing; when both directions are done
// the link closes. It returns false once the link is closed.
func (lp *loop) flow(src *end) bool {
	dst := src.peer
	for {
		switch {
		case src.closed:
			return false
		case src.buf != nil:
			if dst.connecting || !dst.canWrite {
				return true
			}
			n, e := rawWrite(dst.fd, (*src.buf)[src.off:src.n])
			switch e {
			case 0:
				if src.off += n; src.off == src.n {
					chunks.Put(src.buf)
					src.buf = nil
				}
			case syscall.EINTR:
			case syscall.EAGAIN:
				dst.canWrite = false
				return true
			default:
				lp.closeLink(src, true)
				return false
			}
		case src.done:
			return true
		case src.eof:
			if _, _, e := syscall.RawSyscall(syscall.SYS_SHUTDOWN, uintptr(dst.fd), unix.SHUT_WR, 0); e != 0 {
				lp.closeLink(src, true)
				return false
			}
			src.done = true
			if dst.done {
				lp.closeLink(src, false)
				return false
			}
			return true
		case dst.connecting || !src.canRead:
			return true
		default:
			b := chunks.Get().(*[]byte)
			n, e := rawRead(src.fd, *b)
			switch {
			case e == syscall.EINTR:
				chunks.Put(b)
			case e == syscall.EAGAIN:
				chunks.Put(b)
				src.canRead = false
				return true
			case e != 0:
				chunks.Put(b)
				lp.closeLink(src, true)
				return false
			case n == 0:
				chunks.Put(b)
				src.eof = true
			default:
				src.buf, src.off, src.n = b, 0, n
				if n < len(*b) && !src.hup {
					src.canRead = false // drained (see hup)
				}
			}
		}
	}
}

// closeLink closes both sockets of e's link, with a reset (SO_LINGER 0)
// when reset. Closing a descriptor takes it out of the epoll instance.
func (lp *loop) closeLink(e *end, reset bool) {
	for _, x := range [2]*end{e, e.peer} {
		if x.closed {
			continue
		}
		if reset {
			setLinger0(x.fd)
		}
		rawClose(x.fd)
		if x.rt != nil {
			_ = x.rt.Close()
			x.rt = nil
		}
		lp.ends[x.fd] = nil
		if x.buf != nil {
			chunks.Put(x.buf)
			x.buf = nil
		}
		x.closed = true
	}
}
