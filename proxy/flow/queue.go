package flow

import (
	"net"
	"sync"
	"sync/atomic"
)

// ChunkSize is the unit of queue memory and the size of read buffers.
const ChunkSize = 64 << 10

// NotsentLowat is TCP_NOTSENT_LOWAT for an upstream socket with high
// water mark high: the kernel takes a write only while fewer bytes than
// this wait unsent in its send queue (a write taken just below it may add
// up to one segment buffer, 64 KiB, beyond). Without it the kernel's send buffer
// (up to tcp_wmem's 4 MiB) would fill before the proxy's queue, so the
// high water mark would not bound what a stalled upstream holds, and a
// write_timeout could not see bytes stuck there. A quarter of the high
// mark, between 16 KiB and 1 MiB: enough to keep a fast link's pipe full.
func NotsentLowat(high int64) int {
	if high <= 0 {
		return 128 << 10
	}
	return int(min(max(high/4, 16<<10), 1<<20))
}

// maxBatch bounds one write toward the upstream, so that write_timeout
// means "no progress for that long", not "this many bytes in that long".
const maxBatch = 256 << 10

// smallChunkSize is the read buffer of a mesh stream that is likely idle
// (see streamReader): a blocked read holds it.
const smallChunkSize = 4 << 10

var (
	chunkPool      = sync.Pool{New: func() any { b := make([]byte, ChunkSize); return &b }}
	SmallChunkPool = sync.Pool{New: func() any { b := make([]byte, smallChunkSize); return &b }}
)

func GetChunk() *[]byte { return chunkPool.Get().(*[]byte) }

// PutChunk returns a chunk of either size to its pool.
func PutChunk(b *[]byte) {
	if cap(*b) == smallChunkSize {
		SmallChunkPool.Put(b)
		return
	}
	chunkPool.Put(b)
}

// Queue holds the bytes read from the client and not yet accepted by the
// upstream kernel. The request pump appends; the writer drains. Bytes are
// copied into pooled chunks, so the memory held is the queued byte count
// rounded up to a chunk, never the size of the reads that produced it.
//
// queued counts bytes appended and not yet written, including those the
// writer is writing right now; queued == 0 therefore means nobody is
// writing, which is what lets the request pump write directly.
//
// The link uses it only through its methods (push, EndOfInput,
// WaitForRoom for the request pump; next, batch, consume for the writer;
// close, release): its lock and conditions are used only in this file.
type Queue struct {
	b       *Budget       // the process's, which the queue's chunks count against; nil: none
	Done    chan struct{} // closed by close: wakes a pump waiting for the budget
	mu      sync.Mutex
	drained sync.Cond // the request pump waits here under backpressure

	chunks    []*[]byte // filled chunks; chunks[0][head:] is the oldest unsent byte
	lens      []int     // bytes filled in each chunk
	head      int
	inFlight  int   // bytes handed to the writer and not yet consumed
	queued    int64 // bytes appended and not yet written
	maxQueued int64 // the largest queued ever reached
	since     int64 // mono time queued last went from 0 to more
	writer    bool  // a writer runs (from the push that started it to its Drained)
	eof       bool  // the client sent FIN: flush, then CloseWrite
	closed    bool  // the link is ending: nothing more is written

	// queuedNow and closedNow are queued and closed as last written
	// (under mu), for Idle and Room, which the request pump asks at every
	// read: without the lock, which was two of them per request.
	queuedNow atomic.Int64
	closedNow atomic.Bool
}

func (q *Queue) Init(b *Budget) {
	q.b = b
	q.Done = make(chan struct{})
	q.drained.L = &q.mu
}

// Bytes is how many bytes are queued now.
func (q *Queue) Bytes() int64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.queued
}

// Peak is the most bytes ever queued.
func (q *Queue) Peak() int64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.maxQueued
}

// Idle reports whether nothing is queued, which also means nobody is
// writing (so the request pump may write to the kernel directly: only it
// appends, so the queue stays empty until it pushes), and whether the
// queue is still open.
//
// Without the lock: queued is read before closed, and a queue once closed
// stays closed, so an open queue's answer is both as they were at the
// first read (a closed one's count is nobody's business).
func (q *Queue) Idle() (empty, open bool) {
	empty = q.queuedNow.Load() == 0
	return empty, !q.closedNow.Load()
}

// PushResult is what push did with the bytes.
type PushResult int

const (
	pushed            PushResult = iota // queued; the writer is running
	PushedStartWriter                   // queued; the caller starts the writer
	PushOverflow                        // would pass the high watermark: nothing queued
	PushClosed                          // the queue is closed: nothing queued
	PushBudget                          // its new chunks do not fit the memory budget: nothing queued
	PushStalled                         // (waitForBudget) no room, and the upstream makes no progress
)

// Push copies p to the tail of the queue, unless that would take it past
// high (high > 0), the chunks it needs do not fit the budget, or the queue
// is closed. A push with no writer running (the first, or the first since
// the writer drained the queue and ended) asks the caller to start one.
func (q *Queue) Push(p []byte, high int64) PushResult {
	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case q.closed:
		return PushClosed
	case high > 0 && q.queued+int64(len(p)) > high:
		return PushOverflow
	}
	if need := q.chunksFor(len(p)); need > 0 && q.b != nil && !q.b.take(int64(need)*ChunkSize) {
		return PushBudget
	}
	q.appendLocked(p)
	if !q.writer {
		q.writer = true
		return PushedStartWriter
	}
	return pushed
}

// EndOfInput records the client's FIN. It reports true when the writer
// will pass it on after the queued bytes; false when no writer is running
// (nothing is queued), so the caller passes it on itself.
func (q *Queue) EndOfInput() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !q.writer {
		return false
	}
	q.eof = true
	return true
}

// Room is how many bytes may be pushed now without passing high (0 at
// or above it), and whether the queue is open: WaitForRoom's answer
// without the wait. Without the lock, as Idle.
func (q *Queue) Room(high int64) (int64, bool) {
	room := max(high-q.queuedNow.Load(), 0)
	return room, !q.closedNow.Load()
}

// WaitForRoom blocks while the queue holds high bytes or more, until it
// drains to low, and returns how many bytes may be pushed now and whether
// the queue is open.
func (q *Queue) WaitForRoom(high, low int64) (int64, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.queued >= high {
		for q.queued > low && q.queued > 0 && !q.closed {
			q.drained.Wait()
		}
	}
	return high - q.queued, !q.closed
}

// writerStep is what the writer does next.
type writerStep int

const (
	writeQueued writerStep = iota // write a batch of the queued bytes
	PassFin                       // everything is written and the client sent FIN
	StopWriting                   // the queue is closed
	// Drained: everything is written and the input goes on. The writer
	// ends; the next Push that has to queue starts another. An idle link
	// then keeps no writer's goroutine (and its stack) waiting for bytes
	// that may not come for hours.
	Drained
)

// Next says what the writer does next: write the queued bytes (and how
// many there are), pass the FIN on, or end (closed, or drained).
func (q *Queue) Next() (writerStep, int64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case q.closed:
		return StopWriting, 0
	case q.queued > 0:
		return writeQueued, q.queued
	case q.eof:
		return PassFin, 0
	}
	q.writer = false
	return Drained, 0
}

// Batch returns views of up to maxBatch queued bytes not already handed
// out (see batchLocked), and how many bytes they hold.
func (q *Queue) Batch(bufs net.Buffers) (net.Buffers, int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	before := q.inFlight
	bufs = q.batchLocked(bufs)
	return bufs, q.inFlight - before
}

// Consume drops the n bytes of a batch of handed bytes that were written,
// and wakes a pump waiting for room once the queue is at low or empty.
func (q *Queue) Consume(n, handed int, low int64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.consumeLocked(n, handed)
	if q.queued <= low || q.queued == 0 {
		q.drained.Signal()
	}
}

// Close marks the queue closed and wakes the writer and the pump.
func (q *Queue) Close() {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !q.closed {
		close(q.Done)
	}
	q.closed = true
	q.closedNow.Store(true)
	q.drained.Broadcast()
}

// Release returns every chunk to the pool once the link has ended.
func (q *Queue) Release() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.releaseLocked()
}

// chunksFor is how many new chunks appending n bytes takes.
func (q *Queue) chunksFor(n int) int {
	if last := len(q.chunks) - 1; last >= 0 {
		n -= ChunkSize - q.lens[last]
	}
	if n <= 0 {
		return 0
	}
	return (n + ChunkSize - 1) / ChunkSize
}

// putChunkLocked returns a chunk of the queue to the pool and its bytes
// to the budget.
func (q *Queue) putChunkLocked(c *[]byte) {
	PutChunk(c)
	if q.b != nil {
		q.b.give(ChunkSize)
	}
}

// HeldSince reports whether bytes are queued, and since when (mono time)
// the queue has not been empty.
func (q *Queue) HeldSince() (int64, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.since, q.queued > 0
}

// appendLocked copies p to the tail of the queue; push took its new
// chunks from the budget.
func (q *Queue) appendLocked(p []byte) {
	if q.queued == 0 && len(p) > 0 {
		q.since = Mono()
	}
	q.queued += int64(len(p))
	q.queuedNow.Store(q.queued)
	if q.queued > q.maxQueued {
		q.maxQueued = q.queued
	}
	for len(p) > 0 {
		last := len(q.chunks) - 1
		if last < 0 || q.lens[last] == ChunkSize {
			q.chunks = append(q.chunks, GetChunk())
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
func (q *Queue) batchLocked(bufs net.Buffers) net.Buffers {
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
func (q *Queue) consumeLocked(n, handed int) {
	q.inFlight -= handed
	q.queued -= int64(n)
	q.queuedNow.Store(q.queued)
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
			q.putChunkLocked(q.chunks[0])
			q.chunks[0] = nil
			q.chunks, q.lens = q.chunks[:0], q.lens[:0]
			return
		}
		q.putChunkLocked(q.chunks[0])
		q.chunks[0] = nil
		q.chunks = q.chunks[1:]
		q.lens = q.lens[1:]
	}
}

// releaseLocked returns every chunk to the pool once the link has ended.
func (q *Queue) releaseLocked() {
	for i, c := range q.chunks {
		q.putChunkLocked(c)
		q.chunks[i] = nil
	}
	q.chunks, q.lens, q.head = nil, nil, 0
}
