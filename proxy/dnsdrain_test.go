//go:build linux

package proxy

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/dnstest"
	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// dnsPool starts a pool listener on the records of one name (refreshed
// every 100 ms) whose answer is first hosts, and an echo peer on each of
// peerHosts (one port).
func dnsPool(t *testing.T, peerHosts, hosts []string) (*harness, *dnstest.Server, []*faultpeer.Server, []string) {
	t.Helper()
	peers, addrs := peersOn(t, faultpeer.Echo, peerHosts...)
	dns := dnstest.Start(t)
	port := netip.MustParseAddrPort(addrs[0]).Port()
	setRecords(dns, hosts...)
	h := startPool(t, policy.Pool{DNS: fmt.Sprintf("pods.svc:%d", port), Refresh: policy.Duration(100 * time.Millisecond)}, dns.Resolver(), nil)
	return h, dns, peers, addrs
}

func setRecords(dns *dnstest.Server, hosts ...string) {
	var ips []netip.Addr
	for _, h := range hosts {
		ips = append(ips, netip.MustParseAddr(h))
	}
	dns.Set("pods.svc", ips...)
}

// waitMembers waits until the pool's members are exactly want.
func (h *harness) waitMembers(want []string, within time.Duration) {
	h.t.Helper()
	for deadline := time.Now().Add(within); ; time.Sleep(5 * time.Millisecond) {
		got := h.p.Pools()[0].Endpoints
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("pool members %v after %v, want %v", got, within, want)
		}
	}
}

func (h *harness) removedEvictions() float64 {
	return testutil.ToFloat64(h.m.ForListener("test").Evictions(metrics.EvictRemoved))
}

// Finding 5 of issue 20: a member that leaves the pool's DNS (a pod
// Kubernetes is terminating: out of the headless Service's records at the
// start of its grace period, still serving) is drained: no new link goes
// to it, its open link keeps working, and only at drain_timeout (1 s
// here) is it closed and the member forgotten. (On main the link was
// reset within one refresh.)
func TestMemberLeavingDNSDrains(t *testing.T) {
	h, dns, peers, addrs := dnsPool(t, []string{"127.0.0.2", "127.0.0.3"}, []string{"127.0.0.2"})
	const drain = time.Second
	h.p.drain.Store(int64(drain))
	old := h.dial()
	roundTrip(t, old, []byte("to the pod about to terminate"))
	left := time.Now()           // no drain can start before this
	setRecords(dns, "127.0.0.3") // terminating: out of the records, still serving
	h.waitMembers(addrs[1:], 3*time.Second)
	for i := range 5 {
		roundTrip(t, old, fmt.Appendf(nil, "in flight %d", i))
		roundTrip(t, h.dial(), []byte("a new link"))
		time.Sleep(100 * time.Millisecond)
	}
	if got := acceptedBy(peers); got[0] != 1 || got[1] != 5 {
		t.Fatalf("accepts %v, want [1 5]: new links only to the member still in the records", got)
	}
	err, at := waitClosed(t, old, 5*time.Second)
	if !isCloseSignal(err) {
		t.Fatalf("the drained link saw %v, want it closed at drain_timeout", err)
	}
	t.Logf("the link to the member that left worked through its drain and was closed %v after it left", at.Sub(left).Round(time.Millisecond))
	if d := at.Sub(left); d < drain {
		t.Fatalf("closed %v after the member left, before drain_timeout (%v)", d, drain)
	}
	for deadline := time.Now().Add(2 * time.Second); h.removedEvictions() != 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("evictions_total{reason=removed} = %v, want 1", h.removedEvictions())
		}
	}
	for deadline := time.Now().Add(2 * time.Second); h.stateOf(addrs[0]) != "unknown"; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s is %s after its drain, want it forgotten", addrs[0], h.stateOf(addrs[0]))
		}
	}
}

// The dead twin: a member whose pod is gone (its connects refused, its
// links ended) and that left the records leaves routing at once: no new
// link tries it, no connect to it fails, and it is forgotten without
// waiting for drain_timeout, since it has no link left to drain.
func TestMemberWhosePodIsGoneLeavesRouting(t *testing.T) {
	h, dns, peers, addrs := dnsPool(t, []string{"127.0.0.2", "127.0.0.3"}, []string{"127.0.0.2", "127.0.0.3"})
	h.waitMembers(addrs, 3*time.Second)
	c := h.dial()
	roundTrip(t, c, []byte("to the first pod"))
	peers[0].Close() // the pod is gone: its links end, its connects are refused
	if err, _ := waitClosed(t, c, 5*time.Second); !isCloseSignal(err) {
		t.Fatalf("the gone pod's link saw %v, want it ended", err)
	}
	_ = c.Close() // the client's side of the FIN it was passed
	setRecords(dns, "127.0.0.3")
	h.waitMembers(addrs[1:], 3*time.Second)
	for deadline := time.Now().Add(2 * time.Second); h.stateOf(addrs[0]) != "unknown"; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s is %s with no link left, want it forgotten well before drain_timeout (15s)", addrs[0], h.stateOf(addrs[0]))
		}
	}
	errs := testutil.ToFloat64(h.m.ForListener("test").DialErrors)
	for range 4 {
		roundTrip(t, h.dial(), []byte("to the pod left"))
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").DialErrors); got != errs {
		t.Fatalf("dial_errors_total %v -> %v: a member out of the records was dialled", errs, got)
	}
	if got := acceptedBy(peers); got[1] < 4 {
		t.Fatalf("accepts %v, want every new link on the member left", got)
	}
}

// A resolver that answers with a subset of the records on each lookup
// (Consul, multi-value DNS) churns the members on every refresh: that is
// not an eviction storm. Three links, one per member, keep working while
// twenty answers in a row each leave a member out; nothing is evicted.
// (On main every answer evicted the links of the members it left out.)
func TestSubsetAnswersEvictNothing(t *testing.T) {
	hosts := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}
	h, dns, peers, addrs := dnsPool(t, hosts, hosts)
	h.waitMembers(addrs, 3*time.Second)
	var cs []net.Conn
	for range 3 {
		c := h.dial()
		roundTrip(t, c, []byte("hello"))
		cs = append(cs, c)
	}
	if got := acceptedBy(peers); !slices.Equal(got, []int64{1, 1, 1}) {
		t.Fatalf("accepts %v, want one link per member", got)
	}
	for i := range 20 {
		subset := slices.Delete(slices.Clone(hosts), i%3, i%3+1)
		setRecords(dns, subset...)
		time.Sleep(120 * time.Millisecond) // about one refresh
		for j, c := range cs {
			roundTrip(t, c, fmt.Appendf(nil, "answer %d, link %d", i, j))
		}
	}
	setRecords(dns, hosts...)
	h.waitMembers(addrs, 3*time.Second)
	if n := h.removedEvictions(); n != 0 {
		t.Fatalf("evictions_total{reason=removed} = %v, want 0", n)
	}
	select {
	case s := <-h.ended:
		t.Fatalf("a link ended (%s, %v) while the resolver churned", s.Reason, s.Err)
	default:
	}
	if n := h.p.ActiveLinks(); n != 3 {
		t.Fatalf("%d links open, want the three", n)
	}
}
