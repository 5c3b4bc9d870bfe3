package health

import (
	"context"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// blackHoles starts n loopback listeners that accept and never answer (a
// stopped broker whose kernel still completes handshakes): a Kafka probe
// of one hangs until its timeout. Each connection is closed when the
// prober closes its end.
func blackHoles(t *testing.T, n int) []string {
	t.Helper()
	var wg sync.WaitGroup
	addrs := make([]string, 0, n)
	lns := make([]net.Listener, 0, n)
	t.Cleanup(func() {
		for _, ln := range lns {
			ln.Close()
		}
		wg.Wait()
	})
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		addrs = append(addrs, ln.Addr().String())
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer c.Close()
					_, _ = io.Copy(io.Discard, c)
				}()
			}
		}()
	}
	return addrs
}

// socketCounter dials the probes' connections and counts them: open
// now, the most open at once, and dials per address.
type socketCounter struct {
	mu     sync.Mutex
	open   int
	peak   int
	dialed map[string]int
	total  atomic.Int32
	hooks  map[string]func() // called under mu as addr is dialled
}

// onDial calls f (under s.mu) when addr is dialled.
func (s *socketCounter) onDial(addr string, f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.hooks == nil {
		s.hooks = map[string]func(){}
	}
	s.hooks[addr] = f
}

func (s *socketCounter) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	s.mu.Lock()
	s.open++
	s.peak = max(s.peak, s.open)
	s.dialed[addr]++
	if f := s.hooks[addr]; f != nil {
		f()
	}
	s.mu.Unlock()
	s.total.Add(1)
	c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		s.closed()
		return nil, err
	}
	return &countedConn{Conn: c, s: s}, nil
}

func (s *socketCounter) closed() {
	s.mu.Lock()
	s.open--
	s.mu.Unlock()
}

// waitsForSlot reports whether a probe of endpoint waits for a slot.
func (d *Detector) waitsForSlot(endpoint string) bool {
	d.slots.mu.Lock()
	defer d.slots.mu.Unlock()
	for _, w := range d.slots.waiters {
		if w.endpoint == endpoint {
			return true
		}
	}
	return false
}

type countedConn struct {
	net.Conn
	s    *socketCounter
	once sync.Once
}

func (c *countedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.s.closed)
	return err
}

// In a zone outage every endpoint is excluded at once; their probes run
// at most MaxProbes at a time, so they cannot take the descriptors the
// links need. Before (found by an audit), every excluded endpoint's
// probe dialled at once: 1000 excluded endpoints, 1000 sockets.
func TestProbesInFlightAreBounded(t *testing.T) {
	const n, slots = 1000, 16
	addrs := blackHoles(t, n)
	sc := &socketCounter{dialed: map[string]int{}}
	d := New(Options{Dial: sc.dial, MaxProbes: slots})
	defer d.Close()
	pc := ProbeConfig{Kind: ProbeKafka, Timeout: 100 * time.Millisecond, InitialDelay: 10 * time.Millisecond, Factor: 2, MaxDelay: time.Second}
	for _, a := range addrs {
		d.Register(a, pc)
	}
	for _, a := range addrs {
		d.Report(a, "write_timeout")
	}
	var maxWaiting int
	deadline := time.Now().Add(2 * time.Minute)
	for sc.total.Load() < n && time.Now().Before(deadline) {
		_, w := d.ProbeSlots()
		maxWaiting = max(maxWaiting, w)
		time.Sleep(5 * time.Millisecond)
	}
	sc.mu.Lock()
	peak := sc.peak
	sc.mu.Unlock()
	d.slots.mu.Lock()
	slotPeak := d.slots.peak
	d.slots.mu.Unlock()
	t.Logf("%d excluded endpoints hanging till their probe timeout: %d probes dialled, at most %d probe sockets open at once, %d probes in flight at once (the detector's count), up to %d waiting for a slot",
		n, sc.total.Load(), peak, slotPeak, maxWaiting)
	if sc.total.Load() < n {
		t.Fatalf("only %d of %d excluded endpoints were probed in 2 minutes", sc.total.Load(), n)
	}
	if peak > slots || slotPeak > slots {
		t.Fatalf("%d probe sockets open at once (%d probes in flight by the detector's count), over MaxProbes %d: probes of excluded endpoints are not bounded, and take the descriptors the links need", peak, slotPeak, slots)
	}
	failed := 0
	for _, st := range d.Statuses() {
		failed += st.FailedProbes
	}
	if dialled := int(sc.total.Load()); failed > dialled {
		t.Fatalf("%d failed probes recorded for %d probes dialled: waiting for a slot was counted as a failed probe", failed, dialled)
	}
}

// The twin: a recovered endpoint excluded among hundreds of dead ones is
// readmitted in its turn, after the probes that waited before it and
// before those that came after (first come, first served), not after a
// round of every excluded endpoint's backoff.
func TestRecoveredEndpointIsProbedInItsTurn(t *testing.T) {
	const n, later, slots = 500, 100, 16
	dead := blackHoles(t, n+later)
	ahead, after := dead[:n], dead[n:]
	alive, sc, d, readmitted := recoveryRig(t, slots)
	// One probe each in the test's time (the second is an hour away).
	once := ProbeConfig{Kind: ProbeKafka, InitialDelay: 10 * time.Millisecond, Factor: 1e6, MaxDelay: time.Hour}
	short, long := once, once
	short.Timeout, long.Timeout = 100*time.Millisecond, time.Minute
	for _, a := range ahead {
		d.Register(a, short)
		d.Report(a, "write_timeout")
	}
	// Wait until every dead endpoint's probe is running or waiting.
	deadline := time.Now().Add(time.Minute)
	for {
		probed := int(sc.total.Load())
		inFlight, waiting := d.ProbeSlots()
		if probed+waiting >= n || time.Now().After(deadline) {
			t.Logf("dead endpoints: %d probed, %d in flight, %d waiting for a slot", probed, inFlight, waiting)
			if waiting == 0 {
				t.Fatal("no probe waits for a slot: the test did not build a queue")
			}
			break
		}
		time.Sleep(time.Millisecond)
	}
	var afterBefore int // under sc.mu
	sc.onDial(alive, func() {
		for _, a := range after {
			afterBefore += sc.dialed[a]
		}
	})
	d.Register(alive, short)
	excluded := time.Now()
	d.Report(alive, "write_timeout")
	for !d.waitsForSlot(alive) && sc.dials(alive) == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if !d.waitsForSlot(alive) {
		t.Fatal("the recovered endpoint's probe did not wait for a slot: the test did not build a queue ahead of it")
	}
	// Those that come after it hold their slot for a minute.
	for _, a := range after {
		d.Register(a, long)
		d.Report(a, "write_timeout")
	}
	awaitReadmitted(t, readmitted)
	sc.mu.Lock()
	defer sc.mu.Unlock()
	t.Logf("recovered endpoint readmitted %v after its exclusion, behind %d dead endpoints' probes of 100 ms on %d slots; %d later probes dialled before it",
		time.Since(excluded).Round(time.Millisecond), n, slots, afterBefore)
	if afterBefore > slots-1 {
		t.Fatalf("%d probes queued after the recovered endpoint's dialled before it: it was overtaken", afterBefore)
	}
}

// recoveryRig is a detector with slots probe slots that counts the
// probes' sockets, and a live Kafka peer whose readmission closes
// readmitted. The detector is closed at the test's end.
func recoveryRig(t *testing.T, slots int) (alive string, sc *socketCounter, d *Detector, readmitted chan struct{}) {
	t.Helper()
	alive = startKafkaPeer(t, echoCorrelation).ln.Addr().String()
	sc = &socketCounter{dialed: map[string]int{}}
	readmitted = make(chan struct{})
	d = New(Options{Dial: sc.dial, MaxProbes: slots, OnEvent: func(ev Event) {
		if ev.Endpoint == alive && ev.To == Healthy {
			close(readmitted)
		}
	}})
	t.Cleanup(d.Close)
	return alive, sc, d, readmitted
}

// awaitReadmitted waits for recoveryRig's live peer to be readmitted,
// a minute at most.
func awaitReadmitted(t *testing.T, readmitted <-chan struct{}) {
	t.Helper()
	select {
	case <-readmitted:
	case <-time.After(time.Minute):
		t.Fatal("the recovered endpoint was not readmitted within a minute")
	}
}

func (s *socketCounter) dials(addr string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dialed[addr]
}

// An endpoint whose probe is due and waits for a slot says so in its
// status: its NextProbe is past, and without the mark an operator could
// not tell a probe held back by MaxProbes from a prober that is stuck.
// The endpoint whose probe runs is not marked (the twin).
func TestStatusShowsAProbeWaitingForASlot(t *testing.T) {
	addrs := blackHoles(t, 2)
	d := New(Options{MaxProbes: 1})
	defer d.Close()
	pc := ProbeConfig{Kind: ProbeKafka, Timeout: time.Minute, InitialDelay: 10 * time.Millisecond, Factor: 2, MaxDelay: time.Minute}
	for _, a := range addrs {
		d.Register(a, pc)
		d.Report(a, "write_timeout")
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if inFlight, waiting := d.ProbeSlots(); inFlight == 1 && waiting == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("premise: one probe running and one waiting for the slot, not reached in 30s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The running probe holds the slot for its minute-long timeout: the
	// one waiting still waits when the statuses are read.
	for _, st := range d.Statuses() {
		if want := d.waitsForSlot(st.Endpoint); st.ProbeWaiting != want {
			t.Fatalf("%s: ProbeWaiting %v, want %v (the detector's slots)", st.Endpoint, st.ProbeWaiting, want)
		}
		if st.ProbeWaiting && (st.NextProbe.IsZero() || st.NextProbe.After(time.Now())) {
			t.Fatalf("%s waits for a slot with NextProbe %v: want the past time it was due", st.Endpoint, st.NextProbe)
		}
	}
}

// While clients are turned away for want of an endpoint, its probe goes
// ahead of the probes nobody waits on: in a zone outage of hundreds of
// endpoints whose probes each wait out their timeout, a recovered one
// that clients wait for is probed at the next free slot, not after the
// whole queue (one probe_timeout for every MaxProbes of it). Before, the
// queue was first come, first served for every probe.
func TestWantedProbeGoesAheadOfTheQueue(t *testing.T) {
	const n, slots = 64, 2
	dead := blackHoles(t, n)
	alive, sc, d, readmitted := recoveryRig(t, slots)
	// Each dead probe holds its slot 2 s: the queue drains at a probe a
	// second, 32 s for the half of it the wanted probe would wait behind.
	once := ProbeConfig{Kind: ProbeKafka, Timeout: 2 * time.Second, InitialDelay: 10 * time.Millisecond, Factor: 1e6, MaxDelay: time.Hour}
	for _, a := range dead {
		d.Register(a, once)
		d.Report(a, "write_timeout")
	}
	deadline := time.Now().Add(time.Minute)
	for {
		if _, waiting := d.ProbeSlots(); waiting >= n/2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("premise: no queue of dead endpoints' probes within a minute")
		}
		time.Sleep(time.Millisecond)
	}
	var deadBefore int // under sc.mu
	sc.onDial(alive, func() {
		for _, a := range dead {
			deadBefore += sc.dialed[a]
		}
	})
	wanted := once
	wanted.Timeout = 200 * time.Millisecond
	wanted.Waiting = func() bool { return true }
	d.Register(alive, wanted)
	d.Report(alive, "write_timeout")
	// Its place in the queue, by the slots' own accounting.
	var place, queued int
	for {
		d.slots.mu.Lock()
		place = slices.IndexFunc(d.slots.waiters, func(w slotWaiter) bool { return w.endpoint == alive })
		queued = len(d.slots.waiters)
		d.slots.mu.Unlock()
		if place >= 0 || sc.dials(alive) > 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	// Seen queued, it is first; not seen (it had its slot before a look
	// found it), the count of dials before it below says the same.
	if place > 0 || place < 0 && sc.dials(alive) == 0 {
		t.Fatalf("the probe clients wait for is at place %d of %d waiting for a slot (dialled %d times), want first", place, queued, sc.dials(alive))
	}
	awaitReadmitted(t, readmitted)
	sc.mu.Lock()
	defer sc.mu.Unlock()
	t.Logf("queued at place %d of %d; %d dead endpoints' probes had dialled when it did", place, queued, deadBefore)
	// At least n/2 dead probes waited when it queued: behind them, each
	// would have dialled first.
	if deadBefore >= n/2 {
		t.Fatalf("%d dead endpoints' probes dialled before the one clients wait for, which queued behind %d or more of them", deadBefore, n/2)
	}
}

// The twin: probes nobody waits on are delayed by one round of the slots
// at most, never starved by those clients wait for. A probe that is not
// wanted is overtaken MaxProbes times at most; a wanted probe queued after
// that waits behind it.
func TestUnwantedProbeIsOvertakenAtMostOneRound(t *testing.T) {
	s := &probeSlots{max: 3}
	s.enqueueLocked(slotWaiter{endpoint: "u1"})
	s.enqueueLocked(slotWaiter{endpoint: "u2"})
	for i := range 5 {
		s.enqueueLocked(slotWaiter{endpoint: fmt.Sprintf("w%d", i), wanted: true})
	}
	s.enqueueLocked(slotWaiter{endpoint: "u3"})
	var got []string
	for _, w := range s.waiters {
		got = append(got, w.endpoint)
	}
	want := []string{"w0", "w1", "w2", "u1", "u2", "w3", "w4", "u3"}
	if !slices.Equal(got, want) {
		t.Fatalf("queue %v, want %v: a probe nobody waits on is overtaken by %d wanted ones at most", got, want, s.max)
	}
	for _, w := range s.waiters {
		if !w.wanted && w.overtaken > s.max {
			t.Fatalf("%s overtaken %d times, over %d", w.endpoint, w.overtaken, s.max)
		}
	}
}

// slotPlace is endpoint's place among the probes waiting for a slot (-1
// if its probe does not wait) and how many wait, by the slots' own
// accounting.
func (d *Detector) slotPlace(endpoint string) (place, queued int) {
	d.slots.mu.Lock()
	defer d.slots.mu.Unlock()
	return slices.IndexFunc(d.slots.waiters, func(w slotWaiter) bool { return w.endpoint == endpoint }), len(d.slots.waiters)
}

// waitForSlots waits until d's slots hold inFlight probes and queue
// waiting ones.
func waitForSlots(t *testing.T, d *Detector, inFlight, waiting int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if f, w := d.ProbeSlots(); f == inFlight && w == waiting {
			return
		}
		if time.Now().After(deadline) {
			f, w := d.ProbeSlots()
			t.Fatalf("premise: %d probes in flight and %d waiting, not reached in 30s (%d, %d)", inFlight, waiting, f, w)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A probe that queued for a slot while nobody waited on its endpoint
// goes ahead of the probes nobody waits on once clients are turned away
// for it: a pool's member whose probe queued while the pool still routed
// to other members, in a zone outage that then takes the last one. Its
// clients wait from then on; before, its probe kept its place behind
// the whole queue (one probe_timeout for every MaxProbes of it) because
// Waiting was asked only before it queued. The slot is held for the test
// (a minute's probe of a black hole), so the places are the slots' own.
// The twin: a queued probe whose clients do not wait, asked again as
// often, keeps its place behind the others.
func TestQueuedProbeGoesAheadOnceClientsWait(t *testing.T) {
	const unwanted = 4
	addrs := blackHoles(t, 1+unwanted+2)
	hold, dead, member, other := addrs[0], addrs[1:1+unwanted], addrs[1+unwanted], addrs[2+unwanted]
	d := New(Options{MaxProbes: 1})
	defer d.Close()
	pc := ProbeConfig{Kind: ProbeKafka, Timeout: time.Minute, InitialDelay: 10 * time.Millisecond, Factor: 1e6, MaxDelay: time.Hour}
	d.Register(hold, pc)
	d.Report(hold, "write_timeout")
	waitForSlots(t, d, 1, 0)
	for i, a := range dead {
		d.Register(a, pc)
		d.Report(a, "write_timeout")
		waitForSlots(t, d, 1, i+1)
	}
	var memberWaits atomic.Bool
	var otherAsked atomic.Int32
	mpc, opc := pc, pc
	mpc.Waiting = memberWaits.Load
	opc.Waiting = func() bool { otherAsked.Add(1); return false }
	d.Register(member, mpc)
	d.Report(member, "write_timeout")
	waitForSlots(t, d, 1, unwanted+1)
	d.Register(other, opc)
	d.Report(other, "write_timeout")
	waitForSlots(t, d, 1, unwanted+2)
	if place, queued := d.slotPlace(member); place != unwanted {
		t.Fatalf("premise: the member's probe queued at place %d of %d, want %d (behind the others)", place, queued, unwanted)
	}

	memberWaits.Store(true) // the pool's last member is out: its clients wait
	asked := otherAsked.Load()
	deadline := time.Now().Add(20 * time.Second)
	for {
		place, queued := d.slotPlace(member)
		if place == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the probe clients now wait for is at place %d of %d after 20s, want first (Waiting is asked every %v)", place, queued, WaitingInterval/2)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The twin: asked twice more since, still behind every probe that
	// queued before it.
	for otherAsked.Load() < asked+2 {
		if time.Now().After(deadline) {
			t.Fatalf("the queued probe nobody waits on was asked %d times in 20s", otherAsked.Load()-asked)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if place, queued := d.slotPlace(other); place != queued-1 || queued != unwanted+2 {
		t.Fatalf("the probe nobody waits on is at place %d of %d, want last of %d", place, queued, unwanted+2)
	}
	d.slots.mu.Lock()
	defer d.slots.mu.Unlock()
	// Those it went ahead of count it (once each, of MaxProbes 1: no
	// further wanted probe may overtake them); the one behind it already
	// does not.
	for _, w := range d.slots.waiters[1:] {
		want := 1
		if w.endpoint == other {
			want = 0
		}
		if w.overtaken != want {
			t.Fatalf("%s overtaken %d times, want %d", w.endpoint, w.overtaken, want)
		}
	}
}

// A probe promoted while it waits goes ahead of the probes nobody waits
// on that may still be overtaken, never behind its place, nor ahead of a
// wanted one queued before it.
func TestPromotedProbeKeepsTheBound(t *testing.T) {
	s := &probeSlots{max: 2}
	s.waiters = []slotWaiter{
		{endpoint: "w0", wanted: true},
		{endpoint: "u1", overtaken: 2},
		{endpoint: "u2", overtaken: 1},
		{endpoint: "x"},
		{endpoint: "u3"},
	}
	s.promoteLocked(3)
	var got []string
	for _, w := range s.waiters {
		got = append(got, fmt.Sprintf("%s:%d", w.endpoint, w.overtaken))
	}
	if want := []string{"w0:0", "u1:2", "x:0", "u2:2", "u3:0"}; !slices.Equal(got, want) || !s.waiters[2].wanted {
		t.Fatalf("queue %v (x wanted %v), want %v, x wanted", got, s.waiters[2].wanted, want)
	}
	s.promoteLocked(1) // u1 may not be overtaken again, nor go ahead of w0
	if s.waiters[1].endpoint != "u1" || s.waiters[0].endpoint != "w0" {
		t.Fatalf("promoted u1 moved: %v", s.waiters)
	}
}
