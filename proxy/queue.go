package proxy

import (
	"net"
	"sync"
)

// chunkSize is the unit of queue memory and the size of read buffers.
const chunkSize = 64 << 10

// notsentLowat is TCP_NOTSENT_LOWAT for an upstream socket with high
// water mark high: the kernel takes a write only while fewer bytes than
// this wait unsent in its send queue. Without it the kernel's send buffer
// (up to tcp_wmem's 4 MiB) would fill before the proxy's queue, so the
// high water mark would not bound what a stalled upstream holds, and a
// write_timeout could not see bytes stuck there. A quarter of the high
// mark, between 16 KiB and 1 MiB: enough to keep a fast link's pipe full.
func notsentLowat(high int64) int {
	if high <= 0 {
		return 128 << 10
	}
	return int(min(max(high/4, 16<<10), 1<<20))
}

// maxBatch bounds one write toward the upstream, so that write_timeout
// means "no progress for that long", not "this many bytes in that long".
const maxBatch = 256 << 10

var chunkPool = sync.Pool{New: func() any { b := make([]byte, chunkSize); return &b }}

func getChunk() *[]byte  { return chunkPool.Get().(*[]byte) }
func putChunk(b *[]byte) { chunkPool.Put(b) }

// queue holds the bytes read from the client and not yet accepted by the
// upstream kernel. The request pump appends; the writer drains. Bytes are
// copied into pooled chunks, so the memory held is the queued byte count
// rounded up to a chunk, never the size of the reads that produced it.
//
// queued counts bytes appended and not yet written, including those the
// writer is writing right now; queued == 0 therefore means nobody is
// writing, which is what lets the request pump write directly.
type queue struct {
	mu        sync.Mutex
	dataReady sync.Cond // the writer waits here for bytes, EOF or close
	drained   sync.Cond // the request pump waits here under backpressure

	chunks    []*[]byte // filled chunks; chunks[0][head:] is the oldest unsent byte
	lens      []int     // bytes filled in each chunk
	head      int
	inFlight  int   // bytes handed to the writer and not yet consumed
	queued    int64 // bytes appended and not yet written
	maxQueued int64 // the largest queued ever reached
	writer    bool  // writeUpstream has been started
	eof       bool  // the client sent FIN: flush, then CloseWrite
	closed    bool  // the link is ending: nothing more is written
}

func (q *queue) init() {
	q.dataReady.L = &q.mu
	q.drained.L = &q.mu
}

// bytes is how many bytes are queued now.
func (q *queue) bytes() int64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.queued
}

// appendLocked copies p to the tail of the queue.
func (q *queue) appendLocked(p []byte) {
	q.queued += int64(len(p))
	if q.queued > q.maxQueued {
		q.maxQueued = q.queued
	}
	for len(p) > 0 {
		last := len(q.chunks) - 1
		if last < 0 || q.lens[last] == chunkSize {
			q.chunks = append(q.chunks, getChunk())
			q.lens = append(q.lens, 0)
			last++
		}
		n := copy((*q.chunks[last])[q.lens[last]:], p)
		q.lens[last] += n
		p = p[n:]
	}
}

// batchLocked returns views of up to maxBatch unsent bytes that are not
// already in flight. The views stay valid until consumeLocked: the pump
// only writes past lens[last], never into bytes a view covers.
func (q *queue) batchLocked(bufs net.Buffers) net.Buffers {
	skip := q.inFlight
	total := 0
	for i, c := range q.chunks {
		start := 0
		if i == 0 {
			start = q.head
		}
		b := (*c)[start:q.lens[i]]
		if skip >= len(b) {
			skip -= len(b)
			continue
		}
		b = b[skip:]
		skip = 0
		if total+len(b) > maxBatch {
			b = b[:maxBatch-total]
		}
		bufs = append(bufs, b)
		total += len(b)
		if total >= maxBatch {
			break
		}
	}
	q.inFlight += total
	return bufs
}

// consumeLocked drops n written bytes from the head and returns emptied
// chunks to the pool.
func (q *queue) consumeLocked(n, handed int) {
	q.inFlight -= handed
	q.queued -= int64(n)
	for n > 0 {
		avail := q.lens[0] - q.head
		if n < avail {
			q.head += n
			return
		}
		n -= avail
		q.head = 0
		if len(q.chunks) == 1 {
			// Empty: the last chunk goes back to the pool too, so that a
			// link whose queue drained holds no chunk while it idles.
			putChunk(q.chunks[0])
			q.chunks[0] = nil
			q.chunks, q.lens = q.chunks[:0], q.lens[:0]
			return
		}
		putChunk(q.chunks[0])
		q.chunks[0] = nil
		q.chunks = q.chunks[1:]
		q.lens = q.lens[1:]
	}
}

// releaseLocked returns every chunk to the pool once the link has ended.
func (q *queue) releaseLocked() {
	for i, c := range q.chunks {
		putChunk(c)
		q.chunks[i] = nil
	}
	q.chunks, q.lens, q.head = nil, nil, 0
}
