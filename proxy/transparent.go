package proxy

import (
	"net"
	"net/netip"
	"slices"
	"time"

	"github.com/livenessproxy/livenessproxy/health"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// matcher is one entry of a transparent listener's match list.
type matcher struct {
	prefix netip.Prefix
	ports  []uint16 // empty: any port
}

func newMatchers(t policy.Transparent) []matcher {
	ms := make([]matcher, 0, len(t.Match))
	for _, m := range t.Match {
		pfx, err := netip.ParsePrefix(m.CIDR)
		if err != nil {
			continue // validated by policy
		}
		mt := matcher{prefix: pfx.Masked()}
		for _, p := range m.Ports {
			mt.ports = append(mt.ports, uint16(p))
		}
		ms = append(ms, mt)
	}
	return ms
}

func (l *listener) matchesDst(dst netip.AddrPort) bool {
	for _, m := range l.matches {
		if m.prefix.Contains(dst.Addr()) && (len(m.ports) == 0 || slices.Contains(m.ports, dst.Port())) {
			return true
		}
	}
	return false
}

// resolve finds the endpoint of a connection a transparent listener
// accepted: its original destination, if the match list covers it. It
// returns nil and the close reason otherwise: the proxy is never an open
// relay, and never proxies to itself.
func (l *listener) resolve(c *net.TCPConn) (*endpoint, string) {
	dst, err := originalDst(c)
	if err != nil {
		l.log.Debug().Err(err).Str("client", c.RemoteAddr().String()).Msg("no original destination: refused")
		return nil, metrics.ReasonNoMatch
	}
	if l.p.isOwn(dst, c.RemoteAddr()) {
		l.log.Error().Str("destination", dst.String()).Str("client", c.RemoteAddr().String()).
			Msg("interception loop: the proxy's own connection came back; exempt its uid or upstream_mark in the rules")
		return nil, metrics.ReasonLoop
	}
	if !l.matchesDst(dst) {
		l.log.Debug().Str("destination", dst.String()).Msg("destination not in the match list: refused")
		return nil, metrics.ReasonNoMatch
	}
	return l.p.transparentEndpoint(dst.String(), l), ""
}

// isOwn reports whether a connection is the proxy's own: its original
// destination is one of the proxy's listeners, or it comes from one of the
// proxy's upstream sockets (a redirect rule that does not exempt them).
func (p *Proxy) isOwn(dst netip.AddrPort, from net.Addr) bool {
	if _, ok := p.ownUp.Load(from.String()); ok {
		return true
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.listeners {
		ap, err := netip.ParseAddrPort(l.addr)
		if err != nil || ap.Port() != dst.Port() {
			continue
		}
		if ap.Addr() == dst.Addr().Unmap() || dst.Addr().IsLoopback() {
			return true
		}
	}
	return false
}

// transparentEndpoint returns the endpoint for an original destination,
// registering it (and applying endpoints.disabled) on first use.
func (p *Proxy) transparentEndpoint(addr string, l *listener) *endpoint {
	p.mu.Lock()
	ep, existed := p.endpoints[normalizeEndpoint(addr)]
	if !existed {
		ep = p.endpointForLocked(addr, l.tuning().set)
	}
	disabled := !existed && p.disabled[ep.addr]
	ep.lastUsed.Store(mono())
	ep.mu.Lock()
	if !slices.Contains(ep.listeners, l) {
		ep.listeners = append(ep.listeners, l)
	}
	ep.mu.Unlock()
	p.mu.Unlock()
	if disabled {
		p.det.Disable(ep.addr, "config")
	}
	return ep
}

// syncExcludedSet puts a transparent destination into the kernel's
// excluded set while transparent listeners must refuse it, and takes it
// out when it is routable again, so that a client's connect is reset by
// the rules instead of being accepted and then reset.
func (p *Proxy) syncExcludedSet(ep *endpoint, ls []*listener) {
	if p.exset == nil {
		return
	}
	ap, err := netip.ParseAddrPort(ep.addr)
	if err != nil {
		return // a host name: only explicit listeners use those
	}
	refuse, transparent := false, false
	for _, l := range ls {
		if l.matches != nil {
			transparent = true
			refuse = refuse || p.refusing(l, ep)
		}
	}
	if !transparent {
		refuse = false // no transparent listener left: never keep it in the set
	}
	if refuse {
		err = p.exset.AddExcluded(ap)
	} else {
		err = p.exset.RemoveExcluded(ap)
	}
	if err != nil {
		p.log.Error().Err(err).Str("endpoint", ep.addr).Bool("excluded", refuse).Msg("updating the nftables excluded set")
	}
}

// unexclude takes a destination out of the kernel's excluded set (when the
// proxy stops routing to it at all).
func (p *Proxy) unexclude(addr string) {
	if p.exset == nil {
		return
	}
	if ap, err := netip.ParseAddrPort(addr); err == nil {
		_ = p.exset.RemoveExcluded(ap)
	}
}

// clearExcludedSet takes every destination out at shutdown: the rules
// outlive the proxy, the exclusions must not.
func (p *Proxy) clearExcludedSet() {
	p.mu.Lock()
	eps := make([]string, 0, len(p.endpoints))
	for addr := range p.endpoints {
		eps = append(eps, addr)
	}
	p.mu.Unlock()
	for _, addr := range eps {
		if ap, err := netip.ParseAddrPort(addr); err == nil {
			_ = p.exset.RemoveExcluded(ap)
		}
	}
}

// idleEndpoint is how long a transparent destination may go without a
// connection before it is forgotten; sweepEvery is how often that is
// checked. A transparent listener's endpoints are otherwise bounded only by
// the destinations its match list covers.
var (
	idleEndpoint = 10 * time.Minute
	sweepEvery   = time.Minute
)

// sweepIdle forgets transparent-only destinations that are healthy, have
// no links and saw no connection for idleEndpoint: their map entry, their
// detector state and their endpoint_state series. An excluded or disabled
// one is kept, so that it stays refused.
func (p *Proxy) sweepIdle() int {
	cutoff := mono() - int64(idleEndpoint)
	var gone []*endpoint
	p.mu.Lock()
	for addr, ep := range p.endpoints {
		if ep.lastUsed.Load() == 0 || ep.lastUsed.Load() > cutoff {
			continue // explicit (never resolved transparently) or recently used
		}
		if st, _ := p.det.State(addr); st != health.Healthy {
			continue
		}
		ep.mu.Lock()
		idle := len(ep.links) == 0
		for _, l := range ep.listeners {
			idle = idle && l.matches != nil
		}
		ep.mu.Unlock()
		if idle {
			delete(p.endpoints, addr)
			gone = append(gone, ep)
		}
	}
	p.mu.Unlock()
	for _, ep := range gone {
		p.det.Unregister(ep.addr)
		ep.orphans.stop()
	}
	return len(gone)
}

// sweepLoop runs sweepIdle until the proxy stops.
func (p *Proxy) sweepLoop() {
	defer p.bg.Done()
	t := time.NewTicker(sweepEvery)
	defer t.Stop()
	for {
		select {
		case <-p.ctx.Done():
			return
		case <-t.C:
			if n := p.sweepIdle(); n > 0 {
				p.log.Debug().Int("endpoints", n).Msg("forgot idle transparent destinations")
			}
		}
	}
}
