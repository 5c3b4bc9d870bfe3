package flow

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Budget is the process's memory budget: the bytes every link holds in
// its queue's chunks and in the read buffers its pumps have in hand.
//
// A queue takes its chunks from the budget (take) and gives them back as
// they drain (give). A read buffer is counted (reading) but never refused,
// and takes no queue's room (see takeFor): it is held for one read and one
// hand-off, and there are at most two per link, which max_links bounds. When a queue's chunk does not fit, the
// link waits (backpressure: its request pump stops reading the client)
// until a chunk is given back; only a link whose own upstream has bytes
// waiting and acknowledged nothing for write_timeout is closed instead
// (reason budget), and while links wait, the reaper closes such links
// among those that hold the budget: the ones holding memory for nothing
// give way first. A link toward a live upstream that reads is never
// closed for it (one whose client stalled it may be, blamed on no one).
type Budget struct {
	Limit   atomic.Int64 // 0: no budget
	Queued  atomic.Int64 // bytes of queue chunks held
	Reads   atomic.Int64 // bytes of read buffers in hand
	Windows atomic.Int64 // bytes of frame windows held (see FrameScanner.Budget)

	mu      sync.Mutex
	waiters []chan struct{} // links waiting for a chunk, oldest first
	Nwait   atomic.Int32    // len(waiters), read without the lock

	// HeldBack counts reads held back since the last log line; closed
	// counts links the budget closed since then (the reaper logs both at
	// most once a second).
	HeldBack atomic.Int64
	Closed   atomic.Int64
	Waits    prometheus.Counter // memory_budget_waits_total
}

// BudgetRecheck is how often a link waiting for the budget checks its own
// upstream for progress, and the reaper the links that hold the budget.
const BudgetRecheck = 250 * time.Millisecond

// SetLimit sets the budget; a lower one takes effect as chunks are given
// back (nothing is taken away from a queue).
func (b *Budget) SetLimit(n int64) {
	b.Limit.Store(max(n, 0))
	b.wakeOne()
}

// Used is the bytes counted now.
func (b *Budget) Used() int64 { return b.Queued.Load() + b.Reads.Load() + b.Windows.Load() }

// take counts n bytes of queue chunks, unless the budget has no room.
func (b *Budget) take(n int64) bool { return b.takeFor(&b.Queued, n) }

// give returns n bytes of queue chunks and wakes a waiting link.
func (b *Budget) give(n int64) { b.giveFor(&b.Queued, n) }

// takeFor counts n bytes in use (Queued or Windows), unless the budget
// has no room for them beside the queues and windows. The read buffers in
// hand are not in the way: a pump that waits for a chunk holds the one it
// read, and the waiters' own buffers alone could fill the budget with no
// queue left to give a chunk back, every link waiting for good. They are
// bounded by max_links instead (two per link, which the derived max_links
// leaves room for beside the budget: linkOverhead).
func (b *Budget) takeFor(use *atomic.Int64, n int64) bool {
	lim := b.Limit.Load()
	for {
		u := use.Load()
		if lim > 0 && b.Queued.Load()+b.Windows.Load()+n > lim {
			return false
		}
		if use.CompareAndSwap(u, u+n) {
			return true
		}
	}
}

// giveFor returns n bytes of use and wakes a waiting link.
func (b *Budget) giveFor(use *atomic.Int64, n int64) {
	use.Add(-n)
	b.wakeOne()
}

// Reading counts (n > 0) or returns (n < 0) a read buffer. A returned one
// frees no room a queue waits for (see takeFor): nobody is woken.
func (b *Budget) Reading(n int64) { b.Reads.Add(n) }

// Wait registers a waiting link; its channel is signalled once when room
// may have been given back. The caller retries, then calls unwait.
func (b *Budget) Wait() chan struct{} {
	ch := make(chan struct{}, 1)
	b.mu.Lock()
	b.waiters = append(b.waiters, ch)
	b.Nwait.Store(int32(len(b.waiters)))
	b.mu.Unlock()
	return ch
}

// Unwait removes ch from the waiters; if ch had been signalled, the
// signal passes to the next waiter (the room may still be there).
func (b *Budget) Unwait(ch chan struct{}) {
	b.mu.Lock()
	for i, w := range b.waiters {
		if w == ch {
			b.waiters = append(b.waiters[:i], b.waiters[i+1:]...)
			break
		}
	}
	b.Nwait.Store(int32(len(b.waiters)))
	b.mu.Unlock()
	select {
	case <-ch:
		b.wakeOne()
	default:
	}
}

// wakeOne signals the oldest waiter not signalled yet.
func (b *Budget) wakeOne() {
	if b.Nwait.Load() == 0 {
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
