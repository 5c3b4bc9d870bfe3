package pinotsim

import (
	"context"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// Record is one query of a Load: when it was sent, when it ended, how.
type Record struct {
	Sent time.Time
	Done time.Time
	Result
}

// Load sends one query every interval to addr through a broker, each in
// its own goroutine (a broker serving concurrent users pipelines them on
// its one connection), until stopped, until max queries were sent or until
// maxDuration passed. Every query ends at the latest at the broker's
// timeout. The caller owns it: Stop (or Finish) ends every goroutine.
type Load struct {
	b    *Broker
	addr string

	ctx      context.Context // cuts queries still waiting at Stop
	cancel   context.CancelFunc
	stopSend chan struct{}
	loopWG   sync.WaitGroup
	qWG      sync.WaitGroup
	sendOnce sync.Once
	once     sync.Once

	sent atomic.Int64

	mu      sync.Mutex
	records []Record
}

// StartLoad starts a Load.
func StartLoad(b *Broker, addr string, interval time.Duration, max int, maxDuration time.Duration) *Load {
	ctx, cancel := context.WithCancel(context.Background())
	l := &Load{b: b, addr: addr, ctx: ctx, cancel: cancel, stopSend: make(chan struct{})}
	l.loopWG.Add(1)
	go func() {
		defer l.loopWG.Done()
		tick := time.NewTicker(interval)
		defer tick.Stop()
		end := time.NewTimer(maxDuration)
		defer end.Stop()
		for range max {
			l.One()
			select {
			case <-l.stopSend:
				return
			case <-end.C:
				return
			case <-tick.C:
			}
		}
	}()
	return l
}

// One sends one query in its own goroutine.
func (l *Load) One() {
	l.qWG.Add(1)
	l.sent.Add(1)
	go func() {
		defer l.qWG.Done()
		sent := time.Now()
		res := l.b.Query(l.ctx, l.addr)
		l.mu.Lock()
		l.records = append(l.records, Record{Sent: sent, Done: time.Now(), Result: res})
		l.mu.Unlock()
	}()
}

// Stop stops sending, cuts the queries in flight and waits for every
// query goroutine.
func (l *Load) Stop() { l.Finish(0) }

// Pause stops the sending loop; queries in flight go on, and One may still
// send single queries.
func (l *Load) Pause() {
	l.sendOnce.Do(func() { close(l.stopSend) })
	l.loopWG.Wait()
}

// Finish stops sending and lets the queries in flight end on their own
// (each at the latest at the broker's timeout), cutting those still
// waiting after wait.
func (l *Load) Finish(wait time.Duration) {
	l.once.Do(func() {
		l.Pause()
		done := make(chan struct{})
		go func() {
			l.qWG.Wait()
			close(done)
		}()
		t := time.NewTimer(wait)
		select {
		case <-done:
		case <-t.C:
		}
		t.Stop()
		l.cancel()
		<-done
	})
}

// Records returns the queries that ended so far, in the order they were sent.
func (l *Load) Records() []Record {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := append([]Record(nil), l.records...)
	sort.Slice(out, func(i, j int) bool { return out[i].Sent.Before(out[j].Sent) })
	return out
}

// WaitSent waits up to timeout until n queries were sent.
func (l *Load) WaitSent(n int, timeout time.Duration) bool {
	for deadline := time.Now().Add(timeout); l.sent.Load() < int64(n); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			return false
		}
	}
	return true
}

// WaitOK waits up to timeout for n queries sent at or after t0 to succeed.
func (l *Load) WaitOK(t0 time.Time, n int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for {
		ok := 0
		for _, r := range l.Records() {
			if !r.Sent.Before(t0) && r.Outcome == OK {
				ok++
			}
		}
		if ok >= n {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// FirstOK returns the first of rs sent at or after t0 that succeeded.
func FirstOK(rs []Record, t0 time.Time) (Record, bool) {
	for _, r := range rs {
		if !r.Sent.Before(t0) && r.Outcome == OK {
			return r, true
		}
	}
	return Record{}, false
}

// FinishAll finishes the loads (Finish(wait)) together.
func FinishAll(ls []*Load, wait time.Duration) {
	var wg sync.WaitGroup
	for _, l := range ls {
		wg.Add(1)
		go func() { defer wg.Done(); l.Finish(wait) }()
	}
	wg.Wait()
}

// Recovery is the time from t0 until every load had a query sent at or
// after t0 succeed (its answer's arrival), or false if one never did.
func Recovery(ls []*Load, t0 time.Time) (time.Duration, bool) {
	var worst time.Duration
	for _, l := range ls {
		f, ok := FirstOK(l.Records(), t0)
		if !ok {
			return 0, false
		}
		worst = max(worst, f.Done.Sub(t0))
	}
	return worst, true
}

// Tally counts queries by outcome.
type Tally struct {
	Sent, OK, FailedFast, TimedOut, Canceled int
}

// Lost counts the queries that failed, fast or by timing out.
func (t Tally) Lost() int { return t.FailedFast + t.TimedOut }

// Count tallies the queries of rs sent in [from, to); a zero to has no
// end.
func Count(rs []Record, from, to time.Time) Tally {
	var t Tally
	for _, r := range rs {
		if r.Sent.Before(from) || (!to.IsZero() && !r.Sent.Before(to)) {
			continue
		}
		t.Sent++
		switch r.Outcome {
		case OK:
			t.OK++
		case FailedFast:
			t.FailedFast++
		case TimedOut:
			t.TimedOut++
		case Canceled:
			t.Canceled++
		}
	}
	return t
}
