package proxy

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// A reload that moves a listener to an address another process holds is
// refused whole: the listener keeps serving where it was (the last good
// configuration), and the error names the key. Before, the old socket was
// retired before the new bind failed, and the listener was gone.
func TestReloadToABusyPortChangesNothing(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	busy, err := net.Listen("tcp", "127.0.0.1:0") // someone else's port
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()

	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{listenerCfg("a", peer.Addr(), nil)}
	p := New(cfg, Options{})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	oldAddr := p.Addr("a").String()
	c, err := net.Dial("tcp", oldAddr)
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, c, []byte("before"))
	c.Close()

	cfg2 := cfg
	cfg2.Listeners = []policy.Listener{listenerCfg("a", peer.Addr(), nil)}
	cfg2.Listeners[0].Listen = busy.Addr().String()
	err = p.Reload(cfg2)
	if !errors.Is(err, ErrNothingApplied) || !strings.Contains(err.Error(), `listeners[0].listen (listener "a")`) {
		t.Errorf("reload error %v, want one naming listeners[0].listen and saying nothing was applied", err)
	}
	if a := p.Addr("a"); a == nil || a.String() != oldAddr {
		t.Errorf("listener \"a\" at %v after a reload whose bind failed, want %s", a, oldAddr)
	}
	c2, err := net.DialTimeout("tcp", oldAddr, time.Second)
	if err != nil {
		t.Fatalf("the last good listener at %s stopped serving after the failed reload: %v", oldAddr, err)
	}
	defer c2.Close()
	roundTrip(t, c2, []byte("after"))
}

// A reload that adds a listener on a busy port leaves no series of it
// behind (before, links_active{listener="ghost"} and the rest stayed
// exported for good).
func TestRefusedListenerLeavesNoSeries(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	m := metrics.New()
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{listenerCfg("a", peer.Addr(), nil)}
	p := New(cfg, Options{metrics: m})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	cfg2 := cfg
	cfg2.Listeners = []policy.Listener{cfg.Listeners[0], listenerCfg("ghost", peer.Addr(), nil)}
	cfg2.Listeners[1].Listen = busy.Addr().String()
	if err := p.Reload(cfg2); err == nil {
		t.Fatal("reload onto a busy port succeeded")
	}
	if p.Addr("ghost") != nil {
		t.Fatal("ghost bound")
	}
	ghost := seriesOf(t, m, "ghost")
	if ghost > 0 {
		t.Fatalf("%d series of listener \"ghost\", which never bound, are still exported", ghost)
	}
}

// A removed listener's series are deleted once its drain ends, also when
// the drain ends before the reload has bound the listeners it adds (drain
// timeout 0, no links, many listeners added). Before, the drain looked for
// its name in the proxy's list, which still held the retiring listener
// itself until then, and kept the series for good.
func TestRemovedListenerSeriesForgotten(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	stale := 0
	const rounds = 5
	for range rounds {
		m := metrics.New()
		cfg := policy.DefaultConfig()
		cfg.Listeners = []policy.Listener{listenerCfg("keep", peer.Addr(), nil), listenerCfg("gone", peer.Addr(), nil)}
		p := New(cfg, Options{metrics: m})
		if err := p.Start(); err != nil {
			t.Fatal(err)
		}
		cfg2 := cfg
		cfg2.DrainTimeout = 0
		cfg2.Listeners = []policy.Listener{cfg.Listeners[0]}
		for j := range 30 { // binds after the retire: a window for its drain to end
			cfg2.Listeners = append(cfg2.Listeners, listenerCfg(fmt.Sprintf("new%d", j), peer.Addr(), nil))
		}
		if err := p.Reload(cfg2); err != nil {
			t.Fatal(err)
		}
		// The drain ends by itself (no links): wait for it, bounded.
		for deadline := time.Now().Add(3 * time.Second); seriesOf(t, m, "gone") > 0; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				stale++
				break
			}
		}
		_ = p.Close()
	}
	if stale > 0 {
		t.Fatalf("%d of %d rounds: the removed listener's series were never forgotten", stale, rounds)
	}
}

// seriesOf counts the series labelled listener=name that m exports.
func seriesOf(t *testing.T, m *metrics.Metrics, name string) int {
	t.Helper()
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, mf := range mfs {
		for _, mt := range mf.GetMetric() {
			for _, lp := range mt.GetLabel() {
				if lp.GetName() == "listener" && lp.GetValue() == name {
					n++
				}
			}
		}
	}
	return n
}
