//go:build linux

package e2e

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/livenessproxy/livenessproxy/internal/intercept"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// A reload that sets on_excluded: allow on a kept transparent listener
// takes its excluded destinations out of the kernel's excluded set at
// once: their connects reach the proxy again (which lets them through, as
// the setting says). Before, the set kept them until each destination's
// next change of state, and the kernel refused every connect to them
// meanwhile, against the new settings (found by a helper's audit).
func TestRetunedTransparentListenerResyncsTheExcludedSet(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	peer := netns.NewNS(t)
	netns.Veth(t, peer, "10.236.0.1/24", "10.236.0.2/24")
	live := echoIn(t, peer, "10.236.0.2:9000")
	waitReachable(t, live)
	dead := "10.236.0.2:9003" // the peer's kernel refuses it: dial_error

	cfgWith := func(onExcluded string) policy.Config {
		cfg := policy.DefaultConfig()
		s := cfg.Defaults
		s.UpstreamMark = 0x97
		s.OnExcluded = onExcluded
		s.Detector.InitialDelay = policy.Duration(time.Hour) // no probe readmits it in this test
		s.Detector.MaxDelay = policy.Duration(time.Hour)
		cfg.Listeners = []policy.Listener{{Name: "out", Listen: "127.0.0.1:15011", Settings: s,
			Transparent: policy.Transparent{Match: []policy.Match{{CIDR: "10.236.0.0/24"}}}}}
		cfg.Interception.ExcludedSet = true
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	rs, err := intercept.Build(intercept.Config{
		ProxyPort:   15011,
		CIDRs:       []netip.Prefix{netip.MustParsePrefix("10.236.0.0/24")},
		Ports:       []uint16{9000, 9003},
		ProxyUID:    intercept.NoUID,
		ProxyMark:   0x97,
		ExcludedSet: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.Apply(); err != nil {
		t.Fatalf("applying the interception rules: %v", err)
	}
	reg := prometheus.NewRegistry()
	p := proxy.New(cfgWith(policy.OnExcludedRefuse), proxy.Options{Registerer: reg})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })

	// reached counts the connects that completed: each is a link the
	// proxy counts in links_total, once it runs its accept, which may be
	// after the client's connect has returned (the kernel completed the
	// handshake).
	reached := 0.0
	// The first connect reaches the proxy, whose dial is refused: the
	// destination is excluded and goes into the kernel's set.
	if c, err := net.Dial("tcp", dead); err == nil {
		reached++
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, _ = c.Read(make([]byte, 1))
		_ = c.Close()
	}
	refusedByKernel := func() bool {
		c, err := net.DialTimeout("tcp", dead, 2*time.Second)
		if err == nil {
			reached++
			_ = c.Close()
		}
		return errors.Is(err, syscall.ECONNREFUSED)
	}
	// awaitLinks waits until the proxy has counted want links.
	awaitLinks := func(want float64, what string) {
		t.Helper()
		got := 0.0
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if got = counterValue(t, reg, "links_total", "listener", "out"); got >= want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s (links_total %v 5 s on, want %v)", what, got, want)
			}
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for !refusedByKernel() {
		if time.Now().After(deadline) {
			t.Fatal("premise: the excluded destination never entered the kernel's set")
		}
		time.Sleep(50 * time.Millisecond)
	}

	if err := p.Reload(cfgWith(policy.OnExcludedAllow)); err != nil {
		t.Fatal(err)
	}
	awaitLinks(reached, "the connects before the reload were not all counted")
	before := reached
	if refusedByKernel() {
		t.Fatal("after the reload to on_excluded: allow, the kernel's set still refuses the excluded destination")
	}
	awaitLinks(before+1, "the connect did not reach the proxy")
	// The twin: the live destination was never in the set.
	c, err := net.Dial("tcp", live)
	if err != nil {
		t.Fatalf("connect to the live destination: %v", err)
	}
	echoTransfer(t, c, 1024)
	_ = c.Close()
}
