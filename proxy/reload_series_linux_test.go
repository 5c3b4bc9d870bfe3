//go:build linux

package proxy

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/dnstest"
	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// A listener's series belong to its name while any listener of that name
// lives or drains. Here a reload re-adds a name whose old listener still
// drains, and the old one's drain ends while the reload resolves the new
// one's pool (before it is in the proxy's list): the new listener's
// series must stay. Before, the drain looked for the name in the list,
// found none, and deleted them: the listener counted into series no
// longer exported.
func TestReaddedListenerKeepsItsSeries(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	port := netip.MustParseAddrPort(peer.Addr()).Port()
	dns := dnstest.Start(t)
	dns.Set("pods.svc", netip.MustParseAddr("127.0.0.1"))
	entered := make(chan struct{})
	gate := make(chan struct{})
	var once sync.Once
	res := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		once.Do(func() { close(entered); <-gate })
		var d net.Dialer
		return d.DialContext(ctx, network, dns.Addr())
	}}
	m := metrics.New()
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{listenerCfg("keep", peer.Addr(), nil), listenerCfg("a", peer.Addr(), nil)}
	p := New(cfg, Options{metrics: m, Resolver: res})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c, err := net.Dial("tcp", p.Addr("a").String())
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, c, []byte("old a"))

	// Reload 1: "a" removed; its link drains (30 s).
	cfg2 := cfg
	cfg2.DrainTimeout = policy.Duration(30 * time.Second)
	cfg2.Listeners = cfg.Listeners[:1]
	if err := p.Reload(cfg2); err != nil {
		t.Fatal(err)
	}
	// Reload 2: "a" back, as a pool on a name (resolved in the reload).
	cfg3 := cfg2
	a := listenerCfg("a", "", nil)
	a.Pool = policy.Pool{Endpoints: []string{fmt.Sprintf("pods.svc:%d", port)}, Refresh: policy.Duration(time.Hour), Balance: policy.BalanceRoundRobin}
	cfg3.Listeners = []policy.Listener{cfg.Listeners[0], a}
	done := make(chan error, 1)
	go func() { done <- p.Reload(cfg3) }()
	<-entered // the reload resolves the new pool's name
	p.mu.Lock()
	made := p.names["a"]
	p.mu.Unlock()
	c.Close() // the old incarnation's last link ends: its drain ends now
	// ... and releases the name while the reload still resolves (a fixed
	// 300ms sleep could end first on a slow machine: the release then
	// came after the reload, and the test passed without its race).
	waitFor(t, 5*time.Second, "the old incarnation's name released", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.names["a"] < made
	})
	close(gate)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	c2, err := net.Dial("tcp", p.Addr("a").String())
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, c2, []byte("new a")) // counted in links_total at its accept
	c2.Close()
	mfs, _ := m.Registry.Gather()
	found := false
	for _, mf := range mfs {
		if mf.GetName() != "livenessproxy_links_total" {
			continue
		}
		for _, mt := range mf.GetMetric() {
			for _, lp := range mt.GetLabel() {
				if lp.GetName() == "listener" && lp.GetValue() == "a" {
					found = true
				}
			}
		}
	}
	n, _ := testutil.GatherAndCount(m.Registry, "livenessproxy_links_total")
	if !found {
		t.Fatalf("listener \"a\" serves (a link just ended) but has no links_total series (%d series in all): its series were deleted by the old incarnation's drain", n)
	}
}
