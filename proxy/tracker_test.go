package proxy

import (
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// trackerRig is a tracker whose verdicts are recorded. Run inside a
// synctest bubble: time advances only when every goroutine is blocked,
// so deadlines are exact.
type trackerRig struct {
	t        *tracker
	answer   atomic.Int64
	mu       sync.Mutex // guards the rest: judge runs on the timer's goroutine
	verdicts [][]pendingRequest
	left     []int
	counted  int // unanswered, per the rule
}

func newTrackerRig(slack time.Duration, perBurst bool) *trackerRig {
	r := &trackerRig{}
	r.answer.Store(noAnswer)
	r.t = newTracker(slack, perBurst, &r.answer, func(judged []pendingRequest, left int) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.verdicts = append(r.verdicts, append([]pendingRequest(nil), judged...))
		r.left = append(r.left, left)
		r.counted += r.t.unanswered(judged)
	})
	return r
}

// seen returns what was judged so far.
func (r *trackerRig) seen() (verdicts [][]pendingRequest, left []int, counted int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.verdicts, r.left, r.counted
}

func (r *trackerRig) send(due time.Duration, end int64) {
	now := mono()
	r.t.sent(pendingRequest{at: now, due: now + int64(due), end: end, n: 1, thr: 3})
}

// A request nobody answers is judged unanswered once its own deadline
// (not before) plus the judging slack has passed.
func TestTrackerJudgesAtOwnDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var v [][]pendingRequest
		var left []int
		var counted int
		defer func() { _, _, _ = v, left, counted }()
		r := newTrackerRig(10*time.Millisecond, false)
		defer r.t.stop()
		r.send(5*time.Second, 10) // a long poll that asks for 5s
		time.Sleep(5*time.Second + 9*time.Millisecond)
		synctest.Wait()
		v, left, counted = r.seen()
		if len(v) != 0 {
			t.Fatalf("judged %v before its deadline plus slack", v)
		}
		time.Sleep(2 * time.Millisecond)
		synctest.Wait()
		v, left, counted = r.seen()
		if len(v) != 1 || counted != 1 {
			t.Fatalf("verdicts %v, %d unanswered; want one request judged unanswered", v, counted)
		}
	})
}

// An answer from the endpoint after a request was sent, to that request
// or any other on any link, covers it: the server is alive. An answer
// from before it was sent does not.
func TestTrackerAnswerAfterSendCovers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var v [][]pendingRequest
		var left []int
		var counted int
		defer func() { _, _, _ = v, left, counted }()
		r := newTrackerRig(10*time.Millisecond, false)
		defer r.t.stop()
		r.answer.Store(mono()) // an answer before anything was sent
		time.Sleep(time.Millisecond)
		r.send(time.Second, 10)
		time.Sleep(2 * time.Second)
		synctest.Wait()
		v, left, counted = r.seen()
		if counted != 1 {
			t.Fatalf("%d unanswered, want 1: an earlier answer does not cover a later request", counted)
		}
		r.send(time.Second, 20)
		time.Sleep(900 * time.Millisecond)
		r.answer.Store(mono()) // answered 100ms before the deadline
		time.Sleep(time.Second)
		synctest.Wait()
		v, left, counted = r.seen()
		if len(v) != 2 || counted != 1 {
			t.Fatalf("%d verdicts, %d unanswered; want the covered request judged and not counted", len(v), counted)
		}
	})
}

// Requests sent within the slack of each other share an entry: the
// earliest send time and the latest deadline, so merging only ever errs
// toward not counting.
func TestTrackerMergesWithinSlack(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var v [][]pendingRequest
		var left []int
		var counted int
		defer func() { _, _, _ = v, left, counted }()
		r := newTrackerRig(100*time.Millisecond, false)
		defer r.t.stop()
		r.send(time.Second, 10)
		time.Sleep(50 * time.Millisecond)
		r.send(3*time.Second, 20) // within slack: same entry, later deadline
		time.Sleep(100 * time.Millisecond)
		r.send(time.Second, 30) // past slack: its own entry
		r.t.mu.Lock()
		n := len(r.t.pending)
		first := r.t.pending[0]
		r.t.mu.Unlock()
		if n != 2 || first.n != 2 || first.end != 20 {
			t.Fatalf("%d entries, first %+v; want 2 entries, the first holding 2 requests up to offset 20", n, first)
		}
		time.Sleep(1200 * time.Millisecond)
		synctest.Wait()
		v, left, counted = r.seen()
		if len(v) != 1 || v[0][0].end != 30 || left[0] != 2 {
			t.Fatalf("verdicts %v left %v; want the third request judged first with 2 still pending", v, left)
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		v, left, counted = r.seen()
		if counted != 3 {
			t.Fatalf("%d unanswered, want 3", counted)
		}
	})
}

// The list is bounded whatever the request rate: past maxPending, new
// requests join the newest entry.
func TestTrackerBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var v [][]pendingRequest
		var left []int
		var counted int
		defer func() { _, _, _ = v, left, counted }()
		r := newTrackerRig(time.Millisecond, false)
		defer r.t.stop()
		for i := range 3 * maxPending {
			r.send(time.Hour, int64(i))
			time.Sleep(2 * time.Millisecond)
		}
		r.t.mu.Lock()
		n, last := len(r.t.pending), r.t.pending[len(r.t.pending)-1]
		r.t.mu.Unlock()
		if n != maxPending || last.n != 2*maxPending+1 {
			t.Fatalf("%d entries, the newest holding %d; want %d and %d", n, last.n, maxPending, 2*maxPending+1)
		}
	})
}

// Opaque mode: a burst of bytes with no answer in between is one request.
func TestTrackerPerBurst(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var v [][]pendingRequest
		var left []int
		var counted int
		defer func() { _, _, _ = v, left, counted }()
		r := newTrackerRig(10*time.Millisecond, true)
		defer r.t.stop()
		for i := range 5 {
			r.send(time.Second, int64(i))
			time.Sleep(300 * time.Millisecond)
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		v, left, counted = r.seen()
		if counted != 1 {
			t.Fatalf("%d unanswered, want the whole burst to count once", counted)
		}
	})
}

// stop hands over the requests not yet judged and not covered; the
// endpoint's tracker adopts and judges them at their own deadlines.
func TestTrackerStopAndAdopt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var v [][]pendingRequest
		var left []int
		var counted int
		defer func() { _, _, _ = v, left, counted }()
		r := newTrackerRig(10*time.Millisecond, false)
		r.send(time.Second, 10)
		time.Sleep(200 * time.Millisecond)
		r.send(time.Second, 20)
		orphans := r.t.stop()
		if len(orphans) != 2 {
			t.Fatalf("%d orphans, want 2", len(orphans))
		}
		ep := newTrackerRig(10*time.Millisecond, false)
		defer ep.t.stop()
		ep.t.adopt(orphans)
		time.Sleep(900 * time.Millisecond)
		synctest.Wait()
		v, left, counted = ep.seen()
		if len(v) != 1 || counted != 1 {
			t.Fatalf("verdicts %v: want the first orphan judged at its own deadline", v)
		}
		time.Sleep(300 * time.Millisecond)
		synctest.Wait()
		v, left, counted = ep.seen()
		if counted != 2 {
			t.Fatalf("%d unanswered, want 2", counted)
		}
	})
}

// An answer between two requests keeps them apart even within the slack:
// the first is covered, the second is not, and sharing an entry would
// wrongly cover the second (a server that stopped right after answering).
func TestTrackerAnswerSplitsEntries(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newTrackerRig(100*time.Millisecond, false)
		defer r.t.stop()
		r.send(time.Second, 10)
		time.Sleep(10 * time.Millisecond)
		r.answer.Store(mono())
		time.Sleep(10 * time.Millisecond)
		r.send(time.Second, 20) // within the slack, but after the answer
		time.Sleep(2 * time.Second)
		synctest.Wait()
		v, _, counted := r.seen()
		if len(v) != 1 || len(v[0]) != 2 || counted != 1 {
			t.Fatalf("verdicts %v, %d unanswered; want two entries judged together, the second unanswered", v, counted)
		}
	})
}
