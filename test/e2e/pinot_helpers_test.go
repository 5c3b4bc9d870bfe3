//go:build linux

package e2e

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/harness"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
	"github.com/prometheus/client_golang/prometheus"
)

// Helpers shared by the Pinot-shaped end-to-end tests (sigstop, node flap,
// stale backlog): a framed proxy in front of one pinotsim server, a steady
// query load from a pinotsim broker, and recorders for link ends and
// endpoint state changes.

// pinotSettings returns link settings for Pinot's transport (4-byte
// big-endian length prefix) with unanswered tracking and a fast, unjittered
// detector, so that the timings the tests assert are deterministic.
func pinotSettings(requestTimeout time.Duration, threshold int, initialDelay time.Duration) policy.Settings {
	s := policy.DefaultSettings()
	s.Framing = policy.Framing{
		Type:              policy.FramingLengthField,
		LengthFieldLength: 4,
		ByteOrder:         policy.ByteOrderBig,
		MaxFrameLength:    16 * policy.MiB,
	}
	s.Unanswered = policy.Unanswered{
		Track:                        policy.TrackOn,
		RequestTimeout:               policy.Duration(requestTimeout),
		ConsecutiveTimeoutsThreshold: threshold,
	}
	s.Detector.Probe = policy.ProbeKindConnect
	s.Detector.InitialDelay = policy.Duration(initialDelay)
	s.Detector.ProbeTimeout = policy.Duration(300 * time.Millisecond)
	s.Detector.BackoffFactor = 2
	s.Detector.MaxDelay = policy.Duration(2 * time.Second)
	s.Detector.Jitter = 0
	return s
}

// pinotProxy is a started proxy with one explicit listener ("pinot") in
// front of one upstream, recording every link that ends.
type pinotProxy struct {
	p        *proxy.Proxy
	reg      *prometheus.Registry
	addr     string // the listener's address: what the broker dials
	upstream string
	links    harness.LinkEnds
}

// startPinotProxy validates the configuration, starts the proxy and closes
// it in t.Cleanup.
func startPinotProxy(t *testing.T, upstream string, s policy.Settings) *pinotProxy {
	t.Helper()
	cfg := policy.DefaultConfig()
	cfg.Admin.Listen = ""
	cfg.Defaults = s
	cfg.Listeners = []policy.Listener{{Name: "pinot", Listen: "127.0.0.1:0", Upstream: upstream, Settings: s}}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("test configuration is invalid: %v", err)
	}
	return runRecordingProxy(t, cfg, upstream)
}

// runRecordingProxy starts a proxy from cfg, whose one listener is in
// front of upstream, recording every link that ends; t.Cleanup closes it.
func runRecordingProxy(t *testing.T, cfg policy.Config, upstream string) *pinotProxy {
	t.Helper()
	pp := &pinotProxy{reg: prometheus.NewRegistry(), upstream: upstream}
	pp.p = proxy.New(cfg, proxy.Options{Registerer: pp.reg, OnLinkEnd: pp.links.Record})
	if err := pp.p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pp.p.Close() })
	pp.addr = pp.p.Addr(cfg.Listeners[0].Name).String()
	return pp
}

// state returns the upstream endpoint's status.
func (pp *pinotProxy) state() proxy.EndpointStatus {
	for _, st := range pp.p.Endpoints() {
		if st.Endpoint == pp.upstream {
			return st
		}
	}
	return proxy.EndpointStatus{}
}

// counter returns the sum of a counter family's series (prefix
// livenessproxy_ added), optionally restricted to one label value.
func (pp *pinotProxy) counter(t *testing.T, name, label, value string) float64 {
	t.Helper()
	if label == "" {
		return counterValue(t, pp.reg, name)
	}
	return counterValue(t, pp.reg, name, label, value)
}

// counterValue sums the counters livenessproxy_<name> in g whose labels
// include every given pair (name, value, name, value, ...).
func counterValue(t *testing.T, g prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	v, err := harness.Counter(g, name, labels...)
	if err != nil {
		t.Fatalf("gathering metrics: %v", err)
	}
	return v
}

type (
	stateChange  = harness.StateChange
	stateWatcher = harness.StateWatcher
)

// watchEndpoint records every state change of pp's endpoint, polled every
// 5 ms, until the test ends or maxDuration has passed.
func watchEndpoint(t *testing.T, pp *pinotProxy, maxDuration time.Duration) *stateWatcher {
	w := harness.WatchState(func() (proxy.EndpointStatus, error) { return pp.state(), nil }, 5*time.Millisecond, maxDuration)
	t.Cleanup(w.Stop)
	return w
}

// waitState waits up to timeout for the endpoint to be in state.
func (pp *pinotProxy) waitState(state string, timeout time.Duration) bool {
	_, ok := pp.waitStatus(state, timeout)
	return ok
}

// waitStatus waits up to timeout for the endpoint to be in state, and
// returns the status that was.
func (pp *pinotProxy) waitStatus(state string, timeout time.Duration) (proxy.EndpointStatus, bool) {
	deadline := time.Now().Add(timeout)
	for i := 0; i < 10000; i++ {
		if st := pp.state(); st.State == state {
			return st, true
		}
		if time.Now().After(deadline) {
			return proxy.EndpointStatus{}, false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return proxy.EndpointStatus{}, false
}

// waitExcluded waits up to timeout for pp's endpoint to be excluded, and
// returns the first exclusion at or after since: the first w saw, or the
// one seen here if w has none before it; it fails the test if there is
// none. after says what since is, for the message.
//
// w polls on a goroutine of its own, which a loaded machine may run late:
// it may not have seen the exclusion yet, or, if the endpoint flapped back
// before it looked, not at all. Both record the proxy's own time of the
// change (Since).
func waitExcluded(t *testing.T, pp *pinotProxy, w *stateWatcher, since time.Time, timeout time.Duration, after string) stateChange {
	t.Helper()
	st, ok := pp.waitStatus("excluded", timeout)
	if !ok {
		t.Fatalf("endpoint not excluded %v after %s: %+v", timeout, after, pp.state())
	}
	seen := stateChange{At: st.Since, State: st.State, Reason: st.Reason}
	if seen.At.Before(since) {
		t.Fatalf("endpoint excluded at %v, before %s (%v): %+v", seen.At, after, since, st)
	}
	// The watcher saw it, or an earlier one, once it has polled since.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if ex, ok := w.FirstAfter(since, "excluded", 0); ok && !ex.At.After(seen.At) {
			return ex
		}
		if time.Now().After(deadline) {
			return seen
		}
	}
}

// queryRecord and queryLoad are pinotsim's load generator.
type (
	queryRecord = pinotsim.Record
	queryLoad   = pinotsim.Load
)

// startLoad starts a load (at most max queries) that stops with the test.
func startLoad(t *testing.T, b *pinotsim.Broker, addr string, interval time.Duration, max int) *queryLoad {
	l := pinotsim.StartLoad(b, addr, interval, max, time.Duration(max+1)*interval)
	t.Cleanup(l.Stop)
	return l
}

// twoPaths are a broker querying through the proxy and a direct one (the
// control), each with a steady load on its own connection.
type twoPaths struct {
	proxied, direct     *pinotsim.Broker
	viaProxy, viaDirect *queryLoad
}

// startTwoPaths starts the brokers Broker_proxied and Broker_direct (cfg
// otherwise) and their loads, one query every interval and at most max,
// to proxyAddr and directAddr; it waits until each had n queries succeed
// (5 s at most) and fails the test if one did not, naming the fault it
// comes before. t.Cleanup stops the loads and closes the brokers.
func startTwoPaths(t *testing.T, cfg pinotsim.BrokerConfig, proxyAddr, directAddr string, interval time.Duration, max, n int, before string) twoPaths {
	t.Helper()
	var p twoPaths
	cfg.ID = "Broker_proxied"
	p.proxied = pinotsim.NewBroker(cfg)
	t.Cleanup(func() { _ = p.proxied.Close() })
	cfg.ID = "Broker_direct"
	p.direct = pinotsim.NewBroker(cfg)
	t.Cleanup(func() { _ = p.direct.Close() })
	p.viaProxy = startLoad(t, p.proxied, proxyAddr, interval, max)
	p.viaDirect = startLoad(t, p.direct, directAddr, interval, max)
	if !p.viaProxy.WaitOK(time.Time{}, n, 5*time.Second) || !p.viaDirect.WaitOK(time.Time{}, n, 5*time.Second) {
		t.Fatalf("no traffic before %s: proxied %s; direct %s", before,
			fmtOutcomes(outcomes(p.viaProxy.Records(), time.Time{}, time.Now())),
			fmtOutcomes(outcomes(p.viaDirect.Records(), time.Time{}, time.Now())))
	}
	return p
}

// pinotBehindVeth is a pinotsim server on port 9000 of a peer namespace
// joined to this one by a veth pair.
type pinotBehindVeth struct {
	peer *netns.NS
	link *netns.Link
	addr string
	srv  *pinotsim.Server
}

// startPinotBehindVeth builds a peer namespace and a veth pair on
// 10.231.<subnet>.0/24 (.1 here, .2 there), starts a pinotsim server on
// the peer's port 9000 and waits until it is reachable.
func startPinotBehindVeth(t *testing.T, subnet int) pinotBehindVeth {
	t.Helper()
	var v pinotBehindVeth
	v.peer = netns.NewNS(t)
	v.link = netns.Veth(t, v.peer, fmt.Sprintf("10.231.%d.1/24", subnet), fmt.Sprintf("10.231.%d.2/24", subnet))
	v.addr = net.JoinHostPort(v.link.PeerIP().String(), "9000")
	v.srv = startPinotIn(t, v.peer, pinotsim.ServerConfig{Addr: v.addr})
	waitReachable(t, v.addr)
	return v
}

// outcomes counts the outcomes of queries sent in [from, to).
func outcomes(rs []queryRecord, from, to time.Time) map[pinotsim.Outcome]int {
	m := make(map[pinotsim.Outcome]int)
	for _, r := range rs {
		if !r.Sent.Before(from) && r.Sent.Before(to) {
			m[r.Outcome]++
		}
	}
	return m
}

func fmtOutcomes(m map[pinotsim.Outcome]int) string {
	var parts []string
	for _, o := range []pinotsim.Outcome{pinotsim.OK, pinotsim.FailedFast, pinotsim.TimedOut, pinotsim.Canceled} {
		parts = append(parts, fmt.Sprintf("%s=%d", o, m[o]))
	}
	return strings.Join(parts, " ")
}

// firstOKAfter returns the first query sent at or after t0 that succeeded.
var firstOKAfter = pinotsim.FirstOK

// splitHostPortNum returns the port of a host:port.
func splitPort(t *testing.T, addr string) string {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	return port
}

// ms rounds a duration for logs.
func ms(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
