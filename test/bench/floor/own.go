//go:build linux

package main

import (
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ---- -design goroutines-own ----
//
// The goroutines design of goroutines-raw (a goroutine per direction per
// link, raw accept4, socket, connect, read and write) with its sockets
// outside the runtime's poller: each socket is in one edge-triggered epoll
// set of the relay's own, registered once for everything
// (EPOLLIN|EPOLLOUT|EPOLLRDHUP|EPOLLET); the set's descriptor waits in the
// runtime's poller, and one goroutine takes its events and wakes the pumps
// that wait on them. It answers one question of issue 25's: how much of
// the event loop's advantage per new connection a goroutine design keeps
// once its sockets leave the runtime's poller, without the loop itself.
//
// Readiness is kept per socket, as HAProxy keeps it: an event sets it, and
// only a call that found nothing clears it (EAGAIN, or a read that returned
// less than it asked for while no event has reported the peer's FIN or an
// error). So no pump makes a read that finds nothing, not even its first:
// a socket joins the set where nothing can have arrived unseen (epoll_ctl
// reports what is already there when it adds a socket), and after a short
// read only a reported hang-up makes the pump read on to the end.
//
// What the runtime's poller costs per socket and this does not: os.NewFile's
// fcntl(F_GETFL), the epoll_ctl that removes the socket (a raw close does),
// the os.File and its finalizer, and entersyscall at the close (the sysmon
// wake-ups); after the connect, getpeername (the event says how it ended).
// What this costs and the runtime's poller does not: per wake-up, an
// epoll_wait of its own after the runtime's epoll_pwait, and a switch from
// the dispatching goroutine to the pump.

// errClosedSock: the link is closing; a pump waiting on one of its sockets
// ends.
var errClosedSock = errors.New("socket closed")

// ownPoller is the relay's epoll set and its sockets by descriptor.
type ownPoller struct {
	epfd   int
	mu     sync.Mutex
	socks  []*osock // by fd; checked against the event's generation
	gen    int32
	events [batch]unix.EpollEvent
	err    error
}

// osock is one socket in the set. Its readiness and the link's closing
// are under mu; seq counts the events of each direction, so that a call
// that found nothing clears the readiness only when no event came after
// the call began (an edge-triggered set reports a change once).
type osock struct {
	fd  int
	gen int32
	mu  sync.Mutex
	r   ownHalf
	w   ownHalf
	// hup: an event reported the peer's FIN, an error or both sides shut;
	// err: an event reported an error (a failed connect).
	hup, err bool
	closed   bool
}

type ownHalf struct {
	cond  sync.Cond
	ready bool
	seq   uint32
}

func newOwnPoller() (*ownPoller, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	// Non-blocking, so that os.NewFile registers it in the runtime's poller.
	if err := unix.SetNonblock(epfd, true); err != nil {
		return nil, err
	}
	return &ownPoller{epfd: epfd}, nil
}

// run takes the set's events until an epoll_wait fails, as the epoll
// design's loop does: in a RawConn.Read callback on the set's descriptor,
// which the runtime's poller wakes when the set has events (see loop.run:
// no wake-up is lost).
func (p *ownPoller) run() error {
	if err := waitEpoll(p.epfd, p.poll); err != nil {
		return err
	}
	return p.err
}

func (p *ownPoller) poll(uintptr) bool {
	for {
		r, _, e := syscall.RawSyscall6(syscall.SYS_EPOLL_PWAIT, uintptr(p.epfd),
			uintptr(unsafe.Pointer(&p.events[0])), uintptr(len(p.events)), 0, 0, 0)
		if e == syscall.EINTR {
			continue
		}
		if e != 0 {
			p.err = os.NewSyscallError("epoll_pwait", e)
			return true
		}
		p.mu.Lock()
		for i := range int(r) {
			ev := &p.events[i]
			if fd := int(ev.Fd); fd < len(p.socks) {
				if s := p.socks[fd]; s != nil && s.gen == ev.Pad {
					s.event(ev.Events)
				}
			}
		}
		p.mu.Unlock()
		if int(r) < len(p.events) {
			return false
		}
	}
}

// add puts fd in the set; epoll_ctl reports at once what is there already.
func (p *ownPoller) add(fd int) (*osock, error) {
	p.mu.Lock()
	p.gen++
	s := &osock{fd: fd, gen: p.gen}
	s.r.cond.L, s.w.cond.L = &s.mu, &s.mu
	if fd >= len(p.socks) {
		p.socks = append(p.socks, make([]*osock, fd+1-len(p.socks))...)
	}
	p.socks[fd] = s
	p.mu.Unlock()
	ev := unix.EpollEvent{Events: edge, Fd: int32(fd), Pad: s.gen}
	if err := unix.EpollCtl(p.epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		p.forget(s)
		return nil, err
	}
	return s, nil
}

// forget takes s out of the table before its descriptor is closed (the
// close takes it out of the set).
func (p *ownPoller) forget(s *osock) {
	p.mu.Lock()
	if p.socks[s.fd] == s {
		p.socks[s.fd] = nil
	}
	p.mu.Unlock()
}

func (s *osock) event(ev uint32) {
	s.mu.Lock()
	if ev&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		s.hup = true
	}
	if ev&unix.EPOLLERR != 0 {
		s.err = true
	}
	if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		s.r.ready = true
		s.r.seq++
		s.r.cond.Signal()
	}
	if ev&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		s.w.ready = true
		s.w.seq++
		s.w.cond.Signal()
	}
	s.mu.Unlock()
}

// wait waits until h is ready or the link closes; it returns the event
// count the call to come is judged against, and whether a hang-up was
// reported by then.
func (s *osock) wait(h *ownHalf) (seq uint32, hup bool, err error) {
	s.mu.Lock()
	for !h.ready && !s.closed {
		h.cond.Wait()
	}
	seq, hup, closed := h.seq, s.hup, s.closed
	s.mu.Unlock()
	if closed {
		return 0, false, errClosedSock
	}
	return seq, hup, nil
}

// drained: a call begun after event seq found nothing more; h waits for
// the next event, unless one came meanwhile.
func (s *osock) drained(h *ownHalf, seq uint32) {
	s.mu.Lock()
	if h.seq == seq {
		h.ready = false
	}
	s.mu.Unlock()
}

// close wakes the pumps waiting on s for good.
func (s *osock) close() {
	s.mu.Lock()
	s.closed = true
	s.r.cond.Broadcast()
	s.w.cond.Broadcast()
	s.mu.Unlock()
}

// copyOwn relays src to dst until src's EOF (nil) or an error. A chunk is
// held only from a read that returned bytes until they are written.
func copyOwn(src, dst *osock) error {
	for {
		seq, hup, err := src.wait(&src.r)
		if err != nil {
			return err
		}
		b := chunks.Get().(*[]byte)
		n, e := rawRead(src.fd, *b)
		switch {
		case e == syscall.EINTR:
			chunks.Put(b)
			continue
		case e == syscall.EAGAIN:
			chunks.Put(b)
			src.drained(&src.r, seq)
			continue
		case e != 0:
			chunks.Put(b)
			return e
		case n == 0:
			chunks.Put(b)
			return nil // EOF
		}
		if n < len(*b) && !hup {
			src.drained(&src.r, seq) // HAProxy's rule: no read after a short read
		}
		err = dst.writeAll((*b)[:n])
		chunks.Put(b)
		if err != nil {
			return err
		}
	}
}

func (s *osock) writeAll(p []byte) error {
	for len(p) > 0 {
		seq, _, err := s.wait(&s.w)
		if err != nil {
			return err
		}
		n, e := rawWrite(s.fd, p)
		switch e {
		case 0:
			p = p[n:]
		case syscall.EINTR:
		case syscall.EAGAIN:
			s.drained(&s.w, seq)
		default:
			return e
		}
	}
	return nil
}

func serveOwn(ln *net.TCPListener, upstream *unix.RawSockaddrInet4) {
	p, err := newOwnPoller()
	if err != nil {
		fail(err)
	}
	go func() { fail(p.run()) }()
	acceptRaw(ln, func(nfd int) { go relayOwn(p, nfd, upstream) })
}

// ownLink is a link of the goroutines-own design: its descriptors are
// closed once both pumps have ended (neither is then in a call on them).
type ownLink struct {
	p              *ownPoller
	client, server *osock
	reset          atomic.Bool
	ended          atomic.Int32
}

func relayOwn(p *ownPoller, cfd int, upstream *unix.RawSockaddrInet4) {
	client, err := p.add(cfd)
	if err != nil {
		setLinger0(cfd)
		rawClose(cfd)
		return
	}
	lk := &ownLink{p: p, client: client}
	r, _, e := syscall.RawSyscall(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if e != 0 {
		lk.reset.Store(true)
		lk.finish()
		return
	}
	sfd := int(r)
	setNoDelay(sfd)
	_, _, e = syscall.RawSyscall(unix.SYS_CONNECT, r, uintptr(unsafe.Pointer(upstream)), unix.SizeofSockaddrInet4)
	if e != 0 && e != syscall.EINPROGRESS {
		rawClose(sfd)
		lk.reset.Store(true)
		lk.finish()
		return
	}
	// Added after the connect began: a socket added before it reports
	// EPOLLHUP|EPOLLOUT at once (TCP_CLOSE).
	if lk.server, err = p.add(sfd); err != nil {
		rawClose(sfd)
		lk.reset.Store(true)
		lk.finish()
		return
	}
	// The connect's end is its event: EPOLLOUT connected, with EPOLLERR
	// failed (SO_ERROR says why; nothing here needs it).
	if _, _, err := lk.server.wait(&lk.server.w); err != nil || lk.serverFailed() {
		lk.reset.Store(true)
		lk.finish()
		return
	}
	go lk.pump(client, lk.server)
	go lk.pump(lk.server, client)
}

func (lk *ownLink) serverFailed() bool {
	lk.server.mu.Lock()
	defer lk.server.mu.Unlock()
	return lk.server.err
}

// pump relays src to dst; at src's EOF it shuts dst down for writing, on
// an error it closes the link with a reset. The second pump to end
// closes the descriptors.
func (lk *ownLink) pump(src, dst *osock) {
	err := copyOwn(src, dst)
	if err == nil {
		if _, _, e := syscall.RawSyscall(unix.SYS_SHUTDOWN, uintptr(dst.fd), unix.SHUT_WR, 0); e != 0 {
			err = e
		}
	}
	if err != nil {
		if err != errClosedSock {
			lk.reset.Store(true)
		}
		lk.client.close()
		lk.server.close()
	}
	if lk.ended.Add(1) == 2 {
		lk.finish()
	}
}

// finish closes the link's descriptors, with a reset where it failed.
func (lk *ownLink) finish() {
	for _, s := range []*osock{lk.client, lk.server} {
		if s == nil {
			continue
		}
		lk.p.forget(s)
		if lk.reset.Load() {
			setLinger0(s.fd)
		}
		rawClose(s.fd)
	}
}
