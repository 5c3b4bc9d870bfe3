//go:build unix

package pinotsim

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// rcvbufControl sets SO_RCVBUF on a socket before bind/listen, so the
// window scale and every accepted connection follow it.
func rcvbufControl(n int) func(network, address string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, n)
		}); err != nil {
			return err
		}
		return serr
	}
}
