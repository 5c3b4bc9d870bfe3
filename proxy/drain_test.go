//go:build linux

package proxy

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// A drained pool member takes no new link, not even as a retry, while its
// open link keeps working (nothing is evicted); enable puts it back in the
// rotation, still without touching that link.
func TestDrainPoolMember(t *testing.T) {
	peers, addrs := peersOn(t, faultpeer.Echo, "127.0.0.2", "127.0.0.3")
	h := startPool(t, policy.Pool{Endpoints: addrs}, nil, nil)
	held := h.dial()
	roundTrip(t, held, []byte("first")) // round-robin: the first member
	if got := acceptedBy(peers); got[0] != 1 {
		t.Fatalf("accepts %v, want the first link on %s", got, addrs[0])
	}

	changed, links, err := h.p.Drain(addrs[0])
	if err != nil || !changed || links != 1 {
		t.Fatalf("Drain = %v, %d, %v; want changed, 1 link kept", changed, links, err)
	}
	if again, _, _ := h.p.Drain(addrs[0]); again {
		t.Error("a second Drain reported a change")
	}
	for i := range 4 {
		roundTrip(t, h.dial(), []byte{byte(i)})
	}
	if got := acceptedBy(peers); got[0] != 1 || got[1] != 4 {
		t.Fatalf("accepts %v after the drain, want every new link on %s (1, 4)", got, addrs[1])
	}
	roundTrip(t, held, []byte("still served"))
	st := h.endpointAt(addrs[0])
	if !st.Draining || st.State != "healthy" || st.LiveLinks != 1 {
		t.Fatalf("drained member %+v: want draining, healthy, its link live", st)
	}
	for _, r := range []string{metrics.EvictOperator, metrics.EvictDisabled, metrics.EvictExcluded} {
		if n := testutil.ToFloat64(h.m.ForListener("test").Evictions(r)); n != 0 {
			t.Errorf("evictions_total{reason=%s} = %v after a drain, want 0", r, n)
		}
	}

	if changed, err := h.p.Enable(addrs[0]); err != nil || !changed {
		t.Fatalf("Enable after a drain = %v, %v; want changed", changed, err)
	}
	for i := range 2 {
		roundTrip(t, h.dial(), []byte{byte(i)})
	}
	if got := acceptedBy(peers); got[0] != 2 {
		t.Fatalf("accepts %v after enable, want the member back in the rotation", got)
	}
	roundTrip(t, held, []byte("kept across enable"))
	if h.endpointAt(addrs[0]).Draining {
		t.Error("still draining after enable")
	}
}

// Draining a listener's only upstream stops the listener accepting (a
// connect is refused, as for a disabled endpoint) while its open link
// finishes; enable listens again.
func TestDrainOnlyUpstream(t *testing.T) {
	_, h, c := startEcho(t, nil, "hello")
	up := h.p.Endpoints()[0].Endpoint
	if changed, links, err := h.p.Drain(up); err != nil || !changed || links != 1 {
		t.Fatalf("Drain = %v, %d, %v", changed, links, err)
	}
	expectRefusedSoon(t, h.addr)
	roundTrip(t, c, []byte("the open link finishes its work"))
	if _, _, err := h.p.Drain("10.9.9.9:1"); err != ErrUnknownEndpoint {
		t.Errorf("Drain of an unknown endpoint: %v", err)
	}
	if changed, err := h.p.Enable(up); err != nil || !changed {
		t.Fatalf("Enable = %v, %v", changed, err)
	}
	roundTrip(t, h.dialWhenReadmitted(5*time.Second), []byte("back"))
	roundTrip(t, c, []byte("and the old one too"))
}

// endpointAt returns one endpoint's status.
func (h *harness) endpointAt(addr string) EndpointStatus {
	h.t.Helper()
	for _, st := range h.p.Endpoints() {
		if st.Endpoint == addr {
			return st
		}
	}
	h.t.Fatalf("no endpoint %s", addr)
	return EndpointStatus{}
}
