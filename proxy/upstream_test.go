package proxy

import (
	"net"
	"syscall"
)

// upRaw is the raw socket of the link's TCP upstream end (nil before the
// dial, or for a mesh end). It takes no lock: a caller racing the dial
// holds connMu.
func (lk *link) upRaw() syscall.RawConn {
	if e, ok := lk.up.(*tcpEnd); ok {
		return e.raw
	}
	return nil
}

// upstreamConn is the link's TCP upstream connection (nil as for upRaw).
func (lk *link) upstreamConn() *net.TCPConn {
	if e, ok := lk.up.(*tcpEnd); ok {
		return e.conn
	}
	return nil
}
