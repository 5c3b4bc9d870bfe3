package flow

import (
	"encoding/binary"
	"net/netip"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// RouteTo reports whether this host has a route now for an upstream
// socket's segments to dst with mark (SO_MARK, 0 for none): the lookup
// they make, asked of the kernel (rtnetlink's RTM_GETROUTE, as `ip route
// get ADDR ipproto tcp dport PORT mark MARK`), nothing sent. A policy
// rule by fwmark, protocol or destination port selects for it the table
// it selects for the upstream socket: a datagram to another port, looked
// up instead, finds no route where a rule routes only TCP or only that
// port. No route, or an unreachable, prohibit, blackhole or throw one, is
// none. known is false when it could not look (no socket to ask on, an
// address with a zone, no answer).
//
// It asks on the process's kept socket (routeSock), so that it needs no
// new descriptor: a proxy at its descriptor limit, when its own failures
// pile up, still tells its own network from an upstream's death. A
// caller on a thread in another network namespace than the process's (a
// goroutine locked to it) asks on a socket of its own, opened there. A
// caller whose thread's namespace cannot be read (no /proc mounted, a
// kernel without /proc/thread-self) is taken to be in the process's: only
// tests move a thread to another.
func RouteTo(dst netip.AddrPort, mark int) (route, known bool) {
	a := dst.Addr().Unmap()
	if !a.IsValid() || a.Zone() != "" {
		return false, false
	}
	req := routeRequest(a, dst.Port(), mark)
	ns, nsKnown := netnsOf("/proc/thread-self/ns/net")
	if route, known, asked := routeSock.ask(ns, nsKnown, req); asked {
		return route, known
	}
	s, err := routeSocket()
	if err != nil {
		return false, false
	}
	defer unix.Close(s)
	var buf [routeAnswerMax]byte
	route, known, _ = routeAsk(s, req, 1, &buf)
	return route, known
}

// KeepRouteLookup opens the socket RouteTo asks on, if it is not open
// yet and the calling thread is in the process's network namespace: the
// proxy calls it as it starts, so that its first lookup, which may come
// when no descriptor is left, needs none.
func KeepRouteLookup() {
	ns, nsKnown := netnsOf("/proc/thread-self/ns/net")
	routeSock.mu.Lock()
	routeSock.openLocked(ns, nsKnown)
	routeSock.mu.Unlock()
}

// routeSock is the netlink socket of RouteTo's lookups: one for the
// process, in its network namespace (the main thread's, which no
// goroutine changes: a test's namespace runs on a thread of its own),
// opened at KeepRouteLookup or the first lookup and kept. Lookups take
// turns on it; each holds it for one request and its answer, which the
// kernel queues within the send (rtnetlink answers RTM_GETROUTE in the
// sender's system call; an answer that finds the receive queue full is
// dropped, never waited for), so a turn is two system calls and never
// waits on the network. Each request has a sequence number of its own:
// an answer left over from an earlier turn (one whose reader gave up)
// is skipped, never read as the next caller's. One descriptor, no
// goroutine.
var routeSock routeSockT

// routeSockT is routeSock's type.
type routeSockT struct {
	mu   sync.Mutex
	fd   int
	open bool
	ns   netnsID
	seq  uint32
	buf  [routeAnswerMax]byte
}

// routeAnswerMax bounds an answer read: a route's takes about 100 bytes;
// one cut short does not parse: no answer.
const routeAnswerMax = 1024

// netnsID names a network namespace: its nsfs inode.
type netnsID struct{ dev, ino uint64 }

// netnsOf is the network namespace that path (a /proc ns/net link)
// names, read without opening a descriptor; ok is false if it cannot
// be read (no /proc).
func netnsOf(path string) (id netnsID, ok bool) {
	var st unix.Stat_t
	if unix.Stat(path, &st) != nil {
		return id, false
	}
	return netnsID{dev: st.Dev, ino: st.Ino}, true
}

// openLocked opens the kept socket if it is not open and ns, the
// caller's thread's namespace, is the process's (the socket is opened in
// the caller's). It reports whether the socket is open for ns. A caller
// whose namespace is not known (nsKnown false: no /proc to read it from)
// is taken to be in the process's, which no thread but a test's leaves:
// without /proc, every lookup would otherwise need a descriptor of its
// own, and at the descriptor limit tell nothing.
func (r *routeSockT) openLocked(ns netnsID, nsKnown bool) bool {
	if r.open {
		return !nsKnown || r.ns == ns
	}
	main, ok := netnsOf("/proc/self/ns/net")
	if nsKnown && (!ok || main != ns) {
		return false
	}
	fd, err := routeSocket()
	if err != nil {
		return false
	}
	r.fd, r.open, r.ns = fd, true, main
	return true
}

// ask makes the lookup req on the kept socket for a caller in ns (if
// nsKnown, see openLocked); asked is false when it has none for ns
// (another namespace's caller, or none could be opened), and the caller
// asks on a socket of its own. A socket whose send or receive failed for
// another reason than a dropped answer is replaced, if a new one can be
// opened, and the lookup asked again once.
func (r *routeSockT) ask(ns netnsID, nsKnown bool, req []byte) (route, known, asked bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.openLocked(ns, nsKnown) {
		return false, false, false
	}
	for range 2 {
		r.seq++
		route, known, err := routeAsk(r.fd, req, r.seq, &r.buf)
		if err == nil || !r.replaceLocked() {
			return route, known, true
		}
	}
	return false, false, true
}

// replaceLocked opens a new kept socket in place of one that failed and
// reports whether it could: the old one is closed only then, so that a
// process at its descriptor limit keeps the one it has.
func (r *routeSockT) replaceLocked() bool {
	fd, err := routeSocket()
	if err != nil {
		return false
	}
	unix.Close(r.fd)
	r.fd = fd
	return true
}

// routeAsk sends req numbered seq on s and reads its answer, skipping
// earlier requests' (at most routeStale of them). err is a failure of
// the socket itself: neither no answer queued (EAGAIN) nor one the
// kernel dropped (ENOBUFS) is.
func routeAsk(s int, req []byte, seq uint32, buf *[routeAnswerMax]byte) (route, known bool, err error) {
	binary.NativeEndian.PutUint32(req[8:], seq)
	if err := unix.Sendto(s, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return false, false, err
	}
	// The kernel answers within the send: the answer waits already.
	for range routeStale + 1 {
		n, _, err := unix.Recvfrom(s, buf[:], unix.MSG_DONTWAIT)
		switch {
		case err == unix.EAGAIN || err == unix.ENOBUFS:
			return false, false, nil
		case err != nil:
			return false, false, err
		case n >= unix.SizeofNlMsghdr && binary.NativeEndian.Uint32(buf[8:]) == seq:
			route, known = routeAnswer(buf[:n])
			return route, known, nil
		}
	}
	return false, false, nil
}

// routeSocket opens a socket to ask routes of (rtnetlink), as RouteTo's
// own, the kept one and its replacement are.
func routeSocket() (int, error) {
	return unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
}

// routeStale bounds the answers of earlier requests a lookup skips. The
// kernel queues each answer within its send, so a turn leaves none for
// the next; the skip is for a kernel that did not, and is bounded so
// that a turn is too.
const routeStale = 8

// routeRequest is an RTM_GETROUTE request for a TCP segment to a:port
// with mark.
func routeRequest(a netip.Addr, port uint16, mark int) []byte {
	b := make([]byte, unix.SizeofNlMsghdr+unix.SizeofRtMsg, 64)
	ne := binary.NativeEndian
	ne.PutUint16(b[4:], unix.RTM_GETROUTE)
	ne.PutUint16(b[6:], unix.NLM_F_REQUEST)
	// The sequence number (b[8:12]) is set as it is sent (routeAsk).
	b[unix.SizeofNlMsghdr], b[unix.SizeofNlMsghdr+1] = unix.AF_INET6, 128
	if a.Is4() {
		b[unix.SizeofNlMsghdr], b[unix.SizeofNlMsghdr+1] = unix.AF_INET, 32
	}
	b = routeAttr(b, unix.RTA_DST, a.AsSlice())
	b = routeAttr(b, unix.RTA_IP_PROTO, []byte{unix.IPPROTO_TCP})
	if port != 0 {
		b = routeAttr(b, unix.RTA_DPORT, binary.BigEndian.AppendUint16(nil, port))
	}
	if mark != 0 {
		b = routeAttr(b, unix.RTA_MARK, ne.AppendUint32(nil, uint32(mark)))
	}
	ne.PutUint32(b[0:], uint32(len(b)))
	return b
}

// routeAttr appends the route attribute typ with value v to b, padded to
// four bytes.
func routeAttr(b []byte, typ uint16, v []byte) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(unix.SizeofRtAttr+len(v)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, v...)
	for len(b)%unix.RTA_ALIGNTO != 0 {
		b = append(b, 0)
	}
	return b
}

// routeAnswer reads the kernel's answer to routeRequest: a route (its
// type says whether it carries segments), or the lookup's error. The
// errors of a lookup that found no route are those a connect gets:
// ENETUNREACH (none), EHOSTUNREACH (an unreachable route), EACCES
// (prohibit), EINVAL (blackhole; a request the kernel could not read
// would give it too: the request is only ever this one, which
// TestRouteToIsTheTCPLookup has it read); any other is no answer.
func routeAnswer(b []byte) (route, known bool) {
	msgs, err := syscall.ParseNetlinkMessage(b)
	if err != nil || len(msgs) == 0 {
		return false, false
	}
	switch m := msgs[0]; m.Header.Type {
	case unix.NLMSG_ERROR:
		if len(m.Data) < 4 {
			return false, false
		}
		switch syscall.Errno(-int32(binary.NativeEndian.Uint32(m.Data))) {
		case unix.ENETUNREACH, unix.EHOSTUNREACH, unix.EINVAL, unix.EACCES:
			return false, true
		}
	case unix.RTM_NEWROUTE:
		if len(m.Data) < unix.SizeofRtMsg {
			return false, false
		}
		switch m.Data[7] { // rtm_type
		case unix.RTN_UNREACHABLE, unix.RTN_PROHIBIT, unix.RTN_BLACKHOLE, unix.RTN_THROW:
			return false, true
		}
		return true, true
	}
	return false, false
}
