//go:build linux

package proxy

import (
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/intercept"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
)

// A transparent destination forgotten (the idle sweep, a reload, DNS
// churn) while a change of its state is being applied to the kernel's
// excluded set must not stay in the set: no endpoint is left to take it
// out, and the kernel would refuse every connect to it until the proxy
// stops. Here the exclusion's update has decided to add the destination
// (held there by testHookExcludedDecided) when the sweep forgets it.
// Before, the update added it after the forgetting had taken it out, and
// it stayed. The twin: an excluded destination that is not forgotten goes
// into the set.
func TestForgottenDestinationLeavesTheExcludedSet(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	peer := netns.NewNS(t)
	netns.Veth(t, peer, "10.238.0.1/24", "10.238.0.2/24")
	dsts := []string{"10.238.0.2:9000", "10.238.0.2:9001"} // forgotten, kept
	var stops []func()
	for _, d := range dsts {
		ln, err := peer.Listen("tcp", d)
		if err != nil {
			t.Fatal(err)
		}
		stops = append(stops, netns.ServeEcho(t, ln))
		waitFor(t, 5*time.Second, d+" reachable over the veth", func() bool {
			c, err := net.DialTimeout("tcp", d, time.Second)
			if err == nil {
				_ = c.Close()
			}
			return err == nil
		})
	}
	rs, err := intercept.Build(intercept.Config{
		ProxyPort:   15038,
		CIDRs:       []netip.Prefix{netip.MustParsePrefix("10.238.0.0/24")},
		Ports:       []uint16{9000, 9001},
		ProxyUID:    intercept.NoUID,
		ProxyMark:   0x38,
		ExcludedSet: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.Apply(); err != nil {
		t.Fatalf("applying the interception rules: %v", err)
	}
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	s.UpstreamMark = 0x38
	s.Detector.InitialDelay = policy.Duration(time.Hour) // no probe readmits anything here
	s.Detector.MaxDelay = policy.Duration(time.Hour)
	cfg.Listeners = []policy.Listener{{Name: "out", Listen: "127.0.0.1:15038", Settings: s,
		Transparent: policy.Transparent{Match: []policy.Match{{CIDR: "10.238.0.0/24"}},
			ForgetExcludedAfter: policy.Duration(time.Millisecond)}}}
	cfg.Interception.ExcludedSet = true
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := New(cfg, Options{metrics: metrics.New()})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	if p.excludedSet == nil {
		t.Fatal("premise: the kernel's excluded set did not open")
	}
	for _, d := range dsts { // each known to the proxy, its link ended
		c, err := net.Dial("tcp", d)
		if err != nil {
			t.Fatal(err)
		}
		roundTrip(t, c, []byte("through the proxy"))
		_ = c.Close()
	}
	for _, stop := range stops { // the servers close their ends: the links end
		stop()
	}
	waitFor(t, 5*time.Second, "both links ended", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		n := 0
		for _, d := range dsts {
			if ep := p.endpoints[d]; ep != nil && ep.liveLinks() == 0 {
				n++
			}
		}
		return n == len(dsts)
	})

	reached, release := make(chan struct{}), make(chan struct{})
	hook := func(addr string, refuse bool) {
		if addr == dsts[0] && refuse {
			close(reached)
			<-release
		}
	}
	testHookExcludedDecided.Store(&hook)
	t.Cleanup(func() { testHookExcludedDecided.Store(nil) })

	// The exclusion of the first: its update decides to add it, and waits.
	excluded := make(chan struct{})
	go func() { p.det.Report(dsts[0], string(CloseUnanswered)); close(excluded) }()
	<-reached
	// The sweep forgets it meanwhile (excluded, no links, past
	// forget_excluded_after).
	time.Sleep(2 * time.Millisecond) // past forget_excluded_after, surely
	swept := make(chan int)
	go func() { swept <- p.sweepIdle() }()
	waitFor(t, 5*time.Second, "the detector forgot it", func() bool { _, ok := p.det.State(dsts[0]); return !ok })
	p.mu.Lock() // the forgetting's section under p.mu has ended
	p.mu.Unlock()
	close(release)
	<-excluded
	if n := <-swept; n != 1 {
		t.Fatalf("the sweep forgot %d destinations, want 1", n)
	}
	if !p.det.Report(dsts[1], string(CloseUnanswered)) { // the twin, not forgotten
		t.Fatal("premise: the twin's exclusion")
	}
	held, err := p.excludedSet.Excluded()
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(held, netip.MustParseAddrPort(dsts[0])) {
		t.Fatalf("the kernel's excluded set holds %s, which the proxy forgot: every connect to it is refused until the proxy stops (set %v)", dsts[0], held)
	}
	if !slices.Contains(held, netip.MustParseAddrPort(dsts[1])) {
		t.Fatalf("the excluded destination the proxy still knows is not in the kernel's set %v", held)
	}
}
