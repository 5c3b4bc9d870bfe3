// Package proxy is livenessproxy's data plane: listeners, links, the
// request and response pumps, write timeouts, watermarks and upstream
// socket options.
package proxy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/intercept"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// Options are the optional parts of a Proxy.
type Options struct {
	// Logger receives structured logs; zero value: zerolog.Nop().
	Logger *zerolog.Logger
	// Metrics is where collectors are registered; nil: a private one.
	Metrics *metrics.Metrics
	// OnLinkEnd, if set, is called once for every link that ended, from
	// the link's own goroutine.
	OnLinkEnd func(LinkStats)
	// Resolver resolves upstream and pool host names; nil: net.DefaultResolver.
	Resolver *net.Resolver
	// AccessLog logs every finished link at info (log.access): listener,
	// client, upstream, bytes each way, when it opened, how long it lived,
	// why it ended. Without it the line is at debug.
	AccessLog bool
}

// Proxy owns the listeners and every link they accepted.
type Proxy struct {
	log       zerolog.Logger
	metrics   *metrics.Metrics
	onLinkEnd func(LinkStats)
	accessLog bool

	ctx    context.Context // cancelled by Close: aborts dials in progress
	cancel context.CancelFunc

	det      *health.Detector
	resolver *net.Resolver
	drain    atomic.Int64 // drain_timeout of the running config, nanoseconds

	transparent atomic.Bool            // some listener is transparent: track own upstream addresses
	exset       *intercept.ExcludedSet // nil: excluded destinations are reset after accept
	ownUp       sync.Map               // local addresses of upstream sockets, for the loop guard

	reloadMu sync.Mutex     // one Reload at a time; Shutdown holds it to the end
	closing  bool           // Shutdown began: no more reloads (under mu)
	bg       sync.WaitGroup // drains of listeners a reload removed

	mu        sync.Mutex
	listeners []*listener
	endpoints map[string]*endpoint // by normalized host:port
	disabled  map[string]bool      // endpoints.disabled of the running config
	started   bool
	ready     atomic.Bool
	stopOnce  sync.Once
}

// New builds a proxy for the listeners of cfg. Nothing is bound until Start.
func New(cfg policy.Config, opts Options) *Proxy {
	log := zerolog.Nop()
	if opts.Logger != nil {
		log = *opts.Logger
	}
	m := opts.Metrics
	if m == nil {
		m = metrics.New()
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{log: log, metrics: m, onLinkEnd: opts.OnLinkEnd, accessLog: opts.AccessLog, ctx: ctx, cancel: cancel,
		endpoints: make(map[string]*endpoint)}
	if cfg.Interception.ExcludedSet {
		set, err := intercept.OpenSet()
		if err != nil {
			log.Warn().Err(err).Msg("interception.excluded_set: cannot open the nftables sets; excluded destinations are reset after accept instead")
		} else {
			p.exset = set
		}
	}
	// Probes dial with each endpoint's own socket options (probeConfig).
	p.det = health.New(health.Options{
		Logger:  log.With().Str("component", "detector").Logger(),
		OnEvent: p.onHealthEvent,
		OnProbe: p.onProbe,
	})
	p.drain.Store(int64(cfg.DrainTimeout))
	p.resolver = opts.Resolver
	if p.resolver == nil {
		p.resolver = net.DefaultResolver
	}
	// Operator-disabled endpoints are out of routing before anything binds:
	// each is disabled as it is admitted (applyDisabled).
	p.disabled = make(map[string]bool, len(cfg.Endpoints.Disabled))
	for _, addr := range cfg.Endpoints.Disabled {
		p.disabled[normalizeEndpoint(addr)] = true
	}
	p.mu.Lock()
	for _, lc := range cfg.Listeners {
		p.listeners = append(p.listeners, p.newListenerLocked(lc))
	}
	ls := slices.Clone(p.listeners)
	p.mu.Unlock()
	for _, l := range ls {
		if l.pool != nil {
			p.syncPool(l.pool, l.pool.resolve(p.ctx, p.resolver))
		}
	}
	for _, addr := range cfg.Endpoints.Disabled {
		if _, err := p.lookup(addr); err != nil {
			p.log.Warn().Str("endpoint", addr).Msg("endpoints.disabled names an endpoint no listener routes to (yet)")
		}
	}
	m.Register(&bytesCollector{p: p})
	m.Register(&queuedCollector{p: p})
	m.Register(&stateCollector{p: p})
	return p
}

// Start binds every listener and starts accepting. If one fails to bind,
// those already bound are closed and the error names the listener.
func (p *Proxy) Start() error {
	p.mu.Lock()
	if p.started {
		p.mu.Unlock()
		return errors.New("proxy already started")
	}
	lc := net.ListenConfig{KeepAlive: -1}
	lns := make([]net.Listener, 0, len(p.listeners))
	for _, l := range p.listeners {
		ln, err := lc.Listen(p.ctx, "tcp", l.cfg.Listen)
		if err != nil {
			p.mu.Unlock()
			for _, b := range lns {
				_ = b.Close()
			}
			return fmt.Errorf("listener %q: %w", l.cfg.Name, err)
		}
		lns = append(lns, ln)
	}
	p.started = true
	for i, l := range p.listeners {
		addr := lns[i].Addr().String()
		l.mu.Lock()
		l.addr = addr
		paused := l.paused
		if !paused {
			l.ln = lns[i]
		}
		l.mu.Unlock()
		if paused {
			// Bound once to reserve the address (and learn a :0 port);
			// the accept loop binds it again when the endpoint is back.
			_ = lns[i].Close()
		}
		l.acceptWG.Add(1)
		go l.serve()
		l.startRefresh()
		l.log.Info().Str("listen", addr).Str("upstream", l.cfg.Upstream).Bool("paused", paused).Msg("listening")
	}
	p.ready.Store(true)
	p.bg.Add(1)
	go p.sweepLoop()
	p.mu.Unlock()
	return nil
}

// DrainTimeout is the drain_timeout of the configuration now running
// (the last one a Reload applied).
func (p *Proxy) DrainTimeout() time.Duration { return time.Duration(p.drain.Load()) }

// Ready reports whether every listener is bound and accepting.
func (p *Proxy) Ready() bool { return p.ready.Load() }

// Addr returns the bound address of the named listener, or nil.
func (p *Proxy) Addr(name string) net.Addr {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.listeners {
		if l.cfg.Name == name && l.addr != "" {
			a, _ := net.ResolveTCPAddr("tcp", l.addr)
			return a
		}
	}
	return nil
}

// ActiveLinks returns the number of open links across all listeners.
func (p *Proxy) ActiveLinks() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, l := range p.listeners {
		l.mu.Lock()
		n += len(l.links)
		l.mu.Unlock()
	}
	return n
}

// Shutdown stops accepting, lets open links finish until ctx is done, then
// closes those still open (reason "shutdown") and waits for every link
// goroutine to end. It is idempotent; it returns ctx.Err() when links had
// to be cut.
func (p *Proxy) Shutdown(ctx context.Context) error {
	var cut error
	p.stopOnce.Do(func() {
		// A reload in progress finishes first; none starts after this.
		p.reloadMu.Lock()
		defer p.reloadMu.Unlock()
		p.mu.Lock()
		p.closing = true
		p.mu.Unlock()
		p.ready.Store(false)
		p.mu.Lock()
		ls := append([]*listener(nil), p.listeners...)
		p.mu.Unlock()
		for _, l := range ls {
			l.stopAccepting()
		}
		done := make(chan struct{})
		go func() {
			for _, l := range ls {
				l.linkWG.Wait()
			}
			close(done)
		}()
		select {
		case <-done:
		case <-ctx.Done():
			cut = ctx.Err()
			// Links first, so that a dial cut short reads as shutdown and
			// is never reported against a healthy upstream.
			for _, l := range ls {
				l.abortAll(metrics.ReasonShutdown)
			}
			p.cancel() // dials in progress give up
			<-done
		}
		p.cancel()
		p.bg.Wait() // drains of removed listeners end on cancel
		p.det.Close()
		if p.exset != nil {
			p.clearExcludedSet()
			_ = p.exset.Close()
		}
		p.mu.Lock()
		for _, ep := range p.endpoints {
			defer ep.orphans.stop()
		}
		p.mu.Unlock()
	})
	return cut
}

// Close shuts down without draining.
func (p *Proxy) Close() error {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_ = p.Shutdown(ctx)
	return nil
}

// listener accepts client connections and owns the links they become.
type listener struct {
	p   *Proxy
	cfg policy.Listener // name, listen and upstream; settings live in tune
	ctx context.Context
	m   *metrics.Listener
	log zerolog.Logger
	// tune holds the settings new links take; a reload swaps it, links
	// keep the settings they started with.
	tune atomic.Pointer[tuning]
	addr string // bound address, kept to bind again after a pause
	// matches is the transparent match list; nil for an explicit or pool
	// listener (which has pool instead).
	matches []matcher
	// pool is the endpoints an explicit or pool listener routes to.
	pool *pool
	// destinations counts a transparent listener's endpoints (under p.mu),
	// bounded by transparent.max_destinations.
	destinations int
	// stopped is closed when the listener stops accepting (ends its pool's
	// refresh loop).
	stopped chan struct{}

	untrackedSeen sync.Map // untrack reasons already logged at info
	// localErrors counts the proxy's own failures since the last log line
	// about them, logged at most every localErrorLogEvery (mono time).
	localErrors      atomic.Int64
	localErrorLogged atomic.Int64

	acceptWG sync.WaitGroup // the accept loop
	linkWG   sync.WaitGroup // one per link goroutine

	mu       sync.Mutex
	ln       net.Listener // nil while paused or stopped
	links    map[*link]struct{}
	closedUp int64 // bytes of links that ended, for bytes_total
	closedDn int64
	stopping bool
	paused   bool          // refusing: the endpoint is excluded or disabled
	changed  chan struct{} // signalled when paused or stopping changes
}

// tuning is what a new link takes from its listener's configuration; a
// reload swaps it, so every key it holds takes effect for the next link.
type tuning struct {
	cfg           policy.Listener // the configuration it was made from
	set           policy.Settings
	frames        *frameSpec // nil: opaque
	dialer        *net.Dialer
	balance       string        // pool.balance
	failOpen      bool          // pool.fail_open
	groupFailOpen bool          // transparent.group_fail_open
	maxDests      int           // transparent.max_destinations
	forgetAfter   time.Duration // transparent.forget_excluded_after
}

func newTuning(lc policy.Listener) *tuning {
	s := lc.Settings
	// Zero values (a Config built in code) mean the defaults, as in Validate.
	balance := cmp.Or(lc.Pool.Balance, policy.DefaultPool().Balance)
	dt := policy.DefaultTransparent()
	return &tuning{
		cfg:           lc,
		set:           s,
		balance:       balance,
		failOpen:      lc.IsPool() && lc.Pool.FailOpen,
		groupFailOpen: lc.IsTransparent() && lc.Transparent.GroupFailOpen,
		maxDests:      cmp.Or(lc.Transparent.MaxDestinations, dt.MaxDestinations),
		forgetAfter:   cmp.Or(lc.Transparent.ForgetExcludedAfter, dt.ForgetExcludedAfter).D(),
		frames:        newFrameSpec(s.Framing),
		dialer: &net.Dialer{
			Timeout:   s.ConnectTimeout.D(), // non-positive: no timeout of ours
			KeepAlive: -1,                   // ours are set in Control, or left to the kernel
			Control:   upstreamControl(s),
		},
	}
}

func (l *listener) tuning() *tuning { return l.tune.Load() }

func listenerKind(cfg policy.Listener) string {
	if cfg.IsTransparent() {
		return metrics.KindTransparent
	}
	return metrics.KindPool
}

func (p *Proxy) newListenerLocked(cfg policy.Listener) *listener {
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
	l.tune.Store(newTuning(cfg))
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
			ln, err := (&net.ListenConfig{KeepAlive: -1}).Listen(l.ctx, "tcp", l.addr)
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
func (l *listener) acceptLoop(ln net.Listener) {
	var backoff time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
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
		l.m.LinksTotal.Inc()
		tc := c.(*net.TCPConn)
		var ep *endpoint // a pool listener's link picks its endpoint when it dials
		if l.matches != nil {
			var why string
			if ep, why = l.resolve(tc); ep == nil {
				resetConn(tc)
				l.m.Closed(why)
				continue
			}
		}
		if l.refusing(ep) {
			// Out of routing (a pool listener: in the moment before its
			// pause took effect): reset before reading.
			resetConn(tc)
			l.m.Closed(metrics.ReasonRefused)
			continue
		}
		k := newLink(l, ep, tc)
		if !l.track(k) {
			_ = c.Close()
			continue
		}
		go l.serveLink(k)
	}
}

// track registers a new link; it refuses once the listener is stopping.
func (l *listener) track(k *link) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.stopping {
		return false
	}
	l.links[k] = struct{}{}
	l.linkWG.Add(1)
	l.m.LinksActive.Inc()
	if k.ep != nil {
		k.ep.add(k)
	}
	return true
}

func resetConn(c *net.TCPConn) {
	_ = c.SetLinger(0)
	_ = c.Close()
}

func (l *listener) serveLink(k *link) {
	if k.ep != nil && l.refusing(k.ep) {
		// The destination left routing between accept and registration;
		// the eviction may have missed this link, so refuse it here.
		_ = k.client.SetLinger(0)
		k.setReason(metrics.ReasonRefused, nil)
		k.closeBoth()
		l.linkEnded(k, k.stats())
		return
	}
	if !k.start() {
		l.linkEnded(k, k.stats())
	}
}

// linkEnded accounts for a link that has ended with stats s.
func (l *listener) linkEnded(k *link, s LinkStats) {
	defer l.linkWG.Done()

	if k.ep != nil {
		k.ep.remove(k)
	}
	l.mu.Lock()
	delete(l.links, k)
	l.closedUp += s.BytesUp
	l.closedDn += s.BytesDown
	l.mu.Unlock()
	l.m.LinksActive.Dec()
	l.m.Closed(s.Reason)
	l.m.LinkDuration.Observe(s.Duration.Seconds())
	if k.blamesUpstream(s.Reason) {
		l.p.report(k.ep, s.Reason)
	}

	// The access log (log.access) is one info line per link; without it
	// the same line is at debug.
	e := l.log.Debug()
	if l.p.accessLog {
		e = l.log.Info()
	}
	if e.Enabled() {
		e.Str("client", s.Client).Str("upstream", s.Upstream).Str("reason", s.Reason).
			AnErr("cause", s.Err).Int64("bytes_up", s.BytesUp).Int64("bytes_down", s.BytesDown).
			Int64("max_queued", s.MaxQueued).Time("opened", s.Opened).Int64("duration_ms", s.Duration.Milliseconds()).
			Msg("link closed")
	}
	if l.p.onLinkEnd != nil {
		l.p.onLinkEnd(s)
	}
}

func (l *listener) stopAccepting() {
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

func (l *listener) abortAll(reason string) {
	for _, k := range l.snapshotLinks() {
		k.abort(reason, nil)
	}
}

// queuedCollector exports queued_bytes: the bytes waiting in links'
// queues toward their upstreams now, per listener, read at scrape time.
type queuedCollector struct{ p *Proxy }

var queuedDesc = prometheus.NewDesc("livenessproxy_queued_bytes",
	"Bytes read from clients and waiting in the proxy's queues for their upstreams now (the kernel's own send buffers not included).",
	[]string{"listener"}, nil)

func (c *queuedCollector) Describe(ch chan<- *prometheus.Desc) { ch <- queuedDesc }

func (c *queuedCollector) Collect(ch chan<- prometheus.Metric) {
	c.p.mu.Lock()
	ls := append([]*listener(nil), c.p.listeners...)
	c.p.mu.Unlock()
	for _, l := range ls {
		var n int64
		for _, k := range l.snapshotLinks() {
			n += k.q.bytes()
		}
		ch <- prometheus.MustNewConstMetric(queuedDesc, prometheus.GaugeValue, float64(n), l.cfg.Name)
	}
}

// bytesCollector exports bytes_total from live links' counters plus those
// of links that ended, so the pumps never touch a shared metric per read.
type bytesCollector struct{ p *Proxy }

var bytesDesc = prometheus.NewDesc("livenessproxy_bytes_total",
	"Bytes proxied: request is client to upstream, response is upstream to client.",
	[]string{"listener", "direction"}, nil)

func (c *bytesCollector) Describe(ch chan<- *prometheus.Desc) { ch <- bytesDesc }

func (c *bytesCollector) Collect(ch chan<- prometheus.Metric) {
	c.p.mu.Lock()
	ls := append([]*listener(nil), c.p.listeners...)
	c.p.mu.Unlock()
	for _, l := range ls {
		l.mu.Lock()
		up, dn := l.closedUp, l.closedDn
		for k := range l.links {
			up += k.bytesUp.Load()
			dn += k.bytesDown.Load()
		}
		l.mu.Unlock()
		ch <- prometheus.MustNewConstMetric(bytesDesc, prometheus.CounterValue, float64(up), l.cfg.Name, "request")
		ch <- prometheus.MustNewConstMetric(bytesDesc, prometheus.CounterValue, float64(dn), l.cfg.Name, "response")
	}
}
