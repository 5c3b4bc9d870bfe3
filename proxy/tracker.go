package proxy

import (
	"sync"
	"sync/atomic"
	"time"
)

// clockBase anchors mono: tracker times are monotonic nanoseconds.
var clockBase = time.Now()

func mono() int64 { return int64(time.Since(clockBase)) }

// pendingRequest is a request handed to the upstream and not yet judged.
type pendingRequest struct {
	at  int64 // mono time it was handed on
	end int64 // stream offset just past its last byte
}

// tracker follows one link's requests and answers. A request that has
// seen no answer from the upstream (any response byte in opaque mode, any
// complete response frame in framed mode) within the request timeout is
// one unanswered timeout; an answer, even a late one, means the server is
// alive and resets the endpoint's consecutive count.
//
// The request pump adds, the response pump answers, and a timer judges
// expired requests; each request is judged once.
type tracker struct {
	timeout int64 // request_timeout in nanoseconds
	// perBurst: opaque mode. A request is a burst of bytes sent since the
	// last answer; it is recorded once.
	perBurst bool
	// onExpired receives, from the timer's goroutine, the number of
	// unanswered requests among those just judged, the newest request just
	// judged, and how many requests are still pending after it.
	onExpired func(unanswered int, last pendingRequest, pendingLeft int)
	// slack batches judgements: the timer fires up to this long after a
	// deadline so that a busy link is judged a few times per timeout, not
	// once per request.
	slack int64

	lastAnswer atomic.Int64 // mono time of the last answer

	mu      sync.Mutex
	pending []pendingRequest
	head    int
	timer   *time.Timer
	armed   bool
	stopped bool
}

func newTracker(timeout time.Duration, perBurst bool, onExpired func(int, pendingRequest, int)) *tracker {
	slack := min(timeout/10, 100*time.Millisecond)
	t := &tracker{timeout: int64(timeout), perBurst: perBurst, onExpired: onExpired, slack: int64(slack)}
	t.lastAnswer.Store(-1)
	return t
}

// sent records n requests handed on at time now, the last ending at
// stream offset end.
func (t *tracker) sent(n int, now, end int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return
	}
	if t.perBurst {
		if last := len(t.pending) - 1; last >= t.head && t.pending[last].at > t.lastAnswer.Load() {
			// Still the same burst: no answer since it began.
			t.pending[last].end = end
			return
		}
		n = 1
	}
	for range n {
		t.pending = append(t.pending, pendingRequest{at: now, end: end})
	}
	if !t.armed {
		t.arm(now)
	}
}

// answered records an answer from the upstream at time now.
func (t *tracker) answered(now int64) { t.lastAnswer.Store(now) }

// arm sets the timer for the oldest pending request; t.mu is held.
func (t *tracker) arm(now int64) {
	d := time.Duration(max(t.pending[t.head].at+t.timeout-now, 0) + t.slack)
	if t.timer == nil {
		t.timer = time.AfterFunc(d, t.expire)
	} else {
		t.timer.Reset(d)
	}
	t.armed = true
}

// expire judges every request whose timeout has passed.
func (t *tracker) expire() {
	t.mu.Lock()
	if t.stopped {
		t.mu.Unlock()
		return
	}
	now := mono()
	answer := t.lastAnswer.Load()
	unanswered, judged := 0, 0
	var last pendingRequest
	for t.head < len(t.pending) && t.pending[t.head].at+t.timeout <= now {
		last = t.pending[t.head]
		t.head++
		judged++
		if answer < last.at {
			unanswered++
		}
	}
	left := len(t.pending) - t.head
	if t.head == len(t.pending) {
		t.pending, t.head = t.pending[:0], 0
	} else if t.head > 1024 && t.head*2 > len(t.pending) {
		t.pending = append(t.pending[:0], t.pending[t.head:]...)
		t.head = 0
	}
	t.armed = false
	if t.head < len(t.pending) {
		t.arm(now)
	}
	t.mu.Unlock()
	if judged > 0 {
		t.onExpired(unanswered, last, left)
	}
}

// stop ends tracking: requests of a link that ended are not judged.
func (t *tracker) stop() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stopped = true
	if t.timer != nil {
		t.timer.Stop()
	}
	t.pending = nil
}
