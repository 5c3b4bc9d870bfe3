//go:build !linux

package admin

import "net"

// unixPeer names a Unix socket's peer; only Linux reports credentials.
func unixPeer(*net.UnixConn) string { return "unix" }
