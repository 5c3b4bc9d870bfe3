// Package proxy is livenessproxy's data plane: listeners, links, the
// request and response pumps, write timeouts, watermarks and upstream
// socket options.
package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

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
}

// Proxy owns the listeners and every link they accepted.
type Proxy struct {
	log       zerolog.Logger
	metrics   *metrics.Metrics
	onLinkEnd func(LinkStats)

	ctx    context.Context // cancelled by Close: aborts dials in progress
	cancel context.CancelFunc

	mu        sync.Mutex
	listeners []*listener
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
	p := &Proxy{log: log, metrics: m, onLinkEnd: opts.OnLinkEnd, ctx: ctx, cancel: cancel}
	for _, lc := range cfg.Listeners {
		p.listeners = append(p.listeners, p.newListener(lc))
	}
	m.Register(&bytesCollector{p: p})
	return p
}

// Start binds every listener and starts accepting. If one fails to bind,
// those already bound are closed and the error names the listener.
func (p *Proxy) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.started {
		return errors.New("proxy already started")
	}
	lc := net.ListenConfig{KeepAlive: -1}
	for i, l := range p.listeners {
		ln, err := lc.Listen(p.ctx, "tcp", l.cfg.Listen)
		if err != nil {
			for _, b := range p.listeners[:i] {
				_ = b.ln.Close()
			}
			return fmt.Errorf("listener %q: %w", l.cfg.Name, err)
		}
		l.ln = ln
	}
	p.started = true
	for _, l := range p.listeners {
		l.acceptWG.Add(1)
		go l.serve()
		l.log.Info().Str("listen", l.ln.Addr().String()).Str("upstream", l.cfg.Upstream).Msg("listening")
	}
	p.ready.Store(true)
	return nil
}

// Ready reports whether every listener is bound and accepting.
func (p *Proxy) Ready() bool { return p.ready.Load() }

// Addr returns the bound address of the named listener, or nil.
func (p *Proxy) Addr(name string) net.Addr {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.listeners {
		if l.cfg.Name == name && l.ln != nil {
			return l.ln.Addr()
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
			p.cancel() // dials in progress give up
			for _, l := range ls {
				l.abortAll(metrics.ReasonShutdown)
			}
			<-done
		}
		p.cancel()
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
	p      *Proxy
	cfg    policy.Listener
	ctx    context.Context
	ln     net.Listener
	m      *metrics.Listener
	log    zerolog.Logger
	dialer net.Dialer

	acceptWG sync.WaitGroup // the accept loop
	linkWG   sync.WaitGroup // one per link goroutine

	mu        sync.Mutex
	links     map[*link]struct{}
	closedUp  int64 // bytes of links that ended, for bytes_total
	closedDn  int64
	stopping  bool
	closeOnce sync.Once
}

func (p *Proxy) newListener(cfg policy.Listener) *listener {
	return &listener{
		p:     p,
		cfg:   cfg,
		ctx:   p.ctx,
		m:     p.metrics.ForListener(cfg.Name),
		log:   p.log.With().Str("listener", cfg.Name).Logger(),
		links: make(map[*link]struct{}),
		dialer: net.Dialer{
			Timeout:   cfg.ConnectTimeout.D(), // non-positive: no timeout of ours
			KeepAlive: -1,                     // ours are set in Control, or left to the kernel
			Control:   upstreamControl(cfg.Settings),
		},
	}
}

// serve is the accept loop. It only accepts: dialling happens in each
// link's goroutine, so one black-holed upstream never stalls other clients.
func (l *listener) serve() {
	defer l.acceptWG.Done()
	var backoff time.Duration
	for {
		c, err := l.ln.Accept()
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
			l.log.Error().Err(err).Dur("retry_in", backoff).Msg("accept failed")
			select {
			case <-time.After(backoff):
			case <-l.ctx.Done():
				return
			}
			continue
		}
		backoff = 0
		l.m.LinksTotal.Inc()
		k := newLink(l, c.(*net.TCPConn))
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
	return true
}

func (l *listener) serveLink(k *link) {
	defer l.linkWG.Done()
	s := k.run()

	l.mu.Lock()
	delete(l.links, k)
	l.closedUp += s.BytesUp
	l.closedDn += s.BytesDown
	l.mu.Unlock()
	l.m.LinksActive.Dec()
	l.m.Closed(s.Reason)

	if e := l.log.Debug(); e.Enabled() {
		e.Str("client", s.Client).Str("upstream", s.Upstream).Str("reason", s.Reason).
			AnErr("cause", s.Err).Int64("bytes_up", s.BytesUp).Int64("bytes_down", s.BytesDown).
			Int64("max_queued", s.MaxQueued).Dur("duration", s.Duration).Msg("link closed")
	}
	if l.p.onLinkEnd != nil {
		l.p.onLinkEnd(s)
	}
}

func (l *listener) stopAccepting() {
	l.mu.Lock()
	l.stopping = true
	l.mu.Unlock()
	l.closeOnce.Do(func() {
		if l.ln != nil {
			_ = l.ln.Close()
		}
	})
	l.acceptWG.Wait()
}

func (l *listener) abortAll(reason string) {
	l.mu.Lock()
	ks := make([]*link, 0, len(l.links))
	for k := range l.links {
		ks = append(ks, k)
	}
	l.mu.Unlock()
	for _, k := range ks {
		k.abort(reason, nil)
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
