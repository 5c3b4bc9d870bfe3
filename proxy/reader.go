package proxy

import (
	"io"
	"net"
	"os"
	"syscall"
)

// sockReader reads a socket into pooled chunks, taking a chunk only once
// the socket is readable: a link waiting for its next request or response
// holds no buffer, only its goroutine's stack. Thousands of idle links
// (Pinot brokers and Kafka clients keep theirs open between queries) then
// cost a few KiB each instead of a 64 KiB buffer per direction.
//
// It waits on the Go runtime's poller through syscall.RawConn.Read, as
// net.Conn.Read does: the callback tries a read, and on EAGAIN returns
// the chunk to the pool and asks the runtime to wait for readiness.
type sockReader struct {
	rc syscall.RawConn
	fn func(fd uintptr) bool // try, bound once so a read allocates nothing

	// try's argument and results.
	limit int
	bp    *[]byte
	n     int
	err   error
}

func (r *sockReader) init(c *net.TCPConn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	r.rc, r.fn = rc, r.try
	return nil
}

func (r *sockReader) try(fd uintptr) bool {
	bp := getChunk()
	for {
		n, err := syscall.Read(int(fd), (*bp)[:r.limit])
		switch err {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			putChunk(bp)
			return false
		}
		r.bp, r.n, r.err = bp, n, err
		return true
	}
}

// read waits until the socket is readable and reads at most limit bytes
// (1 to chunkSize) into a pooled chunk. It returns the chunk, which the
// caller returns with putChunk, and the count; or io.EOF once the peer
// has sent FIN; or the socket's error (a closed socket's is net.ErrClosed).
func (r *sockReader) read(limit int) (*[]byte, int, error) {
	r.limit = min(max(limit, 1), chunkSize)
	if err := r.rc.Read(r.fn); err != nil {
		return nil, 0, err
	}
	bp, n, err := r.bp, r.n, r.err
	r.bp, r.err = nil, nil
	switch {
	case err != nil:
		putChunk(bp)
		return nil, 0, os.NewSyscallError("read", err)
	case n == 0:
		putChunk(bp)
		return nil, 0, io.EOF
	}
	return bp, n, nil
}
