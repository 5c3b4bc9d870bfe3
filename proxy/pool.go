package proxy

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// lookupTimeout bounds one resolution of all of a pool's names.
const lookupTimeout = 2 * time.Second

// pool is the set of endpoints an explicit or pool listener routes to: the
// configured host:port entries, or every A/AAAA record of pool.dns, with
// each host name resolved again every refresh so that a pod restarted with
// a new address is followed without waiting for a failure. An explicit
// listener's upstream is a pool of one entry.
//
// Each member is an endpoint keyed by its address; one resolved from a
// name keeps the name (host:port) it came from, which endpoints.disabled
// and the admin API accept too.
type pool struct {
	l *listener

	mu          sync.Mutex
	specs       []string            // host:port entries, as configured (normalized)
	dns         bool                // the one spec is pool.dns: its records are the members
	refresh     time.Duration       //
	last        map[string][]string // spec -> its last good addresses
	members     []*endpoint         // sorted by addr
	cursor      uint64              // round-robin position
	failingOpen bool                // last logged: no routable member, links go to excluded ones
	looping     bool                // the refresh loop runs
	// draining are the members that left, while their links finish (see
	// drainMember): closed when one comes back, which ends its drain.
	draining map[*endpoint]chan struct{}

	wake chan struct{} // a reload changed the specs: resolve now

	// routeMu serializes updateRouting: its read of the routing and the
	// pause or resume that follows are one step, so that a caller that
	// read "nothing routable" cannot pause the listener after another
	// resumed it on a readmission (health events, a drain, the DNS
	// refresh and a reload all call it).
	routeMu sync.Mutex
}

func newPool(l *listener, cfg policy.Listener) *pool {
	pl := &pool{l: l, last: map[string][]string{}, draining: map[*endpoint]chan struct{}{}, wake: make(chan struct{}, 1)}
	pl.setSpecs(cfg)
	return pl
}

// setSpecs takes the entries and refresh interval of cfg; members follow
// at the next resolution.
func (pl *pool) setSpecs(cfg policy.Listener) {
	var specs []string
	dns := false
	refresh := policy.DefaultPool().Refresh.D()
	switch {
	case cfg.IsPool() && cfg.Pool.DNS != "":
		specs, dns = []string{normalizeEndpoint(cfg.Pool.DNS)}, true
	case cfg.IsPool():
		for _, e := range cfg.Pool.Endpoints {
			specs = append(specs, normalizeEndpoint(e))
		}
	default:
		specs = []string{normalizeEndpoint(cfg.Upstream)}
	}
	// An explicit upstream's name is resolved on the pool default.
	if cfg.IsPool() && cfg.Pool.Refresh > 0 {
		refresh = cfg.Pool.Refresh.D()
	}
	pl.mu.Lock()
	pl.specs, pl.dns, pl.refresh = specs, dns, refresh
	for s := range pl.last {
		if !slices.Contains(specs, s) {
			delete(pl.last, s)
		}
	}
	pl.mu.Unlock()
	select {
	case pl.wake <- struct{}{}:
	default:
	}
}

// hasNames reports whether any entry is a host name (resolution needed
// after startup).
func (pl *pool) hasNames() bool {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	for _, s := range pl.specs {
		if host, _, err := net.SplitHostPort(s); err != nil || !isIP(host) {
			return true
		}
	}
	return false
}

func isIP(host string) bool {
	_, err := netip.ParseAddr(host)
	return err == nil
}

// startRefresh starts the pool's refresh loop when some entry is a name
// (addresses need none); the listener owns it (acceptWG).
func (l *listener) startRefresh() {
	if l.ingress != nil {
		l.ingress.startOnce.Do(l.ingress.start)
		return
	}
	if l.pool == nil || !l.pool.hasNames() {
		return
	}
	l.pool.mu.Lock()
	running := l.pool.looping
	l.pool.looping = true
	l.pool.mu.Unlock()
	if running {
		return
	}
	l.acceptWG.Add(1)
	go l.pool.refreshLoop(l.p.resolver)
}

// resolve computes the member addresses: literal entries as they are,
// every address of each name. A name whose lookup fails keeps its last
// good addresses (counted and logged); one that was never resolved has
// none yet. It returns addr -> the spec it came from ("" for a literal).
func (pl *pool) resolve(ctx context.Context, r *net.Resolver) map[string]string {
	pl.mu.Lock()
	specs := slices.Clone(pl.specs)
	pl.mu.Unlock()
	out := map[string]string{}
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	for _, spec := range specs {
		host, port, err := net.SplitHostPort(spec)
		if err != nil {
			continue // validated by policy
		}
		if isIP(host) {
			out[spec] = ""
			continue
		}
		ips, err := r.LookupNetIP(ctx, "ip", host)
		pl.mu.Lock()
		if err != nil {
			addrs := pl.last[spec]
			pl.mu.Unlock()
			if ctx.Err() == nil || len(addrs) > 0 {
				pl.l.m.DNSErrors.Inc()
				pl.l.log.Warn().Err(err).Str("name", spec).Int("keeping", len(addrs)).
					Msg("lookup failed: keeping the last good addresses")
			}
			for _, a := range addrs {
				out[a] = spec
			}
			continue
		}
		p, _ := strconv.Atoi(port)
		addrs := make([]string, 0, len(ips))
		for _, ip := range ips {
			addrs = append(addrs, netip.AddrPortFrom(ip.Unmap(), uint16(p)).String())
		}
		slices.Sort(addrs)
		pl.last[spec] = addrs
		pl.mu.Unlock()
		for _, a := range addrs {
			out[a] = spec
		}
	}
	return out
}

// refreshLoop resolves the pool's names every refresh until the listener
// stops; a reload that changes the entries wakes it at once. The listener
// owns it (acceptWG).
func (pl *pool) refreshLoop(r *net.Resolver) {
	l := pl.l
	defer l.acceptWG.Done()
	for {
		pl.mu.Lock()
		d := pl.refresh
		pl.mu.Unlock()
		t := time.NewTimer(d)
		select {
		case <-l.stopped:
			t.Stop()
			return
		case <-pl.wake:
		case <-t.C:
		}
		t.Stop()
		l.p.syncPool(pl, pl.resolve(l.ctx, r))
	}
}

// syncPool makes the pool's members the resolved addresses: new ones are
// admitted (healthy, or disabled if endpoints.disabled names them or
// their name); those that left take no new link and are drained (see
// drainMember): one that comes back before its drain ends is a member as
// before, with its links and its state; one that comes back later starts
// afresh.
func (p *Proxy) syncPool(pl *pool, addrs map[string]string) {
	l := pl.l
	settings := l.spec().settings
	p.mu.Lock()
	l.mu.Lock()
	stopping := l.stopping
	l.mu.Unlock()
	if stopping {
		p.mu.Unlock()
		return
	}
	var members, created, named []*endpoint
	for addr, name := range addrs {
		ep, isNew := p.endpointForLocked(addr, settings, l)
		if name != "" && ep.name != name {
			ep.name = name
			if !isNew {
				// Known by another name, or none (an address another
				// listener routes to): endpoints.disabled may list this
				// one, which no reload's diff of the list would see.
				named = append(named, ep)
			}
		}
		ep.mu.Lock()
		if !slices.Contains(ep.listeners, l) {
			ep.listeners = append(ep.listeners, l)
		}
		ep.mu.Unlock()
		members = append(members, ep)
		if isNew {
			created = append(created, ep)
		}
	}
	slices.SortFunc(members, func(a, b *endpoint) int { return compareAddr(a.addr, b.addr) })
	pl.mu.Lock()
	old := pl.members
	pl.members = members
	var back []*endpoint
	for _, ep := range members {
		if stop, ok := pl.draining[ep]; ok {
			close(stop)
			delete(pl.draining, ep)
			back = append(back, ep)
		}
	}
	leaving := map[*endpoint]chan struct{}{}
	for _, ep := range old {
		if !slices.Contains(members, ep) {
			leaving[ep] = make(chan struct{})
			pl.draining[ep] = leaving[ep]
		}
	}
	pl.mu.Unlock()
	p.mu.Unlock()

	for _, ep := range created {
		p.applyDisabled(ep)
		l.log.Info().Str("endpoint", ep.addr).Str("name", ep.name).Msg("endpoint admitted")
	}
	for _, ep := range named {
		p.applyDisabled(ep)
	}
	for _, ep := range back {
		l.log.Info().Str("endpoint", ep.addr).Str("name", ep.name).Msg("endpoint back before its drain ended: a member again, its links kept")
	}
	for ep, stop := range leaving {
		p.drainMember(pl, ep, stop)
	}
	p.updateRouting(l)
}

// drainPoll is how often a draining member is checked for links left.
const drainPoll = 100 * time.Millisecond

// drainMember lets a member that left the pool's names finish its links:
// it takes no new link (it is no longer a member), its open links go on
// for drain_timeout and are then closed (evictions_total{reason="removed"}),
// and it is forgotten once none is left, or at once when it has none.
// Kubernetes takes a terminating pod out of a headless Service's records
// at the start of its grace period, while it still serves; a resolver
// that answers with a subset of the records (Consul, multi-value DNS)
// drops members that are there: neither is a reason to cut a link, and a
// member back before its drain ends keeps its links (stop is closed).
// The drain runs in a goroutine the proxy owns (Shutdown waits for it).
func (p *Proxy) drainMember(pl *pool, ep *endpoint, stop chan struct{}) {
	l := pl.l
	drain := max(p.DrainTimeout(), 0)
	l.log.Info().Str("endpoint", ep.addr).Str("name", ep.name).Int("links", ep.linksOf(l)).
		Dur("drain_timeout_ms", drain).Msg("endpoint left the pool: no new links, open ones may finish")
	p.bg.Add(1)
	go func() {
		defer p.bg.Done()
		t := time.NewTimer(drain)
		defer t.Stop()
		tick := time.NewTicker(drainPoll)
		defer tick.Stop()
	wait:
		for ep.linksOf(l) > 0 {
			select {
			case <-stop:
				return
			case <-p.ctx.Done():
				return // Shutdown ends the links
			case <-tick.C:
			case <-t.C:
				break wait
			}
		}
		// Under p.mu, as syncPool: a member that comes back now finds
		// either this endpoint still attached, or none (a fresh start).
		p.mu.Lock()
		pl.mu.Lock()
		mine := pl.draining[ep] == stop
		if mine {
			delete(pl.draining, ep)
		}
		pl.mu.Unlock()
		orphan := mine && p.detachFromLocked(l, ep)
		p.mu.Unlock()
		if !mine {
			return // back, and its drain ended with it
		}
		n := ep.evictOf(l, CloseEvicted, metrics.EvictRemoved)
		l.log.Info().Str("endpoint", ep.addr).Str("name", ep.name).Int("links_closed", n).Msg("endpoint removed")
		if orphan {
			p.forget(ep)
		}
	}()
}

// linksOf counts the endpoint's links of listener l.
func (ep *endpoint) linksOf(l *listener) int {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	n := 0
	for lk := range ep.links {
		if lk.host == l {
			n++
		}
	}
	return n
}

// evictOf closes the endpoint's links of listener l, counting them as
// evictions for evictReason: a member that left one pool may still be a
// member of another.
func (ep *endpoint) evictOf(l *listener, closeReason CloseReason, evictReason string) int {
	return ep.evictWhere(func(lk *link) bool { return lk.host == l }, closeReason, evictReason)
}

// compareAddr orders host:port strings (numeric addresses first by
// address, then anything else by text).
func compareAddr(a, b string) int {
	pa, ea := netip.ParseAddrPort(a)
	pb, eb := netip.ParseAddrPort(b)
	if ea == nil && eb == nil {
		return pa.Compare(pb)
	}
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// smallPool is how many members the callers of candidatesLocked make room
// for on their stacks; a larger pool's candidates go to the heap.
const smallPool = 8

// candidatesLocked returns the members as the selector sees them, in cs
// (the caller's room, on its stack for a pool of ordinary size: a pick
// per new link allocated a slice, twice); pl.mu held.
func (pl *pool) candidatesLocked(cs []policy.Candidate) []policy.Candidate {
	cs = slices.Grow(cs[:0], len(pl.members))[:len(pl.members)]
	for i, ep := range pl.members {
		c := policy.Candidate{Addr: ep.addr, Links: ep.liveLinks()}
		switch pl.l.p.routingState(ep) { // a drained member is out as a disabled one is
		case health.Excluded:
			c.State = policy.Excluded
		case health.Disabled:
			c.State = policy.Disabled
		}
		cs[i] = c
	}
	return cs
}

// failOpen reports whether excluded members may take links when no member
// is routable: pool.fail_open, or on_excluded: allow.
func (l *listener) failOpen() bool {
	t := l.spec()
	return t.failOpen || t.settings.OnExcluded == policy.OnExcludedAllow
}

// failOpenKey names the setting that makes l fail open.
func (l *listener) failOpenKey() string {
	if l.spec().failOpen {
		return "fail_open"
	}
	return "on_excluded: allow"
}

// pick chooses the endpoint for a connect attempt of lk, never one of
// the link's tried members while another eligible member exists (a retry
// moves on; see policy.Select), and counts lk on it, dialling, before the
// next pick sees the members' links: least_links spreads a burst of
// connects, and a leaving member's drain counts the link from now on.
// nil: refuse.
func (pl *pool) pick(tried []string, lk *link) (*endpoint, bool) {
	t := pl.l.spec()
	pl.mu.Lock()
	defer pl.mu.Unlock()
	var room [smallPool]policy.Candidate
	ch := policy.Select(pl.candidatesLocked(room[:0]), t.balance, pl.l.failOpen(), &pl.cursor, pl.noRouteLocked(tried))
	if ch.Index < 0 {
		return nil, false
	}
	ep := pl.members[ch.Index]
	lk.dialing.Store(true)
	// Routed now, after the look at the members' states: a member seen
	// excluded (fail-open) left routing before this. One seen routable
	// that leaves it before the dial ends is left by the link then
	// (listener.keeps).
	lk.bound.Store(flow.Mono())
	ep.add(lk)
	return ep, ch.FailOpen
}

// noRouteLocked is tried with, ahead of it, the members a connect found
// no route of the proxy's own to within noRouteFor: Select passes them
// over as tried while a member it has not tried can serve, and takes
// them when none can (never fewer picks than without them). tried itself
// when there are none: no allocation then.
func (pl *pool) noRouteLocked(tried []string) []string {
	var now int64
	var out []string
	for _, ep := range pl.members {
		until := ep.noRouteUntil.Load()
		if until == 0 {
			continue
		}
		if now == 0 {
			now = flow.Mono()
		}
		if until <= now {
			ep.noRouteUntil.CompareAndSwap(until, 0) // over: no look at the clock for it again
			continue
		}
		if !slices.Contains(tried, ep.addr) {
			out = append(out, ep.addr)
		}
	}
	if out == nil {
		return tried
	}
	return append(out, tried...)
}

// routing reports whether a new link could be routed now (some member is
// eligible) and whether it would fail open (no member is routable, and
// links go to excluded ones).
func (pl *pool) routing() (routable, failingOpen bool) {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	var cursor uint64
	var room [smallPool]policy.Candidate
	ch := policy.Select(pl.candidatesLocked(room[:0]), policy.BalanceRoundRobin, pl.l.failOpen(), &cursor, nil)
	return ch.Index >= 0, ch.FailOpen
}

// updateRouting pauses or resumes a pool listener after a member's state
// or the members changed, and logs when the pool starts or stops failing
// open.
func (p *Proxy) updateRouting(l *listener) {
	pl := l.pool
	if pl == nil {
		return
	}
	pl.routeMu.Lock()
	defer pl.routeMu.Unlock()
	routable, failingOpen := pl.routing()
	pl.mu.Lock()
	changed := pl.failingOpen != failingOpen
	pl.failingOpen = failingOpen
	pl.mu.Unlock()
	if changed && failingOpen {
		l.log.Warn().Str("by", l.failOpenKey()).Msg("every enabled endpoint is excluded: failing open, new links go to excluded endpoints")
	} else if changed {
		l.log.Info().Msg("no longer failing open")
	}
	if routable {
		l.resume()
	} else {
		l.pause()
	}
}

// PoolStatus is one pool listener as GET /v1/pools shows it.
type PoolStatus struct {
	Listener    string   `json:"listener"`
	Endpoints   []string `json:"endpoints"`
	Balance     string   `json:"balance"`
	FailOpen    bool     `json:"fail_open"`
	FailingOpen bool     `json:"failing_open"`
}

// Pools returns every explicit and pool listener's members and whether it
// is failing open.
func (p *Proxy) Pools() []PoolStatus {
	p.mu.Lock()
	ls := slices.Clone(p.listeners)
	p.mu.Unlock()
	var out []PoolStatus
	for _, l := range ls {
		if l.pool == nil {
			continue
		}
		t := l.spec()
		_, failingOpen := l.pool.routing()
		st := PoolStatus{Listener: l.cfg.Name, Balance: t.balance, FailOpen: t.failOpen, FailingOpen: failingOpen, Endpoints: []string{}}
		l.pool.mu.Lock()
		for _, ep := range l.pool.members {
			st.Endpoints = append(st.Endpoints, ep.addr)
		}
		l.pool.mu.Unlock()
		out = append(out, st)
	}
	return out
}
