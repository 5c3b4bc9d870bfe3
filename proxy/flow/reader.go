package flow

import (
	"io"
	"math"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"
)

// SockReader reads a socket into pooled chunks, taking a chunk only once
// the socket is readable: a link waiting for its next request or response
// holds no buffer, only its goroutine's stack. Thousands of idle links
// (Pinot brokers and Kafka clients keep theirs open between queries) then
// cost a few KiB each instead of a 64 KiB buffer per direction.
//
// It waits on the Go runtime's poller through syscall.RawConn.Read, as
// net.Conn.Read does: the callback tries a read, and on EAGAIN returns
// the chunk to the pool and asks the runtime to wait for readiness.
type SockReader struct {
	rc syscall.RawConn
	fn func(fd uintptr) bool // call, bound once so a read allocates nothing

	// call's arguments and results: try's when sink is nil (n is its limit
	// going in), call's loop otherwise. sinkErr marks err as sink's.
	sink    ChunkSink
	bp      *[]byte
	err     error
	n       int32
	sinkErr bool

	// waits counts the reads that found nothing (up to 255).
	waits uint8

	// watch sees what a wait after a short read could miss (see
	// ReadEach), and wake is what it wakes the reader's wait with; key
	// (never 0) once it watches this socket, and reported once it has
	// seen the socket's end (the peer's FIN, an error, a hang-up) or
	// urgent data, or can no longer watch. Without a watch every read is
	// followed by another, as net.Conn.Read's are.
	watch    ResetWatch
	wake     Deadliner
	key      uint64
	reported atomic.Bool
}

// Deadliner is what a ResetWatch wakes a reader's wait with: a read
// deadline in the past (*os.File and *net.TCPConn have it).
type Deadliner interface {
	SetReadDeadline(t time.Time) error
}

// ResetWatch is what lets a SockReader wait after a short read (see
// ReadEach): a watch of the socket, one-shot, for what a short read does
// not say and raises no edge after it: the peer's FIN or an error that
// came in behind the bytes the read took (their edge was the one that
// woke the wait), and urgent data (a read stops short at its mark, with
// bytes left behind it). When one comes, the watch first sets the
// reader's reported flag and then gives the reader's wait a new edge:
// shutdown(2) of the read side where the socket can receive nothing more
// (ShutdownReadAtEnd; the bytes still queued are read before the end),
// otherwise a read deadline in the past through the reader's Deadliner,
// which the reader's owner takes as a wake-up and reads on. A reader that
// sees the flag reads on after every read; one that does not waits, and
// the edge comes after the wait's start (the flag is checked after the
// read, which comes after the runtime cleared the socket's readiness), so
// the wait sees it.
type ResetWatch interface {
	// Watch starts watching fd, rc's socket, and returns the key (not 0)
	// that Forget takes; false when it cannot (the reader then reads on
	// after every read). On the socket's end or urgent data it sets
	// reported, then raises the edge (wake is the reader's Deadliner); so
	// it does, without the edge, when it stops watching before the
	// socket's end.
	Watch(fd int, rc syscall.RawConn, wake Deadliner, reported *atomic.Bool) (key uint64, ok bool)
	// Forget ends the watch of key, at the socket's end.
	Forget(key uint64)
}

// ChunkSink is what ReadEach hands chunks to.
type ChunkSink interface {
	// Limit is how many bytes the next read may take (up to ChunkSize; 0:
	// none now, ReadEach returns).
	Limit() int
	// Handle does what the chunk's bytes are read for. An error (of the
	// link's other socket) goes back to ReadEach's caller.
	Handle(bp *[]byte, n int) (Handled, error)
}

// Handled is what a ReadEach handler did with a chunk.
type Handled int8

const (
	HandledMore Handled = iota // consumed it: read on
	HandledStop                // consumed it; ReadEach returns (nil, 0, nil)
	HandledKeep                // ReadEach returns the chunk to its caller, which returns it with PutChunk
)

// watchAfter is how many reads of a socket find nothing before it is
// given to the watch and its reads start to wait after a short read: a
// connection that makes one request and closes (two waits at most, one
// each way) never pays the watch's epoll_ctl; one that waits for a third
// time is a connection that lives, and saves a read per request from
// then on.
const watchAfter = 2

func (r *SockReader) Init(c *net.TCPConn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	r.InitRaw(rc)
	return nil
}

// InitRaw has r read rc's socket.
func (r *SockReader) InitRaw(rc syscall.RawConn) { r.rc, r.fn = rc, r.call }

// SetResetWatch gives r the watch that lets it wait after a short read
// (see ReadEach), and what the watch wakes its wait with; before any
// read.
func (r *SockReader) SetResetWatch(w ResetWatch, wake Deadliner) { r.watch, r.wake = w, wake }

// Forget ends the watch of r's socket, if it began one. The socket's owner
// calls it once the socket's readers have ended.
func (r *SockReader) Forget() {
	if r.key != 0 {
		r.watch.Forget(r.key)
		r.key = 0
	}
}

// waitsDrained reports whether a short read (one that drained the
// socket's receive queue) is followed by a wait instead of a read: on a
// socket that has waited for data watchAfter times (a connection that
// lives), once the watch watches it (see ReadEach).
func (r *SockReader) waitsDrained(fd uintptr) bool {
	if r.key == 0 {
		if r.watch == nil || r.waits < watchAfter {
			return false
		}
		key, ok := r.watch.Watch(int(fd), r.rc, r.wake, &r.reported)
		if !ok {
			r.watch = nil // not again: reads on after every read
			return false
		}
		r.key = key
	}
	return !r.reported.Load()
}

func (r *SockReader) try(fd uintptr) bool {
	bp := GetChunk()
	for {
		n, err := SysRead(int(fd), (*bp)[:r.n])
		switch err {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			PutChunk(bp)
			return false
		}
		r.bp, r.n, r.err = bp, int32(n), err
		return true
	}
}

// Read waits until the socket is readable and reads at most limit bytes
// (1 to ChunkSize) into a pooled chunk. It returns the chunk, which the
// caller returns with PutChunk, and the count; or io.EOF once the peer
// has sent FIN; or the socket's error (a closed socket's is net.ErrClosed).
func (r *SockReader) Read(limit int) (*[]byte, int, error) {
	r.n = int32(min(max(limit, 1), ChunkSize))
	if err := r.rc.Read(r.fn); err != nil {
		return nil, 0, err
	}
	return r.result()
}

// result takes the outcome a callback left and turns a failed or empty
// read into its error.
func (r *SockReader) result() (*[]byte, int, error) {
	bp, n, err := r.bp, int(r.n), r.err
	r.bp, r.n, r.err = nil, 0, nil
	switch {
	case bp == nil:
		return nil, 0, err
	case err != nil:
		PutChunk(bp)
		return nil, 0, os.NewSyscallError("read", err)
	case n == 0:
		PutChunk(bp)
		return nil, 0, io.EOF
	}
	return bp, n, nil
}

// ReadEach reads the socket and hands each chunk read to sink.handle,
// inside one wait on the poller, for as long as it consumes them
// (HandledMore). Before each read it asks sink.limit how many bytes it
// may read; 0 ends it. It returns (nil, 0, nil, nil) when the limit was 0
// or handle said HandledStop without an error; handle's error as sinkErr;
// the chunk when handle said HandledKeep; io.EOF once the peer has sent
// FIN; or the socket's error.
//
// handle runs while this goroutine holds the socket's read lock, so it
// must not close this socket nor wait for anything that does (abort and
// closeBoth do): it says HandledStop or HandledKeep and leaves that to
// the caller. It may block on the other socket of the link, which
// closeBoth closes first.
//
// Why a read is not followed by one that finds nothing (HAProxy's rule):
// a read that returned less than it asked for took everything the
// receive queue held (tcp_recvmsg copies until the queue is empty or the
// buffer full; segments that came in while it held the socket wait in
// its backlog, which release_sock then processes, raising an edge of
// their own), so the callback asks the poller to wait instead of reading
// again. Whatever arrives after the read (bytes, a FIN, an error) makes a
// new edge on the runtime's epoll, which it
// records for this descriptor until the next wait, and the wait comes
// within this same RawConn.Read call. (Each RawConn.Read starts by
// clearing the recorded readiness, which is why the handling happens
// inside the callback and not after it returns.) A read that filled its
// buffer is followed by another at once, as net.Conn.Read would be.
//
// What a short read does not say is what came in behind its bytes before
// it, and raised no edge of its own after it: the peer's FIN (the next
// read would return 0) or a reset, whose edge was the one that woke this
// wait (the runtime's epoll reports bytes and their end as one event);
// and urgent data, at whose mark a read stops short with bytes behind it.
// Waiting then would miss them. So a reader waits after a short read only
// once its ResetWatch watches the socket for them, which gives the wait
// the edge it needs; and only on a socket that has waited watchAfter
// times, a connection that lives (one that makes a request and closes
// pays the read that finds nothing, not the watch). The rule costs a
// plain recv per read: the TCP_INQ control message that said the same
// (what the read left behind) cost a recvmsg, about 5% of the proxy's CPU
// per request at 64 connections (docs/performance.md).
func (r *SockReader) ReadEach(sink ChunkSink) (bp *[]byte, n int, err, sinkErr error) {
	r.sink = sink
	err = r.rc.Read(r.fn)
	r.sink = nil
	fromSink := r.sinkErr
	r.sinkErr = false
	if err != nil {
		if r.bp != nil {
			PutChunk(r.bp)
			r.bp = nil
		}
		return nil, 0, err, nil
	}
	if fromSink {
		err, r.err = r.err, nil
		return nil, 0, nil, err
	}
	bp, n, err = r.result()
	return bp, n, err, nil
}

// call is the RawConn.Read callback: try for read, and for ReadEach the
// loop below (in this frame, not one more: it runs under the sink's
// handler, and a pump's stack should stay within its first 2 KiB; see
// the idle figures in docs/performance.md).
func (r *SockReader) call(fd uintptr) bool {
	if r.sink == nil {
		return r.try(fd)
	}
	marks := 0 // reads made again at an urgent mark (see below)
	for {
		limit := min(r.sink.Limit(), ChunkSize)
		if limit <= 0 {
			return true
		}
		bp := GetChunk()
		n, err := SysRead(int(fd), (*bp)[:limit])
		switch err {
		case syscall.EINTR:
			PutChunk(bp)
			continue
		case syscall.EAGAIN:
			PutChunk(bp)
			// A read that starts at an urgent mark while the thread has a
			// signal pending (the runtime's preemption signal, a profiler's)
			// returns EAGAIN with the bytes behind the mark still queued
			// (tcp_recvmsg_locked), and no edge will come for them. The
			// signal is taken on the way back from the call, so the read
			// made again takes them, unless another signal came meanwhile
			// (a flood of them in TestUrgentMarkWithASignalPendingIsReadPast
			// needed more than 4 tries now and then): 64 times; then, if the
			// urgent byte is there, the reader's wait gets a wake-up of its
			// own a millisecond later (a read deadline, as the watch's), and
			// reads again then.
			// Asked only of a socket whose watch reported (urgent data among
			// the causes): never on the data path of any other.
			if r.reported.Load() && AtUrgentMark(int(fd)) {
				if marks < 64 {
					marks++
					continue
				}
				if UrgentByteIn(int(fd)) { // else the pointer came without the byte (TCP_URG_NOTYET): its arrival is an edge
					_ = r.wake.SetReadDeadline(time.Now().Add(time.Millisecond))
				}
			}
			if r.waits < math.MaxUint8 {
				r.waits++
			}
			return false
		}
		if err != nil || n == 0 {
			r.bp, r.n, r.err = bp, int32(n), err
			return true
		}
		h, herr := r.sink.Handle(bp, n)
		switch h {
		case HandledStop:
			PutChunk(bp)
			r.err, r.sinkErr = herr, herr != nil
			return true
		case HandledKeep:
			r.bp, r.n = bp, int32(n)
			return true
		}
		PutChunk(bp)
		if n < limit && r.waitsDrained(fd) {
			return false // a short read, the watch on: wait (see ReadEach)
		}
	}
}
