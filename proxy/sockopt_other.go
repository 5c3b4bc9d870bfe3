//go:build !linux

package proxy

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/policy"
)

// upstreamControl is a stub outside Linux: TCP_USER_TIMEOUT and the
// keepalive knobs are Linux socket options, so a build for a laptop runs
// with the kernel's defaults (write_timeout and the watermarks still apply).
func upstreamControl(policy.Settings) func(network, address string, c syscall.RawConn) error {
	return nil
}

// bytesAcked is unknown outside Linux: the kernel-side staleness check is
// skipped there (the writer still never sends an overdue request).
func bytesAcked(syscall.RawConn) (int64, bool) { return 0, false }

// originalDst needs Linux's SO_ORIGINAL_DST: transparent listeners work
// only there.
func originalDst(*net.TCPConn) (netip.AddrPort, error) {
	return netip.AddrPort{}, errors.New("transparent mode needs Linux (SO_ORIGINAL_DST)")
}

// unreadBytes is unknown outside Linux.
func unreadBytes(*net.TCPConn) int { return 0 }

// sendWindow is unknown outside Linux (and TCP_USER_TIMEOUT is not set
// there): the window guard never starts.
type sendWindow struct{ zero, answered, idle bool }

func sampleSendWindow(syscall.RawConn) (sendWindow, bool) { return sendWindow{}, false }

func setUserTimeout(syscall.RawConn, time.Duration) error { return nil }
