//go:build !linux

package flow

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/policy"
)

// UpstreamControl is a stub outside Linux: TCP_USER_TIMEOUT and the
// keepalive knobs are Linux socket options, so a build for a laptop runs
// with the kernel's defaults (write_timeout and the watermarks still apply).
func UpstreamControl(policy.Settings) func(network, address string, c syscall.RawConn) error {
	return nil
}

// BytesAcked is unknown outside Linux: the kernel-side staleness check is
// skipped there (the writer still Never sends an overdue request).
func BytesAcked(syscall.RawConn) (int64, bool) { return 0, false }

// Received is unknown outside Linux.
func Received(syscall.RawConn) (n, at int64, ok bool) { return 0, 0, false }

// ResetNotFin is false, and says nothing of what was acknowledged: the
// kernel's TCP state is not read here.
func ResetNotFin(syscall.RawConn, int64) (reset bool, acked int64, ackedOK bool) {
	return false, 0, false
}

// OriginalDst needs Linux's SO_ORIGINAL_DST: transparent listeners work
// only there.
func OriginalDst(syscall.Conn, net.Addr) (netip.AddrPort, error) {
	return netip.AddrPort{}, errors.New("transparent mode needs Linux (SO_ORIGINAL_DST)")
}

// UnreadBytes is unknown outside Linux.
func UnreadBytes(*net.TCPConn) int { return 0 }

// PeerReset reports false: only Linux's TCP_INFO says.
func PeerReset(uintptr) bool { return false }

// UnreadFromALivePeer is unknown outside Linux.
func UnreadFromALivePeer(syscall.RawConn, *atomic.Bool) bool { return false }

// SampleDelivery is unknown outside Linux.
func SampleDelivery(syscall.RawConn) (Delivery, bool) { return Delivery{}, false }

// UnreadInBand is unknown outside Linux.
func UnreadInBand(syscall.RawConn, *atomic.Bool) int { return 0 }

// SendWindow is unknown outside Linux (and TCP_USER_TIMEOUT is not set
// there): the Window guard Never starts.
type SendWindow struct{ Zero, Answered, Idle bool }

func SampleSendWindow(syscall.RawConn) (SendWindow, bool) { return SendWindow{}, false }

func SetUserTimeout(syscall.RawConn, time.Duration) error { return nil }

func ZeroWindowAckedSince(syscall.RawConn, int64) bool { return false }

// NeverSent is unknown here: false.
func NeverSent(syscall.RawConn) bool { return false }

// RouteTo is unknown here.
func RouteTo(netip.AddrPort, int) (route, known bool) { return false, false }

// KeepRouteLookup has nothing to keep here.
func KeepRouteLookup() {}

// SetLiveness is Linux's (DialRaw, which leaves it to the caller, too).
func SetLiveness(syscall.RawConn, *policy.Settings) error { return nil }

// SetLivenessBound is Linux's, as SetLiveness.
func SetLivenessBound(syscall.RawConn, *policy.Settings, time.Duration) error { return nil }

// SetNotsentLowat is Linux's (DialRaw, which leaves it to the caller, too).
func SetNotsentLowat(syscall.RawConn, int64) error { return nil }

// RawDialSupported: DialRaw is Linux's; elsewhere the proxy dials through
// net.
const RawDialSupported = false

// DialRaw is not made outside Linux (RawDialSupported is false).
func DialRaw(context.Context, netip.AddrPort, *policy.Settings, time.Duration) (*os.File, error) {
	return nil, errors.New("raw dial needs Linux")
}

// DialRawGuarded is not made outside Linux either.
func DialRawGuarded(context.Context, netip.AddrPort, *policy.Settings, time.Duration, ConnectGuard) (*os.File, error) {
	return nil, errors.New("raw dial needs Linux")
}

// SockName is not asked for outside Linux.
func SockName(int) (netip.AddrPort, error) {
	return netip.AddrPort{}, errors.New("SockName needs Linux")
}

// RawAcceptSupported: the raw Listener is Linux's; elsewhere listeners
// accept through net.
const RawAcceptSupported = false

// Listener is not made outside Linux (RawAcceptSupported is false).
type Listener struct{}

func NewListener(ln *net.TCPListener) (*Listener, error) {
	_ = ln.Close()
	return nil, errors.New("raw accept needs Linux")
}

func (*Listener) Addr() net.Addr { return nil }

func (*Listener) Close() error { return net.ErrClosed }

func (*Listener) Accept() (*os.File, *net.TCPAddr, error) { return nil, nil, net.ErrClosed }

// ListenControl is Linux's (nil: no Control).
var ListenControl func(network, address string, c syscall.RawConn) error

// AtUrgentMark is Linux's (the reset watch is).
func AtUrgentMark(int) bool { return false }

// ShutdownReadAtEnd is Linux's (the reset watch is: its epoll set is).
func ShutdownReadAtEnd(syscall.RawConn) bool { return false }

// UrgentByteIn is Linux's (AtUrgentMark is never true elsewhere).
func UrgentByteIn(int) bool { return false }
