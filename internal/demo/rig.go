package demo

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// rig is the demo's loopback world: the server, the relay standing in for
// the network, the proxy, the brokers of both paths and their loads, and
// the watch on the endpoint's state. close takes down what was started, in
// the reverse order.
type rig struct {
	srv     *pinotsim.Server // the server running now (a new one after the flap)
	srvAddr string
	rl      *flapRelay
	px      *proxy.Proxy
	links   linkLog

	brokers         []*pinotsim.Broker // direct and proxied, alternating
	direct, proxied []*pinotsim.Load
	loads           []*pinotsim.Load // direct, then proxied
	states          *stateLog
}

// close stops the state watch, cuts what the loads still wait for, closes
// the brokers, the proxy, the relay and the server running at the end.
func (r *rig) close() {
	if r.states != nil {
		r.states.close()
	}
	for _, l := range r.loads {
		l.Stop() // cuts what is still waiting when the run ends early
	}
	for _, b := range r.brokers {
		_ = b.Close()
	}
	if r.px != nil {
		r.px.Close()
	}
	if r.rl != nil {
		r.rl.close()
	}
	if r.srv != nil {
		_ = r.srv.Close()
	}
}

// startServer starts the server and the relay in front of it.
func (r *rig) startServer() error {
	srv, err := pinotsim.NewServer(pinotsim.ServerConfig{})
	if err != nil {
		return fmt.Errorf("start server: %w", err)
	}
	r.srv, r.srvAddr = srv, srv.Addr()
	rl, err := newRelay(r.srvAddr)
	if err != nil {
		return fmt.Errorf("start relay: %w", err)
	}
	r.rl = rl
	return nil
}

// startProxy starts the proxy toward the relay, recording its link ends.
func (r *rig) startProxy(p params) error {
	cfg := proxyConfig(p, r.rl.addr())
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("demo proxy config: %w", err)
	}
	px := proxy.New(cfg, proxy.Options{OnLinkEnd: r.links.record})
	if err := px.Start(); err != nil {
		return fmt.Errorf("start proxy: %w", err)
	}
	r.px = px
	return nil
}

// proxyConfig is the demo proxy's configuration: one listener toward
// upstream, length-field framing, the time rule and a quick probe.
func proxyConfig(p params, upstream string) policy.Config {
	cfg := policy.DefaultConfig()
	cfg.Admin.Listen = ""
	s := cfg.Defaults
	s.Framing = policy.Framing{Type: policy.FramingLengthField, LengthFieldLength: 4, ByteOrder: policy.ByteOrderBig, MaxFrameLength: 16 * policy.MiB}
	s.Unanswered = policy.Unanswered{Track: policy.TrackOn, RequestTimeout: policy.Duration(p.requestTimeout), ConsecutiveTimeoutsThreshold: p.threshold}
	s.Detector.InitialDelay = policy.Duration(p.initialDelay)
	s.Detector.ProbeTimeout = policy.Duration(300 * time.Millisecond)
	s.Detector.MaxDelay = policy.Duration(2 * time.Second)
	s.Detector.Jitter = 0
	cfg.Defaults = s
	cfg.Listeners = []policy.Listener{{Name: listener, Listen: "127.0.0.1:0", Upstream: upstream, Settings: s}}
	return cfg
}

// addBrokers makes a direct and a proxied broker per connection.
func (r *rig) addBrokers(p params) {
	for i := range p.conns {
		db := pinotsim.NewBroker(pinotsim.BrokerConfig{ID: fmt.Sprintf("Broker_direct_%d", i), Timeout: p.queryTimeout})
		pb := pinotsim.NewBroker(pinotsim.BrokerConfig{ID: fmt.Sprintf("Broker_proxied_%d", i), Timeout: p.queryTimeout})
		r.brokers = append(r.brokers, db, pb)
	}
}

// startLoads starts each broker's query load: the direct ones toward the
// relay, the proxied ones toward the proxy.
func (r *rig) startLoads(p params) {
	proxyAddr := r.px.Addr(listener).String()
	perConn := int((p.warmup + p.observe) / p.queryEvery)
	for i := 0; i < len(r.brokers); i += 2 {
		r.direct = append(r.direct, pinotsim.StartLoad(r.brokers[i], r.rl.addr(), p.queryEvery, perConn, time.Duration(perConn+1)*p.queryEvery))
		r.proxied = append(r.proxied, pinotsim.StartLoad(r.brokers[i+1], proxyAddr, p.queryEvery, perConn, time.Duration(perConn+1)*p.queryEvery))
	}
	r.loads = append(append([]*pinotsim.Load(nil), r.direct...), r.proxied...)
}

// flap stalls every connection open through the relay (no FIN, no reset),
// closes the server and starts a new one on its address; it returns when.
func (r *rig) flap(out *printer) (time.Time, error) {
	flapAt := time.Now()
	n := r.rl.stall()
	_ = r.srv.Close()
	restarted, err := pinotsim.NewServer(pinotsim.ServerConfig{Addr: r.srvAddr})
	if err != nil {
		return flapAt, fmt.Errorf("restart server on %s: %w", r.srvAddr, err)
	}
	r.srv = restarted
	out.line(flapAt, "flap: the network drops the %d open connections (no FIN, no reset); the server dies, a new one starts on %s", n, r.srvAddr)
	return flapAt, nil
}

// watcher prints each event after flapAt as it happens (within a poll),
// not at the end.
func (r *rig) watcher(flapAt time.Time, out *printer) *watcher {
	return &watcher{flapAt: flapAt, out: out, proxied: r.proxied,
		ends:   r.links.snapshot,
		states: func() []stateChange { return r.states.since(flapAt) },
	}
}

// measure ends the observation: the loads stop sending and the queries in
// flight end (at the latest at the broker's timeout); then it takes the
// numbers of both paths, the link ends and the state changes since the
// flap.
func (r *rig) measure(p params, flapAt time.Time, sinceStart time.Duration) *result {
	obsEnd := time.Now()
	res := &result{FlapAt: sinceStart}
	pinotsim.FinishAll(r.loads, p.queryTimeout+time.Second)
	openAtEnd := 0
	for i := 0; i < len(r.brokers); i += 2 {
		if r.brokers[i].Connected(r.rl.addr()) {
			openAtEnd++
		}
	}
	r.states.close()
	res.Direct = measure(r.direct, flapAt)
	res.Direct.OpenAtEnd = openAtEnd
	res.Proxied = measure(r.proxied, flapAt)
	res.LinkEnds = r.links.between(flapAt, obsEnd)
	res.States = r.states.since(flapAt)
	return res
}

// shutdown is the orderly teardown: brokers first, so that the proxy's
// links end cleanly, then the proxy within a second.
func (r *rig) shutdown() {
	for _, b := range r.brokers {
		_ = b.Close()
	}
	sctx, cancel := context.WithTimeout(context.Background(), time.Second)
	_ = r.px.Shutdown(sctx)
	cancel()
}

// linkLog records each link end the proxy reports, and when.
type linkLog struct {
	mu    sync.Mutex
	ends  []proxy.LinkStats
	endAt []time.Time
}

func (l *linkLog) record(ls proxy.LinkStats) {
	l.mu.Lock()
	l.ends = append(l.ends, ls)
	l.endAt = append(l.endAt, time.Now())
	l.mu.Unlock()
}

// snapshot is the links ended so far, and when.
func (l *linkLog) snapshot() ([]proxy.LinkStats, []time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.ends), slices.Clone(l.endAt)
}

// between is the links that ended after from and before to, with At
// relative to from.
func (l *linkLog) between(from, to time.Time) []linkEnd {
	l.mu.Lock()
	defer l.mu.Unlock()
	var es []linkEnd
	for i, e := range l.ends {
		if l.endAt[i].After(from) && l.endAt[i].Before(to) {
			es = append(es, linkEnd{At: l.endAt[i].Sub(from), Stats: e})
		}
	}
	return es
}

// stateLog watches the endpoint's state as the proxy reports it, every
// 5 ms, until close.
type stateLog struct {
	mu   sync.Mutex
	seen []seenState
	stop context.CancelFunc
	wg   sync.WaitGroup
}

type seenState struct {
	at            time.Time
	state, reason string
}

// watchStates starts the watch on the proxy's endpoint state.
func (r *rig) watchStates(ctx context.Context) {
	ctx, stop := context.WithCancel(ctx)
	sl := &stateLog{stop: stop}
	sl.wg.Add(1)
	go sl.poll(ctx, r.px)
	r.states = sl
}

// poll records each change of an endpoint's Since until ctx ends.
func (sl *stateLog) poll(ctx context.Context, px *proxy.Proxy) {
	defer sl.wg.Done()
	var since time.Time
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		for _, st := range px.Endpoints() {
			if !st.Since.Equal(since) {
				since = st.Since
				sl.mu.Lock()
				sl.seen = append(sl.seen, seenState{st.Since, st.State, st.Reason})
				sl.mu.Unlock()
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// close stops the watch and waits for it. It may be called again.
func (sl *stateLog) close() {
	sl.stop()
	sl.wg.Wait()
}

// since is the state changes after from, with At relative to it.
func (sl *stateLog) since(from time.Time) []stateChange {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	var cs []stateChange
	for _, c := range sl.seen {
		if c.at.After(from) {
			cs = append(cs, stateChange{At: c.at.Sub(from), State: c.state, Reason: c.reason})
		}
	}
	return cs
}
