package proxy

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
)

// Parking idle links (limits.park_idle_after).
//
// A link's two pumps are goroutines that wait in the runtime's poller, and
// a goroutine keeps its stack (2 KiB at least, more once a deep call grew
// it) for as long as it waits: thousands of idle links (a Pinot broker's,
// a Kafka client's between polls) cost that much each. A link that moved
// no byte either way for park_idle_after gets its pumps parked: each ends
// its goroutine, and the parker's own epoll set (one per process) waits
// for its socket instead. Whatever ends the wait starts the pump's
// goroutine again, and the pump carries on where it stopped: readiness
// (bytes, a FIN, an error on the socket), or the link's close (eviction,
// shutdown, a timer of its own), which resumes every parked pump of the
// link so that it sees the close as a waiting pump would.
//
// Nothing else of the link changes: its timers (the tracker's, the window
// guard's, half_close_timeout) and its evictions run from other goroutines
// whether a pump waits in the poller or in the parker. A link is parked
// only when no byte moved for park_idle_after, which costs a busy link
// nothing; a parked link's next byte costs one goroutine start and an
// epoll_ctl, once per idle spell.
//
// How a pump is parked: the sweep (parkSweepLoop) marks the direction
// (tcpEnd.parkReq) and sets a read deadline in the past on its socket,
// which wakes the pump's wait with os.ErrDeadlineExceeded; the pump sees
// the mark, clears the deadline and parks itself (tcpEnd.park). No byte
// can be lost: the wait ends before any read, and the socket is added to
// the parker's epoll set level-triggered, so bytes already there (or a
// FIN) report it at once.

// A TCP end's pumps, by the socket each reads (the bits of tcpEnd.parkReq
// and tcpEnd.parked, the index of tcpEnd.parkKey).
const (
	parkRequests  = 0 // the request pump, reading the client
	parkResponses = 1 // the response pump, reading the upstream
)

// parkOutcome is what tcpEnd.park did with a pump's read error.
type parkOutcome int8

const (
	parkNone     parkOutcome = iota // not a park request: the error is the read's own
	parkDone                        // the pump is parked (or already resumed elsewhere): its goroutine ends
	parkContinue                    // parking failed: the pump reads on as before
)

// parker holds the parked pumps of a proxy's links and the epoll set that
// waits for their sockets. Its run goroutine ends at stop.
type parker struct {
	log    *zerolog.Logger
	gauge  prometheus.Gauge
	set    *epollSet
	runErr chan error // run's end

	mu     sync.Mutex
	closed bool
	slots  []parkSlot // by the low 32 bits of a key
	free   []uint32   // unused slots
	failed bool       // a park failed and was logged
}

// parkSlot is one parked pump: its end and direction. gen tells a slot's
// uses apart, so that an event still in flight for a pump that was
// resumed by its link's close cannot resume the slot's next holder.
type parkSlot struct {
	e   *tcpEnd
	dir uint8
	gen uint32
}

// newParker opens the parker's epoll set and starts waiting on it.
func newParker(log *zerolog.Logger, gauge prometheus.Gauge) (*parker, error) {
	set, err := newEpollSet()
	if err != nil {
		return nil, err
	}
	pk := &parker{log: log, gauge: gauge, set: set, runErr: make(chan error, 1)}
	go pk.run()
	return pk, nil
}

// run waits on the epoll set until stop. Should the wait fail before that
// (the proxy's own failure), the parker closes and gives every parked
// pump its goroutine back: a pump left in a set nobody waits on would
// never see its socket again.
func (pk *parker) run() {
	err := pk.set.run(pk.wake)
	pk.mu.Lock()
	stopping := pk.closed
	pk.closed = true
	var held []parkSlot
	for i := range pk.slots {
		if pk.slots[i].e != nil {
			held = append(held, pk.slots[i])
			_, _ = pk.releaseLocked(uint32(i))
		}
	}
	pk.mu.Unlock()
	if !stopping {
		pk.log.Error().Err(err).Int("resumed", len(held)).Msg("parker: waiting on its epoll set failed; idle links keep their goroutines from now on")
	}
	for _, s := range held {
		s.e.resume(int(s.dir))
	}
	pk.runErr <- err
}

// stop closes the epoll set and waits for run to end. Pumps still parked
// then are resumed by their links' close, which needs no epoll (or by run,
// on its way out).
func (pk *parker) stop() {
	pk.mu.Lock()
	pk.closed = true
	pk.mu.Unlock()
	pk.set.close()
	<-pk.runErr // the closed set's error: expected
}

// hold records e's pump dir as parked and returns its key; false once the
// parker has stopped.
func (pk *parker) hold(e *tcpEnd, dir int) (uint64, bool) {
	pk.mu.Lock()
	defer pk.mu.Unlock()
	if pk.closed {
		return 0, false
	}
	var i uint32
	if n := len(pk.free); n > 0 {
		i = pk.free[n-1]
		pk.free = pk.free[:n-1]
	} else {
		i = uint32(len(pk.slots))
		pk.slots = append(pk.slots, parkSlot{})
	}
	s := &pk.slots[i]
	s.e, s.dir = e, uint8(dir)
	if s.gen++; s.gen == 0 {
		s.gen = 1 // a key is never 0, which parkKey reads as "not parked"
	}
	key := uint64(s.gen)<<32 | uint64(i)
	e.parkKey[dir] = key
	e.parked.Or(1 << dir)
	pk.gauge.Inc()
	return key, true
}

// releaseLocked frees slot i, whose pump is resumed by the caller.
func (pk *parker) releaseLocked(i uint32) (*tcpEnd, int) {
	s := &pk.slots[i]
	e, dir := s.e, int(s.dir)
	s.e = nil
	pk.free = append(pk.free, i)
	e.parkKey[dir] = 0
	e.parked.And(^uint32(1 << dir))
	pk.gauge.Dec()
	return e, dir
}

// claim takes the pump of key back from the parker; false when it was
// resumed already (by readiness or its link's close).
func (pk *parker) claim(key uint64) (*tcpEnd, int, bool) {
	i, gen := uint32(key), uint32(key>>32)
	pk.mu.Lock()
	defer pk.mu.Unlock()
	if int(i) >= len(pk.slots) || pk.slots[i].e == nil || pk.slots[i].gen != gen {
		return nil, 0, false
	}
	e, dir := pk.releaseLocked(i)
	return e, dir, true
}

// wake is the epoll set's event for key: the socket is readable (or has
// an error or a FIN); the pump's goroutine starts again.
func (pk *parker) wake(key uint64) {
	if e, dir, ok := pk.claim(key); ok {
		e.resume(dir)
	}
}

// resumeAll resumes e's parked pumps: its link is closing.
func (pk *parker) resumeAll(e *tcpEnd) {
	var dirs [2]int
	n := 0
	pk.mu.Lock()
	for dir, key := range e.parkKey {
		if key != 0 {
			_, _ = pk.releaseLocked(uint32(key))
			dirs[n] = dir
			n++
		}
	}
	pk.mu.Unlock()
	for _, dir := range dirs[:n] {
		e.resume(dir)
	}
}

// parkFailed logs, once, that a pump could not be parked: the proxy's own
// failure (the epoll set's limit, memory), which costs the link nothing
// but its goroutine's stack.
func (pk *parker) parkFailed(err error) {
	pk.mu.Lock()
	first := !pk.failed
	pk.failed = true
	pk.mu.Unlock()
	if first {
		pk.log.Warn().Err(err).Msg("parker: an idle link's pump could not be parked; it waits in its goroutine (logged once)")
	}
}

// parkSweepEvery is how often the sweep looks for idle links: a quarter
// of park_idle_after, within these bounds.
const (
	parkSweepMin = 10 * time.Millisecond
	parkSweepMax = time.Second
)

// parkSweepLoop parks the pumps of links idle for park_idle_after, until
// the proxy stops.
func (p *Proxy) parkSweepLoop() {
	defer p.bg.Done()
	t := time.NewTimer(parkSweepMax)
	defer t.Stop()
	for {
		after := time.Duration(p.parkAfter.Load())
		wait := parkSweepMax
		if after > 0 {
			wait = min(max(after/4, parkSweepMin), parkSweepMax)
		}
		t.Reset(wait)
		select {
		case <-p.ctx.Done():
			return
		case <-t.C:
		}
		if after > 0 && p.parker != nil {
			p.parkIdle(after)
		}
	}
}

// parkIdle asks the pumps of every link that moved no byte for after to
// park.
func (p *Proxy) parkIdle(after time.Duration) {
	p.mu.Lock()
	ls := append([]*listener(nil), p.listeners...)
	p.mu.Unlock()
	now := time.Now().UnixNano()
	var idle []*tcpEnd
	for _, l := range ls {
		idle = l.idleEnds(now, int64(after), idle[:0])
		for _, e := range idle {
			e.requestPark()
		}
	}
}

// idleEnds appends to out the TCP ends of l's links that moved no byte
// for after (as far as sweeps at now tell) and have a pump not yet
// parked. The listener's lock is held only to copy its links (accepts and
// link ends wait on it), not while each is looked at: a link that ends
// meanwhile is no longer parkable (parkableEnd).
// The sweep alone reads and writes a link's idleBytes and idleSince, and
// l.swept.
func (l *listener) idleEnds(now, after int64, out []*tcpEnd) []*tcpEnd {
	l.mu.Lock()
	links := l.swept[:0]
	for lk := range l.links {
		links = append(links, lk)
	}
	l.mu.Unlock()
	defer func() {
		clear(links) // holds no ended link until the next sweep
		l.swept = links[:0]
	}()
	for _, lk := range links {
		moved := lk.bytesUp.Load() + lk.bytesDown.Load()
		if moved != lk.idleBytes || lk.idleSince == 0 {
			lk.idleBytes, lk.idleSince = moved, now
			continue
		}
		if now-lk.idleSince < after {
			continue
		}
		if e := lk.parkableEnd(); e != nil {
			out = append(out, e)
			lk.idleSince = now // asked once per park_idle_after at most
		}
	}
	return out
}

// parkableEnd is the link's TCP end when the link is open with both pumps
// running and one of them not parked: a link through the mesh (a stream
// has no readiness to wait for), one still dialling, or one that passed a
// FIN on is left alone.
func (lk *link) parkableEnd() *tcpEnd {
	if _, ok := lk.client.(*tcpClient); !ok || lk.reason.Load() != nil {
		return nil
	}
	lk.connMu.Lock()
	e, ok := lk.up.(*tcpEnd)
	closed := lk.closed
	lk.connMu.Unlock()
	if !ok || closed || e.parked.Load() == 3 {
		return nil
	}
	lk.finMu.Lock()
	fins := lk.fins
	lk.finMu.Unlock()
	if fins > 0 || lk.live.Load() < 2 {
		return nil
	}
	return e
}
