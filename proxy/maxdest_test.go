package proxy

import (
	"testing"

	"github.com/livenessproxy/livenessproxy/policy"
)

// transparent.max_destinations is the most destinations the listener
// tracks, those the proxy already knows from another listener (a pool
// member) too; a destination it tracks is still served at the cap.
// Before, a known one was taken on past the cap and counted (found by a
// helper's audit).
func TestMaxDestinationsHoldsForKnownEndpoints(t *testing.T) {
	cfg := policy.DefaultConfig()
	members := []string{"10.9.0.11:8098", "10.9.0.12:8098", "10.9.0.13:8098"}
	cfg.Listeners = []policy.Listener{
		{Name: "pool", Listen: "127.0.0.1:0", Settings: cfg.Defaults,
			Pool: policy.Pool{Endpoints: members, Refresh: policy.Duration(5e9), Balance: policy.BalanceRoundRobin}},
		{Name: "out", Listen: "127.0.0.1:0", Settings: cfg.Defaults,
			Transparent: policy.Transparent{Match: []policy.Match{{CIDR: "10.9.0.0/16"}}, MaxDestinations: 1, ForgetExcludedAfter: policy.Duration(6e11)}},
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg, Options{})
	var l *listener
	for _, x := range p.listeners {
		if x.cfg.Name == "out" {
			l = x
		}
	}
	if p.transparentEndpoint("10.9.0.1:8098", l) == nil {
		t.Fatal("the first destination was refused")
	}
	admitted := 0
	for _, a := range members {
		if p.transparentEndpoint(a, l) != nil {
			admitted++
		}
	}
	p.mu.Lock()
	n := l.destinations
	p.mu.Unlock()
	if admitted > 0 || n > 1 {
		t.Errorf("max_destinations 1: %d more destinations admitted past the cap (those the pool listener knew), the listener tracks %d", admitted, n)
	}
	if p.transparentEndpoint("10.9.0.1:8098", l) == nil {
		t.Fatal("the destination the listener tracks was refused at the cap")
	}
}
