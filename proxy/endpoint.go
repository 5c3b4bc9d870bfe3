package proxy

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// endpoint is the data plane's view of one upstream host:port: the links
// to it (the registry, so that eviction is one call) and the consecutive
// unanswered count across all of them (a dead server answers none).
type endpoint struct {
	addr         string         // normalized host:port: the detector's and the API's key
	dial         string         // what links dial (the configured spelling)
	dialAP       netip.AddrPort // dial parsed, once: invalid when dial is a name (see directDialer)
	name         string         // the host:port name it was resolved from; "" for an address
	consecutive  atomic.Int64
	lastAnswer   atomic.Int64                    // mono time of the last answer on any link
	silentSince  atomic.Int64                    // mono send time of the earliest unanswered request counted; 0: none
	readmitted   atomic.Int64                    // mono time of the last readmission
	leftAt       atomic.Pointer[time.Time]       // when it last left routing (excluded or disabled)
	lastUsed     atomic.Int64                    // mono time a transparent connection last resolved to it
	settings     atomic.Pointer[policy.Settings] // the settings it is probed with (see endpointForLocked)
	tls          atomic.Bool                     // a client of it spoke TLS
	meshPort     atomic.Int32                    // the mesh port its last link reached it through; 0: directly
	linksKept    atomic.Bool                     // excluded for a reason that is no evidence against open links (keepsLinks): they were kept
	dialTimeouts atomic.Int32                    // connects in a row that timed out (see dialFailed)
	timeoutAt    atomic.Int64                    // mono time the last connect counted in dialTimeouts ended
	noRouteUntil atomic.Int64                    // mono time until which a pool passes it over: a connect found no route of the proxy's own (see pool.pick)
	suspects     logGate                         // the suspect verdict's log line (see suspect)
	p            *Proxy
	// orphans judges unanswered requests whose link ended first (a client
	// that closes on its own timeout must not hide a dead server).
	orphans *flow.Tracker

	mu        sync.Mutex
	links     map[*link]struct{}
	listeners []*listener // listeners whose upstream this is
}

// ErrUnknownEndpoint is returned by the operator API for an endpoint no
// listener routes to.
var ErrUnknownEndpoint = errors.New("unknown endpoint")

// normalizeEndpoint returns the key of the endpoint at addr: the port as a
// plain number and an IP address in one spelling (policy.CanonicalEndpoint,
// which the config's uniqueness checks use too), so that an operator's
// spelling, the config's, a DNS answer and an original destination match.
func normalizeEndpoint(addr string) string {
	return policy.CanonicalEndpoint(addr)
}

// endpointForLocked returns the endpoint for dial, creating it and
// registering it with the detector on first use (created is true then: the
// caller applies endpoints.disabled outside the lock). s are the settings
// of from, the listener that routes to it (nil: none). p.mu is held.
//
// An endpoint has one probe, and listeners that share it may ask for
// different ones. It is probed as the first listener that asks for the
// strongest probe (see pickSettingsLocked): a readmission then rests on
// the strongest evidence any of them wants, whatever the order of their
// reloads and DNS refreshes.
func (p *Proxy) endpointForLocked(dial string, s policy.Settings, from *listener) (ep *endpoint, created bool) {
	addr := normalizeEndpoint(dial)
	ep, ok := p.endpoints[addr]
	if !ok {
		created = true
		ep = &endpoint{addr: addr, dial: dial, links: make(map[*link]struct{}), p: p}
		ep.dialAP, _ = netip.ParseAddrPort(dial)
		ep.lastAnswer.Store(flow.NoAnswer)
		ep.orphans = flow.NewTracker(flow.JudgingSlack(time.Second), false, &ep.lastAnswer, func(judged []flow.PendingRequest, _ int) {
			// Each request keeps the threshold of the listener that sent it.
			for _, r := range judged {
				if r.Verdict && !ep.orphans.Covered(&r) {
					p.countUnanswered(ep, nil, int(r.N), int(r.Thr), max(r.At, ep.lastAnswer.Load()))
				}
			}
		})
		p.endpoints[addr] = ep
		p.reviveDrain(addr)
	}
	ep.pickSettingsLocked(from, s)
	p.det.Register(addr, ep.probeConfig())
	return ep, created
}

// pickSettingsLocked gives ep the settings it is probed with: those of the
// first listener that routes to it and asks for the strongest probe it
// would run (one of the protocol or of the process's health endpoint over
// a connect; a Kafka probe is a connect once ep's clients speak TLS),
// among the listeners that still accept (those a reload retired drain
// their links, no more), whatever the order of their reloads and DNS
// refreshes. from, with its settings s, counts as one of them (nil: none).
// p.mu is held.
func (ep *endpoint) pickSettingsLocked(from *listener, s policy.Settings) {
	ep.mu.Lock()
	ls := append([]*listener(nil), ep.listeners...)
	ep.mu.Unlock()
	if from != nil && !slices.Contains(ls, from) {
		ls = append(ls, from)
	}
	settingsOf := func(l *listener) policy.Settings {
		if l == from {
			return s
		}
		return l.spec().settings
	}
	var best *listener
	bestLive, bestRank := false, -1
	for _, l := range ls {
		l.mu.Lock()
		live := !l.stopping
		l.mu.Unlock()
		r := ep.probeStrength(settingsOf(l))
		if best == nil || live && !bestLive || live == bestLive && r > bestRank {
			best, bestLive, bestRank = l, live, r
		}
	}
	if best == nil {
		ep.settings.Store(&s)
		return
	}
	bs := settingsOf(best)
	ep.settings.Store(&bs)
}

// probeStrength ranks what the probe ep runs with settings s proves: a
// connect that a stopped process's kernel completes (0), or an answer of
// the protocol or of the process's health endpoint (1).
func (ep *endpoint) probeStrength(s policy.Settings) int {
	if kind, _ := s.Probe(); kind == policy.ProbeKindConnect || kind == policy.ProbeKindKafka && ep.kafkaProbeIsConnect(s) {
		return 0
	}
	return 1
}

// kafkaProbeIsConnect reports whether a Kafka probe of settings s is run
// as a connect: the probe was chosen by auto and ep's clients speak TLS.
func (ep *endpoint) kafkaProbeIsConnect(s policy.Settings) bool {
	return ep.tls.Load() && (s.Detector.Probe == policy.ProbeKindAuto || s.Detector.Probe == "")
}

// repickSettingsLocked picks ep's probe settings again (see
// pickSettingsLocked) when the listeners that route to it change: one
// left, stopped accepting, or its clients turned out to speak TLS. p.mu
// is held.
func (p *Proxy) repickSettingsLocked(ep *endpoint) {
	ep.mu.Lock()
	empty := len(ep.listeners) == 0
	ep.mu.Unlock()
	if empty {
		return
	}
	ep.pickSettingsLocked(nil, *ep.settings.Load())
	p.det.Register(ep.addr, ep.probeConfig())
}

// repickForLocked picks again the probe settings of every endpoint l
// routes to (l stopped accepting). p.mu is held.
func (p *Proxy) repickForLocked(l *listener) {
	for _, ep := range p.endpointsOfLocked(l) {
		p.repickSettingsLocked(ep)
	}
}

// applyDisabled disables a newly admitted endpoint that endpoints.disabled
// names, by its address or by the name it was resolved from; true if that
// changed its state.
func (p *Proxy) applyDisabled(ep *endpoint) bool {
	return p.listedDisabled(ep) && p.det.Disable(ep.addr, health.ReasonConfig)
}

// listedDisabled reports whether endpoints.disabled names ep, by its
// address or by the name it was resolved from.
func (p *Proxy) listedDisabled(ep *endpoint) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.disabled[ep.addr] || (ep.name != "" && p.disabled[ep.name])
}

// probeConfig is how the detector probes the endpoint, with the latest
// settings it was registered with. An endpoint whose clients speak TLS
// cannot be probed with a plaintext Kafka request: auto falls back to a
// connect probe for it.
func (ep *endpoint) probeConfig() health.ProbeConfig {
	s := *ep.settings.Load()
	pc := probeConfig(s)
	pc.Override = ep.meshProbe
	pc.Waiting = ep.clientsWaiting
	if pc.Kind == health.ProbeKafka && ep.kafkaProbeIsConnect(s) {
		pc.Kind = health.ProbeConnect
		pc.Connected = nil // nothing to wait for (see probeConfig)
	}
	return pc
}

// clientsWaiting reports whether clients are being turned away for want
// of ep: a listener that routes to it refuses new links because of it (an
// explicit listener paused, a transparent destination in the kernel's
// excluded set, a pool with no member left to route to). Then the
// detector probes it every second whatever its backoff, so that it is
// back within about a second of its recovery. A pool that still routes to
// other members turns no one away: its excluded member keeps the backoff.
func (ep *endpoint) clientsWaiting() bool {
	ep.mu.Lock()
	ls := append([]*listener(nil), ep.listeners...)
	ep.mu.Unlock()
	for _, l := range ls {
		target := ep
		if l.pool != nil {
			target = nil
		}
		if l.refusing(target) {
			return true
		}
	}
	return false
}

// sawTLS records that a client of ep speaks TLS, and re-registers ep's
// probe configuration if that changes it.
func (p *Proxy) sawTLS(ep *endpoint) {
	if ep.tls.Swap(true) {
		return
	}
	p.mu.Lock()
	p.repickSettingsLocked(ep) // its Kafka probe ranks as a connect now
	p.mu.Unlock()
	pc := ep.probeConfig()
	if pc.Kind == health.ProbeConnect {
		p.log.Info().Str("endpoint", ep.addr).Msg("clients speak TLS: probing with a TCP connect, not a plaintext Kafka request (set detector.probe to choose)")
	}
}

// probeConfig is how the detector probes an endpoint of settings s. Probes
// dial with the same socket options as links (the mark, keepalive, user
// timeout): a probe that passes where a link would fail would readmit an
// endpoint no link can use, and with mark-based exemption from the
// interception rules a probe without the mark would be intercepted.
func probeConfig(s policy.Settings) health.ProbeConfig {
	d := s.Detector
	kind, port := s.Probe()
	var connected func(net.Conn) error
	if ut := s.ProbeUserTimeout(); ut != 0 && kind != policy.ProbeKindConnect {
		// A probe waiting for its answer is an idle link: keepalive's
		// count holds (see policy.Settings.ProbeUserTimeout). Raised once
		// connected: the SYN keeps tcp_user_timeout, as a connect probe's
		// does (it closes its connection at once), so that a probe of an
		// endpoint still unreachable ends then and the next one comes.
		connected = func(c net.Conn) error { return setConnUserTimeout(c, ut) }
	}
	return health.ProbeConfig{
		Dialer:       &net.Dialer{KeepAlive: -1, Control: flow.UpstreamControl(s)},
		Connected:    connected,
		OwnNetwork:   probeOwnNetwork(s.UpstreamMark),
		Kind:         healthProbeKind(kind),
		Timeout:      d.ProbeTimeout.D(),
		InitialDelay: d.InitialDelay.D(),
		Factor:       d.BackoffFactor,
		MaxDelay:     d.MaxDelay.D(),
		Jitter:       d.Jitter,
		HTTPPort:     port,
		HTTPPath:     d.HTTP.Path,
	}
}

// probeOwnNetwork is the ProbeConfig.OwnNetwork of probes with the
// upstream's mark: a probe whose connect failed while the proxy's host
// has no route of its own to where it dialed (ownNetwork, as a link's
// connect) asked nothing of the endpoint: no verdict, and the next probe
// comes at the initial delay, so that the endpoint is readmitted within
// it of the route's return, not after a backoff grown meanwhile. Only the
// connect's failure: an answer's is the endpoint's. A probe through the
// mesh (meshProbe) is judged so too: its session's connect goes to the
// peer sidecar with the same mark, and its error names where it went.
func probeOwnNetwork(mark int) func(error) bool {
	return func(err error) bool {
		var oe *net.OpError
		if !errors.As(err, &oe) || oe.Op != "dial" {
			return false
		}
		ta, ok := oe.Addr.(*net.TCPAddr)
		return ok && ownNetwork(err, ta.AddrPort(), mark)
	}
}

// setConnUserTimeout sets TCP_USER_TIMEOUT ut on a connection the proxy
// dialled (a probe's, a mesh session's). A refusal is this process's own
// failure (an os.SyscallError, ownFailure), never the peer's.
func setConnUserTimeout(c net.Conn, ut time.Duration) error {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return nil
	}
	raw, err := tc.SyscallConn()
	if err == nil {
		if err = flow.SetUserTimeout(raw, ut); err != nil {
			err = os.NewSyscallError("setsockopt TCP_USER_TIMEOUT", err)
		}
	}
	return err
}

// healthProbeKind translates a probe kind of the configuration into the
// detector's. A kind policy does not name (validation rejects it) is passed
// on as it is: the detector warns and fails every probe of the endpoint.
func healthProbeKind(kind string) string {
	switch kind {
	case policy.ProbeKindConnect:
		return health.ProbeConnect
	case policy.ProbeKindHTTP:
		return health.ProbeHTTP
	case policy.ProbeKindKafka:
		return health.ProbeKafka
	}
	return kind
}

func (ep *endpoint) add(lk *link) {
	ep.mu.Lock()
	ep.links[lk] = struct{}{}
	ep.mu.Unlock()
}

func (ep *endpoint) remove(lk *link) {
	ep.mu.Lock()
	delete(ep.links, lk)
	ep.mu.Unlock()
}

// evict closes every link to the endpoint routed to it before `before`
// (all of them when before is zero; see link.bound) with the given close
// reason, and counts them per listener as evictions for evictReason.
// A pool link still connecting to ep is not among them: it fails over to
// another member if its connect fails, and moves on if it succeeds to a
// member disabled or excluded meanwhile (listener.keeps; only a leaving
// member's drain, evictOf, ends such links).
func (ep *endpoint) evict(before time.Time, closeReason CloseReason, evictReason string) int {
	mono := flow.MonoOf(before)
	return ep.evictWhere(func(lk *link) bool {
		return !lk.dialing.Load() && (before.IsZero() || lk.bound.Load() < mono)
	}, closeReason, evictReason)
}

// evictWhere closes the endpoint's links that which picks (called under
// ep.mu) with closeReason, and counts them per listener as evictions for
// evictReason. It returns how many it closed.
func (ep *endpoint) evictWhere(which func(*link) bool, closeReason CloseReason, evictReason string) int {
	ep.mu.Lock()
	var ks []*link
	for lk := range ep.links {
		if which(lk) {
			ks = append(ks, lk)
		}
	}
	ep.mu.Unlock()
	n := 0
	for _, lk := range ks {
		if lk.abort(closeReason, nil) {
			lk.m.Evicted(evictReason, 1)
			n++
		}
	}
	return n
}

func (ep *endpoint) liveLinks() int {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	return len(ep.links)
}

// refusing reports whether l must refuse a new link: to ep (a transparent
// destination), or, for a pool listener (ep nil), to any member.
func (l *listener) refusing(ep *endpoint) bool {
	if ep == nil {
		routable, _ := l.pool.routing()
		return !routable
	}
	switch l.p.routingState(ep) {
	case health.Disabled: // or drained
		return true
	case health.Excluded:
		return !l.failOpen() && !l.groupFailingOpen(ep)
	}
	return false
}

// onHealthEvent applies a detector transition to the data plane. It runs
// outside the detector's lock, in order per endpoint.
func (p *Proxy) onHealthEvent(ev health.Event) {
	if hook := testHookHealthEvent.Load(); hook != nil {
		(*hook)(ev)
	}
	p.mu.Lock()
	ep := p.endpoints[ev.Endpoint]
	p.mu.Unlock()
	if ep == nil {
		return
	}
	log := p.log.With().Str("endpoint", ev.Endpoint).Str("from", ev.From.String()).
		Str("to", ev.To.String()).Str("reason", ev.Reason).Logger()
	if ev.From == health.Healthy {
		at := ev.At
		ep.leftAt.Store(&at)
	}
	switch ev.To {
	case health.Excluded:
		ep.onExcluded(ev, &log)
	case health.Disabled:
		n := ep.evict(time.Time{}, CloseEvicted, metrics.EvictDisabled)
		log.Warn().Int("links_closed", n).Msg("endpoint disabled")
	case health.Healthy:
		ep.onReadmitted(ev, &log)
	}
	p.followRouting(ep)
}

// testHookHealthEvent, when set (by a test), runs first in onHealthEvent:
// it can hold an event's application back, as a busy machine can.
var testHookHealthEvent atomic.Pointer[func(health.Event)]

// onExcluded refuses new links to ep and evicts its open ones, unless
// the exclusion's reason is no evidence against them (keepsLinks).
func (ep *endpoint) onExcluded(ev health.Event, log *zerolog.Logger) {
	ep.linksKept.Store(keepsLinks(CloseReason(ev.Reason)))
	if ep.linksKept.Load() {
		// New links are refused, but this is no evidence against the
		// links still open (see keepsLinks): each is judged by its own
		// rules (write and user timeouts, keepalive, unanswered).
		log.Warn().Int("links_kept", ep.liveLinks()).Msg("endpoint excluded: new links refused, open links kept")
		return
	}
	closeReason := CloseEvicted
	if CloseReason(ev.Reason) == CloseUnanswered {
		closeReason = CloseUnanswered
	}
	// The links routed to it before the exclusion: one routed since
	// went there knowingly (fail-open, on_excluded: allow), as one routed
	// during an exclusion restored when a forgotten endpoint came back
	// (its event comes a moment after the state), even one accepted
	// before the exclusion (its pick came after; the event can be
	// delivered after that).
	n := ep.evict(ev.At, closeReason, metrics.EvictExcluded)
	if linkEnd(CloseReason(ev.Reason)) {
		n++ // the link whose end was the evidence, closed before the report
	}
	e := log.Warn().Int("links_closed", n)
	if ev.Evidence.Detail != "" {
		e = e.Str("evidence", ev.Evidence.Detail)
	}
	if !ev.Evidence.Since.IsZero() {
		e = e.Time("evidence_since", ev.Evidence.Since).Int64("evidence_ms", ev.At.Sub(ev.Evidence.Since).Milliseconds())
	}
	e.Msg("endpoint excluded")
}

// onReadmitted starts ep afresh and evicts the links opened before it
// left routing, unless its exclusion kept them.
func (ep *endpoint) onReadmitted(ev health.Event, log *zerolog.Logger) {
	// A fresh start: requests sent before the readmission (on links
	// about to be evicted, or already ended) are not judged against
	// the server now admitted.
	ep.readmitted.Store(flow.Mono())
	ep.orphans.Clear()
	ep.consecutive.Store(0)
	// Connect timeouts in a row start over too: a connect begun before
	// the readmission never counts, and one lost SYN of the clients that
	// rush back (the accept queue is fullest then) excludes nothing.
	ep.timeoutAt.Store(flow.Mono())
	ep.dialTimeouts.Store(0)
	// No client keeps a connection opened before the exclusion (to
	// the process that failed), except after an exclusion that kept
	// them on purpose (keepsLinks): they were judged by their own
	// rules meanwhile; the links of a dead session are gone already,
	// and a server that started afresh has a new epoch, which evicts
	// the links of the old one (evictMeshEpoch). Links opened during
	// the exclusion (fail-open, on_excluded: allow) reach the very
	// process the probe just found healthy: they stay, those accepted
	// before it left and routed to it since too (link.bound).
	n := 0
	if !ep.linksKept.Swap(false) {
		before := ev.At
		if left := ep.leftAt.Load(); left != nil {
			before = *left
		}
		n = ep.evict(before, CloseEvicted, metrics.EvictReadmitted)
	}
	log.Info().Int("links_closed", n).Msg("endpoint readmitted")
}

// followRouting brings the listeners routing to ep in line with its new
// state: the kernel's excluded set, the ingress's readiness, the pause of
// a listener that refuses.
func (p *Proxy) followRouting(ep *endpoint) {
	ep.mu.Lock()
	ls := append([]*listener(nil), ep.listeners...)
	ep.mu.Unlock()
	p.syncExcludedSet(ep)
	for _, l := range ls {
		if l.matches != nil && l.spec().groupFailOpen {
			// The group may have started or stopped failing open: its
			// other destinations move in or out of the kernel's set too.
			for _, other := range l.group(ep) {
				if other != ep {
					p.syncExcludedSet(other)
				}
			}
		}
		if l.ingress != nil {
			l.ingress.kickCheck() // readiness follows the local endpoint's state
		}
		// Transparent listeners refuse per connection, never pause.
		p.updateRouting(l)
	}
}

// keepsLinks reports whether an exclusion for reason leaves the endpoint's
// open links alone: it is evidence that new connections fail, not that
// open ones make no progress. A failed connect (dial_error): a server
// that closed its listener to drain for a graceful restart still finishes
// the links it serves, and a connect lost on the way says nothing of the
// established links (the failure reaches the detector only when no link
// showed the endpoint alive, see dialFailed). The mesh's not ready: the
// same, announced by the peer sidecar. A dead mesh session: its own links
// were closed already; links on another session to the same peer are
// judged by that session's heartbeat (a blackhole can take one path and
// spare another).
func keepsLinks(reason CloseReason) bool {
	switch reason {
	case CloseDialError, reasonMeshNotReady, reasonMeshDead:
		return true
	}
	return false
}

// dialTimeoutsToReport is how many connects in a row must time out before
// a timeout is held against the endpoint: Linux sends a SYN again 1s
// after the first (and 2s after it since 6.5, tcp_syn_linear_timeouts;
// 3s before), so one timeout can be one lost SYN (or two); two in a row,
// each spanning a retransmission, are not.
const dialTimeoutsToReport = 2

// dialFailed decides whether a connect to the endpoint that failed with
// err (an upstream fault), begun at mono time began, is evidence against
// it, to be reported (dial_error). Not while the endpoint shows another
// sign of life: a byte from it on any link since the connect began, or
// within lifeWindow before: a lost SYN or a full accept queue is not a
// dead server. Not on a timeout that a lost SYN explains: only the
// dialTimeoutsToReport-th in a row (a connect that succeeds starts the
// count over). In a row is in time: a timeout counts only when its
// connect began after the last counted one had ended. Connects that
// overlap (clients connecting at once, each losing its SYN in the same
// moment of a full accept queue) are one timeout, however many there
// are. Never on a timeout the proxy noticed late (errFrozenDial: it could
// not run meanwhile), which the count leaves out: it neither counts nor
// starts over. A refusal or an unreachable host with no sign of life is
// reported at once.
func (ep *endpoint) dialFailed(began int64, lifeWindow time.Duration, err error) bool {
	if errors.As(err, new(errFrozenDial)) {
		return false
	}
	timedOut := dialTimedOut(err)
	n := int32(0)
	if timedOut {
		n = ep.dialTimeouts.Load()
		if last := ep.timeoutAt.Load(); began >= last && ep.timeoutAt.CompareAndSwap(last, flow.Mono()) {
			n = ep.dialTimeouts.Add(1)
		}
	}
	if ep.lastAnswer.Load() >= began-int64(lifeWindow) {
		return false
	}
	return !timedOut || n >= dialTimeoutsToReport
}

// dialSucceeded starts the count of connects in a row that timed out over.
func (ep *endpoint) dialSucceeded() {
	if ep.dialTimeouts.Load() != 0 {
		ep.dialTimeouts.Store(0)
	}
}

// linkEnd reports whether an exclusion reason is the end of a link (a
// write timeout, ETIMEDOUT, a stalled overflow): that link was already
// closed when the report came.
func linkEnd(reason CloseReason) bool {
	switch reason {
	case CloseWriteTimeout, CloseUpstreamTimeout, CloseWatermark, CloseBudget:
		return true
	}
	return false
}

// onProbe counts a probe's verdict.
func (p *Proxy) onProbe(addr string, ok bool) {
	p.mu.Lock()
	ep := p.endpoints[addr]
	p.mu.Unlock()
	if ep == nil {
		return
	}
	// Once per endpoint, under the first of its listeners by name: a
	// sum() over listeners must not count a probe twice.
	if l := ep.owner(); l != nil {
		if ok {
			l.m.ProbesOK.Inc()
		} else {
			l.m.ProbesFailed.Inc()
		}
	}
}

// owner is the listener that endpoint-level counters are counted under:
// the first of its listeners by name (nil when none is left).
func (ep *endpoint) owner() *listener {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	var first *listener
	for _, l := range ep.listeners {
		if first == nil || l.cfg.Name < first.cfg.Name {
			first = l
		}
	}
	return first
}

// report passes a data-plane failure to the detector.
func (p *Proxy) report(ep *endpoint, reason CloseReason) {
	p.det.Report(ep.addr, string(reason))
}

// reportLinkEnd passes the end of lk, evidence against its upstream (see
// blamesUpstream), to the detector, with what was seen: since when the
// upstream had acknowledged nothing, and the link's error. On an endpoint
// already out it closes the endpoint's other links.
func (p *Proxy) reportLinkEnd(lk *link, reason CloseReason, err error) {
	ev := health.Evidence{Since: monoToTime(lk.ackedAt.Load()), Detail: "a link ended " + string(reason)}
	if err != nil {
		ev.Detail += ": " + err.Error()
	}
	ended := time.Now()
	if p.det.ReportEvidence(lk.ep.addr, string(reason), ev) {
		return // onExcluded closes the other links
	}
	if st, ok := p.det.State(lk.ep.addr); ok && st != health.Healthy {
		// Already out (excluded for a reason that kept the open links,
		// a dial_error; or with links opened since, under fail-open or
		// on_excluded: allow): this end is the same evidence against
		// the links still open as at a healthy endpoint, and closes them
		// as suspect does. Readmission then has none left to keep. Not
		// the links routed to it since (after a readmission that came
		// between the report and the look at the state).
		lk.ep.linksKept.Store(false)
		if n := lk.ep.evict(ended, CloseEvicted, metrics.EvictExcluded); n > 0 {
			p.log.Warn().Str("endpoint", lk.ep.addr).Str("reason", string(reason)).Int("links_closed", n).
				Msg("a link to an excluded endpoint ended on evidence against it: its other links closed")
		}
	}
}

// monoToTime converts a mono time to wall-clock time.
func monoToTime(m int64) time.Time {
	return time.Now().Add(-time.Duration(flow.Mono() - m))
}

// countUnanswered adds n unanswered requests to the endpoint's consecutive
// count; reaching thr, the threshold of the listener that sent them, marks
// the endpoint suspect. since is the mono send time of the earliest of
// them: the endpoint has answered nothing since. from is the listener
// whose link judged them, nil for a link that had already ended (then
// they count under the endpoint's owner).
func (p *Proxy) countUnanswered(ep *endpoint, from *listener, n, thr int, since int64) {
	if n <= 0 {
		return
	}
	// A link's requests count under its listener; those of links that
	// ended count once, under the endpoint's owner.
	counter := from
	if counter == nil {
		counter = ep.owner()
	}
	if counter != nil {
		counter.m.UnansweredTimeouts.Add(float64(n))
	}
	if thr <= 0 {
		return
	}
	if from := ep.judgedFrom(); since < from {
		return // sent before the readmission: see judgedFrom
	} else if s := ep.silentSince.Load(); s != 0 && s < from {
		// A count begun before the readmission, which the proxy has
		// not applied yet (onReadmitted): it starts over now.
		ep.consecutive.Store(0)
		ep.silentSince.CompareAndSwap(s, 0)
	}
	ep.noteSilence(since)
	// At or past thr, whoever else's requests the count holds: listeners
	// with other thresholds share it, so a crossing of this one's may
	// never come (one with threshold 1 counting after one with 2). The
	// swap makes one count the suspicion's; one that lost it to another
	// count (of a listener with a higher threshold, say) tries again
	// until the count is taken or starts over (an answer).
	for c := ep.consecutive.Add(int64(n)); c >= int64(thr); c = ep.consecutive.Load() {
		if ep.consecutive.CompareAndSwap(c, 0) {
			p.suspect(ep, thr, int(c))
			return
		}
	}
}

// judgedFrom is the mono time from which the endpoint's silence is
// evidence against it: since it has been Healthy for the detector (its
// registration, or its readmission, a probe's or the operator's, whose
// fresh start the proxy applies with the event a moment later:
// onReadmitted). Requests sent before a readmission went to what the
// probe replaced: counted, no evidence against what it readmitted, and
// they do not take the evidence of the requests sent since with them.
// NoAnswer when it is not Healthy (its verdict is in).
func (ep *endpoint) judgedFrom() int64 {
	if at := ep.p.det.HealthySince(ep.addr); !at.IsZero() {
		return flow.MonoOf(at)
	}
	return flow.NoAnswer
}

// noteSilence records that the endpoint has been silent since mono time
// since (the earliest unanswered request counted since its last answer).
func (ep *endpoint) noteSilence(since int64) {
	for {
		cur := ep.silentSince.Load()
		if cur != 0 && cur <= since || ep.silentSince.CompareAndSwap(cur, since) {
			return
		}
	}
}

// answered records an answer from the endpoint at mono time now: it is
// alive, and its consecutive count starts over.
func (ep *endpoint) answered(now int64) {
	// Never backwards: two pumps may store out of order.
	for {
		last := ep.lastAnswer.Load()
		if last >= now || ep.lastAnswer.CompareAndSwap(last, now) {
			break
		}
	}
	if ep.consecutive.Load() != 0 {
		ep.consecutive.Store(0)
		ep.silentSince.Store(0)
	}
}

// heardAt records bytes from the endpoint that its kernel took in at mono
// time at, before the proxy read them (see link.heardUnread): an answer
// then. Unlike answered, it starts the consecutive count over only when
// at is later than the silence the count rests on: requests counted
// since were sent after those bytes came, and stay counted.
func (ep *endpoint) heardAt(at int64) {
	for {
		last := ep.lastAnswer.Load()
		if last >= at || ep.lastAnswer.CompareAndSwap(last, at) {
			break
		}
	}
	if s := ep.silentSince.Load(); ep.consecutive.Load() != 0 && s != 0 && at > s {
		ep.consecutive.Store(0)
		ep.silentSince.Store(0)
	}
}

// suspect handles an endpoint that reached the unanswered threshold: it is
// excluded and every link to it closed, client sides included. overdue is
// how many requests were past their deadline with no answer since.
func (p *Proxy) suspect(ep *endpoint, thr, overdue int) {
	ep.consecutive.Store(0)
	now := flow.Mono()
	since := ep.silentSince.Swap(0)
	if since == 0 || since > now {
		since = now
	}
	// A silence that began before the endpoint's readmission rests on
	// requests sent to what the probe replaced: no verdict against what
	// it readmitted, whose own requests are judged afresh. The proxy's
	// application of the readmission (onReadmitted: the count and the
	// orphans start over) comes with its event, a moment after the
	// detector's state: requests judged in between are not counted
	// against it either.
	if since < ep.judgedFrom() {
		p.log.Debug().Str("endpoint", ep.addr).Int("overdue_requests", overdue).
			Msg("requests past their deadline, sent before the endpoint's readmission: no verdict")
		return
	}
	if l := ep.owner(); l != nil {
		l.m.EndpointSuspect.Inc() // once per endpoint
	}
	silent := time.Duration(now - since)
	ev := health.Evidence{
		Since:  monoToTime(since),
		Detail: fmt.Sprintf("%d request(s) past their own deadline; no answer from the endpoint, on any link, for %v with them outstanding", overdue, silent.Round(time.Millisecond)),
	}
	// At most a line a second per endpoint: under fail-open (or
	// on_excluded: allow) toward a silent endpoint, every link let through
	// comes back here, as often as its clients reconnect.
	if n, ok := ep.suspects.pass(); ok {
		log := p.log.Warn().Str("endpoint", ep.addr).Int("threshold", thr).Int("overdue_requests", overdue).
			Int64("silent_ms", silent.Milliseconds()).Int64("verdicts_since_last_line", n)
		if last := ep.lastAnswer.Load(); last != flow.NoAnswer {
			log = log.Int64("last_answer_ms_ago", time.Duration(now-last).Milliseconds())
		}
		log.Msg("endpoint suspect: requests past their deadline with the endpoint silent")
	}
	if !p.det.ReportEvidence(ep.addr, string(CloseUnanswered), ev) {
		// Already excluded (on_excluded: allow) or disabled: still close.
		ep.evict(time.Time{}, CloseUnanswered, metrics.EvictExcluded)
	}
}

// blamesUpstream reports whether the link's end is evidence against its
// upstream, to be reported to the detector. Which events exclude an
// endpoint, and why, is in the README ("What counts as a dead upstream").
// upstreamEnded reports whether a link's end came from its upstream's
// side: a local server behind a mesh ingress may have gone.
func upstreamEnded(reason CloseReason) bool {
	switch reason {
	case CloseUpstreamClosed, CloseUpstreamError, CloseUpstreamTimeout,
		CloseWriteTimeout, CloseDialError, CloseUnanswered, CloseRefused:
		return true
	}
	return false
}

func (lk *link) blamesUpstream(reason CloseReason) bool {
	switch reason {
	case CloseWriteTimeout, CloseUpstreamTimeout:
		return true // (a failed dial is reported by the attempt itself)
	case CloseWatermark, CloseBudget:
		return lk.overflowStalled.Load()
	}
	return false
}
