package proxy

import (
	"errors"
	"fmt"
	"net"
	"reflect"
	"slices"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// Reload applies a new, validated configuration without dropping links
// it does not affect:
//   - a listener with the same name, listen address and upstream keeps its
//     socket and its links; its new settings apply to links opened from
//     now on;
//   - a listener that is new, or whose listen address or upstream changed,
//     is bound (a failure to bind is returned and the rest still applies);
//   - a listener that is gone stops accepting at once; its links get
//     drain_timeout to finish and are then closed;
//   - endpoints.disabled: every listed endpoint is disabled (including
//     one a new listener routes to); endpoints the previous config listed
//     and this one does not are enabled (a readmission: links opened
//     before it are evicted). Endpoints disabled through the admin API
//     and never listed stay as they are.
//
// Admin and log settings are not reloaded (they need a restart).
func (p *Proxy) Reload(cfg policy.Config) error {
	p.reloadMu.Lock()
	defer p.reloadMu.Unlock()

	p.mu.Lock()
	if !p.started || p.closing {
		p.mu.Unlock()
		return errors.New("reload: proxy not running")
	}
	old := make(map[string]*listener, len(p.listeners))
	for _, l := range p.listeners {
		old[l.cfg.Name] = l
	}
	var keep, added []*listener
	for _, lc := range cfg.Listeners {
		l, ok := old[lc.Name]
		if ok && l.cfg.Listen == lc.Listen && normalizeEndpoint(l.cfg.Upstream) == normalizeEndpoint(lc.Upstream) &&
			reflect.DeepEqual(l.cfg.Transparent, lc.Transparent) {
			delete(old, lc.Name)
			l.tune.Store(newTuning(lc.Settings))
			if l.ep != nil {
				p.endpointForLocked(lc.Upstream, lc.Settings) // refresh the probe config
			}
			keep = append(keep, l)
			continue
		}
		added = append(added, p.newListenerLocked(lc))
	}
	p.mu.Unlock()

	p.mu.Lock()
	prev := p.disabled
	p.disabled = make(map[string]bool, len(cfg.Endpoints.Disabled))
	for _, a := range cfg.Endpoints.Disabled {
		p.disabled[normalizeEndpoint(a)] = true
	}
	now := p.disabled
	p.mu.Unlock()
	// Every endpoint the new config lists as disabled leaves routing
	// before any listener binds, including one this reload newly routes to
	// (Disable of one already disabled changes nothing).
	for addr := range now {
		if ep, err := p.lookup(addr); err == nil {
			p.det.Disable(ep.addr, "config")
		}
	}

	// Removed (or moved) listeners first: a listener that moved to a new
	// upstream under the same address needs the address free.
	for _, l := range old {
		p.retire(l, cfg.DrainTimeout.D())
	}
	var errs []error
	lc := net.ListenConfig{KeepAlive: -1}
	for _, l := range added {
		ln, err := lc.Listen(p.ctx, "tcp", l.cfg.Listen)
		if err != nil {
			errs = append(errs, fmt.Errorf("listener %q: %w", l.cfg.Name, err))
			p.detach(l)
			continue
		}
		l.mu.Lock()
		l.addr = ln.Addr().String()
		paused := l.paused || (l.ep != nil && p.refusing(l, l.ep))
		l.paused = paused
		if paused {
			_ = ln.Close()
		} else {
			l.ln = ln
		}
		l.mu.Unlock()
		l.acceptWG.Add(1)
		go l.serve()
		l.log.Info().Str("listen", l.addr).Str("upstream", l.cfg.Upstream).Msg("listener added by reload")
		keep = append(keep, l)
	}
	p.mu.Lock()
	p.listeners = keep
	p.mu.Unlock()

	for addr := range prev {
		if !now[addr] {
			if ep, err := p.lookup(addr); err == nil {
				p.det.Enable(ep.addr, "config")
			}
		}
	}
	return errors.Join(errs...)
}

// retire stops a listener that a reload removed: no more accepts, its
// links get drain to finish, then they are closed. The drain runs in a
// goroutine the proxy owns (Shutdown waits for it).
func (p *Proxy) retire(l *listener, drain time.Duration) {
	l.stopAccepting()
	l.log.Info().Int("links", len(l.snapshotLinks())).Dur("drain_timeout", drain).Msg("listener removed by reload")
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
		l.abortAll(metrics.ReasonShutdown)
		<-done
		p.detach(l)
		p.mu.Lock()
		reused := false
		for _, x := range p.listeners {
			reused = reused || x.cfg.Name == l.cfg.Name
		}
		p.mu.Unlock()
		if !reused { // a listener that moved keeps its series
			p.metrics.Forget(l.cfg.Name)
		}
	}()
}

// detach removes a listener from its endpoint; an endpoint no listener
// routes to any more is forgotten by the detector.
func (p *Proxy) detach(l *listener) {
	if l.ep != nil {
		p.detachFrom(l, l.ep)
		return
	}
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
	ep.mu.Lock()
	if !slices.Contains(ep.listeners, l) {
		ep.mu.Unlock()
		p.mu.Unlock()
		return
	}
	ep.listeners = slices.DeleteFunc(ep.listeners, func(x *listener) bool { return x == l })
	orphan := len(ep.listeners) == 0
	ep.mu.Unlock()
	if orphan && p.endpoints[ep.addr] == ep {
		delete(p.endpoints, ep.addr)
	}
	p.mu.Unlock()
	if !orphan {
		return
	}
	p.det.Unregister(ep.addr)
	p.unexclude(ep.addr)
	ep.orphans.stop()
}

func (l *listener) snapshotLinks() []*link {
	l.mu.Lock()
	defer l.mu.Unlock()
	ks := make([]*link, 0, len(l.links))
	for k := range l.links {
		ks = append(ks, k)
	}
	return ks
}
