package proxy

import (
	"testing"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/policy"
)

// An IP endpoint is one endpoint however it is spelled: endpoints.disabled
// and the operator API name it in any spelling of its address (all zeros
// written out, upper-case hex, an IPv4-mapped IPv6 address for an IPv4
// one). Before, the proxy keyed endpoints by the string as written:
// endpoints.disabled ['[0:0:0:0:0:0:0:1]:9'] validated and left [::1]:9
// healthy and routed to, and the API answered 404 for [0::1]:9 (found by
// a helper's audit).
func TestEndpointInAnotherSpellingIsTheSameEndpoint(t *testing.T) {
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{
		listenerCfg("v6", "[::1]:9", nil),
		listenerCfg("v4", "[::ffff:127.0.0.1]:9", nil),
		listenerCfg("api", "[::1]:10", nil),
	}
	cfg.Endpoints.Disabled = []string{"[0:0:0:0:0:0:0:1]:9", "127.0.0.1:9"}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg, Options{})
	for _, addr := range []string{"[::1]:9", "127.0.0.1:9"} {
		if st, ok := p.det.State(addr); st != health.Disabled {
			t.Errorf("%s is %v (known %v) with endpoints.disabled %q, the same address: want disabled", addr, st, ok, cfg.Endpoints.Disabled)
		}
	}
	if eps := p.Endpoints(); len(eps) != 3 {
		t.Errorf("the proxy has %d endpoints, want 3 ([::1]:9, 127.0.0.1:9, [::1]:10): %+v", len(eps), eps)
	}
	if changed, _, err := p.Drain("[0:0::1]:010"); err != nil || !changed || !p.isDrained("[::1]:10") {
		t.Errorf("Drain([0:0::1]:010) = %v, %v; [::1]:10 draining %v: want it drained", changed, err, p.isDrained("[::1]:10"))
	}
	if changed, err := p.Disable("[0000::0001]:10"); err != nil || !changed {
		t.Errorf("Disable([0000::0001]:10) = %v, %v: want [::1]:10 disabled", changed, err)
	}
	if st, _ := p.det.State("[::1]:10"); st != health.Disabled {
		t.Errorf("[::1]:10 is %v after the API disabled it as [0000::0001]:10, want disabled", st)
	}
}

// Its twin: a name is kept as written, and names every address it
// resolved to, in endpoints.disabled and the API alike.
func TestNamedEndpointIsKeyedByItsName(t *testing.T) {
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{listenerCfg("a", "localhost:09", nil), listenerCfg("b", "localhost:10", nil)}
	cfg.Endpoints.Disabled = []string{"localhost:9"}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg, Options{})
	if st, _ := p.det.State("127.0.0.1:9"); st != health.Disabled {
		t.Errorf("127.0.0.1:9 (localhost:09) is %v with endpoints.disabled [localhost:9], want disabled", st)
	}
	if changed, err := p.Disable("localhost:10"); err != nil || !changed {
		t.Errorf("Disable(localhost:10) = %v, %v: want the addresses of localhost:10 disabled", changed, err)
	}
}
