package proxy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// listener accepts client connections and owns the links they become.
type listener struct {
	p   *Proxy
	cfg policy.Listener // name, listen and upstream; settings live in current
	ctx context.Context
	m   *metrics.Listener
	log zerolog.Logger
	// current holds the settings new links take; a reload swaps it, links
	// keep the settings they started with.
	current atomic.Pointer[linkSpec]
	addr    string // bound address, kept to bind again after a pause
	// matches is the transparent match list; nil for an explicit or pool
	// listener (which has pool instead).
	matches []matcher
	// pool is the endpoints an explicit or pool listener routes to.
	pool *pool
	// ingress is a mesh ingress listener's server side; nil otherwise.
	ingress *ingress
	// destinations counts a transparent listener's endpoints (under p.mu),
	// bounded by transparent.max_destinations.
	destinations int
	// stopped is closed when the listener stops accepting (ends its pool's
	// refresh loop).
	stopped chan struct{}

	// swept is the park sweep's copy of links, kept between sweeps so
	// that a sweep allocates nothing (park.go; the sweep's alone).
	swept []*link

	untrackedSeen sync.Map // untrack reasons already logged at info
	// localErrors: the proxy's own failures, logged at most every
	// logEvery (see localError).
	localErrors logGate
	// badFrames: links closed on a frame the proxy cannot follow (see
	// badFrame).
	badFrames logGate
	// loops: interception loops (transparent), logged once per logEvery.
	loops logGate

	acceptWG sync.WaitGroup // the accept loop
	linkWG   sync.WaitGroup // one per link goroutine

	mu       sync.Mutex
	ln       acceptor // nil while paused or stopped
	links    map[*link]struct{}
	closedUp int64 // bytes of links that ended, for bytes_total
	closedDn int64
	slots    int // max_links slots its links hold (under p.slots.mu)
	stopping bool
	paused   bool          // refusing: the endpoint is excluded or disabled
	changed  chan struct{} // signalled when paused or stopping changes
}

// linkSpec is what a new link takes from its listener's configuration; a
// reload swaps it, so every key it holds takes effect for the next link.
type linkSpec struct {
	cfg           policy.Listener // the configuration it was made from
	settings      policy.Settings
	frames        *flow.FrameSpec // nil: opaque
	dialer        *net.Dialer
	balance       string        // pool.balance
	failOpen      bool          // pool.fail_open
	groupFailOpen bool          // transparent.group_fail_open
	maxDests      int           // transparent.max_destinations
	forgetAfter   time.Duration // transparent.forget_excluded_after
}

func newLinkSpec(lc policy.Listener) *linkSpec {
	s := lc.Settings
	// Zero values (a Config built in code) mean the defaults, as in Validate.
	balance := cmp.Or(lc.Pool.Balance, policy.DefaultPool().Balance)
	dt := policy.DefaultTransparent()
	return &linkSpec{
		cfg:           lc,
		settings:      s,
		balance:       balance,
		failOpen:      lc.IsPool() && lc.Pool.FailOpen,
		groupFailOpen: lc.IsTransparent() && lc.Transparent.GroupFailOpen,
		maxDests:      cmp.Or(lc.Transparent.MaxDestinations, dt.MaxDestinations),
		forgetAfter:   cmp.Or(lc.Transparent.ForgetExcludedAfter, dt.ForgetExcludedAfter).D(),
		frames:        flow.NewFrameSpec(s.Framing),
		dialer: &net.Dialer{
			Timeout:   s.ConnectTimeout.D(), // non-positive: no timeout of ours
			KeepAlive: -1,                   // ours are set in Control, or left to the kernel
			Control:   flow.UpstreamControl(s),
		},
	}
}

// spec is what the next link of l takes.
func (l *listener) spec() *linkSpec { return l.current.Load() }

func listenerKind(cfg policy.Listener) string {
	switch {
	case cfg.IsTransparent():
		return metrics.KindTransparent
	case cfg.IsIngress():
		return metrics.KindIngress
	}
	return metrics.KindPool
}

// precreateMeshFallbacks creates mesh_fallbacks_total{listener} at zero
// for a listener whose links may reach an endpoint around the mesh (a
// mesh port, on the listener or a match entry, with fallback direct), so
// that the first fallback is an increase.
func (p *Proxy) precreateMeshFallbacks(cfg policy.Listener) {
	if cfg.IsIngress() || cfg.Settings.Mesh.OrDefaults().Fallback != policy.MeshFallbackDirect {
		return
	}
	if cfg.ReachesThroughMesh() {
		p.metrics.MeshFallbacks(cfg.Name)
	}
}

func (p *Proxy) newListenerLocked(cfg policy.Listener) *listener {
	if p.names == nil {
		p.names = map[string]int{}
	}
	p.names[cfg.Name]++
	l := &listener{
		p:       p,
		cfg:     cfg,
		ctx:     p.ctx,
		m:       p.metrics.ForListenerKind(cfg.Name, listenerKind(cfg)),
		log:     p.log.With().Str("listener", cfg.Name).Logger(),
		links:   make(map[*link]struct{}),
		changed: make(chan struct{}, 1),
		stopped: make(chan struct{}),
	}
	l.m.PrecreateCloses(closeLabels(listenerKind(cfg)))
	p.precreateMeshFallbacks(cfg)
	l.current.Store(newLinkSpec(cfg))
	if cfg.IsIngress() {
		l.ingress = newIngress(l, cfg)
		l.ingress.endpointsLocked(cfg.Settings)
		return l
	}
	if cfg.IsTransparent() {
		l.matches = newMatchers(cfg.Transparent)
		p.transparent.Store(true)
		return l
	}
	// Members are resolved by the caller (syncPool), outside p.mu.
	l.pool = newPool(l, cfg)
	return l
}

func (l *listener) signal() {
	select {
	case l.changed <- struct{}{}:
	default:
	}
}

// pause stops listening: while an endpoint is excluded (on_excluded:
// refuse) or disabled, a client's connect is refused the way a down
// server's is, instead of succeeding and then closing, which a client's
// failure detector would take for a live server.
func (l *listener) pause() {
	l.mu.Lock()
	if l.paused || l.stopping {
		l.mu.Unlock()
		return
	}
	l.paused = true
	ln, addr := l.ln, l.addr
	l.ln = nil
	l.mu.Unlock()
	if ln != nil {
		_ = ln.Close()
	}
	l.signal()
	l.log.Info().Str("listen", addr).Msg("not listening while the endpoint is out of routing")
}

// resume listens again (the accept loop binds the same address).
func (l *listener) resume() {
	l.mu.Lock()
	was := l.paused
	l.paused = false
	l.mu.Unlock()
	if was {
		l.signal()
	}
}

// serve is the accept loop. It only accepts: dialling happens in each
// link's goroutine, so one black-holed upstream never stalls other clients.
func (l *listener) serve() {
	defer l.acceptWG.Done()
	for {
		l.mu.Lock()
		ln := l.ln
		l.mu.Unlock()
		if ln != nil {
			l.acceptLoop(ln)
		}
		if !l.waitToListen() {
			return
		}
	}
}

// acceptor is a bound listening socket: a *flow.Listener (Linux, every
// listener but a mesh ingress), or net's.
type acceptor interface {
	Addr() net.Addr
	Close() error
}

// listenTCP binds addr for a listener. The connections it accepts get no
// keepalive of the runtime's (a link sets its own, or leaves the
// kernel's) and are plain TCP: Go's listeners take MPTCP by default,
// which a sidecar on loopback gains nothing from, and a plain TCP
// listening socket is what passes TCP_NODELAY on to the sockets it
// accepts. raw: the socket is for a flow.Listener, which needs it set
// before it listens (flow.ListenControl).
func listenTCP(ctx context.Context, addr string, raw bool) (net.Listener, error) {
	lc := net.ListenConfig{KeepAlive: -1}
	lc.SetMultipathTCP(false)
	if raw {
		lc.Control = flow.ListenControl
	}
	return lc.Listen(ctx, "tcp", addr)
}

// listen binds addr for l: accepting with flow.Listener where it can (a
// mesh ingress hands its connections to yamux, which takes net's).
func (l *listener) listen(addr string) (acceptor, error) {
	return listenAcceptor(l.ctx, addr, l.ingress != nil)
}

func listenAcceptor(ctx context.Context, addr string, ingress bool) (acceptor, error) {
	raw := !ingress && flow.RawAcceptSupported
	ln, err := listenTCP(ctx, addr, raw)
	if err != nil {
		return nil, err
	}
	if !raw {
		return ln, nil
	}
	fl, err := flow.NewListener(ln.(*net.TCPListener))
	if err != nil {
		return nil, err
	}
	return fl, nil
}

// bind listens on the listener's configured address (Start, and a reload
// that added it); the error names the listener. open serves what it
// bound.
func (l *listener) bind() (acceptor, error) {
	ln, err := l.listen(l.cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("listener %q: %w", l.cfg.Name, err)
	}
	return ln, nil
}

// open starts serving ln, which bind returned: the accept loop, and the
// pool's refresh or the ingress's checks. It returns the bound address,
// and whether the listener is paused (its endpoint left routing before
// it bound): then ln was bound once to reserve the address (and learn a
// :0 port) and is closed; the accept loop binds it again when the
// endpoint is back.
func (l *listener) open(ln acceptor) (addr string, paused bool) {
	addr = ln.Addr().String()
	l.mu.Lock()
	l.addr = addr
	paused = l.paused
	if !paused {
		l.ln = ln
	}
	l.mu.Unlock()
	if paused {
		_ = ln.Close()
	}
	l.acceptWG.Add(1)
	go l.serve()
	l.startRefresh()
	return addr, paused
}

// waitToListen waits while the listener is paused and binds its address
// again when it is resumed. It returns false once the listener is stopping.
func (l *listener) waitToListen() bool {
	retry := 50 * time.Millisecond
	for {
		l.mu.Lock()
		stopping, paused := l.stopping, l.paused
		l.mu.Unlock()
		if stopping {
			return false
		}
		if !paused {
			ln, err := l.listen(l.addr)
			if err == nil {
				l.mu.Lock()
				if l.stopping || l.paused {
					l.mu.Unlock()
					_ = ln.Close()
					continue
				}
				l.ln = ln
				l.mu.Unlock()
				l.log.Info().Str("listen", l.addr).Msg("listening again")
				return true
			}
			l.log.Error().Err(err).Str("listen", l.addr).Dur("retry_in_ms", retry).Msg("cannot listen again")
			select {
			case <-time.After(retry):
			case <-l.changed:
			case <-l.ctx.Done():
				return false
			}
			retry = min(retry*2, 2*time.Second)
			continue
		}
		select {
		case <-l.changed:
		case <-l.ctx.Done():
			return false
		}
	}
}

// acceptLoop accepts until ln is closed (pause or stop).
func (l *listener) acceptLoop(ln acceptor) {
	var backoff time.Duration
	// A mesh ingress's connections are sessions; every other connection
	// is a link and takes a max_links slot before it is accepted.
	gated := l.ingress == nil
	for {
		if gated && !l.p.slots.acquire(l) {
			return
		}
		tc, c, err := l.acceptOne(ln)
		if err != nil {
			if gated {
				l.p.slots.release(l)
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors and the like: back off, keep serving.
			if backoff == 0 {
				backoff = 5 * time.Millisecond
			} else if backoff *= 2; backoff > time.Second {
				backoff = time.Second
			}
			l.log.Error().Err(err).Dur("retry_in_ms", backoff).Msg("accept failed")
			select {
			case <-time.After(backoff):
			case <-l.ctx.Done():
				return
			}
			continue
		}
		backoff = 0
		if tc != nil {
			l.ingress.serveConn(tc) // each stream is a link
			continue
		}
		l.admit(c)
	}
}

// acceptOne takes ln's next connection: a mesh ingress's as net's
// *net.TCPConn (tc), every other listener's as the client of a link (c).
func (l *listener) acceptOne(ln acceptor) (tc *net.TCPConn, c *tcpClient, err error) {
	if rl, ok := ln.(*flow.Listener); ok {
		f, remote, err := rl.Accept()
		if err != nil {
			return nil, nil, err
		}
		return nil, newRawClient(f, remote), nil
	}
	nc, err := ln.(net.Listener).Accept()
	if err != nil {
		return nil, nil, err
	}
	tc = nc.(*net.TCPConn)
	if l.ingress != nil {
		return tc, nil, nil
	}
	return nil, newTCPClient(tc), nil
}

// admit makes a link of client c, which holds a max_links slot, and
// starts it, or refuses c (with a reset, before reading it) and gives
// the slot back.
func (l *listener) admit(c *tcpClient) {
	l.m.LinksTotal.Inc()
	var ep *endpoint // a pool listener's link picks its endpoint when it dials
	if l.matches != nil {
		var why CloseReason
		if ep, why = l.resolve(c); ep == nil {
			l.refuse(c, why)
			return
		}
	}
	if l.refusing(ep) {
		// Out of routing (a pool listener: in the moment before its
		// pause took effect).
		l.refuse(c, CloseRefused)
		return
	}
	lk := newLink(l, ep, c)
	lk.slot = true
	if !l.track(lk) {
		_ = c.Close()
		l.p.slots.release(l)
		return
	}
	l.p.starters.start(startJob{l, lk})
}

// refuse counts the close with reason why, resets c before reading it,
// and gives c's max_links slot back. It counts first: whoever sees the
// reset (the client, or the proxy's own link for a loop) finds it
// counted.
func (l *listener) refuse(c *tcpClient, why CloseReason) {
	l.m.Closed(string(why))
	c.abortive()
	_ = c.Close()
	l.p.slots.release(l)
}

// track registers a new link; it refuses once the listener is stopping.
func (l *listener) track(lk *link) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.stopping {
		return false
	}
	l.links[lk] = struct{}{}
	l.linkWG.Add(1)
	l.m.LinksActive.Inc()
	if lk.ep != nil {
		lk.ep.add(lk)
	}
	return true
}

func resetConn(c *net.TCPConn) {
	_ = c.SetLinger(0)
	_ = c.Close()
}

func (l *listener) serveLink(lk *link) {
	if lk.ep != nil {
		// Routed from the look at its destination's state below: one
		// that leaves routing after this evicts the link (evict); seen
		// out and let through (on_excluded: allow, group_fail_open), it
		// went there knowingly.
		lk.bound.Store(flow.Mono())
	}
	if lk.ep != nil && l.refusing(lk.ep) {
		// The destination left routing between accept and registration;
		// the eviction may have missed this link, so refuse it here.
		lk.client.abortive()
		lk.setReason(CloseRefused, nil)
		lk.closeBoth()
		l.linkEnded(lk, lk.stats())
		return
	}
	if !lk.start() {
		// finish, not just the stats: a link whose start failed after its
		// upstream connected (a mesh stream whose ack could not be written)
		// holds its end, which release gives back.
		lk.finish()
		l.linkEnded(lk, lk.stats())
	}
}

// linkEnded accounts for a link that has ended with stats s.
func (l *listener) linkEnded(lk *link, s LinkStats) {
	defer l.linkWG.Done()

	if lk.slot {
		l.p.slots.release(l)
	}
	if lk.ep != nil {
		lk.ep.remove(lk)
	}
	l.mu.Lock()
	delete(l.links, lk)
	l.closedUp += s.BytesUp
	l.closedDn += s.BytesDown
	l.mu.Unlock()
	l.m.LinksActive.Dec()
	reason := s.Reason
	l.m.Closed(string(reason))
	l.m.LinkDuration.Observe(s.Duration.Seconds())
	if lk.blamesUpstream(reason) {
		l.p.reportLinkEnd(lk, reason, s.Err)
	}
	if l.ingress != nil && upstreamEnded(reason) {
		l.ingress.kickCheck() // the local server may have gone: announce it at once
	}

	if l.p.onLinkEnd != nil {
		s.Client = lk.client.RemoteAddr().String()
	}
	l.logLinkEnd(lk, s) // the access log (accesslog.go)
	if l.p.onLinkEnd != nil {
		l.p.onLinkEnd(s)
	}
}

func (l *listener) stopAccepting() {
	if l.ingress != nil {
		l.ingress.drain()
	}
	l.mu.Lock()
	if !l.stopping {
		close(l.stopped)
	}
	l.stopping = true
	ln := l.ln
	l.ln = nil
	l.mu.Unlock()
	if ln != nil {
		_ = ln.Close()
	}
	l.signal()
	l.acceptWG.Wait()
}

func (l *listener) abortAll(reason CloseReason) {
	for _, lk := range l.snapshotLinks() {
		lk.abort(reason, nil)
	}
}
