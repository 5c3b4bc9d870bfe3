//go:build unix && !(linux || freebsd || netbsd || openbsd || dragonfly)

package flow

// sendFlags are SysWrite's and SysWritev's: none where send(2) has no
// MSG_NOSIGNAL (darwin); the runtime ignores a SIGPIPE raised by a
// socket's write unless the process asks for it (signal.Notify).
const sendFlags = 0
