package proxy

import (
	"errors"
	"fmt"
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
//   - endpoints.disabled: every listed endpoint is disabled (including
//     one a new listener routes to); endpoints the previous config listed
//     and this one does not are enabled (a readmission: links opened
//     before it are evicted). Endpoints disabled through the admin API
//     and never listed stay as they are.
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
	var ch Changes
	p.reloadMu.Lock()
	defer p.reloadMu.Unlock()

	p.mu.Lock()
	if !p.started || p.closing {
		p.mu.Unlock()
		return ch, errors.New("reload: proxy not running")
	}
	old := make(map[string]*listener, len(p.listeners))
	for _, l := range p.listeners {
		old[l.cfg.Name] = l
	}
	var keep, added, pools []*listener
	for _, lc := range cfg.Listeners {
		l, ok := old[lc.Name]
		if ok && sameTarget(l.cfg, lc) {
			delete(old, lc.Name)
			if prev := l.spec().cfg; !reflect.DeepEqual(prev.Settings, lc.Settings) || !reflect.DeepEqual(prev.Pool, lc.Pool) ||
				!reflect.DeepEqual(prev.Transparent, lc.Transparent) || prev.MaxLinks != lc.MaxLinks || !reflect.DeepEqual(prev.Ingress, lc.Ingress) {
				ch.ListenersRetuned = append(ch.ListenersRetuned, lc.Name)
			}
			l.current.Store(newLinkSpec(lc))
			if l.ingress != nil {
				l.ingress.retuneLocked(lc)
			}
			if l.pool != nil {
				l.pool.setSpecs(lc) // members follow below
				pools = append(pools, l)
			}
			keep = append(keep, l)
			continue
		}
		nl := p.newListenerLocked(lc)
		added = append(added, nl)
		if nl.pool != nil {
			pools = append(pools, nl)
		}
	}
	p.mu.Unlock()

	p.drain.Store(int64(cfg.DrainTimeout))
	// A lower budget or max_links cuts nothing (see setLimits); a higher
	// listener max_links lets its accept loop go on.
	p.setLimits(cfg.Limits)
	p.slots.retuned()
	p.mu.Lock()
	prev := p.disabled
	p.disabled = make(map[string]bool, len(cfg.Endpoints.Disabled))
	for _, a := range cfg.Endpoints.Disabled {
		p.disabled[normalizeEndpoint(a)] = true
	}
	now := p.disabled
	p.mu.Unlock()
	// Members from the new entries (names resolved now), each admitted one
	// disabled if the new endpoints.disabled names it: a kept pool's
	// members that left are drained (drainMember), every member's probe
	// configuration is the new one.
	for _, l := range pools {
		p.syncPool(l.pool, l.pool.resolve(p.ctx, p.resolver))
		if !slices.Contains(added, l) {
			l.startRefresh() // entries may have become names
		}
	}
	// Every endpoint the new config lists as disabled leaves routing
	// before any listener binds, including one this reload newly routes to
	// (Disable of one already disabled changes nothing).
	for addr := range now {
		eps, _ := p.lookup(addr)
		for _, ep := range eps {
			if p.det.Disable(ep.addr, health.ReasonConfig) {
				ch.EndpointsDisabled = append(ch.EndpointsDisabled, ep.addr)
			}
		}
	}

	// Removed (or moved) listeners first: a listener that moved to a new
	// upstream under the same address needs the address free.
	for _, l := range old {
		p.retire(l, cfg.DrainTimeout.D())
		ch.ListenersRemoved = append(ch.ListenersRemoved, l.cfg.Name)
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
		paused := l.paused
		l.paused = paused
		if paused {
			_ = ln.Close()
		} else {
			l.ln = ln
		}
		l.mu.Unlock()
		l.acceptWG.Add(1)
		go l.serve()
		l.startRefresh()
		l.log.Info().Str("listen", l.addr).Str("upstream", l.cfg.Upstream).Msg("listener added by reload")
		keep = append(keep, l)
		ch.ListenersAdded = append(ch.ListenersAdded, l.cfg.Name)
	}
	p.mu.Lock()
	p.listeners = keep
	p.mu.Unlock()

	for addr := range prev {
		if !now[addr] {
			eps, _ := p.lookup(addr)
			for _, ep := range eps {
				if p.det.Enable(ep.addr, health.ReasonConfig) {
					ch.EndpointsEnabled = append(ch.EndpointsEnabled, ep.addr)
				}
			}
		}
	}
	slices.Sort(ch.ListenersRemoved)
	return ch, errors.Join(errs...)
}

// retire stops a listener that a reload removed: no more accepts, its
// links get drain to finish, then they are closed. The drain runs in a
// goroutine the proxy owns (Shutdown waits for it).
func (p *Proxy) retire(l *listener, drain time.Duration) {
	l.stopAccepting()
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
	return orphan
}

// forget drops what the detector and the excluded set hold for an
// endpoint no listener routes to any more.
func (p *Proxy) forget(ep *endpoint) {
	p.det.Unregister(ep.addr)
	p.unexclude(ep.addr)
	ep.orphans.stop()
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
