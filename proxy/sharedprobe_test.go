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
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	peer.SetAnswer(func(int64) (time.Duration, bool) { return 0, false }) // stopped: accepts, answers nothing
	_, closedPort, _ := net.SplitHostPort(lptestutil.ClosedAddr(t))
	httpPort, _ := strconv.Atoi(closedPort)

	cfg := policy.DefaultConfig()
	strict := cfg.Defaults
	framed(300*time.Millisecond, 1, func(s *policy.Settings) {
		s.Detector.Probe = policy.ProbeKindHTTP
		s.Detector.HTTP = policy.ProbeHTTP{Port: httpPort, Path: "/health"}
	})(&strict)
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
	c, err := net.Dial("tcp", p.Addr("strict").String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	sendFrame(t, c, "query")
	state := func() (string, string) {
		for _, ep := range p.Endpoints() {
			if ep.Endpoint == peer.Addr() {
				return ep.State, ep.Reason
			}
		}
		return "unknown", ""
	}
	waitFor(t, 3*time.Second, "excluded for unanswered", func() bool { st, _ := state(); return st == "excluded" })
	return p, cfg, state
}
