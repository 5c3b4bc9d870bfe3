//go:build !linux

package proxy

import (
	"syscall"

	"github.com/livenessproxy/livenessproxy/policy"
)

// upstreamControl is a stub outside Linux: TCP_USER_TIMEOUT and the
// keepalive knobs are Linux socket options, so a build for a laptop runs
// with the kernel's defaults (write_timeout and the watermarks still apply).
func upstreamControl(policy.Settings) func(network, address string, c syscall.RawConn) error {
	return nil
}

// sendQueueBytes is unknown outside Linux: only the proxy's own queue
// counts toward staleness there.
func sendQueueBytes(syscall.RawConn) int { return 0 }
