package flow

import (
	"math/rand/v2"
	"slices"
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
	t        *Tracker
	answer   atomic.Int64
	mu       sync.Mutex // guards the rest: judge runs on the timer's goroutine
	verdicts [][]PendingRequest
	left     []int
	counted  int // unanswered, per the rule
}

func newTrackerRig(slack time.Duration, perBurst bool) *trackerRig {
	r := &trackerRig{}
	r.answer.Store(NoAnswer)
	r.t = NewTracker(slack, perBurst, &r.answer, func(judged []PendingRequest, left int) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.verdicts = append(r.verdicts, append([]PendingRequest(nil), judged...))
		r.left = append(r.left, left)
		n, _ := r.t.Unanswered(judged)
		r.counted += n
	})
	return r
}

// seen returns what was judged so far.
func (r *trackerRig) seen() (verdicts [][]PendingRequest, left []int, counted int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.verdicts, r.left, r.counted
}

// after lets d pass on the bubble's clock, waits until every goroutine
// is blocked (the verdicts due by then are in), and returns what was
// judged so far.
func (r *trackerRig) after(d time.Duration) (verdicts [][]PendingRequest, left []int, counted int) {
	time.Sleep(d)
	synctest.Wait()
	return r.seen()
}

func (r *trackerRig) send(due time.Duration, end int64) {
	now := Mono()
	r.t.Sent(PendingRequest{At: now, Due: now + int64(due), End: end, N: 1, Thr: 3})
}

// trackerStep is one step of a tracker scenario: let wait pass, then
// send a request due in send (if not zero, end offset end), record an
// answer, and check what was judged so far against want (if not nil).
type trackerStep struct {
	wait   time.Duration
	send   time.Duration
	end    int64
	answer bool
	want   *trackerWant
}

// trackerWant is what was judged: verdicts entries (-1: not checked), the
// first of them holding firstLen requests (0: not checked), counted
// unanswered.
type trackerWant struct {
	verdicts, firstLen, counted int
	why                         string
}

func TestTrackerScenarios(t *testing.T) {
	sendEvery := func(n int, due, every time.Duration) []trackerStep {
		var out []trackerStep
		for i := range n {
			out = append(out, trackerStep{send: due, end: int64(i)}, trackerStep{wait: every})
		}
		return out
	}
	cases := []struct {
		name     string
		slack    time.Duration
		perBurst bool
		steps    []trackerStep
	}{
		// A request nobody answers is judged unanswered once its own
		// deadline (not before) plus the judging slack has passed.
		{"judged at its own deadline", 10 * time.Millisecond, false, []trackerStep{
			{send: 5 * time.Second, end: 10}, // a long poll that asks for 5s
			{wait: 5*time.Second + 9*time.Millisecond, want: &trackerWant{0, 0, 0, "nothing judged before its deadline plus slack"}},
			{wait: 2 * time.Millisecond, want: &trackerWant{1, 0, 1, "one request judged unanswered"}},
		}},
		// An answer from the endpoint after a request was sent, to that
		// request or any other on any link, covers it: the server is
		// alive. An answer from before it was sent does not.
		{"an answer after the send covers it", 10 * time.Millisecond, false, []trackerStep{
			{answer: true}, // an answer before anything was sent
			{wait: time.Millisecond, send: time.Second, end: 10},
			{wait: 2 * time.Second, want: &trackerWant{-1, 0, 1, "an earlier answer does not cover a later request"}},
			{send: time.Second, end: 20},
			{wait: 900 * time.Millisecond, answer: true}, // answered 100ms before the deadline
			{wait: time.Second, want: &trackerWant{2, 0, 1, "the covered request judged and not counted"}},
		}},
		// Opaque mode: a burst of bytes with no answer in between is one
		// request.
		{"per burst", 10 * time.Millisecond, true, append(sendEvery(5, time.Second, 300*time.Millisecond),
			trackerStep{wait: 2 * time.Second, want: &trackerWant{-1, 0, 1, "the whole burst counts once"}})},
		// An answer between two requests keeps them apart even within the
		// slack: the first is covered, the second is not, and sharing an
		// entry would wrongly cover the second (a server that stopped
		// right after answering).
		{"an answer splits entries", 100 * time.Millisecond, false, []trackerStep{
			{send: time.Second, end: 10},
			{wait: 10 * time.Millisecond, answer: true},
			{wait: 10 * time.Millisecond, send: time.Second, end: 20}, // within the slack, but after the answer
			{wait: 2 * time.Second, want: &trackerWant{1, 2, 1, "two entries judged together, the second unanswered"}},
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				r := newTrackerRig(tc.slack, tc.perBurst)
				defer r.t.Stop()
				for i, st := range tc.steps {
					v, _, counted := r.after(st.wait)
					if st.answer {
						r.answer.Store(Mono())
					}
					if st.send != 0 {
						r.send(st.send, st.end)
					}
					w := st.want
					if w == nil {
						continue
					}
					if (w.verdicts >= 0 && len(v) != w.verdicts) || (w.firstLen > 0 && (len(v) == 0 || len(v[0]) != w.firstLen)) || counted != w.counted {
						t.Fatalf("step %d: verdicts %v, %d unanswered; want %s", i, v, counted, w.why)
					}
				}
			})
		})
	}
}

// Requests sent within the slack of each other, with deadlines within
// the slack too, share an entry: the earliest send time, the earliest
// deadline (the verdict) and the latest (when the entry is checked for
// staleness and leaves).
func TestTrackerMergesWithinSlack(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newTrackerRig(100*time.Millisecond, false)
		defer r.t.Stop()
		r.send(time.Second, 10)
		time.Sleep(50 * time.Millisecond)
		r.send(time.Second, 20) // within slack: same entry, due 50ms later
		time.Sleep(100 * time.Millisecond)
		r.send(2*time.Second, 30) // past slack: its own entry
		r.t.mu.Lock()
		n := len(r.t.pending)
		first := r.t.pending[0]
		r.t.mu.Unlock()
		if n != 2 || first.N != 2 || first.End != 20 || first.last-first.Due != int64(50*time.Millisecond) {
			t.Fatalf("%d entries, first %+v; want 2 entries, the first holding 2 requests up to offset 20, due 50ms before its last deadline", n, first)
		}
		v, _, counted := r.after(1100 * time.Millisecond) // +1.25s: the first entry's verdict (at 1s + slack)
		if len(v) != 1 || !v[0][0].Verdict || !v[0][0].Expired || counted != 2 {
			t.Fatalf("verdicts %v, %d unanswered; want the first entry judged at its earliest deadline (2 requests)", v, counted)
		}
		v, left, counted := r.after(time.Second) // +2.25s
		if len(v) != 2 || v[1][0].End != 30 || !v[1][0].Expired || left[1] != 0 || counted != 3 {
			t.Fatalf("verdicts %v left %v, %d unanswered; want the third request judged and gone", v, left, counted)
		}
	})
}

// Requests with deadlines further apart than the slack keep their own
// entries, even sent together: each is judged at its own deadline.
func TestTrackerDistinctDeadlinesNotMerged(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newTrackerRig(100*time.Millisecond, false)
		defer r.t.Stop()
		r.send(3*time.Second, 10)
		r.send(time.Second, 20)
		r.t.mu.Lock()
		n := len(r.t.pending)
		r.t.mu.Unlock()
		if n != 2 {
			t.Fatalf("%d entries, want 2", n)
		}
		if _, _, counted := r.after(1200 * time.Millisecond); counted != 1 {
			t.Fatalf("%d unanswered at 1.2s, want the 1s request alone", counted)
		}
		if _, _, counted := r.after(2 * time.Second); counted != 2 {
			t.Fatalf("%d unanswered at 3.2s, want both", counted)
		}
	})
}

// A long poll and a short request sent together keep their own entries
// (their deadlines are far apart): the short one's verdict is not
// delayed to the long poll's deadline.
func TestTrackerShortRequestNotDelayedByLongPoll(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newTrackerRig(100*time.Millisecond, false)
		defer r.t.Stop()
		r.send(5*time.Second, 10) // a Fetch parked for 5s
		r.send(time.Second, 20)   // a Metadata request right after it
		time.Sleep(900 * time.Millisecond)
		r.answer.Store(Mono()) // the endpoint answers something
		if _, _, counted := r.after(5 * time.Second); counted != 0 {
			t.Fatalf("%d unanswered: an answer after both were sent covers both", counted)
		}
		r.send(5*time.Second, 30)
		r.send(time.Second, 40)
		if _, _, counted := r.after(1150 * time.Millisecond); counted != 1 {
			t.Fatalf("%d unanswered 1.15s after a silent 1s request, want it counted then, not at the 5s deadline", counted)
		}
	})
}

// A request the server may hold (a long poll) is covered by an answer
// after its hold ended, not by one during it: answers while it is held say
// the server was alive while entitled to hold it; past the hold it owes an
// answer within its deadline.
func TestTrackerHeldRequestCoveredOnlyAfterItsHold(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newTrackerRig(10*time.Millisecond, false)
		defer r.t.Stop()
		held := func(hold, rt time.Duration, end int64) {
			now := Mono()
			r.t.Sent(PendingRequest{At: now, Held: now + int64(hold), Due: now + int64(hold+rt), End: end, N: 1, Thr: 1})
		}
		held(5*time.Second, 3*time.Second, 10)
		time.Sleep(4 * time.Second)
		r.answer.Store(Mono()) // another connection answered, during the hold
		if _, _, counted := r.after(4100 * time.Millisecond); counted != 1 {
			t.Fatalf("%d unanswered: a held request with no answer since its hold ended must count at its deadline", counted)
		}
		held(5*time.Second, 3*time.Second, 20)
		time.Sleep(6 * time.Second)
		r.answer.Store(Mono()) // an answer after the hold, before the deadline
		if _, _, counted := r.after(3 * time.Second); counted != 1 {
			t.Fatalf("%d unanswered: an answer after the hold ended covers the request", counted)
		}
	})
}

// The list is bounded whatever the request rate: past maxPending, new
// requests join the newest entry.
func TestTrackerBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newTrackerRig(time.Millisecond, false)
		defer r.t.Stop()
		for i := range 3 * maxPending {
			r.send(time.Hour, int64(i))
			time.Sleep(2 * time.Millisecond)
		}
		r.t.mu.Lock()
		n, last := len(r.t.pending), r.t.pending[len(r.t.pending)-1]
		r.t.mu.Unlock()
		if n != maxPending || last.N != 2*maxPending+1 {
			t.Fatalf("%d entries, the newest holding %d; want %d and %d", n, last.N, maxPending, 2*maxPending+1)
		}
	})
}

// An endpoint's tracker of orphans stays within maxPending however many
// links end with requests outstanding, and a request past the bound only
// puts a verdict off: it joins the newest entry, judged at the later of
// the two deadlines, and is counted there.
func TestTrackerAdoptBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newTrackerRig(time.Millisecond, false)
		defer r.t.Stop()
		now := Mono()
		for i := range 3 * maxPending {
			// Deadlines a second apart: none shares an entry by the slack.
			at := now + int64(i)*int64(time.Millisecond)
			r.t.Adopt([]PendingRequest{{At: at, Held: at, Due: at + int64(time.Hour) + int64(i)*int64(time.Second), N: 1, Thr: 1}})
		}
		r.t.mu.Lock()
		n, newest := len(r.t.pending), r.t.pending[len(r.t.pending)-1]
		r.t.mu.Unlock()
		if n != maxPending || newest.N != 2*maxPending+1 {
			t.Fatalf("%d entries, the newest holding %d; want %d and %d", n, newest.N, maxPending, 2*maxPending+1)
		}
		last := int64(3*maxPending - 1)
		if want := now + last*int64(time.Millisecond) + int64(time.Hour) + last*int64(time.Second); newest.Due != want {
			t.Fatalf("the newest entry is due at %d, want %d: the latest deadline among those it took", newest.Due, want)
		}
		if newest.Held != newest.At || newest.At != now+int64(maxPending-1)*int64(time.Millisecond) {
			t.Fatalf("the newest entry was sent at %d, held to %d; want the earliest of those it took", newest.At, newest.Held)
		}
		// A request of another threshold (another listener's: 0 is never
		// to count) joins no entry of this one's: with none of its own,
		// it is dropped unjudged.
		r.t.Adopt([]PendingRequest{{At: now, Held: now, Due: now + int64(time.Hour), N: 1, Thr: 0}})
		r.t.mu.Lock()
		n, newest = len(r.t.pending), r.t.pending[len(r.t.pending)-1]
		r.t.mu.Unlock()
		if n != maxPending || newest.N != 2*maxPending+1 || newest.Thr != 1 {
			t.Fatalf("after a request of threshold 0: %d entries, the newest holding %d of threshold %d; want it dropped", n, newest.N, newest.Thr)
		}
		// Every request is judged, none lost: the last verdict is at the
		// latest deadline.
		if _, _, counted := r.after(time.Hour + time.Duration(3*maxPending)*(time.Second+time.Millisecond)); counted != 3*maxPending {
			t.Fatalf("%d unanswered, want %d", counted, 3*maxPending)
		}
	})
}

// stop hands over the requests not yet judged and not covered; the
// endpoint's tracker adopts and judges them at their own deadlines.
func TestTrackerStopAndAdopt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newTrackerRig(10*time.Millisecond, false)
		r.send(time.Second, 10)
		time.Sleep(200 * time.Millisecond)
		r.send(time.Second, 20)
		orphans := r.t.Stop()
		if len(orphans) != 2 {
			t.Fatalf("%d orphans, want 2", len(orphans))
		}
		ep := newTrackerRig(10*time.Millisecond, false)
		defer ep.t.Stop()
		ep.t.Adopt(orphans)
		if v, _, counted := ep.after(900 * time.Millisecond); len(v) != 1 || counted != 1 {
			t.Fatalf("verdicts %v: want the first orphan judged at its own deadline", v)
		}
		if _, _, counted := ep.after(300 * time.Millisecond); counted != 2 {
			t.Fatalf("%d unanswered, want 2", counted)
		}
	})
}

// Past maxPending, requests each answered before the next (records kept
// for the staleness check only) leave room for the next request's own
// record: a request left unanswered after them is judged at its own
// deadline. Before, it joined the newest record, answered already, and
// was never judged.
func TestTrackerFullOfAnsweredRecordsJudgesTheNext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newTrackerRig(time.Millisecond, false)
		defer r.t.Stop()
		for i := range 3 * maxPending {
			r.send(time.Hour, int64(i+1))
			time.Sleep(time.Millisecond)
			r.answer.Store(Mono())
			time.Sleep(time.Millisecond)
		}
		if n := r.t.Records(); n != maxPending {
			t.Fatalf("%d records, want %d", n, maxPending)
		}
		r.send(time.Second, int64(3*maxPending+1))
		if _, _, counted := r.after(time.Second + 2*time.Millisecond); counted != 1 {
			t.Fatalf("%d unanswered at the last request's deadline, want 1", counted)
		}
	})
}

// Past maxPending, a request that joins the newest record waiting for
// its verdict keeps its own deadline when it is the later one: a
// request the server may hold longer than the newest record's is not
// judged by that one's deadline.
func TestTrackerJoinPastTheBoundKeepsTheLaterDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newTrackerRig(time.Millisecond, false)
		defer r.t.Stop()
		for i := range maxPending {
			r.send(time.Hour, int64(i+1))
			time.Sleep(2 * time.Millisecond)
		}
		now := Mono()
		r.t.Sent(PendingRequest{At: now, Held: now + int64(2*time.Hour), Due: now + int64(3*time.Hour), End: maxPending + 1, N: 1, Thr: 3})
		r.t.mu.Lock()
		n, newest := len(r.t.pending), r.t.pending[len(r.t.pending)-1]
		r.t.mu.Unlock()
		if n != maxPending || newest.N != 2 {
			t.Fatalf("%d records, the newest holding %d; want %d and 2", n, newest.N, maxPending)
		}
		if want := now + int64(3*time.Hour); newest.Due != want {
			t.Fatalf("the newest record is due at %d, want %d: the later deadline", newest.Due, want)
		}
	})
}

// An endpoint's tracker full of adopted requests that were answered
// since (clients that gave up on a slow server, which then answered)
// leaves room for the next adopted request's own record: a server that
// stopped then is judged by it. Before, it joined the newest record,
// answered already, and was never judged.
func TestTrackerAdoptFullOfAnsweredJudgesTheNext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newTrackerRig(time.Millisecond, false)
		defer r.t.Stop()
		for range 3 * maxPending {
			at := Mono()
			r.t.Adopt([]PendingRequest{{At: at, Held: at, Due: at + int64(time.Hour), N: 1, Thr: 3}})
			time.Sleep(time.Millisecond)
			r.answer.Store(Mono())
			time.Sleep(time.Millisecond)
		}
		if n := r.t.Records(); n != maxPending {
			t.Fatalf("%d records, want %d", n, maxPending)
		}
		at := Mono()
		r.t.Adopt([]PendingRequest{{At: at, Held: at, Due: at + int64(time.Second), N: 1, Thr: 3}})
		if _, _, counted := r.after(time.Second + 2*time.Millisecond); counted != 1 {
			t.Fatalf("%d unanswered at the last request's deadline, want 1", counted)
		}
	})
}

// TestExpireLockedIsTheOneCopyPass checks expireLocked, the two passes in
// place, against the pass it replaced (a copy of each entry, kept ones
// appended to a new list), on lists of entries mixed at random: due,
// judged already, expired or not, in any order. The list left, the
// judged copies and their order, left and next must be the same.
func TestExpireLockedIsTheOneCopyPass(t *testing.T) {
	reference := func(pending []PendingRequest, now int64) (kept, judged []PendingRequest, left int, next int64) {
		next = Never
		for _, r := range pending {
			if !r.judged && r.Due <= now {
				r.judged, r.Verdict = true, true
			}
			r.Expired = r.last <= now
			if r.Verdict || r.Expired {
				judged = append(judged, r)
			}
			if r.Expired {
				continue
			}
			r.Verdict = false
			kept = append(kept, r)
			next = min(next, r.next())
			left += int(r.N)
		}
		return kept, judged, left, next
	}
	rnd := rand.New(rand.NewPCG(25, 1))
	for round := range 2000 {
		const now = 1000
		pending := make([]PendingRequest, rnd.IntN(40))
		for i := range pending {
			due := now + int64(rnd.IntN(7)) - 3
			pending[i] = PendingRequest{At: int64(i), Due: due, last: due + int64(rnd.IntN(5)),
				End: int64(10 * i), N: int32(1 + rnd.IntN(3)), judged: rnd.IntN(3) == 0}
		}
		wantKept, wantJudged, wantLeft, wantNext := reference(slices.Clone(pending), now)
		tr := &Tracker{pending: slices.Clone(pending)}
		judged, left, next := tr.expireLocked(now)
		if !slices.Equal(tr.pending, wantKept) && len(tr.pending)+len(wantKept) > 0 {
			t.Fatalf("round %d: kept %+v, want %+v", round, tr.pending, wantKept)
		}
		if !slices.Equal(judged, wantJudged) && len(judged)+len(wantJudged) > 0 {
			t.Fatalf("round %d: judged %+v, want %+v", round, judged, wantJudged)
		}
		if left != wantLeft || next != wantNext {
			t.Fatalf("round %d: left %d next %d, want %d and %d", round, left, next, wantLeft, wantNext)
		}
	}
}
