package proxy

import (
	"context"
	"errors"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"
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

// closeReasonFor maps an error on an upstream socket to a close reason:
// upstream_timeout (ETIMEDOUT: TCP_USER_TIMEOUT or keepalive gave up),
// upstream_error (any other failure of the upstream), or local_error.
func closeReasonFor(err error) CloseReason {
	switch {
	case errors.Is(err, syscall.ETIMEDOUT):
		return CloseUpstreamTimeout
	case upstreamFault(err):
		return CloseUpstreamError
	}
	return CloseLocalError
}

// localErrorLogEvery bounds the log lines about the proxy's own failures:
// when descriptors run out, every link fails the same way.
const localErrorLogEvery = time.Second

// localError says, at most once a second per listener, that the proxy
// itself failed a link (the count of those not logged is in the next
// line); link_closes_total{reason="local_error"} counts every one.
func (l *listener) localError(ep *endpoint, err error) {
	l.localErrors.Add(1)
	now := flow.Mono()
	last := l.localErrorLogged.Load()
	if now-last < int64(localErrorLogEvery) || !l.localErrorLogged.CompareAndSwap(last, now) {
		return
	}
	l.log.Error().Err(err).Str("endpoint", ep.addr).Int64("local_errors_since_last_line", l.localErrors.Swap(0)).
		Msg("the proxy could not serve a link for want of its own resources (descriptors, memory, a socket option); the client was reset and the upstream is not blamed")
}
