//go:build linux

package flow

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/policy"
)

// setUpstreamOptions applies the socket options of an upstream socket
// before it connects, with setsockoptInt (no wake of the runtime's
// sysmon; see SysRead): SO_MARK, and TCP_NOTSENT_LOWAT (lowat) and the
// liveness options (live, setLiveness) where the caller does not set them
// later. TCP_NODELAY is Go's default for every TCP connection.
func setUpstreamOptions(fd int, s *policy.Settings, lowat, live bool) error {
	if s.UpstreamMark > 0 {
		// Lets interception rules exempt the proxy's own connections.
		if err := setsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, s.UpstreamMark); err != nil {
			return fmt.Errorf("SO_MARK %d (needs NET_ADMIN): %w", s.UpstreamMark, err)
		}
	}
	// A small unsent backlog in the kernel: the proxy's own queue, bounded
	// by high_water_mark, holds the rest (see NotsentLowat). DialRaw's
	// caller sets it when it can first matter (SetNotsentLowat).
	if lowat {
		if err := setsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT, NotsentLowat(int64(s.WriteBuffer.HighWaterMark))); err != nil {
			return err
		}
	}
	if live {
		return setLiveness(fd, s, s.TCPUserTimeout.D())
	}
	return nil
}

// setLiveness sets TCP_USER_TIMEOUT to ut (tcp_user_timeout, or the
// bound the window guard keeps on an idle socket) and keepalive. A
// disabled (non-positive) setting leaves the kernel's default untouched. Keepalive
// times have one-second granularity in the kernel; shorter values round up
// to one second.
//
// On a connected socket (SetLiveness) the order keeps keepalive's clock:
// SO_KEEPALIVE first, then TCP_KEEPIDLE, which the kernel applies from the
// last segment received (tcp_sock_set_keepidle_locked re-arms the timer
// for idle less the time since then), so the first probe goes out when it
// would have had keepalive been on since the connect.
func setLiveness(fd int, s *policy.Settings, ut time.Duration) error {
	if ut > 0 {
		if err := setsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(ut.Milliseconds())); err != nil {
			return os.NewSyscallError("setsockopt TCP_USER_TIMEOUT", err)
		}
	}
	if ka := s.Keepalive; ka.Idle > 0 {
		for _, o := range []struct {
			name            string
			level, opt, val int
		}{
			{"SO_KEEPALIVE", unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
			{"TCP_KEEPIDLE", unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, ceilSeconds(ka.Idle)},
			{"TCP_KEEPINTVL", unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, ceilSeconds(ka.Interval)},
			{"TCP_KEEPCNT", unix.IPPROTO_TCP, unix.TCP_KEEPCNT, ka.Count},
		} {
			if err := setsockoptInt(fd, o.level, o.opt, o.val); err != nil {
				return os.NewSyscallError("setsockopt "+o.name, err)
			}
		}
	}
	return nil
}

func ceilSeconds(d policy.Duration) int {
	s := int((d.D() + 999_999_999) / 1_000_000_000)
	if s < 1 {
		s = 1
	}
	return s
}

func UpstreamControl(s policy.Settings) func(network, address string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) { serr = setUpstreamOptions(int(fd), &s, true, true) }); err != nil {
			return err
		}
		return serr
	}
}

// SetLiveness sets tcp_user_timeout and keepalive (as Settings has them)
// on a connected socket DialRaw made, which leaves them unset for its
// caller to set when they can first matter. Set late, each still judges
// by its own clock: the kernel counts TCP_USER_TIMEOUT from the first
// retransmission of the oldest unacknowledged segment (retrans_stamp)
// and clamps the retransmission timer to what is left of it from the
// next retransmission on, and keepalive's idle time from the last segment
// received (see setLiveness). So a caller that sets them well before
// either can expire (a quarter of the shorter) changes no verdict on a
// connected socket (TCP_USER_TIMEOUT also bounds the SYN's retransmissions:
// DialRaw sets it before the connect where that matters). A refused option
// is an *os.SyscallError; any other error is rc's own (the socket was
// closed).
func SetLiveness(rc syscall.RawConn, s *policy.Settings) error {
	return SetLivenessBound(rc, s, s.TCPUserTimeout.D())
}

// SetLivenessBound is SetLiveness with TCP_USER_TIMEOUT ut instead of
// tcp_user_timeout: the window guard sets the bound it keeps on an idle
// socket (see policy.Settings.IdleUserTimeout).
func SetLivenessBound(rc syscall.RawConn, s *policy.Settings, ut time.Duration) error {
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = setLiveness(int(fd), s, ut) }); err != nil {
		return err
	}
	return serr
}

// SetNotsentLowat sets TCP_NOTSENT_LOWAT, NotsentLowat(high), on a
// socket DialRaw made, which leaves it unset: until more than that many
// bytes have been written to the socket the kernel cannot hold more than
// that unsent, which is all the option bounds, so a caller sets it before
// the write that takes the total past it, and a link that never writes
// that much (most request/response links) saves the system call.
func SetNotsentLowat(rc syscall.RawConn, high int64) error {
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = setsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT, NotsentLowat(high))
	}); err != nil {
		return err
	}
	if serr != nil {
		return os.NewSyscallError("setsockopt TCP_NOTSENT_LOWAT", serr)
	}
	return nil
}

// BytesAcked is the stream offset the peer has acknowledged: TCP_INFO's
// tcpi_bytes_acked less the one the SYN takes (on a socket that
// connected, the kernel counts every sequence number acknowledged, its
// SYN's included, so a connection that has sent nothing reads 1). On a
// connection whose FIN was acknowledged it is one too many, which no
// caller looks at. An accepted socket's count starts at 0 (its SYN-ACK
// is acknowledged before the socket exists: measured, 0 then 10 after
// 10 bytes), so there it is one short, never below 0: the one caller on
// a client's socket (link.halfProgress) looks only at whether it moves.
func BytesAcked(raw syscall.RawConn) (int64, bool) {
	c, ok := tcpInfo(raw)
	defer c.put()
	if !ok {
		return 0, false
	}
	return ackedOf(&c.ti), true
}

// ackedOf is BytesAcked's count from a TCP_INFO read (see BytesAcked):
// ResetNotFin and SampleDelivery say it as BytesAcked does.
func ackedOf(ti *unix.TCPInfo) int64 { return max(int64(ti.Bytes_acked)-1, 0) }

// Received is what the kernel says of the bytes the peer sent: how many
// it has taken in, in order (TCP_INFO's tcpi_bytes_received, less the
// sequence number a FIN takes), and when the latest of them arrived, as a
// mono time no later than the arrival (tcpi_last_data_recv counts in
// jiffies, 10 ms at the coarsest, so a jiffy and a millisecond are taken
// off). ok is false when no byte has arrived (the kernel's clock then
// starts at the handshake), when the connection is closed with nothing
// left unread (SIOCINQ), or when the kernel does not say.
func Received(raw syscall.RawConn) (n, at int64, ok bool) {
	now := Mono()
	c, ok := tcpInfo(raw)
	defer c.put()
	if !ok {
		return 0, 0, false
	}
	ti := &c.ti
	n = int64(ti.Bytes_received)
	switch ti.State {
	case unix.BPF_TCP_CLOSE:
		// FIN_WAIT2, CLOSING or LAST_ACK then the last segment land here
		// (a user's socket never shows TIME_WAIT), as does a reset: only
		// bytes still unread say anything.
		var inq int
		var err error
		_ = raw.Control(func(fd uintptr) { inq, err = unix.IoctlGetInt(int(fd), unix.SIOCINQ) })
		if err != nil || inq <= 0 {
			return 0, 0, false
		}
		n-- // a FIN, if any: after a reset, one byte short
	case unix.BPF_TCP_CLOSE_WAIT, unix.BPF_TCP_LAST_ACK, unix.BPF_TCP_CLOSING, unix.BPF_TCP_TIME_WAIT:
		n-- // the peer's FIN
	}
	if n <= 0 {
		return 0, 0, false
	}
	return n, now - int64(ti.Last_data_recv)*int64(time.Millisecond) - receivedSlack, true
}

// ResetNotFin reports whether rc's socket, whose read just returned the
// end of the stream, was ended by a reset, not by the peer's FIN: it is
// closed (TCP_INFO's state) and tcpi_bytes_received, which counts a FIN
// as one byte, is no more than the read bytes taken from it. The kernel
// reports a reset's error once, to whichever call on the socket comes
// first; when a write of another goroutine took it, the read that follows
// returns 0 as it does after a FIN, and passing that on as a FIN would
// make a cut-short stream look whole. A count that missed bytes reads as
// a FIN, as before. A socket closed under the read (the write that took
// the reset has its link aborted already, which closes it) counts as
// reset: nothing is to be passed on from it.
//
// A kernel that does not fill tcpi_bytes_received (before Linux 4.1)
// leaves the question open: a FIN, as before.
//
// The same TCP_INFO says what the peer has acknowledged: acked is what
// BytesAcked would have read then (ackedOK as its ok), so that a caller
// that wants both asks the kernel once (half_close_timeout's snapshot at
// a link's first FIN).
func ResetNotFin(rc syscall.RawConn, read int64) (reset bool, acked int64, ackedOK bool) {
	c := tcpInfoCalls.Get().(*tcpInfoCall)
	defer tcpInfoCalls.Put(c)
	c.ti, c.n, c.err = unix.TCPInfo{}, 0, nil
	if cerr := rc.Control(c.fn); cerr != nil {
		return true, 0, false
	}
	if c.err != nil {
		return false, 0, false
	}
	ti := &c.ti
	filled := c.n >= uint32(unsafe.Offsetof(ti.Bytes_received)+unsafe.Sizeof(ti.Bytes_received))
	reset = filled && ti.State == unix.BPF_TCP_CLOSE && int64(ti.Bytes_received) <= read
	return reset, ackedOf(ti), true
}

// tcpInfoCall is ResetNotFin's RawConn.Control callback and what it
// fills, pooled. A closure over ResetNotFin's locals was four heap
// allocations per call (the closure, and the TCP_INFO, its length and
// the error it captures: rc is an interface, so all of them escape), two
// calls per link.
type tcpInfoCall struct {
	ti  unix.TCPInfo
	n   uint32
	err error
	fn  func(fd uintptr) // call, bound once
}

func (c *tcpInfoCall) call(fd uintptr) {
	c.n, c.err = getsockoptLen(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO, unsafe.Pointer(&c.ti), uint32(unsafe.Sizeof(c.ti)))
}

var tcpInfoCalls = sync.Pool{New: func() any {
	c := new(tcpInfoCall)
	c.fn = c.call
	return c
}}

// receivedSlack is how much earlier than the kernel's figure Received
// puts an arrival: a jiffy at HZ=100, and the millisecond the conversion
// may round away.
const receivedSlack = int64(11 * time.Millisecond)

// tcpInfo reads the socket's TCP_INFO into c.ti, a pooled call the
// caller hands back with c.put once read; ok is false when the kernel
// does not say (the socket is closed). A closure over its results was
// four heap allocations per call (the closure, the TCP_INFO, and the two
// results it set), and half_close_timeout asks it of both sockets of
// every link at its first FIN. The TCP_INFO stays in the pool's struct,
// not in the caller's frame: the request pump asks it at the client's
// FIN, and 232 bytes more there grew its first 2 KiB stack at every link.
func tcpInfo(raw syscall.RawConn) (c *tcpInfoCall, ok bool) {
	c = tcpInfoCalls.Get().(*tcpInfoCall)
	c.ti, c.n, c.err = unix.TCPInfo{}, 0, errNotCalled
	_ = raw.Control(c.fn)
	return c, c.err == nil
}

func (c *tcpInfoCall) put() { tcpInfoCalls.Put(c) }

// errNotCalled stands for the result of a Control whose callback did not
// run (the socket is closed).
var errNotCalled = errors.New("not called")

// ShutdownReadAtEnd shuts rc's socket for reading (shutdown(2) with
// SHUT_RD), made as SysRead is, for what it wakes: the kernel wakes every
// waiter on the socket, which raises a new edge for the runtime's epoll
// (see ResetWatch). It does so only where no byte can come in any more
// (TCP_INFO's state: closed by a reset or an error, or the peer's FIN in:
// CLOSE_WAIT, LAST_ACK, CLOSING, TIME_WAIT), so that it never shuts a
// socket that lives, whatever else raised its EPOLLERR (an error-queue
// entry would, with options the proxy does not set today). It reports
// whether it shut the socket; the call's own errno is not looked at (on
// a socket a reset closed it is ENOTCONN, and it wakes the waiters all
// the same).
func ShutdownReadAtEnd(rc syscall.RawConn) bool {
	shut := false
	_ = rc.Control(func(fd uintptr) {
		var ti unix.TCPInfo
		if getsockopt(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO, unsafe.Pointer(&ti), uint32(unsafe.Sizeof(ti))) != nil {
			return
		}
		switch ti.State {
		case unix.BPF_TCP_CLOSE, unix.BPF_TCP_CLOSE_WAIT, unix.BPF_TCP_LAST_ACK, unix.BPF_TCP_CLOSING, unix.BPF_TCP_TIME_WAIT:
			raceReleaseIO()
			syscall.RawSyscall(syscall.SYS_SHUTDOWN, fd, syscall.SHUT_RD, 0)
			shut = true
		}
	})
	return shut
}

// ip6tSOOriginalDst is IP6T_SO_ORIGINAL_DST, which x/sys does not name.
const ip6tSOOriginalDst = 80

// OriginalDst reads the destination a connection had before an nftables
// REDIRECT sent it to the proxy (SO_ORIGINAL_DST; IP6T_SO_ORIGINAL_DST for
// IPv6). Reading it needs no privilege. peer is the client's address,
// which tells the family: a client of a dual-stack listener over IPv4
// (an IPv4-mapped address) was redirected by an IPv4 rule.
func OriginalDst(c syscall.Conn, peer net.Addr) (netip.AddrPort, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	v6 := false
	if pa, ok := peer.(*net.TCPAddr); ok && pa.IP.To4() == nil {
		v6 = true
	}
	// Raw getsockopts (see getsockopt): a transparent listener asks at
	// every accept, and the call through syscall.Syscall would wake the
	// runtime's sysmon thread as net's accept did.
	var dst netip.AddrPort
	var serr error
	if err := raw.Control(func(fd uintptr) {
		if v6 {
			var sa unix.RawSockaddrInet6
			if serr = getsockopt(int(fd), unix.SOL_IPV6, ip6tSOOriginalDst, unsafe.Pointer(&sa), unix.SizeofSockaddrInet6); serr == nil {
				dst = netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), netOrder(sa.Port))
			}
			return
		}
		var sa unix.RawSockaddrInet4
		if serr = getsockopt(int(fd), unix.SOL_IP, unix.SO_ORIGINAL_DST, unsafe.Pointer(&sa), unix.SizeofSockaddrInet4); serr == nil {
			dst = netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), netOrder(sa.Port))
		}
	}); err != nil {
		return netip.AddrPort{}, err
	}
	if serr != nil {
		return netip.AddrPort{}, fmt.Errorf("original destination: %w", serr)
	}
	if !dst.IsValid() {
		return netip.AddrPort{}, errors.New("original destination: none")
	}
	return dst, nil
}

// AtUrgentMark reports whether fd's next read starts at an urgent mark
// (SIOCATMARK), with bytes behind it.
func AtUrgentMark(fd int) bool {
	v, err := unix.IoctlGetInt(fd, unix.SIOCATMARK)
	return err == nil && v == 1
}

// UrgentByteIn reports whether fd's urgent byte has arrived (POLLPRI:
// TCP_URG_VALID), not only its pointer (TCP_URG_NOTYET, where SIOCATMARK
// says "at the mark" too). A poll with no timeout: a pending signal does
// not interrupt it.
func UrgentByteIn(fd int) bool {
	pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLPRI}}
	n, err := unix.Poll(pfd, 0)
	return err == nil && n == 1 && pfd[0].Revents&unix.POLLPRI != 0
}

// PeerReset reports whether the socket fd was ended by its peer's reset
// (or an error of its own: TCP_INFO's state closed), never by its FIN (a
// half-close leaves it in CLOSE_WAIT). It takes nothing from the socket:
// a reset's error stays for the call that reads or writes it.
func PeerReset(fd uintptr) bool {
	var ti unix.TCPInfo
	err := getsockopt(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO, unsafe.Pointer(&ti), uint32(unsafe.Sizeof(ti)))
	return err == nil && ti.State == unix.BPF_TCP_CLOSE
}

// UnreadBytes is how many bytes wait in c's receive queue (SIOCINQ): a
// mesh session's heartbeat counts them as life, so that its own process
// being slow to read is never blamed on the peer.
func UnreadBytes(c *net.TCPConn) int {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0
	}
	n := 0
	_ = raw.Control(func(fd uintptr) {
		if v, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ); err == nil {
			n = v
		}
	})
	return n
}

// UnreadFromALivePeer reports whether bytes the peer sent wait unread in
// raw's receive queue (UnreadInBand) while the peer's kernel still
// answers: fewer than two of the zero-window probes it is sent in a row
// unanswered (TCP_INFO tcpi_probes, which any ACK from the peer resets).
// A peer that stopped reading because the proxy does not read its bytes
// waits on the proxy, unless it is gone. False when the kernel does not
// say.
func UnreadFromALivePeer(raw syscall.RawConn, peeked *atomic.Bool) bool {
	if UnreadInBand(raw, peeked) <= 0 {
		return false
	}
	c, ok := tcpInfo(raw)
	defer c.put()
	return ok && c.ti.Probes < 2
}

// UnreadInBand is how many of the bytes the peer sent a read would still
// return, waiting in raw's receive queue; 0 when none or when the kernel
// does not say. SIOCINQ leaves out a FIN and an urgent byte, which a read
// skips (the proxy's sockets do not read it inline), and counts only up
// to an urgent mark not yet read past: at the mark it says 0, so a peek
// (which skips the urgent byte as a read would) looks for a byte behind
// it, and 1 stands for any. The count of bytes taken in (TCP_INFO
// tcpi_bytes_received) is no measure: it counts every urgent byte, which
// no read returns, so it stays ahead of what was read for good.
//
// A peek takes a reset's error as a read would (see ResetNotFin), and
// says nothing of it: peeked is set before the first, so that the
// socket's reader, finding the end of the stream, knows a peek may have
// taken the error (see the proxy's link.finOnly).
func UnreadInBand(raw syscall.RawConn, peeked *atomic.Bool) int {
	n := 0
	_ = raw.Control(func(fd uintptr) {
		v, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ)
		if err != nil {
			return
		}
		n = v
		if n == 0 && AtUrgentMark(int(fd)) {
			// A peek at the mark with a signal pending (the runtime's
			// preemption) finds nothing, as a read does (see
			// SockReader.ReadEach): asked again a few times.
			var b [1]byte
			peeked.Store(true)
			for range 4 {
				k, _, err := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
				if err == nil && k > 0 {
					n = 1
				}
				if err != unix.EAGAIN || !AtUrgentMark(int(fd)) {
					break
				}
			}
		}
	})
	return n
}

// SampleDelivery reads raw's TCP_INFO and send queue for a Delivery;
// false when the kernel does not say.
func SampleDelivery(raw syscall.RawConn) (Delivery, bool) {
	now := Mono()
	var ti unix.TCPInfo
	outq, ok := -1, false
	// The send queue first: an ACK between the two readings then makes
	// Acked+Queued more than was handed, never a queue that looks empty
	// with bytes still unacknowledged.
	_ = raw.Control(func(fd uintptr) {
		v, err := unix.IoctlGetInt(int(fd), unix.SIOCOUTQ)
		if err != nil || v < 0 {
			return
		}
		outq = v
		ok = getsockopt(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO, unsafe.Pointer(&ti), uint32(unsafe.Sizeof(ti))) == nil
	})
	if !ok {
		return Delivery{}, false
	}
	return Delivery{
		Acked:  ackedOf(&ti),
		Queued: int64(outq),
		AckAt:  now - int64(ti.Last_ack_recv)*int64(time.Millisecond) - receivedSlack,
		// Unacked counts segments sent and not acknowledged: none while
		// the kernel only probes a zero window. A zero window with
		// segments in flight (a peer out of receive memory drops them and
		// says so) is no lossy path: the kernel's retransmissions into it
		// are not counted in tcpi_retransmits, which would never end
		// Awaiting (tcpi_snd_wnd: Linux 5.4; before, 0, and never Awaiting).
		Awaiting: ti.Unacked > 0 && ti.Snd_wnd > 0 && ti.Retransmits < AwaitedRetransmits,
	}, true
}

// SendWindow is what an upstream socket's kernel is doing with the bytes
// it holds for the peer.
type SendWindow struct {
	// Zero: the peer advertises a zero window, bytes wait for it and none
	// is in flight: the kernel is probing the window (the peer reads
	// nothing), not retransmitting.
	Zero bool
	// Answered: no zero-window probe is outstanding (the peer's kernel
	// answered the last one).
	Answered bool
	// Idle: nothing unsent, nothing unacknowledged.
	Idle bool
}

// SampleSendWindow reads TCP_INFO for a SendWindow; false when the kernel
// does not say (the socket is closed).
func SampleSendWindow(raw syscall.RawConn) (SendWindow, bool) {
	c, ok := tcpInfo(raw)
	defer c.put()
	if !ok {
		return SendWindow{}, false
	}
	ti := &c.ti
	return SendWindow{
		Zero:     ti.Snd_wnd == 0 && ti.Notsent_bytes > 0 && ti.Unacked == 0,
		Answered: ti.Probes == 0,
		Idle:     ti.Notsent_bytes == 0 && ti.Unacked == 0,
	}, true
}

// ZeroWindowAckedSince reports whether a socket the kernel failed had a
// zero send window and an acknowledgement from the peer's kernel at or
// after mono time t (an answer to a zero-window probe): the peer was
// there, reading nothing. TCP_INFO stays readable on the failed socket
// until it is closed.
func ZeroWindowAckedSince(raw syscall.RawConn, t int64) bool {
	c, ok := tcpInfo(raw)
	defer c.put()
	ti := &c.ti
	return ok && ti.Snd_wnd == 0 && Mono()-int64(time.Duration(ti.Last_ack_recv)*time.Millisecond) >= t
}

// NeverSent reports whether a socket the kernel failed held bytes it had
// never sent while the peer's window was open: some waiting, none in
// flight (SIOCOUTQ, write_seq - snd_una, equals SIOCOUTQNSD, write_seq -
// snd_nxt), and a send window above zero (tcpi_snd_wnd: Linux 5.4;
// before, 0, and never so). The kernel then tried to send them (its
// window probes) and every attempt failed at the proxy's own host: its
// route, a drop rule of its own netfilter output, its egress queue. A
// peer that went silent after bytes were sent leaves them in flight, and
// a zero window a send window of 0. Both queues are sequence numbers and
// stay readable after the kernel's verdict, until the socket is closed.
func NeverSent(raw syscall.RawConn) bool {
	outq, notSent, ok := 0, 0, false
	_ = raw.Control(func(fd uintptr) {
		var err, nerr error
		outq, err = unix.IoctlGetInt(int(fd), unix.SIOCOUTQ)
		notSent, nerr = unix.IoctlGetInt(int(fd), unix.SIOCOUTQNSD)
		ok = err == nil && nerr == nil
	})
	if !ok || outq <= 0 || outq != notSent {
		return false
	}
	c, ok := tcpInfo(raw)
	defer c.put()
	return ok && c.ti.Snd_wnd > 0
}

// SetUserTimeout sets TCP_USER_TIMEOUT on an open socket (0: the kernel's
// default, no bound of its own).
func SetUserTimeout(raw syscall.RawConn, d time.Duration) error {
	var serr error
	if err := raw.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(d.Milliseconds()))
	}); err != nil {
		return err
	}
	return serr
}
