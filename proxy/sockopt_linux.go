//go:build linux

package proxy

import (
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/policy"
)

// setUpstreamOptions applies the liveness socket options to an upstream
// socket before it connects (TCP_NODELAY is Go's default for every TCP
// connection). A disabled (non-positive) setting leaves the
// kernel's default untouched. Keepalive times have one-second granularity
// in the kernel; shorter values round up to one second.
func setUpstreamOptions(fd int, s policy.Settings) error {
	if ut := s.TCPUserTimeout.D(); ut > 0 {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(ut.Milliseconds())); err != nil {
			return err
		}
	}
	if ka := s.Keepalive; ka.Idle > 0 {
		for _, o := range []struct{ level, opt, val int }{
			{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
			{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, ceilSeconds(ka.Idle)},
			{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, ceilSeconds(ka.Interval)},
			{unix.IPPROTO_TCP, unix.TCP_KEEPCNT, ka.Count},
		} {
			if err := unix.SetsockoptInt(fd, o.level, o.opt, o.val); err != nil {
				return err
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

func upstreamControl(s policy.Settings) func(network, address string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) { serr = setUpstreamOptions(int(fd), s) }); err != nil {
			return err
		}
		return serr
	}
}

// bytesAcked is TCP_INFO's tcpi_bytes_acked: the stream offset the peer
// has acknowledged.
func bytesAcked(raw syscall.RawConn) (int64, bool) {
	var n int64
	ok := false
	_ = raw.Control(func(fd uintptr) {
		if ti, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			n, ok = int64(ti.Bytes_acked), true
		}
	})
	return n, ok
}
