package proxy

import (
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/mesh"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/hashicorp/yamux"
)

// clientSide is a link's client: a TCP connection its listener accepted,
// or a stream that a mesh ingress accepted from a peer sidecar.
type clientSide interface {
	// read waits for bytes and reads at most limit (1 to flow.ChunkSize) into a
	// pooled chunk, as flow.SockReader.Read does.
	read(limit int) (*[]byte, int, error)
	// ReadEach reads as flow.SockReader.readEach does; a transport without
	// readiness returns each chunk it reads to the caller unhandled.
	readEach(sink flow.ChunkSink) (bp *[]byte, n int, err, sinkErr error)
	Write(p []byte) (int, error)
	// CloseWrite passes the end of the responses on (a FIN).
	CloseWrite() error
	// abortive makes the next Close a reset where the transport has one.
	abortive()
	// upstreamConnected tells the client that the link reached its
	// upstream, where its transport has a way to (a mesh stream's ack).
	upstreamConnected() error
	Close() error
	RemoteAddr() net.Addr
}

// tcpClient is a client connection accepted by a listener: an *os.File
// from flow.Listener (Linux), or a *net.TCPConn where net accepted it.
type tcpClient struct {
	sock   clientSocket
	remote net.Addr
	once   sync.Once
	err    error
	rc     syscall.RawConn
	r      flow.SockReader
	// w writes to the client for the link's one writer to it (the
	// response pump); see Write.
	w flow.Writer
}

// clientSocket is what a tcpClient needs of its socket; *os.File and
// *net.TCPConn have it.
type clientSocket interface {
	syscall.Conn
	SetReadDeadline(t time.Time) error
	Close() error
}

func newTCPClient(c *net.TCPConn) *tcpClient { return &tcpClient{sock: c, remote: c.RemoteAddr()} }

// newRawClient is the client of a socket flow.Listener accepted from
// remote.
func newRawClient(f *os.File, remote net.Addr) *tcpClient { return &tcpClient{sock: f, remote: remote} }

func (c *tcpClient) RemoteAddr() net.Addr { return c.remote }

// localAddr is the socket's local address, asked of the kernel: only a
// write's error names it.
func (c *tcpClient) localAddr() net.Addr {
	if tc, ok := c.sock.(*net.TCPConn); ok {
		return tc.LocalAddr()
	}
	if c.raw() != nil {
		return nil
	}
	return flow.LocalAddr(c.rc)
}

func (c *tcpClient) SetReadDeadline(t time.Time) error { return c.sock.SetReadDeadline(t) }

func (c *tcpClient) Close() error { return c.sock.Close() }

// raw makes the client's raw connection, its reader and its writer, once.
func (c *tcpClient) raw() error {
	c.once.Do(func() {
		c.rc, c.err = c.sock.SyscallConn()
		if c.err == nil {
			c.r.InitRaw(c.rc)
			c.w.InitWrite(c.rc) // the response pump's Write alone writes to the client
		}
	})
	return c.err
}

// Write writes all of p, as net.Conn.Write does (waiting on the runtime's
// poller while the client's receive window is full), with the system
// call made as flow.SysWrite makes it: a response on its way to the
// client does not wake the runtime's sysmon thread. The link has one
// writer to its client at a time (the response pump).
func (c *tcpClient) Write(p []byte) (int, error) {
	if err := c.raw(); err != nil {
		return 0, err
	}
	n, err := c.w.Write(p)
	if err != nil {
		if oe, ok := err.(*net.OpError); ok {
			err = oe.Err // the raw-write's own: a closed socket, a deadline
		}
		return n, &net.OpError{Op: "write", Net: "tcp", Source: c.localAddr(), Addr: c.remote, Err: err}
	}
	return n, nil
}

// clientReset reports whether the client's socket, whose read just
// returned the end of the stream, was reset rather than half-closed (see
// flow.ResetNotFin); false for a mesh stream. Nothing peeks at a client's
// socket: its reader and its one writer (the response pump) are the only
// calls on it that can take a reset's error (see link.finOnly). fa is
// what the same TCP_INFO said of what the client acknowledged, for
// half_close_timeout's snapshot if the FIN is passed on at once.
func (lk *link) clientReset() (reset bool, fa finAck) {
	c, ok := lk.client.(*tcpClient)
	if !ok || c.rc == nil || lk.finOnly(nil) {
		return false, finAck{}
	}
	reset, fa.n, fa.ok = flow.ResetNotFin(c.rc, lk.bytesUp.Load())
	fa.client = true
	return reset, fa
}

// CloseWrite passes the FIN on, as net.TCPConn.CloseWrite does
// (flow.ShutdownWrite).
func (c *tcpClient) CloseWrite() error {
	if err := c.raw(); err != nil {
		return err
	}
	return flow.ShutdownWrite(c.rc)
}

func (c *tcpClient) read(limit int) (*[]byte, int, error) {
	if err := c.raw(); err != nil {
		return nil, 0, err
	}
	return c.r.Read(limit)
}

func (c *tcpClient) readEach(sink flow.ChunkSink) (*[]byte, int, error, error) {
	if err := c.raw(); err != nil {
		return nil, 0, err, nil
	}
	return c.r.ReadEach(sink)
}

func (c *tcpClient) abortive() {
	if c.raw() == nil {
		_ = flow.SetLinger0(c.rc)
	}
}

func (c *tcpClient) upstreamConnected() error { return nil }

// streamConn is what streamClient needs of a mesh stream (a
// *yamux.Stream): Close is the half-close, as yamux streams have no
// CloseWrite.
type streamConn interface {
	Read(p []byte) (int, error)
	Write(p []byte) (int, error)
	Close() error
	SetDeadline(t time.Time) error
	Shrink()
}

// streamReader reads a mesh stream into pooled chunks. yamux gives no
// readiness to wait on, so a read holds its chunk while it waits: a small
// one while the stream is likely idle (the last read did not fill its
// chunk), a full one while data streams in. yamux's receive buffer is
// dropped when empty by shrinkStreams, from the session's ticker (egress)
// or the ingress's shrinker: an idle mesh link then holds a small chunk, not two 64 KiB
// buffers, and a busy one does not reallocate its buffer per read.
type streamReader struct{ streaming bool }

func (r *streamReader) read(s streamConn, limit int) (*[]byte, int, error) {
	var bp *[]byte
	if r.streaming {
		bp = flow.GetChunk()
	} else {
		bp = flow.SmallChunkPool.Get().(*[]byte)
	}
	buf := (*bp)[:min(max(limit, 1), len(*bp))]
	n, err := s.Read(buf)
	r.streaming = n == len(buf)
	if n == 0 {
		flow.PutChunk(bp)
		return nil, 0, err
	}
	return bp, n, nil
}

// streamClient is a stream a mesh ingress accepted: the client of a link
// to a local server. A stream has no readiness to wait on, so a read
// holds a chunk while it waits; the peer's egress link holds the other
// end.
type streamClient struct {
	s      *yamux.Stream
	ms     *mesh.Session
	remote net.Addr
	r      streamReader
	rst    atomic.Bool // the link aborts: Close resets the stream
	once   sync.Once
	done   func() // once, at Close: the ingress's stream count
}

// errSessionClosed ends a stream whose session closed: yamux reads it as
// the end of the stream, which the link must not pass on as the client's
// FIN (the server would take a cut-short request for a whole one).
var errSessionClosed = errors.New("mesh: the session to the peer sidecar closed")

func (c *streamClient) read(limit int) (*[]byte, int, error) {
	bp, n, err := c.r.read(c.s, limit)
	if n == 0 && errors.Is(err, io.EOF) && c.ms.Closed() {
		err = errSessionClosed
	}
	return bp, n, err
}

func (c *streamClient) readEach(sink flow.ChunkSink) (*[]byte, int, error, error) {
	limit := sink.Limit()
	if limit <= 0 {
		return nil, 0, nil, nil
	}
	bp, n, err := c.read(limit)
	return bp, n, err, nil
}

func (c *streamClient) Write(p []byte) (int, error) { return c.s.Write(p) }

// CloseWrite half-closes the stream: yamux's Close sends FIN and keeps
// reading.
func (c *streamClient) CloseWrite() error { return c.s.Close() }

// abortive has Close reset the stream: the egress link's client then
// sees a reset, as it would from the server itself.
func (c *streamClient) abortive() { c.rst.Store(true) }

// upstreamConnected sends the ack the egress waits for in its dial.
func (c *streamClient) upstreamConnected() error {
	_, err := c.s.Write([]byte{mesh.Ack})
	return err
}

// Close closes the stream, with a reset after abortive, and wakes the
// link's reads and writes on it (yamux's Close alone is a half-close: a
// read would wait on). A stream closed without reset is freed once the
// egress closes its side (or after half_close_timeout).
func (c *streamClient) Close() error {
	if c.rst.Swap(false) { // once: a link may close its client twice
		c.ms.ResetStream(c.s)
	}
	err := c.s.Close()
	_ = c.s.SetDeadline(pastDeadline)
	if c.done != nil {
		c.once.Do(c.done)
	}
	return err
}

// pastDeadline, set on a mesh stream, wakes every read and write on it.
var pastDeadline = time.Unix(1, 0)

func (c *streamClient) RemoteAddr() net.Addr { return c.remote }
