package proxy

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"reflect"
	"slices"
	"time"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/policy"
)

// sameTarget reports whether a listener can take the new configuration in
// place: same listen address and the same kind of target, with the same
// upstream (explicit), or the same match list (transparent). A pool keeps
// its listener whatever its entries: members that leave are evicted.
func sameTarget(a, b policy.Listener) bool {
	if a.Listen != b.Listen || a.IsPool() != b.IsPool() || a.IsTransparent() != b.IsTransparent() || a.IsIngress() != b.IsIngress() {
		return false
	}
	switch {
	case b.IsIngress():
		// Its tuning and ports are retuned in place: the listener, its
		// sessions and its ports' epochs stay.
		return a.Ingress.Local == b.Ingress.Local
	case b.IsPool():
		return true
	case b.IsTransparent():
		return reflect.DeepEqual(a.Transparent.Match, b.Transparent.Match)
	}
	return normalizeEndpoint(a.Upstream) == normalizeEndpoint(b.Upstream)
}

// Reload applies a new, validated configuration without dropping links
// it does not affect:
//   - a listener with the same name, listen address and upstream keeps its
//     socket and its links; its new settings apply to links opened from
//     now on;
//   - a listener that is new, or whose listen address or upstream changed,
//     is bound (a failure to bind is returned and the rest still applies);
//   - a listener that is gone stops accepting at once; its links get
//     drain_timeout to finish and are then closed;
//   - endpoints.disabled is diffed: a newly listed endpoint is disabled,
//     and so is a listed one the reload makes (a new listener routes to
//     it); one listed before and still is keeps its state (the admin API
//     may have enabled it); endpoints the previous config listed and this
//     one does not are enabled if the listing still disables them (a
//     readmission: links opened before it are evicted). Endpoints the
//     admin API disabled, or the detector excluded, stay as they are.
//
// Admin and log settings are not reloaded (they need a restart).
func (p *Proxy) Reload(cfg policy.Config) error {
	_, err := p.Apply(cfg)
	return err
}

// Changes is what a reload changed, for its log line.
type Changes struct {
	ListenersAdded    []string `json:"listeners_added,omitempty"`
	ListenersRemoved  []string `json:"listeners_removed,omitempty"`
	ListenersRetuned  []string `json:"listeners_retuned,omitempty"` // kept, with settings that differ
	EndpointsDisabled []string `json:"endpoints_disabled,omitempty"`
	EndpointsEnabled  []string `json:"endpoints_enabled,omitempty"`
}

// Apply is Reload, and says what changed.
func (p *Proxy) Apply(cfg policy.Config) (Changes, error) {
	// The steps, in this order, each a function of its own:
	//   - plan: which listeners are kept, made anew or retired, and which
	//     endpoints are disabled or enabled, worked out from the
	//     configurations alone (planReload);
	//   - swap: kept listeners take their new configuration and new ones
	//     are made, the drain timeout and the limits take effect, pools'
	//     members are synced, and every endpoint the new config disables
	//     leaves routing, before any listener binds;
	//   - retire the removed (or moved) listeners, then bind the added
	//     ones: a listener that moved to a new upstream under the same
	//     address needs the address free;
	//   - the new listener set is in force; endpoints no longer listed as
	//     disabled are enabled.
	var ch Changes
	p.reloadMu.Lock()
	defer p.reloadMu.Unlock()

	p.mu.Lock()
	if !p.started || p.closing {
		p.mu.Unlock()
		return ch, errors.New("reload: proxy not running")
	}
	plan := planReload(p.runningLocked(), p.disabled, cfg)
	pre, err := p.prebindLocked(plan)
	if err != nil {
		p.mu.Unlock()
		return ch, err
	}
	known := make(map[*endpoint]bool, len(p.endpoints))
	for _, ep := range p.endpoints {
		known[ep] = true
	}
	set := p.swapListenersLocked(plan, &ch)
	set.pre = pre
	p.mu.Unlock()
	for _, ep := range set.orphans {
		p.forget(ep)
	}
	for _, ep := range set.resynced {
		p.syncExcludedSet(ep)
	}

	p.swapSettings(cfg, plan.disabled)
	p.syncPools(set)
	p.disableListed(plan.disable, known, &ch)

	for _, l := range set.gone {
		p.retire(l, cfg.DrainTimeout.D())
		ch.ListenersRemoved = append(ch.ListenersRemoved, l.cfg.Name)
	}
	errs := p.bindAdded(&set, &ch)
	p.mu.Lock()
	p.listeners = set.keep
	p.noteMeshKeysLocked()
	// The loop guard (ownConn) is kept while a transparent listener
	// accepts; the removed ones accept no more. Links that registered
	// still forget their addresses when they end.
	p.transparent.Store(slices.ContainsFunc(set.keep, func(l *listener) bool { return l.cfg.IsTransparent() }))
	p.mu.Unlock()

	p.enableUnlisted(plan.enable, &ch)
	return ch, errors.Join(errs...)
}

// ErrNothingApplied marks a reload that was refused before it changed
// anything: the running configuration stays in force.
var ErrNothingApplied = errors.New("nothing applied; the running configuration is unchanged")

// prebindLocked binds, before the reload changes anything, every listener
// it adds on a port that no listener it retires holds: a listener moved to
// a port another process holds (or another listener of the new
// configuration) fails the reload whole, and the one in force keeps
// serving. A port a retiring listener holds is bound after it is retired
// (bindAdded), as before. p.mu is held.
func (p *Proxy) prebindLocked(plan reloadPlan) (map[string]acceptor, error) {
	vacated := map[string]bool{}
	for _, l := range p.listeners {
		if slices.Contains(plan.remove, l.cfg.Name) {
			if _, port, err := net.SplitHostPort(l.addr); err == nil {
				vacated[port] = true
			}
		}
	}
	pre := map[string]acceptor{}
	for i, lp := range plan.listeners {
		if _, port, err := net.SplitHostPort(lp.cfg.Listen); lp.keep || err != nil || vacated[port] {
			continue
		}
		ln, err := listenAcceptor(p.ctx, lp.cfg.Listen, lp.cfg.IsIngress())
		if err != nil {
			for _, b := range pre {
				_ = b.Close()
			}
			return nil, fmt.Errorf("listeners[%d].listen (listener %q): %w: %w", i, lp.cfg.Name, err, ErrNothingApplied)
		}
		pre[lp.cfg.Name] = ln
	}
	return pre, nil
}

// runningListener is what planReload knows of a listener in force: the
// configuration it was made from, and the one it runs now (a reload that
// kept it may have retuned it).
type runningListener struct {
	made, now policy.Listener
}

// runningLocked describes the listeners in force, for planReload; p.mu is
// held.
func (p *Proxy) runningLocked() []runningListener {
	rs := make([]runningListener, 0, len(p.listeners))
	for _, l := range p.listeners {
		rs = append(rs, runningListener{made: l.cfg, now: l.spec().cfg})
	}
	return rs
}

// reloadPlan is what a reload is to do, worked out by planReload from the
// configurations alone.
type reloadPlan struct {
	// listeners is the new configuration's, in its order.
	listeners []listenerPlan
	// remove names the running listeners that go (gone from the
	// configuration, or moved: same name, new address or target), sorted.
	remove []string
	// disabled is the new endpoints.disabled, normalized.
	disabled map[string]bool
	// disable is disabled's addresses that the previous
	// endpoints.disabled did not list, sorted; enable the addresses the
	// previous endpoints.disabled listed and the new one does not, sorted.
	disable, enable []string
}

// listenerPlan is what a reload does with one listener of the new
// configuration.
type listenerPlan struct {
	cfg policy.Listener
	// keep: the running listener of that name takes cfg in place
	// (sameTarget), with its socket and its links; otherwise a new
	// listener is made and bound.
	keep bool
	// retuned: kept, with settings that differ from those it runs.
	retuned bool
}

// planReload compares the running listeners and endpoints.disabled
// (normalized) with the new configuration. It has no effects: it only
// reads its arguments.
func planReload(running []runningListener, prevDisabled map[string]bool, cfg policy.Config) reloadPlan {
	var plan reloadPlan
	old := make(map[string]runningListener, len(running))
	for _, r := range running {
		old[r.made.Name] = r
	}
	for _, lc := range cfg.Listeners {
		r, ok := old[lc.Name]
		if !ok || !sameTarget(r.made, lc) {
			plan.listeners = append(plan.listeners, listenerPlan{cfg: lc})
			continue
		}
		delete(old, lc.Name)
		prev := r.now
		retuned := !reflect.DeepEqual(prev.Settings, lc.Settings) || !reflect.DeepEqual(prev.Pool, lc.Pool) ||
			!reflect.DeepEqual(prev.Transparent, lc.Transparent) || prev.MaxLinks != lc.MaxLinks || !reflect.DeepEqual(prev.Ingress, lc.Ingress)
		plan.listeners = append(plan.listeners, listenerPlan{cfg: lc, keep: true, retuned: retuned})
	}
	plan.remove = slices.Sorted(maps.Keys(old))
	plan.disabled = make(map[string]bool, len(cfg.Endpoints.Disabled))
	for _, a := range cfg.Endpoints.Disabled {
		plan.disabled[normalizeEndpoint(a)] = true
	}
	for addr := range plan.disabled {
		if !prevDisabled[addr] {
			plan.disable = append(plan.disable, addr)
		}
	}
	slices.Sort(plan.disable)
	for addr := range prevDisabled {
		if !plan.disabled[addr] {
			plan.enable = append(plan.enable, addr)
		}
	}
	slices.Sort(plan.enable)
	return plan
}

// reloadSet is the listeners a reload works on, made from its plan by
// swapListenersLocked.
type reloadSet struct {
	resynced []*endpoint         // destinations of retuned transparent listeners: the excluded set follows
	keep     []*listener         // kept, in the new config's order; bindAdded appends those it binds
	added    []*listener         // made for the new configuration, to bind
	pools    []*listener         // kept and added pools, in the new config's order
	gone     []*listener         // to retire, in plan.remove's order
	pre      map[string]acceptor // bound by prebindLocked, by name
	// orphans: endpoints of the ingress ports a reload removed that no
	// listener routes to any more, to forget once p.mu is released.
	orphans []*endpoint
}

// swapListenersLocked gives every kept listener its new configuration
// (the next link takes it; a pool's members follow in syncPools) and
// makes the new ones, in the new config's order; p.mu is held.
func (p *Proxy) swapListenersLocked(plan reloadPlan, ch *Changes) reloadSet {
	byName := make(map[string]*listener, len(p.listeners))
	for _, l := range p.listeners {
		byName[l.cfg.Name] = l
	}
	var set reloadSet
	for _, lp := range plan.listeners {
		if !lp.keep {
			nl := p.newListenerLocked(lp.cfg)
			set.added = append(set.added, nl)
			if nl.pool != nil {
				set.pools = append(set.pools, nl)
			}
			continue
		}
		l := byName[lp.cfg.Name]
		if lp.retuned {
			ch.ListenersRetuned = append(ch.ListenersRetuned, lp.cfg.Name)
		}
		l.current.Store(newLinkSpec(lp.cfg))
		p.precreateMeshFallbacks(lp.cfg)
		if l.ingress != nil {
			set.orphans = append(set.orphans, l.ingress.retuneLocked(lp.cfg)...)
		}
		if l.matches != nil && lp.retuned {
			set.resynced = append(set.resynced, p.retuneDestinationsLocked(l)...)
		}
		if l.pool != nil {
			l.pool.setSpecs(lp.cfg) // members follow in syncPools
			set.pools = append(set.pools, l)
		}
		set.keep = append(set.keep, l)
	}
	for _, name := range plan.remove {
		set.gone = append(set.gone, byName[name])
	}
	return set
}

// retuneDestinationsLocked gives the destinations a kept transparent
// listener has seen its new settings, probe configuration included, as
// syncPool gives a pool's members theirs: a destination excluded under a
// wrong probe setting is probed with the corrected one from the reload
// on, not only once it is forgotten (one that clients keep asking for
// never is). It returns them: the kernel's excluded set follows the new
// settings (on_excluded, group_fail_open) once p.mu is released. p.mu is
// held.
func (p *Proxy) retuneDestinationsLocked(l *listener) []*endpoint {
	s := l.spec().settings
	eps := p.endpointsOfLocked(l)
	for _, ep := range eps {
		p.endpointForLocked(ep.dial, s, l) // re-registers the probe configuration
	}
	return eps
}

// endpointsOfLocked returns the endpoints l routes to. p.mu is held.
func (p *Proxy) endpointsOfLocked(l *listener) []*endpoint {
	var eps []*endpoint
	for _, ep := range p.endpoints {
		ep.mu.Lock()
		mine := slices.Contains(ep.listeners, l)
		ep.mu.Unlock()
		if mine {
			eps = append(eps, ep)
		}
	}
	return eps
}

// swapSettings puts the reload's drain timeout, limits and
// endpoints.disabled in force.
func (p *Proxy) swapSettings(cfg policy.Config, disabled map[string]bool) {
	p.drain.Store(int64(cfg.DrainTimeout))
	// A lower budget or max_links cuts nothing (see setLimits); a higher
	// listener max_links lets its accept loop go on.
	p.setLimits(cfg)
	p.slots.retuned()
	p.mu.Lock()
	p.disabled = disabled
	p.mu.Unlock()
}

// syncPools makes every pool's members from its new entries (names
// resolved now), each admitted disabled if the new endpoints.disabled
// names it: a kept pool's members that left are drained (drainMember),
// every member's probe configuration is the new one.
func (p *Proxy) syncPools(set reloadSet) {
	for _, l := range set.pools {
		p.syncPool(l.pool, l.pool.resolve(p.ctx, p.resolver))
		if !slices.Contains(set.added, l) {
			l.startRefresh() // entries may have become names
		}
	}
}

// disableListed takes out of routing, before any listener binds, every
// endpoint that addrs (the addresses and names the new config lists as
// disabled and the previous one did not) names, and every endpoint this
// reload made (not among known) that the new list names, whether or not
// the previous one did: one a new listener routes to. An endpoint listed
// before and still is keeps the state it has: an operator may have
// enabled it through the admin API since, and a reload that leaves the
// list as it was does not disable it again (endpoints.disabled is
// diffed).
func (p *Proxy) disableListed(addrs []string, known map[*endpoint]bool, ch *Changes) {
	ch.EndpointsDisabled = p.byConfig(addrs, p.det.Disable, ch.EndpointsDisabled)
	p.mu.Lock()
	var made []*endpoint
	for _, ep := range p.endpoints {
		if !known[ep] {
			made = append(made, ep)
		}
	}
	p.mu.Unlock()
	for _, ep := range made {
		if p.applyDisabled(ep) {
			ch.EndpointsDisabled = append(ch.EndpointsDisabled, ep.addr)
		}
	}
}

// enableUnlisted readmits the endpoints the previous config listed as
// disabled and the new one does not, each only if it is still disabled
// by the config: one the admin API enabled since, and the detector then
// excluded, is not readmitted without a probe, and one the admin API
// disabled stays disabled.
func (p *Proxy) enableUnlisted(addrs []string, ch *Changes) {
	undisable := func(addr, reason string) bool {
		// Listed still, by another spelling (its name for its address, or
		// the reverse): the new list keeps it out.
		if ep := p.lookupEndpoint(addr); ep != nil && p.listedDisabled(ep) {
			return false
		}
		return p.det.Undisable(addr, health.ReasonConfig, reason)
	}
	ch.EndpointsEnabled = p.byConfig(addrs, undisable, ch.EndpointsEnabled)
}

// byConfig calls change (the detector's Disable or Enable) for the
// configuration's reason on every endpoint each address names, and
// appends to changed the endpoints whose state changed.
func (p *Proxy) byConfig(addrs []string, change func(endpoint, reason string) bool, changed []string) []string {
	for _, addr := range addrs {
		eps, _ := p.lookup(addr)
		for _, ep := range eps {
			if change(ep.addr, health.ReasonConfig) {
				changed = append(changed, ep.addr)
			}
		}
	}
	return changed
}

// bindAdded binds and serves every listener the reload made; one that
// fails to bind is detached and its error returned, the others still
// bind. Those bound join set.keep.
func (p *Proxy) bindAdded(set *reloadSet, ch *Changes) []error {
	var errs []error
	for _, l := range set.added {
		ln, err := set.pre[l.cfg.Name], error(nil)
		if ln == nil {
			ln, err = l.bind()
		}
		if err != nil {
			errs = append(errs, err)
			p.detach(l)
			p.releaseName(l.cfg.Name)
			continue
		}
		addr, _ := l.open(ln)
		l.log.Info().Str("listen", addr).Str("upstream", l.cfg.Upstream).Msg("listener added by reload")
		set.keep = append(set.keep, l)
		ch.ListenersAdded = append(ch.ListenersAdded, l.cfg.Name)
	}
	return errs
}

// retire stops a listener that a reload removed: no more accepts, its
// links get drain to finish, then they are closed. The drain runs in a
// goroutine the proxy owns (Shutdown waits for it).
func (p *Proxy) retire(l *listener, drain time.Duration) {
	l.stopAccepting()
	// Out of the live listeners and into the retiring ones in one step:
	// a scrape counts it once (Apply's swap of p.listeners comes later).
	p.mu.Lock()
	p.listeners = slices.DeleteFunc(p.listeners, func(x *listener) bool { return x == l })
	p.retiring = append(p.retiring, l)
	p.repickForLocked(l) // its endpoints are probed as the listeners that accept ask
	p.mu.Unlock()
	l.log.Info().Int("links", len(l.snapshotLinks())).Dur("drain_timeout_ms", drain).Msg("listener removed by reload")
	p.bg.Add(1)
	go func() {
		defer p.bg.Done()
		done := make(chan struct{})
		go func() { l.linkWG.Wait(); close(done) }()
		t := time.NewTimer(max(drain, 0))
		defer t.Stop()
		select {
		case <-done:
		case <-t.C:
		case <-p.ctx.Done():
		}
		l.abortAll(CloseShutdown)
		<-done
		if l.ingress != nil {
			l.ingress.close()
		}
		p.detach(l)
		p.retired(l)
		p.releaseName(l.cfg.Name)
	}()
}

// retired takes a drained listener out of the scrape-time series: its
// bytes carry over to its name while another listener of that name
// lives (releaseName forgets them with the name).
func (p *Proxy) retired(l *listener) {
	l.mu.Lock()
	up, dn := l.closedUp, l.closedDn
	l.mu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.retiring = slices.DeleteFunc(p.retiring, func(x *listener) bool { return x == l })
	if p.names[l.cfg.Name] > 1 {
		if p.carried == nil {
			p.carried = map[string][2]int64{}
		}
		c := p.carried[l.cfg.Name]
		p.carried[l.cfg.Name] = [2]int64{c[0] + up, c[1] + dn}
	}
}

// detach removes a listener from its endpoints; an endpoint no listener
// routes to any more is forgotten by the detector.
func (p *Proxy) detach(l *listener) {
	p.mu.Lock()
	eps := make([]*endpoint, 0, len(p.endpoints))
	for _, ep := range p.endpoints {
		eps = append(eps, ep)
	}
	p.mu.Unlock()
	for _, ep := range eps {
		p.detachFrom(l, ep)
	}
}

func (p *Proxy) detachFrom(l *listener, ep *endpoint) {
	// p.mu then ep.mu, as everywhere: a listener attaching to ep holds
	// p.mu too, so an orphan seen here stays one until it is deleted.
	p.mu.Lock()
	orphan := p.detachFromLocked(l, ep)
	p.mu.Unlock()
	if orphan {
		p.forget(ep)
	}
}

// detachFromLocked removes l from ep's listeners and reports whether ep
// is left an orphan, deleted from the proxy's endpoints (the caller then
// calls forget, outside p.mu); p.mu is held.
func (p *Proxy) detachFromLocked(l *listener, ep *endpoint) (orphan bool) {
	ep.mu.Lock()
	if !slices.Contains(ep.listeners, l) {
		ep.mu.Unlock()
		return false
	}
	ep.listeners = slices.DeleteFunc(ep.listeners, func(x *listener) bool { return x == l })
	if l.matches != nil {
		l.destinations--
	}
	orphan = len(ep.listeners) == 0
	ep.mu.Unlock()
	if orphan && p.endpoints[ep.addr] == ep {
		delete(p.endpoints, ep.addr)
	}
	if !orphan {
		p.repickSettingsLocked(ep)
	}
	return orphan
}

// releaseName ends one incarnation of a listener name; the last one's
// series are deleted (under p.mu, as newListenerLocked creates them).
func (p *Proxy) releaseName(name string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.names[name]--; p.names[name] <= 0 {
		delete(p.names, name)
		delete(p.carried, name)
		p.metrics.Forget(name)
	}
}

// forget drops what the detector and the excluded set hold for an
// endpoint no listener routes to any more.
//
// What is kept by address (the detector's state, the drain, the kernel's
// excluded set) is dropped only while no endpoint of that address was
// made since: a DNS refresh, a reload or a transparent client may have
// made one after ep was taken out of p.endpoints and before this runs,
// and that one's state is its own. The detector's state and the drain
// under p.mu; the excluded set after it, under p.setMu, which orders it
// with the set's other updates (unexclude, syncExcludedSet).
func (p *Proxy) forget(ep *endpoint) {
	p.mu.Lock()
	cur := p.endpoints[ep.addr]
	mine := cur == nil || cur == ep
	if mine {
		p.det.Unregister(ep.addr)
		p.forgetDrain(ep.addr)
	}
	p.mu.Unlock()
	if mine {
		p.unexclude(ep) // after p.mu: it checks again, under p.setMu
	}
	ep.orphans.Stop()
	p.meshMu.Lock()
	peers := make([]*meshPeer, 0, len(p.peers))
	for _, pr := range p.peers {
		peers = append(peers, pr)
	}
	p.meshMu.Unlock()
	for _, pr := range peers {
		pr.mu.Lock()
		delete(pr.endpoints, ep)
		pr.mu.Unlock()
	}
}

func (l *listener) snapshotLinks() []*link {
	l.mu.Lock()
	defer l.mu.Unlock()
	ks := make([]*link, 0, len(l.links))
	for lk := range l.links {
		ks = append(ks, lk)
	}
	return ks
}
