package proxy

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// budget is the process's memory budget: the bytes every link holds in
// its queue's chunks and in the read buffers its pumps have in hand.
//
// A queue takes its chunks from the budget (take) and gives them back as
// they drain (give). A read buffer is counted (reading) but never refused:
// it is held for one read and one hand-off, and there are at most two per
// link, which max_links bounds. When a queue's chunk does not fit, the
// link waits (backpressure: its request pump stops reading the client)
// until a chunk is given back; only a link whose own upstream has bytes
// waiting and acknowledged nothing for write_timeout is closed instead
// (reason budget), and while links wait, the reaper closes such links
// among those that hold the budget: the ones holding memory for nothing
// give way first. A link toward a live upstream is never closed for it.
type budget struct {
	limit  atomic.Int64 // 0: no budget
	queued atomic.Int64 // bytes of queue chunks held
	reads  atomic.Int64 // bytes of read buffers in hand

	mu      sync.Mutex
	waiters []chan struct{} // links waiting for a chunk, oldest first
	nwait   atomic.Int32    // len(waiters), read without the lock

	// heldBack counts reads held back since the last log line; closed
	// counts links the budget closed since then (the reaper logs both at
	// most once a second).
	heldBack atomic.Int64
	closed   atomic.Int64
	waits    prometheus.Counter // memory_budget_waits_total
}

// budgetRecheck is how often a link waiting for the budget checks its own
// upstream for progress, and the reaper the links that hold the budget.
const budgetRecheck = 250 * time.Millisecond

// setLimit sets the budget; a lower one takes effect as chunks are given
// back (nothing is taken away from a queue).
func (b *budget) setLimit(n int64) {
	b.limit.Store(max(n, 0))
	b.wakeOne()
}

// used is the bytes counted now.
func (b *budget) used() int64 { return b.queued.Load() + b.reads.Load() }

// take counts n bytes of queue chunks, unless the budget has no room.
func (b *budget) take(n int64) bool {
	lim := b.limit.Load()
	for {
		q := b.queued.Load()
		if lim > 0 && q+n+b.reads.Load() > lim {
			return false
		}
		if b.queued.CompareAndSwap(q, q+n) {
			return true
		}
	}
}

// give returns n bytes of queue chunks and wakes a waiting link.
func (b *budget) give(n int64) {
	b.queued.Add(-n)
	b.wakeOne()
}

// reading counts (n > 0) or returns (n < 0) a read buffer.
func (b *budget) reading(n int64) {
	b.reads.Add(n)
	if n < 0 {
		b.wakeOne()
	}
}

// wait registers a waiting link; its channel is signalled once when room
// may have been given back. The caller retries, then calls unwait.
func (b *budget) wait() chan struct{} {
	ch := make(chan struct{}, 1)
	b.mu.Lock()
	b.waiters = append(b.waiters, ch)
	b.nwait.Store(int32(len(b.waiters)))
	b.mu.Unlock()
	return ch
}

// unwait removes ch from the waiters; if ch had been signalled, the
// signal passes to the next waiter (the room may still be there).
func (b *budget) unwait(ch chan struct{}) {
	b.mu.Lock()
	for i, w := range b.waiters {
		if w == ch {
			b.waiters = append(b.waiters[:i], b.waiters[i+1:]...)
			break
		}
	}
	b.nwait.Store(int32(len(b.waiters)))
	b.mu.Unlock()
	select {
	case <-ch:
		b.wakeOne()
	default:
	}
}

// wakeOne signals the oldest waiter not signalled yet.
func (b *budget) wakeOne() {
	if b.nwait.Load() == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, w := range b.waiters {
		select {
		case w <- struct{}{}:
			return
		default: // already signalled: try the next
		}
	}
}
