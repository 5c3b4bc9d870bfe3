package proxy

import (
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	lptestutil "github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
)

// Two listeners route to one endpoint. "strict" proves the process with
// an HTTP probe (here of a closed port: it can never pass, as for a
// stopped Pinot server's /health); "plain" probes with a TCP connect. A
// stopped server (its kernel accepts, nothing answers) that strict's own
// unanswered rule excluded stays out whatever the order of the
// listeners: it is probed as strict asks. Before, the last listener
// registered won, and with strict listed first plain's connect probe
// readmitted it within a second (found by a helper's audit).
func TestSharedEndpointIsProbedAsItsStrictestListenerAsks(t *testing.T) {
	// strictLast: strict's probe was the endpoint's before too.
	for _, strictLast := range []bool{true, false} {
		name := "strict listed first"
		if strictLast {
			name = "strict listed last"
		}
		t.Run(name, func(t *testing.T) { sharedProbe(t, strictLast) })
	}
}

func sharedProbe(t *testing.T, strictLast bool) {
	_, _, state := sharedProbeSetup(t, strictLast)
	// strict's HTTP probe cannot pass; for 3 s (three probes while its
	// clients are refused) the endpoint must stay out.
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if st, reason := state(); st == "healthy" {
			t.Fatalf("endpoint readmitted (%s) while the server still answers nothing and strict's HTTP probe cannot pass: probed with plain's connect probe", reason)
		}
	}
}

// The twin: once a reload removes strict, the endpoint is probed as
// plain asks, and its connect probe readmits the server (whose kernel
// accepts).
func TestSharedEndpointProbedAsTheListenersLeftAsk(t *testing.T) {
	p, cfg, state := sharedProbeSetup(t, false)
	cfg.Listeners = cfg.Listeners[1:] // plain, at its address
	cfg.Listeners[0].Listen = p.Addr("plain").String()
	if _, err := p.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "readmitted by plain's connect probe", func() bool { st, _ := state(); return st == "healthy" })
}

// sharedProbeSetup starts strict and plain on a stopped server (strict
// first unless strictLast), has strict's request exclude it, and returns
// the proxy, its config and the endpoint's state.
func sharedProbeSetup(t *testing.T, strictLast bool) (*Proxy, policy.Config, func() (string, string)) {
	peer, cfg, strict := stoppedBehindAnHTTPProbe(t)
	plain := cfg.Defaults
	plain.Detector.Probe = policy.ProbeKindConnect
	cfg.Listeners = []policy.Listener{
		{Name: "strict", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: strict},
		{Name: "plain", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: plain},
	}
	if strictLast {
		cfg.Listeners[0], cfg.Listeners[1] = cfg.Listeners[1], cfg.Listeners[0]
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg, Options{metrics: metrics.New(), Logger: testLogger()})
	state := queryUntilExcluded(t, p, "strict", peer.Addr())
	return p, cfg, state
}

// endpointState reports addr's state and reason in p.
func endpointState(p *Proxy, addr string) func() (string, string) {
	return func() (string, string) {
		for _, ep := range p.Endpoints() {
			if ep.Endpoint == addr {
				return ep.State, ep.Reason
			}
		}
		return "unknown", ""
	}
}

// queryUntilExcluded sends a frame through listener name, which a stopped
// server at addr never answers, and waits until its rule excludes addr.
func queryUntilExcluded(t *testing.T, p *Proxy, name, addr string) func() (string, string) {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr(name).String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	sendFrame(t, c, "query")
	state := endpointState(p, addr)
	waitFor(t, 3*time.Second, "excluded for unanswered", func() bool { st, _ := state(); return st == "excluded" })
	return state
}

// Two listeners, "a" then "b", route to one stopped server and both
// probe it over HTTP (a closed port: it can never pass). A reload that
// changes only a's probe to a connect leaves b asking for the HTTP
// probe: the endpoint is probed as "the first listener asking for the
// strongest", b's HTTP probe, in either order of the listeners (found by
// a review: a listener's own weaker settings replaced the probe).
func TestOwnDowngradeKeepsOthersStrongerProbe(t *testing.T) {
	for _, aFirst := range []bool{true, false} {
		name := "a listed first"
		if !aFirst {
			name = "b listed first"
		}
		t.Run(name, func(t *testing.T) { ownDowngrade(t, aFirst) })
	}
}

func ownDowngrade(t *testing.T, aFirst bool) {
	peer, cfg, strict := stoppedBehindAnHTTPProbe(t)
	cfg.Listeners = []policy.Listener{
		{Name: "a", Listen: lptestutil.ClosedAddr(t), Upstream: peer.Addr(), Settings: strict},
		{Name: "b", Listen: lptestutil.ClosedAddr(t), Upstream: peer.Addr(), Settings: strict},
	}
	if !aFirst {
		cfg.Listeners[0], cfg.Listeners[1] = cfg.Listeners[1], cfg.Listeners[0]
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg, Options{metrics: metrics.New(), Logger: testLogger()})
	state := queryUntilExcluded(t, p, "a", peer.Addr())

	// Reload: a now asks for a connect probe; b still for HTTP.
	downgradeA(t, p, cfg)
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if st, reason := state(); st == "healthy" {
			t.Fatalf("endpoint readmitted (%s) while b still asks for an HTTP probe that cannot pass: a's reload to a connect probe replaced b's stronger one", reason)
		}
	}
}

// The same with the stronger listener one a reload does not retune: "a"
// (an explicit listener, listed first, HTTP) and "t" (a transparent
// listener whose client reached the same server, HTTP) share the
// endpoint, whose probe is a's. A reload that changes only a's probe to
// a connect leaves t, not retuned, asking for HTTP: the endpoint stays
// out. Before (found by a review), a's connect was taken and the stopped
// server readmitted.
func TestOwnDowngradeBesideAnUnretunedTransparentListener(t *testing.T) {
	peer, cfg, strict := stoppedBehindAnHTTPProbe(t)
	cfg.Listeners = []policy.Listener{
		{Name: "a", Listen: lptestutil.ClosedAddr(t), Upstream: peer.Addr(), Settings: strict},
		{Name: "t", Listen: lptestutil.ClosedAddr(t), Settings: strict,
			Transparent: policy.Transparent{Match: []policy.Match{{CIDR: "127.0.0.0/8"}}, MaxDestinations: 16, ForgetExcludedAfter: policy.Duration(10 * time.Minute)}},
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg, Options{metrics: metrics.New(), Logger: testLogger()})
	var tl *listener
	for _, l := range p.listeners {
		if l.cfg.Name == "t" {
			tl = l
		}
	}
	p.transparentEndpoint(peer.Addr(), tl) // a client of t reached the server
	state := queryUntilExcluded(t, p, "a", peer.Addr())

	downgradeA(t, p, cfg)
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if st, reason := state(); st == "healthy" {
			pc := p.endpoints[peer.Addr()].probeConfig()
			t.Fatalf("endpoint readmitted (%s), probed as %q, while t still asks for an HTTP probe that cannot pass: a's own downgrade replaced t's stronger probe", reason, pc.Kind)
		}
	}
}

// A reload that binds listener "a" anew (its listen address changed)
// and, in the same edit, corrects its probe (an HTTP probe of a port
// that never answers, to a connect) retires the old "a", which drains
// while a client's link is open. The endpoint is probed as the new "a"
// asks at once: a retired listener no longer chooses the probe. Before
// (found by a review), the old one's settings held while it drained, up
// to drain_timeout, and the endpoint stayed excluded.
func TestReboundListenerTakesItsNewProbeAtOnce(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	_, closedPort, _ := net.SplitHostPort(lptestutil.ClosedAddr(t))
	httpPort, _ := strconv.Atoi(closedPort)

	cfg := policy.DefaultConfig()
	cfg.DrainTimeout = policy.Duration(time.Minute)
	s := cfg.Defaults
	s.Detector.Probe = policy.ProbeKindHTTP
	s.Detector.HTTP = policy.ProbeHTTP{Port: httpPort, Path: "/health"} // never answers
	s.Detector.InitialDelay = policy.Duration(200 * time.Millisecond)
	s.Detector.MaxDelay = policy.Duration(time.Second)
	cfg.Listeners = []policy.Listener{{Name: "a", Listen: lptestutil.ClosedAddr(t), Upstream: peer.Addr(), Settings: s}}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg, Options{metrics: metrics.New(), Logger: testLogger()})
	c, err := net.Dial("tcp", p.Addr("a").String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	roundTrip(t, c.(*net.TCPConn), []byte("hello"))         // a link of the old "a", kept open
	if !p.det.Report(peer.Addr(), string(CloseDialError)) { // an exclusion that keeps links
		t.Fatal("premise: exclusion")
	}

	cfg.Listeners[0].Listen = lptestutil.ClosedAddr(t)
	cfg.Listeners[0].Settings.Detector.Probe = policy.ProbeKindConnect
	ch, err := p.Apply(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(ch.ListenersAdded) != 1 {
		t.Fatalf("premise: a rebound: %+v", ch)
	}
	state := func() string {
		for _, ep := range p.Endpoints() {
			if ep.Endpoint == peer.Addr() {
				return ep.State
			}
		}
		return "unknown"
	}
	deadline := time.Now().Add(5 * time.Second)
	for state() != "healthy" {
		if time.Now().After(deadline) {
			p.mu.Lock()
			pc := p.endpoints[peer.Addr()].probeConfig()
			p.mu.Unlock()
			t.Fatalf("endpoint still %s 5s after a reload whose only probe is a connect (the server accepts): probed as %q with HTTP port %d, the replaced listener's settings, while it drains", state(), pc.Kind, pc.HTTPPort)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A listener ranks by the probe the endpoint would run for it: an auto
// probe under the kafka profile is a connect once the endpoint's clients
// speak TLS. "k" (kafka, auto, listed first) does not outrank "h" (an
// HTTP probe): the stopped server stays out. Before (found by a review),
// k kept the endpoint and its connect readmitted the server.
func TestTLSKafkaListenerDoesNotOutrankHTTP(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	peer.SetAnswer(func(int64) (time.Duration, bool) { return 0, false }) // stopped
	_, closedPort, _ := net.SplitHostPort(lptestutil.ClosedAddr(t))
	httpPort, _ := strconv.Atoi(closedPort)

	cfg := policy.DefaultConfig()
	k := cfg.Defaults
	k.Framing.Type = policy.FramingKafka // probe auto: kafka
	k.Detector.InitialDelay = policy.Duration(200 * time.Millisecond)
	h := cfg.Defaults
	h.Detector.Probe = policy.ProbeKindHTTP
	h.Detector.HTTP = policy.ProbeHTTP{Port: httpPort, Path: "/health"}
	h.Detector.InitialDelay = policy.Duration(200 * time.Millisecond)
	cfg.Listeners = []policy.Listener{
		{Name: "k", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: k},
		{Name: "h", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: h},
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg, Options{metrics: metrics.New(), Logger: testLogger()})
	p.mu.Lock()
	ep := p.endpoints[peer.Addr()]
	p.mu.Unlock()
	p.sawTLS(ep) // k's clients speak TLS
	if !p.det.Report(ep.addr, string(CloseUnanswered)) {
		t.Fatal("premise: exclusion")
	}
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if st, _ := p.det.State(ep.addr); st.String() == "healthy" {
			t.Fatalf("endpoint readmitted, probed as %q, while h asks for an HTTP probe that cannot pass: k's kafka probe (a connect under TLS) outranked it", ep.probeConfig().Kind)
		}
	}
}

// stoppedBehindAnHTTPProbe is a stopped server (it accepts, answers
// nothing) and settings that judge it by length framing and probe it over
// HTTP on a closed port (a probe that can never pass).
func stoppedBehindAnHTTPProbe(t *testing.T) (*faultpeer.Server, policy.Config, policy.Settings) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	peer.SetAnswer(func(int64) (time.Duration, bool) { return 0, false }) // stopped
	_, closedPort, _ := net.SplitHostPort(lptestutil.ClosedAddr(t))
	httpPort, _ := strconv.Atoi(closedPort)
	cfg := policy.DefaultConfig()
	strict := cfg.Defaults
	framed(300*time.Millisecond, 1, func(s *policy.Settings) {
		s.Detector.Probe = policy.ProbeKindHTTP
		s.Detector.HTTP = policy.ProbeHTTP{Port: httpPort, Path: "/health"}
	})(&strict)
	return peer, cfg, strict
}

// downgradeA reloads cfg with listener a's probe a connect, its listeners
// kept.
func downgradeA(t *testing.T, p *Proxy, cfg policy.Config) {
	t.Helper()
	for i := range cfg.Listeners {
		if cfg.Listeners[i].Name == "a" {
			cfg.Listeners[i].Settings.Detector.Probe = policy.ProbeKindConnect
		}
	}
	ch, err := p.Apply(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(ch.ListenersAdded) != 0 {
		t.Fatalf("premise: the reload rebound listeners: %+v", ch)
	}
}
