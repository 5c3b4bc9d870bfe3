//go:build linux

package e2e

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/harness"
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
	deadline := time.Now().Add(timeout)
	for i := 0; i < 10000; i++ {
		if pp.state().State == state {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return false
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
