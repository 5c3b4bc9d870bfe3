//go:build linux || freebsd || netbsd || openbsd || dragonfly

package flow

import "syscall"

// sendFlags are SysWrite's and SysWritev's: no SIGPIPE on a connection the
// peer reset (ECONNRESET or EPIPE says it).
const sendFlags = syscall.MSG_NOSIGNAL
