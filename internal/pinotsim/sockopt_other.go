//go:build !unix

package pinotsim

import "syscall"

// rcvbufControl is a no-op where SO_RCVBUF is not set through x/sys/unix.
func rcvbufControl(int) func(network, address string, c syscall.RawConn) error { return nil }
