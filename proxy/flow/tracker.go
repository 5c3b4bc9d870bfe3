package flow

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// clockBase anchors mono: tracker times are monotonic nanoseconds.
var clockBase = time.Now()

func Mono() int64 { return int64(time.Since(clockBase)) }

// MonoOf is the mono time of t, a time.Now() reading of this process
// (compared by its monotonic clock, as Mono is).
func MonoOf(t time.Time) int64 { return int64(t.Sub(clockBase)) }

// Never is the due time of a request that is never judged.
const Never = math.MaxInt64

// NoAnswer is the last answer time of an endpoint that never answered.
const NoAnswer = math.MinInt64

// PendingRequest is one or more requests handed on close together and not
// yet judged.
type PendingRequest struct {
	At int64 // mono time the first of them was handed on
	// Held is the mono time until which the server may hold it by its
	// protocol (a long poll's max_wait, an acks=all Produce's timeout_ms;
	// at for a request that asks for no hold): an answer after it is life.
	Held int64
	Due  int64 // mono time the first of their deadlines passes: the verdict
	last int64 // mono time the last of their deadlines passes: staleness
	End  int64 // stream offset just past the last byte of the last one
	N    int32 // how many requests
	Thr  int32 // consecutive_timeouts_threshold of the listener that sent them
	// Abandoned, when not 0, is the end of a shorter hold that judges the
	// request once its client has abandoned it (closed the link while it
	// waited): a hold the protocol allows that no client waits out (a
	// Kafka transaction's, up to 15 minutes). 0: an abandoned request is
	// not judged.
	Abandoned int64
	// judged: the verdict was given at due; the entry is kept until last
	// for the staleness check only.
	judged bool
	// verdict and expired say what a judgement is about (set only on the
	// copies handed to judge): due passed just now (count it if
	// unanswered), last passed (check staleness; the entry is gone).
	Verdict, Expired bool
}

// next is when the entry must be looked at again.
func (r *PendingRequest) next() int64 {
	if r.judged {
		return r.last
	}
	return r.Due
}

// maxPending bounds a tracker's list. Requests sent with no answer in
// between share an entry (see tracker), so a dead server's requests fill
// about (longest deadline / slack) entries whatever the request rate; a
// live server's answered requests each keep an entry until their deadline
// (for the staleness check), and past the bound new requests join the
// newest entry.
const maxPending = 1024

// Tracker holds requests until their deadline and then judges them.
//
// The rule (the README's "What counts as a dead upstream"): a request
// whose deadline passed counts as unanswered only if the endpoint answered
// nothing at all, on any link, since the request was sent, or, for one
// the server may hold by its protocol (a Kafka Fetch's max_wait_ms, an
// acks=all Produce's timeout_ms), since that hold ended, unless it had its
// own answer (AnsweredThrough: Kafka matches responses to requests). An
// answer to any request proves the server process alive and reading;
// whether this particular request is still being worked on is the
// protocol's business, judged by the deadline the request itself carries. Answers while a request is held say the server was alive while
// it was entitled to hold it; past the hold it owes an answer within the
// deadline, and answering nothing at all meanwhile is a stop. One such
// request is the evidence (the default threshold is 1): the verdict comes
// by the clock, whatever the clients' request rate.
//
// Requests handed on with holds and deadlines within slack of each other
// share an entry (the earliest send time, hold end and deadline, the
// latest deadline for staleness) as long as no answer came since the
// entry's hold ended: an answer then covers all of them or none, give or
// take the slack, and the verdict at the earliest deadline is that
// request's own, with the bias toward not counting. Past maxPending
// entries, new requests join the newest entry waiting for its verdict
// whatever came in between, with the later deadline and the earlier hold
// (joinLocked); that can only delay a verdict.
//
// A link's tracker judges the link's requests; when the link ends, its
// unjudged requests are handed to the endpoint's tracker (adopt), so a
// client that gives up and closes first does not hide a dead server.
type Tracker struct {
	slack int64
	// perBurst: opaque mode. A request is a burst of bytes sent since the
	// last answer; it is recorded once.
	perBurst bool
	answer   *atomic.Int64 // mono time of the endpoint's last answer; NoAnswer: none
	// answeredEnd is the stream end of the last request known answered
	// (Kafka: responses are matched to requests, in order): a request
	// up to there had its own answer, whatever its hold.
	answeredEnd atomic.Int64
	// judge receives every entry whose first deadline (verdict) or last
	// deadline (expired) passed, from the timer's goroutine (two may
	// overlap when the timer was reset while one ran). left is how many
	// requests are still pending.
	judge func(judged []PendingRequest, left int)

	mu      sync.Mutex
	pending []PendingRequest
	timer   *time.Timer
	armed   int64 // the due time the timer is set for; 0: not set
	stopped bool
	judging sync.WaitGroup // an expire in progress; stop waits for it
	// recorded counts the requests Sent recorded (per-burst: the bursts'
	// records), for tests and diagnostics.
	recorded int64
}

func NewTracker(slack time.Duration, perBurst bool, answer *atomic.Int64, judge func([]PendingRequest, int)) *Tracker {
	return &Tracker{slack: int64(slack), perBurst: perBurst, answer: answer, judge: judge}
}

// JudgingSlack is how long after a deadline its judgement may come (one
// timer for requests due close together); an answer in that window still
// counts as on time.
func JudgingSlack(requestTimeout time.Duration) time.Duration {
	return max(min(requestTimeout/10, 100*time.Millisecond), time.Millisecond)
}

// Covered reports whether the endpoint answered anything after r was sent
// (or, for a request it may hold, after that hold ended), or r had its own
// answer.
func (t *Tracker) Covered(r *PendingRequest) bool {
	return t.answer.Load() > r.Held || t.answeredEnd.Load() >= r.End && r.End > 0
}

// AnsweredThrough records that every request ending at or before stream
// offset end has had its own answer.
func (t *Tracker) AnsweredThrough(end int64) {
	for {
		cur := t.answeredEnd.Load()
		if cur >= end || t.answeredEnd.CompareAndSwap(cur, end) {
			return
		}
	}
}

// Sent records r (n requests handed on at r.at, due at r.due, ending at
// stream offset r.end; r.last, when later than r.due, is when the last of
// them is due).
func (t *Tracker) Sent(r PendingRequest) {
	if r.last == 0 || r.last < r.Due { // 0: not set (mono times may be negative in tests)
		r.last = r.Due
	}
	if r.Held == 0 || r.Held < r.At {
		r.Held = r.At
	}
	r.judged, r.Verdict, r.Expired = false, false, false // expireLocked's marks
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return
	}
	t.recorded += int64(r.N)
	if last := len(t.pending) - 1; last >= 0 {
		l := &t.pending[last]
		switch {
		case t.perBurst && !t.Covered(l):
			// Still the same burst: no answer since it began. The burst is
			// due request_timeout after its last byte.
			l.End, l.Due, l.last = r.End, max(l.Due, r.Due), max(l.last, r.last)
			if !l.judged {
				t.armLocked(l.Due)
			}
			return
		case t.perBurst:
			// l was answered: a new burst begins. A burst answered is
			// done with (opaque mode checks no staleness), and kept it
			// would hold a record per request a fast request/response
			// client made within request_timeout, unbounded.
			t.pending = slices.DeleteFunc(t.pending, func(r PendingRequest) bool { return t.Covered(&r) })
		case !t.perBurst && last+1 >= maxPending && t.roomLocked():
			// r takes the room with a verdict of its own.
		case !t.perBurst && last+1 >= maxPending:
			// Full: r joins the newest entry waiting for its verdict, in
			// the way that can only put a verdict off (see joinLocked).
			// With none, it keeps the newest's staleness check.
			if !t.joinLocked(r) {
				l.N += r.N
				l.End, l.last = max(l.End, r.End), max(l.last, r.last)
			}
			return
		case !t.perBurst && l.Thr == r.Thr && !l.judged && within(r.Held, l.Held, t.slack) &&
			within(r.Due, l.Due, t.slack) && !t.Covered(l):
			// No answer since l's hold ended: any later answer covers all
			// of them or none (within the slack), so sharing an entry
			// changes no verdict but by the slack, toward not counting.
			l.N += r.N
			l.End, l.Due, l.last, l.Held = r.End, min(l.Due, r.Due), max(l.last, r.last), min(l.Held, r.Held)
			if l.Abandoned == 0 || r.Abandoned == 0 {
				l.Abandoned = 0 // one of them is not judged once abandoned: nor is the entry
			} else {
				l.Abandoned = min(l.Abandoned, r.Abandoned)
			}
			t.armLocked(l.next())
			return
		}
	}
	if t.perBurst {
		r.N = 1
	}
	t.pending = append(t.pending, r)
	t.armLocked(r.Due)
}

// doneWith reports whether r needs no verdict any more: it had one, or
// an answer covers it.
func (t *Tracker) doneWith(r *PendingRequest) bool { return r.judged || t.Covered(r) }

// within reports whether a and b are less than d apart.
func within(a, b, d int64) bool { return a-b < d && b-a < d }

// Adopt takes over requests whose link ended before they were judged.
// The list stays within maxPending however many links end with requests
// outstanding (an endpoint that went quiet under a high connection churn):
// past it, an adopted request joins the newest entry not yet judged with
// the same threshold (an endpoint's record holds the requests of every
// listener routing to it, and a threshold of 0 is never to count), in the
// way that can only put a verdict off (the later deadline, the earlier
// hold), or, with none, is dropped unjudged.
func (t *Tracker) Adopt(rs []PendingRequest) {
	if len(rs) == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return
	}
	for _, r := range rs {
		r.last = r.Due // the link is gone: nothing can be stale
		r.Verdict, r.Expired = false, false
		if len(t.pending) < maxPending || t.roomLocked() {
			t.pending = append(t.pending, r)
			t.armLocked(r.Due)
			continue
		}
		t.joinLocked(r)
	}
}

// roomLocked makes room for one entry in a full list when the two newest
// need no verdict any more (doneWith): they are kept for the staleness
// check alone, which one entry does for both (the later deadline, toward
// not dropping). A request joined to an answered entry had no verdict of
// its own: a server that stopped while a client made request after
// request, each answered (or, at an endpoint, while clients gave up on
// requests it answered after), was never judged by the request left
// waiting. It reports false when the two newest are not both done with.
// t.mu is held.
func (t *Tracker) roomLocked() bool {
	last := len(t.pending) - 1
	if last < 1 || !t.doneWith(&t.pending[last]) || !t.doneWith(&t.pending[last-1]) {
		return false
	}
	p, l := &t.pending[last-1], &t.pending[last]
	p.N += l.N
	p.End, p.last, p.judged = max(p.End, l.End), max(p.last, l.last), true
	t.pending = t.pending[:last]
	return true
}

// joinLocked adds r to the newest entry not yet judged with r's threshold
// (an endpoint's record holds the requests of every listener routing to
// it, and a threshold of 0 is never to count), in the way that can only
// put a verdict off: the later deadline, the earlier hold and send. The
// entry then counts only if r would have counted on its own, and no
// sooner: a request the server may hold longer than the newest entry's
// is not judged by that one's deadline. It reports false when there is
// none. t.mu is held.
func (t *Tracker) joinLocked(r PendingRequest) bool {
	for i := len(t.pending) - 1; i >= 0; i-- {
		if l := &t.pending[i]; !l.judged && l.Thr == r.Thr {
			l.N += r.N
			l.At, l.Held, l.End = min(l.At, r.At), min(l.Held, r.Held), max(l.End, r.End)
			l.Due, l.last = max(l.Due, r.Due), max(l.last, r.last)
			if l.Abandoned == 0 || r.Abandoned == 0 {
				l.Abandoned = 0
			} else {
				l.Abandoned = max(l.Abandoned, r.Abandoned)
			}
			t.armLocked(l.next())
			return true
		}
	}
	return false
}

// Defer gives the requests of entries just given their verdict another
// one at due: the judge could not tell (the server's bytes wait unread in
// the proxy, whose client is not reading).
func (t *Tracker) Defer(rs []PendingRequest, due int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return
	}
	for _, r := range rs {
		r.judged, r.Verdict, r.Expired = false, false, false
		r.Due, r.last = due, max(r.last, due)
		t.pending = append(t.pending, r)
		t.armLocked(due)
	}
}

// Clear forgets every pending request (an endpoint readmitted starts
// afresh: requests sent to the previous incarnation are not held against
// the new one; a link no longer tracked forgets what it recorded).
func (t *Tracker) Clear() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.pending = t.pending[:0]
}

// armLocked makes the timer fire by due (plus slack); t.mu is held.
func (t *Tracker) armLocked(due int64) {
	if due == Never || (t.armed != 0 && t.armed <= due) {
		return
	}
	t.armed = due
	d := time.Duration(max(due-Mono(), 0) + t.slack)
	if t.timer == nil {
		t.timer = time.AfterFunc(d, t.expire)
	} else {
		t.timer.Reset(d)
	}
}

// OverdueEnd returns the stream end of the newest entry whose last
// deadline has passed without a judgement yet (0 if none), and when the
// earliest of them was sent: the writer must not send bytes up to there,
// unless the upstream is still taking them in (see tcpEnd.writeUpstream).
func (t *Tracker) OverdueEnd(now int64) (end, sent int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range t.pending {
		if r.last <= now {
			if end == 0 || r.At < sent {
				sent = r.At
			}
			end = max(end, r.End)
		}
	}
	return end, sent
}

// expire judges every entry whose first deadline has passed (the
// verdict) and hands on those whose last deadline has passed (staleness).
func (t *Tracker) expire() {
	t.mu.Lock()
	if t.stopped {
		t.mu.Unlock()
		return
	}
	t.judging.Add(1)
	defer t.judging.Done()
	judged, left, next := t.expireLocked(Mono())
	t.armed = 0
	t.armLocked(next)
	t.mu.Unlock()
	if len(judged) > 0 {
		t.judge(judged, left)
	}
}

// expireLocked gives a verdict to every entry whose first deadline has
// passed at now, drops those whose last deadline has, and returns copies
// of both for judge (Verdict, Expired), how many requests are left and
// the earliest time an entry left must be looked at again. t.mu is held.
//
// It works in place, in two passes over the list: it is looked at every
// slack on a live link, and a link whose requests are answered keeps
// about one entry per request for request_timeout (up to maxPending), so
// the first pass touches each entry only to read its times, and the
// second moves the entries left in runs (one copy each) once they are
// counted, into a judged slice made once, at its size.
func (t *Tracker) expireLocked(now int64) (judged []PendingRequest, left int, next int64) {
	next = Never
	n := 0
	for i := range t.pending {
		r := &t.pending[i]
		// An entry in the list has Verdict and Expired false; they are set
		// here for the second pass and the copies.
		if !r.judged && r.Due <= now {
			r.judged, r.Verdict = true, true
		}
		if r.last <= now {
			r.Expired = true
		}
		if r.Verdict || r.Expired {
			n++
		}
		if !r.Expired {
			next = min(next, r.next())
			left += int(r.N)
		}
	}
	if n == 0 {
		return nil, left, next
	}
	judged = make([]PendingRequest, 0, n)
	w := 0
	for i := 0; i < len(t.pending); {
		r := &t.pending[i]
		if r.Verdict || r.Expired {
			judged = append(judged, *r)
			r.Verdict = false
		}
		if r.Expired {
			i++
			continue
		}
		j := i + 1 // a run of entries kept
		for j < len(t.pending) && !t.pending[j].Expired {
			if p := &t.pending[j]; p.Verdict {
				judged = append(judged, *p)
				p.Verdict = false
			}
			j++
		}
		if w != i {
			copy(t.pending[w:], t.pending[i:j])
		}
		w += j - i
		i = j
	}
	t.pending = t.pending[:w]
	return judged, left, next
}

// Unanswered returns how many requests of the entries just given their
// verdict count as unanswered, per the rule above, and since when the
// endpoint has been silent with one of them outstanding (its send, or the
// endpoint's last answer if that came later, during its hold). It must be
// called from judge.
func (t *Tracker) Unanswered(judged []PendingRequest) (n int, since int64) {
	return t.UnansweredFrom(judged, NoAnswer)
}

// UnansweredFrom is Unanswered for the requests whose silence began at
// mono time from or later (sent then, or answered-after since): those
// sent before an endpoint's readmission are left out.
func (t *Tracker) UnansweredFrom(judged []PendingRequest, from int64) (n int, since int64) {
	since = Never
	last := t.answer.Load()
	for i := range judged {
		if r := &judged[i]; r.Verdict && !t.Covered(r) && max(r.At, last) >= from {
			n += int(r.N)
			since = min(since, max(r.At, last))
		}
	}
	return n, since
}

// Extend moves the deadlines of every request after stream offset after
// that has no verdict yet to due at the earliest, and the end of their
// hold to held: the server cannot have started on them before now (a
// Kafka broker answers a connection's requests one at a time, and may hold
// each for its own time once it starts on it).
func (t *Tracker) Extend(after, held, due int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.pending {
		if r := &t.pending[i]; !r.judged && r.End > after {
			r.Due, r.Held, r.last = max(r.Due, due), max(r.Held, held), max(r.last, due)
		}
	}
}

// NextDue is the earliest deadline of the requests waiting for their
// verdict; Never when none waits.
func (t *Tracker) NextDue() int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	due := int64(Never)
	for _, r := range t.pending {
		if !r.judged {
			due = min(due, r.Due)
		}
	}
	return due
}

// Recorded is how many requests Sent has recorded.
func (t *Tracker) Recorded() int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.recorded
}

// Records is how many entries the tracker keeps (at most maxPending in
// framed mode), for tests and diagnostics.
func (t *Tracker) Records() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.pending)
}

// Pending is how many requests wait for their verdict.
func (t *Tracker) Pending() (n int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range t.pending {
		if !r.judged {
			n += int(r.N)
		}
	}
	return n
}

// Stop ends tracking and returns the requests not yet given their verdict
// that have seen no answer, so that the endpoint can judge them. A judgement already
// running finishes first.
func (t *Tracker) Stop() []PendingRequest {
	t.mu.Lock()
	t.stopped = true
	if t.timer != nil {
		t.timer.Stop()
	}
	var orphans []PendingRequest
	for i := range t.pending {
		if r := &t.pending[i]; !r.judged && !t.Covered(r) {
			orphans = append(orphans, *r)
		}
	}
	t.pending = nil
	t.mu.Unlock()
	t.judging.Wait()
	return orphans
}
