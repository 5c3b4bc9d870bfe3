package proxy

import "github.com/livenessproxy/livenessproxy/health"

// Draining an endpoint (the operator's drain, HAProxy's "set server state
// drain"): no new link is routed to it, not even by fail-open, and the
// links it has finish on their own; nothing is evicted. The drained set,
// Proxy.drained, is the one place routing asks (pool candidates, a
// transparent destination's refusal, hence a pool listener's pause and
// the kernel's excluded set); it is keyed by normalized address and holds
// only endpoints that existed when drained; enable empties it of one.
//
// A drain is the data plane's, not the detector's: the detector goes on
// judging a drained endpoint by its probes and links (its state is shown
// beside draining), and a drained endpoint that is also excluded or
// disabled is out for either reason.

// isDrained reports whether routing must not send a new link to addr.
func (p *Proxy) isDrained(addr string) bool {
	_, ok := p.drained.Load(addr)
	return ok
}

// Drain is the operator's drain of the endpoint (or of each endpoint
// resolved from the name): no new links, the existing ones finish. It
// reports whether any endpoint was not draining yet, and the links still
// open to them.
func (p *Proxy) Drain(addr string) (changed bool, links int, err error) {
	eps, err := p.lookup(addr)
	for _, ep := range eps {
		if _, was := p.drained.LoadOrStore(ep.addr, struct{}{}); !was {
			changed = true
			p.log.Info().Str("endpoint", ep.addr).Int("links_kept", ep.liveLinks()).Msg("endpoint draining: no new links, open links finish")
			p.drainChanged(ep)
		}
		links += ep.liveLinks()
	}
	return changed, links, err
}

// undrain ends ep's drain, if any, and reports whether it was draining.
func (p *Proxy) undrain(ep *endpoint) bool {
	if _, was := p.drained.LoadAndDelete(ep.addr); !was {
		return false
	}
	p.log.Info().Str("endpoint", ep.addr).Msg("endpoint no longer draining")
	p.drainChanged(ep)
	return true
}

// drainChanged applies a drain or its end to routing: each listener that
// reaches ep pauses or resumes (a pool with no member left to route to
// refuses connects), and the kernel's excluded set follows.
func (p *Proxy) drainChanged(ep *endpoint) {
	ep.mu.Lock()
	ls := append([]*listener(nil), ep.listeners...)
	ep.mu.Unlock()
	p.syncExcludedSet(ep, ls)
	for _, l := range ls {
		p.updateRouting(l)
	}
}

// routingState is the state routing sees for ep: the detector's, with a
// drain taking the endpoint out as a disable does (without the eviction).
func (p *Proxy) routingState(ep *endpoint) health.State {
	st, _ := p.det.State(ep.addr)
	if st != health.Disabled && p.isDrained(ep.addr) {
		return health.Disabled
	}
	return st
}
