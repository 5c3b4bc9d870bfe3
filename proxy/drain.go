package proxy

import (
	"sync/atomic"
	"time"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// Draining an endpoint (the operator's drain, HAProxy's "set server state
// drain"): no new link is routed to it, not even by fail-open, and the
// links it has finish on their own; nothing is evicted. The drained set,
// Proxy.drained, is the one place routing asks (pool candidates, a
// transparent destination's refusal, hence a pool listener's pause and
// the kernel's excluded set); it is keyed by normalized address and holds
// only endpoints that existed when drained (and, for drainKeptFor, those
// forgotten since: see drainMark); enable empties it of one.
//
// A drain is the data plane's, not the detector's: the detector goes on
// judging a drained endpoint by its probes and links (its state is shown
// beside draining), and a drained endpoint that is also excluded or
// disabled is out for either reason.

// isDrained reports whether routing must not send a new link to addr.
func (p *Proxy) isDrained(addr string) bool {
	v, ok := p.drained.Load(addr)
	return ok && v.(drainMark).live()
}

// drainMark is an entry of Proxy.drained: a drain of an endpoint, and
// when that endpoint was forgotten (0: it was not). A drain outlives its
// endpoint for drainKeptFor, as the detector keeps an exclusion or an
// operator's disable (health.Register): an endpoint that leaves and comes
// back meanwhile (a DNS answer that left it out, a transparent listener a
// reload bound anew) is still drained.
type drainMark struct{ forgotAt int64 }

// drainKeptFor: 10 minutes (an atomic for tests).
var drainKeptFor = func() *atomic.Int64 {
	var d atomic.Int64
	d.Store(int64(10 * time.Minute))
	return &d
}()

func (m drainMark) live() bool {
	return m.forgotAt == 0 || flow.Mono()-m.forgotAt < drainKeptFor.Load()
}

// forgetDrain marks addr's drain, if any, as its endpoint's forgetting,
// and drops the drains of endpoints forgotten drainKeptFor ago or more.
func (p *Proxy) forgetDrain(addr string) {
	if _, ok := p.drained.Load(addr); ok {
		p.drained.Store(addr, drainMark{forgotAt: flow.Mono()})
	}
	p.drained.Range(func(k, v any) bool {
		if !v.(drainMark).live() {
			p.drained.CompareAndDelete(k, v)
		}
		return true
	})
}

// reviveDrain takes up the drain of addr, an endpoint created anew, if it
// was forgotten less than drainKeptFor ago.
func (p *Proxy) reviveDrain(addr string) {
	if v, ok := p.drained.Load(addr); ok {
		if m := v.(drainMark); m.live() {
			p.drained.CompareAndSwap(addr, m, drainMark{})
		} else {
			p.drained.CompareAndDelete(addr, m)
		}
	}
}

// Drain is the operator's drain of the endpoint (or of each endpoint
// resolved from the name): no new links, the existing ones finish. It
// reports whether any endpoint was not draining yet, and the links still
// open to them.
func (p *Proxy) Drain(addr string) (changed bool, links int, err error) {
	eps, err := p.lookup(addr)
	for _, ep := range eps {
		// Under p.mu, and only for an endpoint still known: one forgotten
		// since the lookup would leave a drain no forgetting ever ends.
		p.mu.Lock()
		known := p.endpoints[ep.addr] == ep
		var v any
		was := false
		if known {
			v, was = p.drained.Swap(ep.addr, drainMark{})
		}
		p.mu.Unlock()
		if known && (!was || !v.(drainMark).live()) {
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
	p.syncExcludedSet(ep)
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
