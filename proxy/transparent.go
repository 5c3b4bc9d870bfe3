package proxy

import (
	"math"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/livenessproxy/livenessproxy/health"

	"github.com/livenessproxy/livenessproxy/policy"
)

// matcher is one entry of a transparent listener's match list.
type matcher struct {
	prefix   netip.Prefix
	ports    []uint16 // empty: any port
	meshPort int      // the entry's mesh.port; 0: the listener's
}

func newMatchers(t policy.Transparent) []matcher {
	ms := make([]matcher, 0, len(t.Match))
	for _, m := range t.Match {
		pfx, err := netip.ParsePrefix(m.CIDR)
		if err != nil {
			continue // validated by policy
		}
		mt := matcher{prefix: pfx.Masked(), meshPort: m.Mesh.Port}
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
func (l *listener) resolve(c *tcpClient) (*endpoint, CloseReason) {
	dst, err := flow.OriginalDst(c.sock, c.remote)
	if err != nil {
		l.log.Debug().Err(err).Str("client", c.RemoteAddr().String()).Msg("no original destination: refused")
		return nil, CloseNoMatch
	}
	if own, fromOwn := l.p.isOwn(dst, c.RemoteAddr()); own {
		if la, ok := c.localAddr().(*net.TCPAddr); ok && !fromOwn && la.AddrPort().Addr().Unmap() == dst.Addr().Unmap() && la.Port == int(dst.Port()) {
			// Not redirected (its original destination is the address it
			// reached): a client of another host connected to the listener
			// itself, which a wildcard listener answers on every address.
			// No loop, and nothing to proxy it to.
			l.log.Debug().Str("client", c.RemoteAddr().String()).Msg("a connection to the transparent listener's own address, not redirected: refused")
			return nil, CloseNoMatch
		}
		if n, ok := l.loops.pass(); ok {
			l.log.Error().Str("destination", dst.String()).Str("client", c.RemoteAddr().String()).Int64("loops_since_last_line", n).
				Msg("interception loop: the proxy's own connection came back; exempt its uid or upstream_mark in the rules")
		}
		return nil, CloseLoop
	}
	if !l.matchesDst(dst) {
		l.log.Debug().Str("destination", dst.String()).Msg("destination not in the match list: refused")
		return nil, CloseNoMatch
	}
	ep := l.p.transparentEndpoint(dst.String(), l)
	if ep == nil {
		return nil, CloseCapacity
	}
	return ep, ""
}

// matchIndex is the first match entry covering addr (host:port), -1 if
// none: a destination's group for group_fail_open.
func (l *listener) matchIndex(addr string) int {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return -1
	}
	for i, m := range l.matches {
		if m.prefix.Contains(ap.Addr().Unmap()) && (len(m.ports) == 0 || slices.Contains(m.ports, ap.Port())) {
			return i
		}
	}
	return -1
}

// groupFailingOpen reports whether a connection to ep, an excluded
// destination of a transparent listener with group_fail_open, may go
// through: no destination of its group (its match entry) that the proxy
// currently knows is routable. All-or-nothing, as for a pool: one healthy
// destination in the group and the excluded one is refused.
func (l *listener) groupFailingOpen(ep *endpoint) bool {
	if l.matches == nil || !l.spec().groupFailOpen {
		return false
	}
	for _, other := range l.group(ep) {
		if st, _ := l.p.det.State(other.addr); st == health.Healthy {
			return false
		}
	}
	return true
}

// group returns the destinations a transparent listener knows in ep's
// match entry (ep included).
func (l *listener) group(ep *endpoint) []*endpoint {
	group := l.matchIndex(ep.addr)
	if group < 0 {
		return nil
	}
	p := l.p
	p.mu.Lock()
	defer p.mu.Unlock()
	var peers []*endpoint
	for addr, other := range p.endpoints {
		other.mu.Lock()
		mine := slices.Contains(other.listeners, l)
		other.mu.Unlock()
		if mine && l.matchIndex(addr) == group {
			peers = append(peers, other)
		}
	}
	return peers
}

// ownAddrs is the loop guard's set of the local addresses of upstream
// sockets, each with the number of live sockets that have it: the kernel
// gives two connections to different destinations the same local port
// when it can, so one that ends must not take the other's guard with it.
// At most one entry per link.
type ownAddrs struct {
	mu sync.Mutex
	n  map[string]int
}

func (o *ownAddrs) add(a string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n == nil {
		o.n = make(map[string]int)
	}
	o.n[a]++
}

func (o *ownAddrs) remove(a string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n[a] <= 1 {
		delete(o.n, a)
		return
	}
	o.n[a]--
}

func (o *ownAddrs) has(a string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.n[a] > 0
}

// len is how many distinct addresses the set holds.
func (o *ownAddrs) len() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.n)
}

// isOwn reports whether a connection is the proxy's own (and whether it
// comes from one of the proxy's upstream sockets): its original
// destination is one of the proxy's listeners, or it comes from one of the
// proxy's upstream sockets (a redirect rule that does not exempt them). A
// listener bound to a wildcard address (0.0.0.0, ::) answers on every
// address of the host: a destination on its port is the proxy's own when
// the address is one of the host's.
func (p *Proxy) isOwn(dst netip.AddrPort, from net.Addr) (own, fromOwnSocket bool) {
	if p.ownUpHas(from.String()) {
		return true, true
	}
	addr := dst.Addr().Unmap()
	wildcard := false
	p.mu.Lock()
	for _, l := range p.listeners {
		ap, err := netip.ParseAddrPort(l.addr)
		if err != nil || ap.Port() != dst.Port() {
			continue
		}
		if ap.Addr().Unmap() == addr || addr.IsLoopback() {
			p.mu.Unlock()
			return true, false
		}
		wildcard = wildcard || ap.Addr().IsUnspecified()
	}
	p.mu.Unlock()
	return wildcard && isLocalAddr(addr), false
}

// ownUpHas reports whether from is the local address of one of the
// proxy's upstream sockets. A raw connect's SYN can reach a listener,
// and its connection be accepted, before the connect(2) that sent it has
// returned and its local address is known: on a miss, it waits for the
// connects in flight to say theirs (ownDial) and looks again. That wait
// is as long as a connect(2) call and a getsockname, and there is none
// when no connect is in flight: a connect counts itself in inFlight
// before it is made and out only once its address is in ownUp, so a
// looping connection, accepted after its connect began, finds either the
// count above 0 or, looking after the count, the address.
func (p *Proxy) ownUpHas(from string) bool {
	if p.inFlight.Load() > 0 && !p.ownUp.has(from) {
		p.connecting.Lock() // an empty critical section: the wait is the point
		p.connecting.Unlock()
	}
	return p.ownUp.has(from)
}

// ownDial is the loop guard's flow.ConnectGuard of one raw dial made
// while a transparent listener is open: it puts each connect's local
// address in ownUp as soon as connect(2) has returned, before the dial
// waits for the handshake, holding connecting (read) from before the
// connect until then, so a looping connection is known as the proxy's
// own whenever it is accepted (ownUpHas). The tcpEnd that takes the
// socket forgets the address at its release; a dial that fails forgets
// it itself (Abandoned, or forget when the socket is not taken).
type ownDial struct {
	p     *Proxy
	local net.Addr // registered in ownUp, nil when none is
}

func (d *ownDial) Connecting() {
	d.p.inFlight.Add(1)
	d.p.connecting.RLock()
}

// testHookConnected, when set (by a test), runs in Connected before the
// address is asked for: a connect whose SYN came back is still in flight.
var testHookConnected atomic.Pointer[func()]

func (d *ownDial) Connected(fd int, ok bool) {
	defer d.p.inFlight.Add(-1) // after the RUnlock, and after the address is in ownUp
	defer d.p.connecting.RUnlock()
	if !ok {
		return
	}
	if hook := testHookConnected.Load(); hook != nil {
		(*hook)()
	}
	if ap, err := flow.SockName(fd); err == nil {
		d.local = net.TCPAddrFromAddrPort(ap)
		d.p.ownUp.add(d.local.String())
	}
}

func (d *ownDial) Abandoned() { d.forget() }

// forget takes the registered address out of ownUp.
func (d *ownDial) forget() {
	if d.local != nil {
		d.p.ownUp.remove(d.local.String())
		d.local = nil
	}
}

// isLocalAddr reports whether a is an address of one of the host's
// interfaces (read now: addresses come and go). An error reading them
// says nothing.
func isLocalAddr(a netip.Addr) bool {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, ia := range addrs {
		if ipn, ok := ia.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(ipn.IP); ok && ip.Unmap() == a {
				return true
			}
		}
	}
	return false
}

// transparentEndpoint returns the endpoint for an original destination,
// registering it (and applying endpoints.disabled) on first use. nil: the
// listener already tracks transparent.max_destinations destinations.
func (p *Proxy) transparentEndpoint(addr string, l *listener) *endpoint {
	p.mu.Lock()
	ep, mine := p.endpoints[normalizeEndpoint(addr)]
	if mine {
		ep.mu.Lock()
		mine = slices.Contains(ep.listeners, l)
		ep.mu.Unlock()
	}
	// The cap counts the listener's own destinations, those the proxy
	// knows from another listener (a pool member, another transparent
	// listener's) too.
	if max := l.spec().maxDests; !mine && max > 0 && l.destinations >= max {
		p.mu.Unlock()
		l.log.Debug().Str("destination", addr).Int("max_destinations", max).
			Msg("too many destinations tracked: refused (link_closes_total{reason=\"capacity\"})")
		return nil
	}
	created := false
	if !mine {
		ep, created = p.endpointForLocked(addr, l.spec().settings, l)
	}
	ep.lastUsed.Store(flow.Mono())
	ep.mu.Lock()
	if !slices.Contains(ep.listeners, l) {
		ep.listeners = append(ep.listeners, l)
		l.destinations++
	}
	ep.mu.Unlock()
	p.mu.Unlock()
	if created {
		p.applyDisabled(ep)
	}
	return ep
}

// syncExcludedSet puts a transparent destination into the kernel's
// excluded set while transparent listeners must refuse it, and takes it
// out when it is routable again, so that a client's connect is reset by
// the rules instead of being accepted and then reset.
//
// From the look at its state to the kernel's update it holds p.setMu,
// which forget's unexclude takes too: updates of one address (an event's,
// a drain's, a reload's, a group's) reach the kernel in the order they
// looked, and one for an endpoint forgotten meanwhile touches nothing
// (forget takes the address out; an endpoint made anew for it has
// updates of its own). Before, an update that had looked before a
// forgetting could add the address after it: the kernel refused every
// connect to it, with no endpoint left to take it out.
func (p *Proxy) syncExcludedSet(ep *endpoint) {
	if p.excludedSet == nil {
		return
	}
	ap, err := netip.ParseAddrPort(ep.addr)
	if err != nil {
		return // a host name: only explicit listeners use those
	}
	p.setMu.Lock()
	defer p.setMu.Unlock()
	ep.mu.Lock()
	ls := append([]*listener(nil), ep.listeners...)
	ep.mu.Unlock()
	refuse, transparent := false, false
	for _, l := range ls {
		if l.matches != nil {
			transparent = true
			refuse = refuse || l.refusing(ep)
		}
	}
	if !transparent {
		refuse = false // no transparent listener left: never keep it in the set
	}
	if hook := testHookExcludedDecided.Load(); hook != nil {
		(*hook)(ep.addr, refuse)
	}
	if !p.owns(ep) {
		return
	}
	if refuse {
		err = p.excludedSet.AddExcluded(ap)
	} else {
		err = p.excludedSet.RemoveExcluded(ap)
	}
	if err != nil {
		p.log.Error().Err(err).Str("endpoint", ep.addr).Bool("excluded", refuse).Msg("updating the nftables excluded set")
	}
}

// owns reports whether ep is the endpoint the proxy knows for its address.
func (p *Proxy) owns(ep *endpoint) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.endpoints[ep.addr] == ep
}

// testHookExcludedDecided, when set (by a test), runs in syncExcludedSet
// once it has decided whether the destination goes into the set.
var testHookExcludedDecided atomic.Pointer[func(addr string, refuse bool)]

// unexclude takes the address of ep, forgotten, out of the kernel's
// excluded set (the proxy stops routing to it at all), unless an endpoint
// was made anew for it since: that one's updates decide. Under p.setMu
// (see syncExcludedSet), not under p.mu.
func (p *Proxy) unexclude(ep *endpoint) {
	if p.excludedSet == nil {
		return
	}
	ap, err := netip.ParseAddrPort(ep.addr)
	if err != nil {
		return
	}
	p.setMu.Lock()
	defer p.setMu.Unlock()
	p.mu.Lock()
	cur := p.endpoints[ep.addr]
	p.mu.Unlock()
	if cur == nil || cur == ep {
		_ = p.excludedSet.RemoveExcluded(ap)
	}
}

// clearExcludedSet takes every destination out at shutdown: the rules
// outlive the proxy, the exclusions must not. (A process that dies before
// this leaves them; the next one empties the sets as it starts.)
func (p *Proxy) clearExcludedSet() {
	p.setMu.Lock()
	defer p.setMu.Unlock()
	if _, err := p.excludedSet.Clear(); err != nil {
		p.log.Error().Err(err).Msg("interception.excluded_set: emptying the excluded sets at shutdown")
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

// sweepIdle forgets transparent-only destinations that have no links and
// are either healthy and saw no connection for idleEndpoint, or excluded
// with probes failing for the shortest transparent.forget_excluded_after
// of their listeners (a pod gone for good must not keep a prober and
// metric series forever): their map entry, their detector state and their
// endpoint_state series. A disabled one is kept, so that it stays refused.
// A forgotten destination that comes back starts afresh, but for an
// exclusion, an operator's disable or drain (kept 10 minutes: see
// health.Register and drainMark).
func (p *Proxy) sweepIdle() int {
	now := flow.Mono()
	cutoff := now - int64(idleEndpoint)
	states := map[string]health.Status{}
	for _, st := range p.det.Statuses() {
		states[st.Endpoint] = st
	}
	var gone []*endpoint
	p.mu.Lock()
	for addr, ep := range p.endpoints {
		if ep.lastUsed.Load() == 0 {
			continue // explicit (never resolved transparently)
		}
		st := states[addr]
		ep.mu.Lock()
		idle := len(ep.links) == 0
		forget := time.Duration(math.MaxInt64)
		for _, l := range ep.listeners {
			idle = idle && l.matches != nil
			if f := l.spec().forgetAfter; f > 0 {
				forget = min(forget, f)
			}
		}
		ep.mu.Unlock()
		switch {
		case !idle, p.isDrained(addr): // a drained one is kept, as a disabled one
		case st.State == health.Healthy && ep.lastUsed.Load() <= cutoff,
			st.State == health.Excluded && time.Since(st.Since) >= forget:
			delete(p.endpoints, addr)
			gone = append(gone, ep)
		}
	}
	for _, ep := range gone {
		ep.mu.Lock()
		for _, l := range ep.listeners {
			l.destinations--
		}
		ep.mu.Unlock()
	}
	p.mu.Unlock()
	for _, ep := range gone {
		p.forget(ep)
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
