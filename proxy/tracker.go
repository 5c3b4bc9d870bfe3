package proxy

import (
	"sync"
	"sync/atomic"
	"time"
)

// clockBase anchors mono: tracker times are monotonic nanoseconds.
var clockBase = time.Now()

func mono() int64 { return int64(time.Since(clockBase)) }

// pendingRequest is a batch of requests handed on together (one read's
// worth) and not yet judged.
type pendingRequest struct {
	at  int64 // mono time they were handed on
	end int64 // stream offset just past the last byte of the last one
	n   int   // how many requests
}

// verdict is what one judgement found.
type verdict struct {
	unanswered int            // requests with no answer within the timeout
	last       pendingRequest // the newest batch judged
	left       int            // requests still pending after it
}

// tracker follows requests and answers. A request that has seen no answer
// from the upstream (any response byte in opaque mode, any complete
// response frame in framed mode) within the request timeout is one
// unanswered timeout; an answer, even a late one, means the server is alive
// and resets the endpoint's consecutive count (the caller's job).
//
// A link's tracker reads the link's own answers; when the link ends, its
// unanswered requests are handed to the endpoint's tracker, which judges
// them against answers on any link to the endpoint. The request pump adds,
// the response pump answers, and a timer judges; each request is judged
// once. Judgements are batched: the timer fires up to slack after a
// deadline, so an answer arriving in that window still counts as on time.
type tracker struct {
	timeout int64 // request_timeout in nanoseconds
	slack   int64
	// perBurst: opaque mode. A request is a burst of bytes sent since the
	// last answer; it is recorded once.
	perBurst bool
	answer   *atomic.Int64 // mono time of the last answer; -1: none yet
	// judge receives each verdict, from the timer's goroutine.
	judge func(verdict)

	mu      sync.Mutex
	pending []pendingRequest
	timer   *time.Timer
	armed   bool
	stopped bool
	judging sync.WaitGroup // an expire in progress; stop waits for it
}

func newTracker(timeout time.Duration, perBurst bool, answer *atomic.Int64, judge func(verdict)) *tracker {
	slack := min(timeout/10, 100*time.Millisecond)
	if answer == nil {
		answer = new(atomic.Int64)
		answer.Store(-1)
	}
	return &tracker{timeout: int64(timeout), slack: int64(slack), perBurst: perBurst, answer: answer, judge: judge}
}

// sent records n requests handed on at time now, the last ending at
// stream offset end.
func (t *tracker) sent(n int, now, end int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return
	}
	if last := len(t.pending) - 1; t.perBurst && last >= 0 && t.pending[last].at > t.answer.Load() {
		// Still the same burst: no answer since it began.
		t.pending[last].end = end
		return
	}
	if t.perBurst {
		n = 1
	}
	t.pending = append(t.pending, pendingRequest{at: now, end: end, n: n})
	if !t.armed {
		t.arm(now)
	}
}

// adopt takes over requests whose link ended before they were judged.
func (t *tracker) adopt(rs []pendingRequest) {
	if len(rs) == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return
	}
	t.pending = append(t.pending, rs...)
	// Adopted batches arrive out of order with the ones already here: arm
	// for the earliest deadline; expire judges by deadline, not by position.
	t.armAt(t.earliestLocked(), mono())
}

func (t *tracker) earliestLocked() int64 {
	earliest := t.pending[0].at
	for _, r := range t.pending {
		earliest = min(earliest, r.at)
	}
	return earliest
}

// clear forgets every pending request (an endpoint readmitted starts
// afresh: requests sent to the previous incarnation are not held against
// the new one).
func (t *tracker) clear() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.pending = t.pending[:0]
}

// answered records an answer from the upstream at time now.
func (t *tracker) answered(now int64) { t.answer.Store(now) }

// arm sets the timer for the newest request just added, unless it is
// already armed for an earlier one; t.mu is held.
func (t *tracker) arm(now int64) { t.armAt(t.pending[len(t.pending)-1].at, now) }

// armAt (re)arms the timer for a request handed on at `at`; t.mu is held.
func (t *tracker) armAt(at, now int64) {
	d := time.Duration(max(at+t.timeout-now, 0) + t.slack)
	if t.timer == nil {
		t.timer = time.AfterFunc(d, t.expire)
	} else {
		t.timer.Reset(d)
	}
	t.armed = true
}

// overdueEnd returns the stream end of the newest request whose deadline
// has passed without a judgement yet (0 if none): the writer must not send
// bytes up to there.
func (t *tracker) overdueEnd(now int64) int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	var end int64
	for _, r := range t.pending {
		if r.at+t.timeout <= now {
			end = max(end, r.end)
		}
	}
	return end
}

// expire judges every request whose timeout has passed.
func (t *tracker) expire() {
	t.mu.Lock()
	if t.stopped {
		t.mu.Unlock()
		return
	}
	t.judging.Add(1)
	defer t.judging.Done()
	now := mono()
	answer := t.answer.Load()
	var v verdict
	judged := false
	keep := t.pending[:0]
	for _, r := range t.pending {
		if r.at+t.timeout > now {
			keep = append(keep, r)
			continue
		}
		if !judged || r.end > v.last.end {
			v.last = r
		}
		judged = true
		if answer < r.at {
			v.unanswered += r.n
		}
	}
	t.pending = keep
	for _, r := range keep {
		v.left += r.n
	}
	t.armed = false
	if len(t.pending) > 0 {
		t.armAt(t.earliestLocked(), now)
	}
	t.mu.Unlock()
	if judged {
		t.judge(v)
	}
}

// stop ends tracking and returns the requests not yet judged that have
// seen no answer, so that the endpoint can judge them. A judgement already
// running finishes first.
func (t *tracker) stop() []pendingRequest {
	t.mu.Lock()
	t.stopped = true
	if t.timer != nil {
		t.timer.Stop()
	}
	answer := t.answer.Load()
	var orphans []pendingRequest
	for _, r := range t.pending {
		if answer < r.at {
			orphans = append(orphans, r)
		}
	}
	t.pending = nil
	t.mu.Unlock()
	t.judging.Wait()
	return orphans
}
