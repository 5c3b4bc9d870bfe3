package mesh

import (
	"crypto/tls"
	"net"
	"sync/atomic"

	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// liveConn is the connection a session's TLS runs on: it notes when bytes
// last came off the socket. TLS reads a record's bytes out of the socket
// as they arrive and hands nothing on until the record is whole (16 KiB
// once a connection has sent a few): on a path slow enough that a record
// takes longer than ping_timeout to arrive, the guard above TLS reads
// nothing and the socket's receive queue is empty, while the peer's bytes
// keep coming. The heartbeat counts them here, as it counts a plain
// session's when the guard reads them.
type liveConn struct {
	net.Conn
	last atomic.Int64 // mono
}

func (c *liveConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.last.Store(flow.Mono())
	}
	return n, err
}

// TLSClient runs TLS over c, as a session's client (the egress), its
// bytes' arrival noted for the session's heartbeat (see liveConn).
func TLSClient(c net.Conn, cfg *tls.Config) *tls.Conn { return tls.Client(&liveConn{Conn: c}, cfg) }

// TLSServer runs TLS over c, as a session's server (the ingress), its
// bytes' arrival noted for the session's heartbeat (see liveConn).
func TLSServer(c net.Conn, cfg *tls.Config) *tls.Conn { return tls.Server(&liveConn{Conn: c}, cfg) }

// arrivalClock is where the session over rw notes when its peer's bytes
// last arrived: under TLS made by TLSClient or TLSServer, the socket's
// (liveConn); otherwise a clock of its own, which the guard sets as it
// reads.
func arrivalClock(rw net.Conn) *atomic.Int64 {
	if t, ok := rw.(*tls.Conn); ok {
		if lc, ok := t.NetConn().(*liveConn); ok {
			return &lc.last
		}
	}
	return new(atomic.Int64)
}
