// Package proxy is livenessproxy's data plane: listeners, links, the
// request and response pumps, write timeouts, watermarks and upstream
// socket options; and the mesh, in which two sidecars carry links as
// streams of a yamux session with heartbeats (mesh*.go).
package proxy

import (
	"context"
	"errors"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/mesh"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

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
	// Registerer is where the proxy registers its collectors (the
	// livenessproxy_* series of the data plane); nil: a private registry.
	// The Go runtime and process collectors, build_info and the reload
	// series are the caller's.
	Registerer prometheus.Registerer
	// OnLinkEnd, if set, is called once for every link that ended, from
	// the link's own goroutine.
	OnLinkEnd func(LinkStats)
	// Resolver resolves upstream and pool host names; nil: net.DefaultResolver.
	Resolver *net.Resolver
	// AccessLog logs every finished link at info (log.access; the fields:
	// logLinkEnd). Without it the line is at debug.
	AccessLog bool
	// ManageRuntime lets the proxy set process-wide limits: it raises the
	// soft RLIMIT_NOFILE to the hard limit and, unless the environment
	// sets GOMEMLIMIT, sets the runtime's memory limit from limits.memory
	// (or the container's limit), and unless it sets GOMAXPROCS, sets
	// GOMAXPROCS from limits.procs, at New and at each Reload. The binary
	// sets it; a library user may leave the process alone.
	ManageRuntime bool

	// metrics, for the package's own tests: collectors they read directly.
	metrics *metrics.Metrics
}

// Proxy owns the listeners and every link they accepted.
//
// Lock order, outermost first: Proxy.reloadMu, pool.routeMu (held by
// updateRouting alone, with no other lock), Proxy.mu, listener.mu, then
// pool.mu, then endpoint.mu (a pool reads and counts its members' links
// under its own lock; never two endpoints' at once), then the health
// detector's own lock (its methods
// are called with any of these held; it calls back into the proxy, in
// onHealthEvent and onProbe, holding none of its own). A link's own locks
// come after all of these: connMu, finMu and its queue's are taken alone;
// its conv's is taken before its tracker's.
type Proxy struct {
	log       zerolog.Logger
	metrics   *metrics.Metrics
	onLinkEnd func(LinkStats)
	accessLog bool

	ctx    context.Context // cancelled by Close: aborts dials in progress
	cancel context.CancelFunc

	starters *starters // run the start of new links (starters.go)

	det      *health.Detector
	resolver *net.Resolver
	drain    atomic.Int64 // drain_timeout of the running config, nanoseconds

	// budget is the memory budget of every link's queue and read buffers;
	// slots is max_links; limits is how both were derived.
	budget flow.Budget
	slots  linkSlots
	// parkAfter is limits.park_idle_after (ns; 0: never); parker holds the
	// parked pumps of idle links (park.go), from Start on (nil if its
	// epoll set could not be made).
	parkAfter     atomic.Int64
	parker        *parker
	rwatch        *resetWatch // nil where it could not be made: readers read on after every read
	manageRuntime bool
	limitsMu      sync.Mutex
	limits        Limits

	transparent atomic.Bool            // some listener is transparent: track own upstream addresses
	excludedSet *intercept.ExcludedSet // nil: excluded destinations are reset after accept
	// setMu orders the updates of excludedSet, each from its look at the
	// state to the kernel's answer (syncExcludedSet); mu and the
	// endpoints' locks are taken under it, never the other way.
	setMu sync.Mutex
	ownUp ownAddrs // local addresses of upstream sockets, for the loop guard
	// connecting is read-held by each raw connect of the proxy's own
	// from just before connect(2) until its local address is in ownUp
	// (ownDial); isOwn takes it for writing before it calls a connection
	// not the proxy's own, so that no connect in flight is missed.
	connecting sync.RWMutex
	// inFlight counts those connects, from before the read lock until
	// after the address is in ownUp: while it is 0, a miss needs no wait.
	inFlight atomic.Int32

	reloadMu sync.Mutex     // one Reload at a time; Shutdown holds it to the end
	closing  bool           // Shutdown began: no more reloads (under mu)
	bg       sync.WaitGroup // drains of listeners a reload removed, starters

	// memoMu guards ingressMemos, what the ingresses a reload replaces
	// share, by local host (see ingressMemo); it is taken under mu (a
	// reload builds the new ingress), and nothing is taken under it.
	memoMu       sync.Mutex
	ingressMemos map[string]*ingressMemo

	// meshMu guards peers, the ingress sidecars this proxy reaches through
	// the mesh, by host:mesh port. It is taken alone.
	meshMu     sync.Mutex
	peers      map[string]*meshPeer
	peersSwept int64                  // mono: the last sweep of idle peers
	certs      map[string]*mesh.Certs // mesh.tls file sets, by their paths
	meshClosed atomic.Bool            // Shutdown closed the mesh: no session opens
	// meshKeys are the session keys of the settings the listeners give
	// new links (noteMeshKeysLocked): a session of another key is retired
	// once idle, one of these is kept.
	meshKeys atomic.Pointer[map[sessionKey]bool]

	mu        sync.Mutex
	listeners []*listener
	endpoints map[string]*endpoint // by normalized host:port
	disabled  map[string]bool      // endpoints.disabled of the running config
	names     map[string]int       // listeners made per name, live or draining: the last to go forgets the name's series (releaseName)
	retiring  []*listener          // removed by a reload, their links draining (retire): the scrape-time series still count them
	carried   map[string][2]int64  // bytes up and down of a name's retired listeners, while another of the name lives (bytes_total stays monotonic)
	drained   sync.Map             // endpoints the operator drained: address -> struct{} (drain.go)
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
	m := opts.metrics
	if m == nil {
		reg := opts.Registerer
		if reg == nil {
			reg = prometheus.NewRegistry()
		}
		m = metrics.NewOn(reg)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{log: log, metrics: m, onLinkEnd: opts.OnLinkEnd, accessLog: opts.AccessLog, ctx: ctx, cancel: cancel,
		endpoints: make(map[string]*endpoint), manageRuntime: opts.ManageRuntime}
	p.starters = newStarters(ctx, &p.bg, serveJob)
	p.budget.Waits = m.BudgetWaits
	p.setLimits(cfg)
	if cfg.Interception.ExcludedSet {
		excluded, err := intercept.OpenSet()
		if err != nil {
			log.Warn().Err(err).Msg("interception.excluded_set: cannot open the nftables sets; excluded destinations are reset after accept instead")
		} else {
			p.excludedSet = excluded
			// Exclusions an earlier process left (it crashed before its
			// shutdown took them out) belong to no one: the rules would
			// refuse those destinations for good, and this process would
			// never see a connection to them to probe or readmit.
			if n, err := excluded.Clear(); err != nil {
				log.Error().Err(err).Msg("interception.excluded_set: cannot empty the excluded sets an earlier process may have left")
			} else if n != 0 { // -1: emptied, how many unknown
				log.Warn().Int("destinations", n).Msg("interception.excluded_set: emptied the excluded sets of the destinations an earlier process left in them")
			}
		}
	}
	// Probes dial with each endpoint's own socket options (probeConfig).
	p.det = health.New(health.Options{
		Logger:  log.With().Str("component", "detector").Logger(),
		OnEvent: p.onHealthEvent, OnProbe: p.onProbe, OwnFailure: ownFailure,
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
		if l.ingress != nil {
			for _, ep := range l.ingress.localEndpoints() {
				p.applyDisabled(ep)
			}
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
	m.Register(&budgetCollector{b: &p.budget})
	m.Register(&probesCollector{det: p.det})
	return p
}

// setLimits derives the process's limits from cfg (and, with
// ManageRuntime, applies them to the runtime) and puts the budget and
// max_links in force. Lowering either cuts nothing: queues give chunks
// back as they drain, listeners accept again once enough links ended.
func (p *Proxy) setLimits(cfg policy.Config) Limits {
	l := PlanLimits(cfg)
	if p.manageRuntime {
		l = ApplyRuntime(l)
	}
	p.limitsMu.Lock()
	was := p.limits
	p.limits = l
	p.limitsMu.Unlock()
	if p.manageRuntime && was.ProcsSource != "" && was.Procs != l.Procs {
		p.log.Info().Int("gomaxprocs", l.Procs).Int("was", was.Procs).Str("gomaxprocs_source", l.ProcsSource).Msg("GOMAXPROCS changed")
	}
	if was.MaxLinksSource != "" {
		p.logRetunedLimits(was, l)
	}
	p.budget.SetLimit(l.Budget)
	p.slots.setMax(l.MaxLinks)
	p.parkAfter.Store(int64(l.ParkIdleAfter))
	return l
}

// logRetunedLimits says, at a reload, what changed from was to l in
// max_links and the budget (a reload that adds a mesh listener lowers a
// derived max_links, say), and the warnings l has that was had not: the
// start log says them once, a reload would leave them unsaid.
func (p *Proxy) logRetunedLimits(was, l Limits) {
	if was.MaxLinks != l.MaxLinks || was.Budget != l.Budget {
		p.log.Info().Int("max_links", l.MaxLinks).Int("max_links_was", was.MaxLinks).Str("max_links_source", l.MaxLinksSource).
			Int64("memory_budget", l.Budget).Int64("memory_budget_was", was.Budget).Msg("limits changed")
	}
	old := was.Warnings()
	for _, w := range l.Warnings() {
		if !slices.Contains(old, w) {
			p.log.Warn().Msg(w)
		}
	}
}

// Limits returns the process limits in force: the memory budget, max_links,
// GOMEMLIMIT, the descriptors and GOMAXPROCS, each with where it came from.
func (p *Proxy) Limits() Limits {
	p.limitsMu.Lock()
	defer p.limitsMu.Unlock()
	return p.limits
}

// Start binds every listener and starts accepting. If one fails to bind,
// those already bound are closed and the error names the listener.
func (p *Proxy) Start() error {
	p.mu.Lock()
	if p.started {
		p.mu.Unlock()
		return errors.New("proxy already started")
	}
	lns := make([]acceptor, 0, len(p.listeners))
	for _, l := range p.listeners {
		ln, err := l.bind()
		if err != nil {
			p.mu.Unlock()
			for _, b := range lns {
				_ = b.Close()
			}
			return err
		}
		lns = append(lns, ln)
	}
	p.started = true
	// The route lookups of its verdicts (ownNetwork) ask on a socket
	// kept from now on: at its descriptor limit the proxy opens none.
	flow.KeepRouteLookup()
	p.noteMeshKeysLocked()
	pk, err := newParker(&p.log, p.metrics.ParkedPumps)
	if err != nil {
		p.log.Warn().Err(err).Msg("idle links cannot be parked: each keeps its goroutines (limits.park_idle_after has no effect)")
	} else {
		p.parker = pk
	}
	rw, err := newResetWatch(&p.log)
	if err != nil {
		p.log.Warn().Err(err).Msg("no reset watch: each read of a link is followed by another")
	} else {
		p.rwatch = rw
	}
	for i, l := range p.listeners {
		addr, paused := l.open(lns[i])
		l.log.Info().Str("listen", addr).Str("upstream", l.cfg.Upstream).Bool("paused", paused).Msg("listening")
	}
	p.ready.Store(true)
	p.bg.Add(3)
	go p.sweepLoop()
	go p.reap()
	go p.parkSweepLoop()
	p.mu.Unlock()
	return nil
}

// DrainTimeout is the drain_timeout of the configuration now running
// (the last one a Reload applied).
func (p *Proxy) DrainTimeout() time.Duration { return time.Duration(p.drain.Load()) }

// Ready reports whether every listener is bound and accepting.
func (p *Proxy) Ready() bool { return p.ready.Load() }

// ListenerConfigs returns the configuration of each listener running now,
// as its last reload left it: after a reload applied in part, a listener
// whose bind failed is not among them.
func (p *Proxy) ListenerConfigs() []policy.Listener {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]policy.Listener, 0, len(p.listeners))
	for _, l := range p.listeners {
		out = append(out, l.spec().cfg)
	}
	return out
}

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

// lookupEndpoint returns the endpoint at addr, nil if no listener routes
// to it.
func (p *Proxy) lookupEndpoint(addr string) *endpoint {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.endpoints[normalizeEndpoint(addr)]
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
				l.abortAll(CloseShutdown)
			}
			p.cancel() // dials in progress give up
			<-done
		}
		p.cancel()
		p.bg.Wait() // drains of removed listeners and the starters end on cancel
		if p.parker != nil {
			p.parker.stop() // every link has ended: none is parked
		}
		if p.rwatch != nil {
			p.rwatch.stop() // every link has ended: none is watched
		}
		p.det.Close() // probes first: a mesh probe may open a session
		p.closeMesh()
		for _, l := range ls {
			if l.ingress != nil {
				l.ingress.close()
			}
		}
		if p.excludedSet != nil {
			p.clearExcludedSet()
			_ = p.excludedSet.Close()
		}
		p.mu.Lock()
		for _, ep := range p.endpoints {
			defer ep.orphans.Stop()
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
