package proxy

import (
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/policy"
)

// A reload that changes a transparent listener's match list binds it anew
// and retires the old one; when the old one's drain ends, every
// destination only it had seen is forgotten. The operator's disable and
// drain, and the detector's exclusion, outlive that (README: "Endpoints
// disabled through the admin API, or excluded by the detector, stay as
// they are"): the next connection to each is refused. Before, each
// started afresh, healthy, and was proxied (found by a helper's audit).
func TestReloadedTransparentListenerKeepsOperatorState(t *testing.T) {
	cfgWith := func(match ...policy.Match) policy.Config {
		cfg := policy.DefaultConfig()
		cfg.Listeners = []policy.Listener{{Name: "out", Listen: "127.0.0.1:0", Settings: cfg.Defaults,
			Transparent: policy.Transparent{Match: match, MaxDestinations: 4096, ForgetExcludedAfter: policy.Duration(10 * time.Minute)}}}
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	a := policy.Match{CIDR: "10.9.0.0/16"}
	p := startProxy(t, cfgWith(a), Options{})
	const disabled, drained, excluded = "10.9.0.1:8098", "10.9.0.2:8098", "10.9.0.3:8098"
	for _, d := range []string{disabled, drained, excluded} {
		p.transparentEndpoint(d, p.listeners[0]) // a client connected to it once
	}
	if ok, err := p.Disable(disabled); !ok || err != nil {
		t.Fatalf("premise: disable %v %v", ok, err)
	}
	if ok, _, err := p.Drain(drained); !ok || err != nil {
		t.Fatalf("premise: drain %v %v", ok, err)
	}
	if !p.det.Report(excluded, string(CloseDialError)) {
		t.Fatal("premise: exclusion")
	}

	// The operator adds a CIDR to the match list: the listener is bound anew.
	next := cfgWith(a, policy.Match{CIDR: "10.8.0.0/16"})
	if err := p.Reload(next); err != nil {
		t.Fatal(err)
	}
	// The old listener had no links: its drain ends at once, and its
	// destinations are forgotten.
	waitFor(t, 3*time.Second, "the old listener's destinations forgotten", func() bool {
		return p.lookupEndpoint(disabled) == nil && p.lookupEndpoint(drained) == nil && p.lookupEndpoint(excluded) == nil
	})

	l := p.listeners[0]
	for _, c := range []struct {
		addr, want string
	}{{disabled, "disabled"}, {drained, "draining"}, {excluded, "excluded"}} {
		ep := p.transparentEndpoint(c.addr, l) // a client connects to it again
		st, _ := p.det.State(ep.addr)
		refused := l.refusing(ep)
		if !refused {
			t.Errorf("%s, %s before the reload, is %v and routable after a reload that changed only the match list: its operator/detector state was forgotten with the old listener",
				c.addr, c.want, st)
		}
		if c.addr == disabled && st != health.Disabled {
			t.Errorf("%s: state %v after the reload, want disabled (the operator's disable)", c.addr, st)
		}
	}
}
