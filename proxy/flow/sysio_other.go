//go:build unix && !linux

package flow

// sendFlags are SysWrite's and SysWritev's: none outside Linux (the
// runtime ignores a SIGPIPE for a socket's write).
const sendFlags = 0
