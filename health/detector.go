package health

import (
	"context"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"
)

// Options configure a Detector. Every field may be left zero.
type Options struct {
	// Logger receives one Debug line per state transition and per failed
	// probe (OnEvent's subscriber logs the transitions it acts on). The
	// zero Logger logs nothing.
	Logger zerolog.Logger
	// OnEvent is called for every real transition, in the order the
	// transitions happened (per endpoint and overall), never while the
	// detector's lock is held. It runs on the goroutine that caused the
	// transition (a Report/Disable/Enable caller or a probe goroutine; a
	// verdict Register restores, on a goroutine of the detector's), or on
	// whichever goroutine is already delivering events, so a caller's
	// event may be delivered just after its call returns. OnEvent may call
	// any Detector method except Close; a panic in it is logged and
	// swallowed. It should not block for long: it delays the probe
	// goroutines, and Close waits for it.
	OnEvent func(Event)
	// OnProbe is called after every probe that reached a verdict (for
	// probes_total{result}), once Statuses reflects it. Probes interrupted by Close,
	// Disable, Enable or Unregister reach none and are not reported. It runs
	// on the probe goroutine, without the lock; a panic in it is logged and
	// swallowed.
	OnProbe func(endpoint string, ok bool)
	// Dial opens the probes' fresh connections (connect probes and the
	// HTTP probe's transport). Nil means a plain net.Dialer. The context
	// carries the probe timeout and shutdown.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// OwnFailure reports whether a probe's error is the prober's own
	// failure (no descriptors, no buffers, a socket option the kernel
	// refused, a name that did not resolve): such a probe reaches no
	// verdict, as one that timed out while the process could not run,
	// and the next comes at ProbeConfig.InitialDelay, whatever the
	// backoff has grown to: the failure said nothing of the endpoint,
	// and an endpoint back while the prober's own failure lasted is
	// readmitted within InitialDelay of its end (a probe that fails so
	// asks nothing of the endpoint, its host or the network).
	// Nil: every error is the endpoint's.
	OwnFailure func(error) bool
	// MaxProbes bounds the probes in flight at once, over every endpoint:
	// a probe due while all are running waits its turn (first come, first
	// served among its kind: see probeSlots) without a verdict.
	// Non-positive means DefaultMaxProbes.
	MaxProbes int
}

// Detector is the per-endpoint failure detector. Its methods are safe for
// concurrent use. Create it with New and stop it with Close.
type Detector struct {
	log     zerolog.Logger
	onEvent func(Event)
	onProbe func(string, bool)
	dial    func(ctx context.Context, network, addr string) (net.Conn, error)
	own     func(error) bool
	http    *http.Client
	slots   probeSlots

	ctx       context.Context // parent of every probe goroutine's context; cancelled by Close
	stop      context.CancelFunc
	probers   sync.WaitGroup
	closeOnce sync.Once

	mu         sync.Mutex
	closed     bool
	eps        map[string]*epState
	graves     map[string]grave // verdicts of endpoints forgotten while out (see Unregister)
	graveOrder []grave          // the same, oldest first (entries since restored are skipped)
	pending    []Event          // transitions not yet handed to OnEvent, in order
	delivering bool             // a goroutine is draining pending
}

// epState is the state of one registered endpoint; guarded by Detector.mu.
type epState struct {
	name      string
	pc        ProbeConfig // normalized
	state     State
	reason    string
	since     time.Time
	nextProbe time.Time
	probes    int // failed probes of the most recent exclusion
	// flaps counts exclusions that came soon (within MaxDelay) after a
	// probe readmitted the endpoint; each one starts the backoff one step
	// further, so a probe that passes while the server cannot serve (a
	// stopped process whose kernel still completes handshakes) does not
	// readmit it at the initial delay forever.
	flaps        int
	readmittedAt time.Time
	lastErr      string
	evidence     Evidence
	// passingSince: a flapping endpoint's probes have passed since then,
	// without a failure; it is readmitted once that has lasted
	// holdDown(flaps). Zero when no probe passed since the last failure.
	passingSince time.Time

	// gen identifies the current probe goroutine; it changes whenever one is
	// started or stopped, so a stopped one recognizes it lost its claim even
	// if its context cancellation races with a result.
	gen    uint64
	cancel context.CancelFunc // of the current probe goroutine; nil if none
	done   chan struct{}      // closed when the latest probe goroutine returned
	wake   chan struct{}      // ProbeSoon: the current probe goroutine probes now
}

// New returns a Detector with no endpoints. It starts no goroutine until an
// endpoint is excluded.
func New(opts Options) *Detector {
	dial := opts.Dial
	if dial == nil {
		dial = (&net.Dialer{}).DialContext
	}
	ctx, stop := context.WithCancel(context.Background())
	d := &Detector{
		log:     opts.Logger,
		onEvent: opts.OnEvent,
		onProbe: opts.OnProbe,
		dial:    dial,
		own:     opts.OwnFailure,
		ctx:     ctx,
		stop:    stop,
		eps:     make(map[string]*epState),
		graves:  make(map[string]grave),
	}
	d.http = newHTTPClient(d.dialContext)
	d.slots.max = opts.MaxProbes
	if d.slots.max <= 0 {
		d.slots.max = DefaultMaxProbes
	}
	return d
}

// Register adds endpoint (host:port) in state Healthy, or, if it is already
// registered, replaces its probe configuration (used from the next probe on)
// and keeps its state. It does nothing after Close.
//
// An endpoint unregistered while excluded, or disabled by the operator,
// less than graveFor before comes back in that state (an event says so;
// an excluded one is probed afresh): a verdict rests on evidence, and an
// endpoint that leaves and returns (a DNS answer that left it out, a
// listener a reload bound anew) has shown none since.
func (d *Detector) Register(endpoint string, pc ProbeConfig) {
	pc = pc.normalized()
	if pc.Kind != ProbeConnect && pc.Kind != ProbeHTTP && pc.Kind != ProbeKafka {
		d.log.Warn().Str("endpoint", endpoint).Str("kind", pc.Kind).
			Msg("unknown probe kind: every probe of this endpoint will fail")
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return
	}
	if e, ok := d.eps[endpoint]; ok {
		e.pc = pc
		d.mu.Unlock()
		return
	}
	e := &epState{
		name:   endpoint,
		pc:     pc,
		state:  Healthy,
		reason: ReasonRegistered,
		since:  time.Now(),
	}
	d.eps[endpoint] = e
	g, buried := d.graves[endpoint]
	if !buried || time.Since(g.at) >= graveFor {
		d.mu.Unlock()
		return
	}
	delete(d.graves, endpoint)
	e.evidence = Evidence{Since: g.since, Detail: "its verdict from before it was forgotten " + time.Since(g.at).Round(time.Millisecond).String() + " ago"}
	d.transitionLocked(e, g.state, g.reason)
	if g.state == Excluded {
		d.startProberLocked(e)
	}
	// Delivered on a goroutine of the detector's: Register's callers
	// hold locks of their own that OnEvent may take.
	d.probers.Add(1)
	d.mu.Unlock()
	go func() {
		defer d.probers.Done()
		d.deliver()
	}()
}

// graveFor is how long the verdict of an endpoint unregistered while
// excluded, or disabled by the operator, is kept for its return; at most
// maxGraves are kept, the oldest dropped first.
var graveFor = 10 * time.Minute

const maxGraves = 4096

// grave is what Register restores of an endpoint unregistered while out.
type grave struct {
	name   string
	state  State
	reason string
	since  time.Time // when it went out
	at     time.Time // when it was unregistered
}

// Unregister stops probing endpoint and forgets it. It emits no event. A
// later Register starts it afresh, Healthy, unless it was excluded or
// disabled by the operator (see Register).
func (d *Detector) Unregister(endpoint string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	e, ok := d.eps[endpoint]
	if !ok {
		return
	}
	d.stopProberLocked(e)
	delete(d.eps, endpoint)
	if d.closed || e.state != Excluded && (e.state != Disabled || e.reason != ReasonOperatorDisable) {
		return
	}
	now := time.Now()
	for len(d.graveOrder) > 0 && (len(d.graves) >= maxGraves || len(d.graveOrder) >= 2*maxGraves || now.Sub(d.graveOrder[0].at) >= graveFor) {
		old := d.graveOrder[0]
		d.graveOrder = d.graveOrder[1:]
		if g, ok := d.graves[old.name]; ok && g.at == old.at {
			delete(d.graves, old.name)
		}
	}
	g := grave{name: endpoint, state: e.state, reason: e.reason, since: e.since, at: now}
	d.graves[endpoint] = g
	d.graveOrder = append(d.graveOrder, g)
}

// Report records a data-plane failure of endpoint. A Healthy endpoint becomes
// Excluded and probing starts; Report returns true only then. On an Excluded
// or Disabled endpoint, an unregistered one, or after Close it changes
// nothing and returns false. An empty reason is recorded as "reported".
func (d *Detector) Report(endpoint, reason string) bool {
	return d.ReportEvidence(endpoint, reason, Evidence{})
}

// ReportEvidence is Report with what the report rests on, shown in
// Statuses and carried by the exclusion's Event.
func (d *Detector) ReportEvidence(endpoint, reason string, ev Evidence) bool {
	if reason == "" {
		reason = "reported"
	}
	d.mu.Lock()
	e, ok := d.eps[endpoint]
	if d.closed || !ok || e.state != Healthy {
		closed := d.closed
		d.mu.Unlock()
		if !ok && !closed {
			d.log.Warn().Str("endpoint", endpoint).Str("reason", reason).
				Msg("report for an unregistered endpoint ignored")
		}
		return false
	}
	if !e.readmittedAt.IsZero() && time.Since(e.readmittedAt) < e.pc.MaxDelay {
		e.flaps++
	} else {
		e.flaps = 0
	}
	e.evidence, e.passingSince = ev, time.Time{}
	d.transitionLocked(e, Excluded, reason)
	e.probes, e.lastErr = 0, ""
	d.startProberLocked(e)
	d.mu.Unlock()
	d.deliver()
	return true
}

// Disable takes endpoint out on the operator's behalf: any state becomes
// Disabled and probing stops. It returns true if the state changed (false if
// already Disabled, unregistered, or after Close). An empty reason is
// recorded as "operator_disable".
func (d *Detector) Disable(endpoint, reason string) bool {
	if reason == "" {
		reason = ReasonOperatorDisable
	}
	return d.operator(endpoint, Disabled, reason)
}

// Enable readmits endpoint on the operator's behalf: Disabled becomes
// Healthy, and so does Excluded (an operator override: probing stops, no
// probe is required). It returns true if the state changed (false if already
// Healthy, unregistered, or after Close). An empty reason is recorded as
// "operator_enable".
func (d *Detector) Enable(endpoint, reason string) bool {
	if reason == "" {
		reason = ReasonOperatorEnable
	}
	return d.operator(endpoint, Healthy, reason)
}

// Undisable readmits endpoint if, and only if, it is Disabled for the
// reason disabledFor: it undoes that one disabling (a config's list no
// longer naming the endpoint), and leaves alone an endpoint in any other
// state, or disabled for another reason. It returns true if the state
// changed; reason is recorded as Enable's.
func (d *Detector) Undisable(endpoint, disabledFor, reason string) bool {
	return d.operatorIf(endpoint, Healthy, reason, func(e *epState) bool {
		return e.state == Disabled && e.reason == disabledFor
	})
}

func (d *Detector) operator(endpoint string, to State, reason string) bool {
	return d.operatorIf(endpoint, to, reason, nil)
}

// operatorIf is operator, made only where cond (when given) holds of the
// endpoint's state.
func (d *Detector) operatorIf(endpoint string, to State, reason string, cond func(*epState) bool) bool {
	d.mu.Lock()
	e, ok := d.eps[endpoint]
	if ok && !d.closed && e.state == Disabled && to == Disabled && reason == ReasonOperatorDisable {
		// The operator disables what the config's list already did: the
		// operator's word is on record now, so that unlisting the endpoint
		// (Undisable for the config's reason) leaves it disabled.
		e.reason = reason
	}
	if d.closed || !ok || e.state == to || cond != nil && !cond(e) {
		d.mu.Unlock()
		return false
	}
	d.transitionLocked(e, to, reason)
	e.flaps, e.readmittedAt, e.passingSince = 0, time.Time{}, time.Time{} // the operator's word resets the history
	d.mu.Unlock()
	d.deliver()
	return true
}

// State returns endpoint's state, and false if it is not registered.
func (d *Detector) State(endpoint string) (State, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	e, ok := d.eps[endpoint]
	if !ok {
		return Healthy, false
	}
	return e.state, true
}

// HealthySince reports since when endpoint has been Healthy: its
// registration, or its last readmission (a probe's or the operator's);
// zero if it is not Healthy or is unknown. It is the detector's own
// time, which the event that tells of a readmission (OnEvent) follows a
// moment later.
func (d *Detector) HealthySince(endpoint string) time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	if e, ok := d.eps[endpoint]; ok && e.state == Healthy {
		return e.since
	}
	return time.Time{}
}

// Statuses returns a snapshot of every registered endpoint, sorted by
// endpoint string.
func (d *Detector) Statuses() []Status {
	waiting := d.slots.waitingFor() // before d.mu: acquire holds neither while it waits
	d.mu.Lock()
	out := make([]Status, 0, len(d.eps))
	for _, e := range d.eps {
		st := Status{
			Endpoint:       e.name,
			State:          e.state,
			Reason:         e.reason,
			Since:          e.since,
			NextProbe:      e.nextProbe,
			FailedProbes:   e.probes,
			LastProbeError: e.lastErr,
			Evidence:       e.evidence,
			ProbeWaiting:   waiting[e.name],
		}
		if e.state == Excluded && !e.passingSince.IsZero() {
			st.ProbationUntil = e.passingSince.Add(holdDown(e.pc, e.flaps))
		}
		out = append(out, st)
	}
	d.mu.Unlock()
	slices.SortFunc(out, func(a, b Status) int { return strings.Compare(a.Endpoint, b.Endpoint) })
	return out
}

// Close stops every probe goroutine and waits for them (including any
// OnEvent or OnProbe call they are making). Shutting down is not a failure:
// in-flight probes are abandoned without a verdict and no event is emitted.
// Endpoints keep their last state; later mutating calls do nothing. Close is
// idempotent, and a concurrent second call waits like the first.
func (d *Detector) Close() {
	d.closeOnce.Do(func() {
		d.mu.Lock()
		d.closed = true
		for _, e := range d.eps {
			d.stopProberLocked(e)
		}
		d.mu.Unlock()
		d.stop()
		d.probers.Wait()
		d.http.CloseIdleConnections()
	})
}

// transitionLocked moves e to state to (which differs from e.state), stops
// its probing unless it is now Excluded, and queues the event. The caller
// calls deliver after unlocking.
func (d *Detector) transitionLocked(e *epState, to State, reason string) {
	now := time.Now()
	ev := Event{Endpoint: e.name, From: e.state, To: to, Reason: reason, At: now}
	if to == Excluded {
		ev.Evidence = e.evidence
	}
	d.pending = append(d.pending, ev)
	e.state, e.reason, e.since = to, reason, now
	if to != Excluded {
		d.stopProberLocked(e)
	}
}

// stopProberLocked cancels e's probe goroutine, if any, and revokes its
// claim on e.
func (d *Detector) stopProberLocked(e *epState) {
	if e.cancel != nil {
		e.cancel()
		e.cancel = nil
	}
	e.gen++
	e.nextProbe = time.Time{}
}

// startProberLocked starts e's probe goroutine. Any previous one has been
// stopped (e left Excluded since); the new one waits for it to return, so
// there is never more than one probe of an endpoint at a time.
func (d *Detector) startProberLocked(e *epState) {
	d.stopProberLocked(e)
	ctx, cancel := context.WithCancel(d.ctx)
	prev, done := e.done, make(chan struct{})
	e.cancel, e.done, e.wake = cancel, done, make(chan struct{}, 1)
	d.probers.Add(1)
	go d.probeLoop(ctx, e, e.gen, prev, done, e.wake)
}

// ProbeSoon asks for the next probe of an excluded endpoint now rather
// than at its scheduled time: a hint that it may be back (a mesh peer
// announced its server ready). A probe still decides; a failed one counts
// toward the backoff as any other. It reports whether endpoint is
// excluded (and so will be probed).
func (d *Detector) ProbeSoon(endpoint string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	e, ok := d.eps[endpoint]
	if d.closed || !ok || e.state != Excluded || e.wake == nil {
		return false
	}
	select {
	case e.wake <- struct{}{}:
	default:
	}
	return true
}

// claimedLocked reports whether the probe goroutine of generation gen still
// owns e: e is registered, Excluded, and no one stopped the goroutine.
func (d *Detector) claimedLocked(e *epState, gen uint64) bool {
	return !d.closed && e.gen == gen && e.state == Excluded && d.eps[e.name] == e
}

// probeLoop probes the excluded endpoint e until a probe readmits it or
// it is stopped (Disable, Enable, Unregister, Close). A probe comes at
// the earliest of: the backoff's delay; WaitingInterval after the last
// one, while ProbeConfig.Waiting reports clients turned away; a
// ProbeSoon. An endpoint that flapped (excluded again soon after a
// readmission) is readmitted only once its probes have passed, without a
// failure, for holdDown(flaps); its probes meanwhile come every
// WaitingInterval at most. A probe due waits for a slot (Options.MaxProbes)
// behind those due before it, those of endpoints whose clients wait first
// (probeSlots).
func (d *Detector) probeLoop(ctx context.Context, e *epState, gen uint64, prev <-chan struct{}, done chan<- struct{}, wake <-chan struct{}) {
	defer d.probers.Done()
	defer close(done)
	if prev != nil {
		select {
		case <-prev:
		case <-ctx.Done():
			return
		}
	}
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	// The exclusion, then the end of each probe (the backoff counts from
	// there) and its start (the probes while clients wait: one a second,
	// back to back if a probe takes that long).
	last := time.Now()
	lastStart := last
	own := false // the last probe failed for the prober's own reason
	for {
		pc, plan, ok := d.schedule(e, gen, last, lastStart, own)
		if !ok {
			return
		}

		if !d.sleepUntil(ctx, timer, wake, &plan, pc.Waiting) {
			return
		}

		// A probe due while every slot is taken waits its turn: no
		// verdict, and its time starts when it runs. Clients turned
		// away put it ahead of the probes nobody waits on.
		if !d.slots.acquire(ctx, e.name, plan.wanted, pc.Waiting) {
			return
		}
		d.mu.Lock()
		if !d.claimedLocked(e, gen) {
			d.mu.Unlock()
			d.slots.release()
			return
		}
		e.nextProbe = time.Time{}
		pc = e.pc // Register may have changed it while we slept
		d.mu.Unlock()

		started := time.Now()
		lastStart = started
		overridden, err := d.probe(ctx, e.name, pc)
		d.slots.release()
		if ctx.Err() != nil {
			return // stopped mid-probe: no verdict, not a failure
		}
		last = time.Now()
		if err != nil && !overridden && noticedLate(err, last.Sub(started), pc.Timeout) {
			d.log.Debug().Err(err).Str("endpoint", e.name).Dur("took_ms", last.Sub(started)).
				Msg("probe timed out while the proxy could not run: no verdict")
			own = false
			continue
		}
		if own = err != nil && d.ownFailure(err, pc); own {
			d.noteOwnFailure(e, gen, err)
			d.log.Debug().Err(err).Str("endpoint", e.name).
				Msg("probe failed for the proxy's own reason (descriptors, buffers, a socket option, a name, no route of its own): no verdict; the next at the initial delay")
			continue
		}

		if d.verdict(e, gen, pc, err, started, last) {
			return
		}
	}
}

// ownFailure reports whether a probe's error err is the prober's own
// (Options.OwnFailure, ProbeConfig.OwnNetwork), not the endpoint's.
func (d *Detector) ownFailure(err error, pc ProbeConfig) bool {
	return d.own != nil && d.own(err) || pc.OwnNetwork != nil && pc.OwnNetwork(err)
}

// noteOwnFailure shows err, a probe's failure for the prober's own
// reason, as e's last probe error, marked so: it is no verdict and not
// counted, but an operator reading /v1/endpoints sees why e is not
// readmitted (the proxy's own route, descriptors, a name).
func (d *Detector) noteOwnFailure(e *epState, gen uint64, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.claimedLocked(e, gen) {
		e.lastErr = OwnFailurePrefix + err.Error()
	}
}

// OwnFailurePrefix begins a last probe error that was the prober's own
// failure, not counted against the endpoint (see noteOwnFailure).
const OwnFailurePrefix = "not counted, the proxy's own failure: "

// probePlan is when a probe loop probes next: at, the backoff's time, or
// soon, one WaitingInterval after the last probe's start, once clients
// wait; wanted is whether they did when last asked.
type probePlan struct {
	at, soon time.Time
	wanted   bool
}

// schedule plans the next probe of e by the loop of generation gen: at
// soon if clients wait or e is on probation, else at the backoff's time;
// sleepUntil may bring it to soon later. last is the end of the last
// probe (or the exclusion), lastStart its start; own: it failed for the
// prober's own reason, and the backoff's time is InitialDelay after it.
// It records the plan's at as e's next probe and returns e's probe
// configuration; ok is false if the loop no longer owns e.
func (d *Detector) schedule(e *epState, gen uint64, last, lastStart time.Time, own bool) (pc ProbeConfig, plan probePlan, ok bool) {
	d.mu.Lock()
	if !d.claimedLocked(e, gen) {
		d.mu.Unlock()
		return pc, plan, false
	}
	pc = e.pc
	d.mu.Unlock()
	plan.wanted = pc.Waiting != nil && pc.Waiting() // without the lock: it asks the data plane
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.claimedLocked(e, gen) {
		return pc, plan, false
	}
	step := e.probes + e.flaps
	if own {
		step = 0
	}
	plan.at = last.Add(probeDelay(pc, step))
	plan.soon = lastStart.Add(waitingDelay(pc.Jitter, rand.Float64()))
	if plan.wanted || !e.passingSince.IsZero() {
		// Clients wait, or on probation: probe often enough to see
		// it through.
		plan.at = minTime(plan.at, plan.soon)
	}
	e.nextProbe = plan.at
	return pc, plan, true
}

// verdict records the result err of the probe of e that ran from started
// to last, with pc, and reports it. It returns true when the probe loop
// of generation gen ends: e is readmitted, or the loop no longer owns e
// (the verdict is stale). A failure, or a pass while the hold-down of a
// flapped endpoint runs, keeps the loop probing.
func (d *Detector) verdict(e *epState, gen uint64, pc ProbeConfig, err error, started, last time.Time) (end bool) {
	// Record the verdict first, so that OnProbe and OnEvent observers
	// see a Status that already reflects it.
	d.mu.Lock()
	if !d.claimedLocked(e, gen) {
		d.mu.Unlock()
		return true // stopped as the probe ended: the verdict is stale
	}
	if err == nil {
		if e.flaps > 0 {
			if e.passingSince.IsZero() {
				e.passingSince = started
			}
			if last.Sub(e.passingSince) < holdDown(pc, e.flaps) {
				passing := e.passingSince
				d.mu.Unlock()
				d.reportProbe(e.name, true)
				d.log.Debug().Str("endpoint", e.name).Int("flaps", e.flaps).Time("passing_since", passing).
					Msg("probe passed; readmission held down: the endpoint flapped")
				return false
			}
		}
		e.readmittedAt, e.passingSince = time.Now(), time.Time{}
		d.transitionLocked(e, Healthy, ReasonProbeOK)
		d.mu.Unlock()
		d.reportProbe(e.name, true)
		d.deliver()
		return true
	}
	e.probes++
	e.lastErr = err.Error()
	e.passingSince = time.Time{}
	failed := e.probes
	d.mu.Unlock()
	d.reportProbe(e.name, false)
	d.log.Debug().Err(err).Str("endpoint", e.name).Int("failed_probes", failed).Msg("probe failed")
	return false
}

// sleepUntil waits until plan.at, or until plan.soon (or later) once
// waiting reports clients turned away (then plan.wanted), or a wake; it
// reports false if ctx ended. waiting is asked at soon, then every
// WaitingInterval/2.
func (d *Detector) sleepUntil(ctx context.Context, timer *time.Timer, wake <-chan struct{}, plan *probePlan, waiting func() bool) bool {
	at, soon := plan.at, plan.soon
	for {
		next := at
		if waiting != nil && soon.Before(at) {
			next = soon
		}
		timer.Reset(max(time.Until(next), 0))
		select {
		case <-ctx.Done():
			return false
		case <-wake:
			return true
		case <-timer.C:
		}
		if !next.Before(at) {
			return true
		}
		if waiting() {
			plan.wanted = true
			return true
		}
		soon = time.Now().Add(WaitingInterval / 2)
	}
}

// waitingDelay is the delay between probes while clients wait:
// WaitingInterval, jittered downward only (r is in [0, 1)).
func waitingDelay(jitter, r float64) time.Duration {
	return time.Duration(float64(WaitingInterval) * (1 - jitter*r/2))
}

// holdDown is how long a flapping endpoint's probes must pass before it is
// readmitted: the backoff's delay at the step of its flaps (without
// jitter), so each flap doubles it, up to MaxDelay.
func holdDown(pc ProbeConfig, flaps int) time.Duration {
	if flaps <= 0 {
		return 0
	}
	return baseDelay(pc, flaps)
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// deliver hands queued events to OnEvent in order. Only one goroutine
// delivers at a time; a goroutine that finds another delivering leaves its
// events to it (so OnEvent may call back into the Detector without deadlock).
func (d *Detector) deliver() {
	d.mu.Lock()
	if d.delivering {
		d.mu.Unlock()
		return
	}
	d.delivering = true
	for len(d.pending) > 0 {
		evs := d.pending
		d.pending = nil
		d.mu.Unlock()
		for _, ev := range evs {
			d.emit(ev)
		}
		d.mu.Lock()
	}
	d.delivering = false
	d.mu.Unlock()
}

// emit logs one transition and passes it to OnEvent.
func (d *Detector) emit(ev Event) {
	// At debug: the subscriber logs the change with what it did about it
	// (one line per change).
	d.log.Debug().Str("endpoint", ev.Endpoint).Stringer("from", ev.From).Stringer("to", ev.To).
		Str("reason", ev.Reason).Msg("endpoint state changed")
	if d.onEvent == nil {
		return
	}
	defer d.recoverCallback("OnEvent", ev.Endpoint)
	d.onEvent(ev)
}

// reportProbe passes one probe verdict to OnProbe.
func (d *Detector) reportProbe(endpoint string, ok bool) {
	if d.onProbe == nil {
		return
	}
	defer d.recoverCallback("OnProbe", endpoint)
	d.onProbe(endpoint, ok)
}

// recoverCallback keeps a panicking subscriber from taking down the process
// (or wedging event delivery).
func (d *Detector) recoverCallback(name, endpoint string) {
	if r := recover(); r != nil {
		d.log.Error().Str("endpoint", endpoint).Interface("panic", r).Msg(name + " panicked")
	}
}
