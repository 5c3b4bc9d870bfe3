package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"
	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// upstreamFault reports whether err, from a dial or an upstream socket,
// is the upstream's failure (or its path's): the connection was refused,
// the host or network is unreachable, the connect timed out, the
// connection timed out or was reset or aborted by the peer. Everything
// else is the proxy's own failure and must never be held against the
// upstream: no descriptors (EMFILE, ENFILE), no buffers or memory
// (ENOBUFS, ENOMEM), a socket option the kernel refused (EINVAL, EPERM),
// no local port (EADDRNOTAVAIL), a name that did not resolve.
func upstreamFault(err error) bool {
	var dnsErr *net.DNSError
	if errors.As(err, &dnsErr) {
		return false
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		switch errno {
		case syscall.ECONNREFUSED, syscall.EHOSTUNREACH, syscall.ENETUNREACH, syscall.EHOSTDOWN,
			syscall.ETIMEDOUT, syscall.ECONNRESET, syscall.ECONNABORTED, syscall.EPIPE,
			syscall.ENOTCONN: // a shutdown(2) after the peer reset the connection
			return true
		}
		return false
	}
	// A connect that did not complete within connect_timeout.
	return deadlinePassed(err)
}

// ownFailure reports whether a probe's err is the proxy's own failure: a
// name that did not resolve, or a system call that failed for want of the
// proxy's resources or by its own settings (no descriptors, buffers,
// memory or local port; a socket option refused; a local rule's EPERM).
// An HTTP probe's answer, a timeout, a refusal or a reset are the
// endpoint's.
func ownFailure(err error) bool {
	var dnsErr *net.DNSError
	if errors.As(err, &dnsErr) || errors.Is(err, mesh.ErrOwnTLS) {
		return true
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		switch errno {
		// Not EACCES: an ICMPv6 "administratively prohibited" from the
		// upstream's side comes back as it.
		case syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, syscall.EINVAL,
			syscall.EPERM, syscall.EADDRNOTAVAIL, syscall.EADDRINUSE:
			return true
		}
	}
	return false
}

// deadlinePassed reports whether err is a deadline's of the proxy's own
// (connect_timeout, a socket deadline).
func deadlinePassed(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout() || errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded)
}

// dialTimedOut reports whether a failed connect ran out of
// connect_timeout (rather than being refused, unreachable, or given up by
// the kernel after all its SYN retransmissions).
func dialTimedOut(err error) bool {
	return !errors.Is(err, syscall.ETIMEDOUT) && deadlinePassed(err)
}

// errFrozenDial is a connect timeout the proxy noticed at least
// connect_timeout after its deadline: the dial took twice its timeout or
// more. A dial's wait ends within a millisecond or two of its deadline
// while the proxy runs; so late, the proxy itself could not run
// (CPU throttling, a host under contention) for about as long as the
// upstream was given, and a freeze before the SYN went out may have left
// the connect none of its time at all. The kernel's own verdict was
// taken (flow.DialRaw looks at the socket after its deadline: a connect
// that completed during the freeze is a connection), but a connect
// still unanswered then is not held against the endpoint: the link
// fails as on any timeout, and the endpoint's count of timeouts in a row
// neither counts it nor starts over (see endpoint.dialFailed).
type errFrozenDial struct {
	error
	late time.Duration // from the deadline to the error
}

func (e errFrozenDial) Error() string {
	return fmt.Sprintf("%v (noticed %v after connect_timeout: the proxy could not run meanwhile)", e.error, e.late.Round(time.Millisecond))
}

func (e errFrozenDial) Unwrap() error { return e.error }

// frozenDial is err, of a dial with timeout begun at mono time began, as
// an errFrozenDial when it is a connect timeout (dialTimedOut) that came
// at least timeout after the deadline.
func frozenDial(err error, began int64, timeout time.Duration) error {
	if timeout <= 0 || !dialTimedOut(err) || errors.As(err, new(errFrozenDial)) {
		return err
	}
	if late := time.Duration(flow.Mono()-began) - timeout; late >= timeout {
		return errFrozenDial{err, late}
	}
	return err
}

// closeReasonFor maps an error on a connected upstream socket to a close
// reason: upstream_timeout (the kernel gave up, kernelGaveUp),
// upstream_error (any other failure of the upstream), or local_error.
func closeReasonFor(err error) CloseReason {
	switch {
	case kernelGaveUp(err):
		return CloseUpstreamTimeout
	case upstreamFault(err):
		return CloseUpstreamError
	}
	return CloseLocalError
}

// kernelGaveUp reports whether err, from a connected upstream socket, is
// the kernel giving up on the connection: TCP_USER_TIMEOUT of
// unacknowledged data, unanswered window probes, or keepalive. The
// kernel reports it as the ICMP error it saw on the connection since
// the peer's last acknowledgement, if any, and as ETIMEDOUT only
// without one (tcp_write_err: sk_err_soft, else ETIMEDOUT): an upstream
// host gone from its network, whose address no longer answers ARP, ends
// its links with EHOSTUNREACH at tcp_user_timeout. On a connected socket
// (no IP_RECVERR) an ICMP error is never reported otherwise, so these
// say the same as ETIMEDOUT.
func kernelGaveUp(err error) bool {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return false
	}
	switch errno {
	case syscall.ETIMEDOUT, syscall.EHOSTUNREACH, syscall.ENETUNREACH, syscall.EHOSTDOWN:
		return true
	}
	return false
}

// ownNetwork reports whether err, the kernel giving up on a socket to dst
// with mark (a connected upstream's verdict, kernelGaveUp, or a failed
// connect), is the proxy's own network's: its host has no route to dst
// now (flow.RouteTo, the lookup the socket's segments make: TCP, to
// dst's port, with mark, so that a policy rule by protocol, port or mark
// routes it as it routes them). A route
// removed, an interface down or an unreachable route of the proxy's own
// fails a connect at once (ENETUNREACH, EHOSTUNREACH), and every
// retransmission at the same lookup: the kernel then reports ETIMEDOUT
// (nothing was ever sent, or no lookup error was kept) or that lookup's
// error (EHOSTUNREACH, ENETUNREACH), the errors a dead upstream leaves
// too. When it cannot tell (no descriptor for the lookup, no answer, a
// zoned address), the kernel's word stands: the verdict is the
// upstream's, as it was before the proxy looked. A dead upstream would
// otherwise go unjudged while the proxy is short of descriptors, as it is
// when links pile up to one, and a zoned one for good.
func ownNetwork(err error, dst netip.AddrPort, mark int) bool {
	var errno syscall.Errno
	errors.As(err, &errno)
	switch errno {
	case syscall.EHOSTUNREACH, syscall.ENETUNREACH, syscall.EHOSTDOWN, syscall.ETIMEDOUT:
	case 0:
		if !deadlinePassed(err) {
			return false
		}
	default:
		return false
	}
	route, known := flow.RouteTo(dst, mark)
	return known && !route
}

// errOwnNetwork is an upstream socket's failure found the proxy's own:
// no route of its host to the upstream (ownNetwork), or, neverSent, the
// kernel's verdict on bytes that never left the proxy's host while the
// upstream's window was open (flow.NeverSent). It does not unwrap, so
// that nothing takes it for the upstream's: the link ends local_error,
// the upstream not blamed (neither excluded nor its connect failures
// counted). Before, such a link or connect excluded its endpoint.
type errOwnNetwork struct {
	cause     error
	neverSent bool
}

func (x errOwnNetwork) Error() string {
	if x.neverSent {
		return x.cause.Error() + " (the bytes never left the proxy's host, the upstream's window open: its own network, a drop rule of its own or its egress queue)"
	}
	return x.cause.Error() + " (the proxy's host has no route to the upstream: its own network)"
}

// logEvery bounds the log lines of a kind that a flood can repeat: when
// descriptors run out every link fails the same way, and any client can
// send a frame the proxy cannot follow, or any peer a refused mesh
// handshake, as often as it likes.
const logEvery = time.Second

// logGate lets one log line of its kind through per logEvery and counts
// the ones it held back; the metrics count every event.
type logGate struct {
	events atomic.Int64 // since the last line let through
	logged atomic.Int64 // mono time of the last line let through
}

// pass counts an event and reports whether its line may be written now,
// with the events since the last line written, this one included.
func (g *logGate) pass() (events int64, ok bool) {
	g.events.Add(1)
	now := flow.Mono()
	last := g.logged.Load()
	if last != 0 && now-last < int64(logEvery) || !g.logged.CompareAndSwap(last, now) {
		return 0, false
	}
	return g.events.Swap(0), true
}

// localError says, at most once a second per listener, that the proxy
// itself failed a link (the count of those not logged is in the next
// line); link_closes_total{reason="local_error"} counts every one.
func (l *listener) localError(ep *endpoint, err error) {
	if n, ok := l.localErrors.pass(); ok {
		l.log.Error().Err(err).Str("endpoint", ep.addr).Int64("local_errors_since_last_line", n).
			Msg("the proxy could not serve a link for want of its own resources (descriptors, memory, a socket option); the client was reset and the upstream is not blamed")
	}
}

// badFrame logs a link closed on a frame the proxy cannot follow: at warn
// at most once a second per listener (with the count since the line
// before), every one at debug; link_closes_total{reason="bad_frame"}
// counts every one. Any client can send such frames as fast as it likes.
func (l *listener) badFrame(lk *link, direction string, err error) {
	ev := lk.log.Debug()
	n, ok := l.badFrames.pass()
	if ok {
		ev = lk.log.Warn().Int64("bad_frames_since_last_line", n)
	}
	ev.Err(err).Str("direction", direction).Str("endpoint", lk.ep.addr).
		Str("client", lk.client.RemoteAddr().String()).Msg("bad frame: link closed")
}
