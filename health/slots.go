package health

import (
	"context"
	"slices"
	"sync"
	"time"
)

// DefaultMaxProbes is how many probes a Detector runs at once when
// Options.MaxProbes is not set. Each holds a descriptor (its connection)
// for its own time (its Timeout) at most; the proxy's descriptor check
// keeps this many beside the links' and the rest of its reserve.
const DefaultMaxProbes = 256

// probeSlots bounds the probes in flight. A probe that finds every slot
// taken waits for one, first come first served among its kind, so that
// in a zone outage (thousands of endpoints excluded at once) a recovered
// endpoint is probed after those already waiting, each of which holds
// its slot for its Timeout at most, not after a round of every excluded
// endpoint's backoff. There are two kinds: a probe of an endpoint whose
// clients are turned away (wanted) goes ahead of the probes nobody waits
// on, each of which it may overtake max times at most, so that those
// are delayed by one round of the slots at most, never starved; a probe
// that queued unwanted goes ahead so once its clients are turned away
// (acquire asks again while it waits). Waiting is no verdict: the probe
// has not run.
type probeSlots struct {
	mu      sync.Mutex
	max     int
	running int
	waiters []slotWaiter // oldest first
	peak    int          // the most probes in flight at once (tests)
}

// slotWaiter is a probe waiting for a slot: turn is closed when it is
// handed one. overtaken counts the wanted probes queued ahead of one
// that is not.
type slotWaiter struct {
	endpoint  string
	turn      chan struct{}
	wanted    bool
	overtaken int
}

// acquire takes a slot for a probe of endpoint, waiting its turn behind
// earlier callers of its kind (wanted: clients are turned away for want
// of endpoint), and behind earlier callers of the other kind unless it
// is wanted and they may still be overtaken; false if ctx ended first
// (no slot is held then). A probe that waits without being wanted asks
// waiting (when set) again every WaitingInterval/2, and goes ahead as a
// wanted one once it reports clients turned away: a probe may wait for
// many rounds of the slots, and its clients may start waiting meanwhile
// (a pool's member whose probe queued while the pool routed to others).
func (s *probeSlots) acquire(ctx context.Context, endpoint string, wanted bool, waiting func() bool) bool {
	s.mu.Lock()
	if s.running < s.max && len(s.waiters) == 0 {
		s.running++
		s.peak = max(s.peak, s.running)
		s.mu.Unlock()
		return true
	}
	turn := make(chan struct{})
	s.enqueueLocked(slotWaiter{endpoint: endpoint, turn: turn, wanted: wanted})
	s.mu.Unlock()
	if !wanted && waiting != nil {
		if s.awaitUnwanted(ctx, turn, waiting) {
			return true
		}
	} else {
		select {
		case <-turn:
			return true
		case <-ctx.Done():
		}
	}
	s.mu.Lock()
	select {
	case <-turn: // handed a slot as ctx ended: hand it on
		s.mu.Unlock()
		s.release()
		return false
	default:
	}
	if i := slices.IndexFunc(s.waiters, func(w slotWaiter) bool { return w.turn == turn }); i >= 0 {
		s.waiters = slices.Delete(s.waiters, i, i+1)
	}
	s.mu.Unlock()
	return false
}

// awaitUnwanted waits for turn, the turn of a probe queued unwanted,
// asking waiting every WaitingInterval/2 (without the lock: it asks the
// data plane) until it reports clients turned away, then putting the
// probe ahead as a wanted one (promoteLocked). It reports whether the
// turn came; false once ctx ended.
func (s *probeSlots) awaitUnwanted(ctx context.Context, turn chan struct{}, waiting func() bool) bool {
	ask := time.NewTicker(WaitingInterval / 2)
	defer ask.Stop()
	for {
		select {
		case <-turn:
			return true
		case <-ctx.Done():
			return false
		case <-ask.C:
		}
		if !waiting() {
			continue
		}
		s.mu.Lock()
		if i := slices.IndexFunc(s.waiters, func(w slotWaiter) bool { return w.turn == turn }); i >= 0 {
			s.promoteLocked(i)
		}
		s.mu.Unlock()
		ask.Stop()
		select {
		case <-turn:
			return true
		case <-ctx.Done():
			return false
		}
	}
}

// enqueueLocked queues w: at the end, or, wanted, ahead of the probes
// nobody waits on that may still be overtaken (promoteLocked).
func (s *probeSlots) enqueueLocked(w slotWaiter) {
	s.waiters = append(s.waiters, w)
	if w.wanted {
		s.promoteLocked(len(s.waiters) - 1)
	}
}

// promoteLocked makes the waiter at k wanted and moves it ahead of the
// probes nobody waits on queued before it that may still be overtaken,
// each of which then counts one more overtaking; never behind where it
// was, nor ahead of a wanted probe queued before it.
func (s *probeSlots) promoteLocked(k int) {
	w := s.waiters[k]
	w.wanted = true
	i := k
	for i > 0 && !s.waiters[i-1].wanted && s.waiters[i-1].overtaken < s.max {
		i--
	}
	for j := i; j < k; j++ {
		s.waiters[j].overtaken++
	}
	copy(s.waiters[i+1:k+1], s.waiters[i:k])
	s.waiters[i] = w
}

// release gives a slot back: to the oldest waiter, if any.
func (s *probeSlots) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.waiters) == 0 {
		s.running--
		return
	}
	turn := s.waiters[0].turn
	s.waiters[0] = slotWaiter{}
	s.waiters = s.waiters[1:]
	close(turn)
}

// waitingFor is the set of endpoints whose probe waits for a slot, nil
// when none does.
func (s *probeSlots) waitingFor() map[string]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.waiters) == 0 {
		return nil
	}
	m := make(map[string]bool, len(s.waiters))
	for _, w := range s.waiters {
		m[w.endpoint] = true
	}
	return m
}

// ProbeSlots reports the probes in flight now and those due that wait for
// a slot (Options.MaxProbes).
func (d *Detector) ProbeSlots() (inFlight, waiting int) {
	d.slots.mu.Lock()
	defer d.slots.mu.Unlock()
	return d.slots.running, len(d.slots.waiters)
}
