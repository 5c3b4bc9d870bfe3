package proxy

import (
	"net"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

func listenerCfg(name, upstream string, tune func(*policy.Settings)) policy.Listener {
	s := policy.DefaultSettings()
	if tune != nil {
		tune(&s)
	}
	return policy.Listener{Name: name, Listen: "127.0.0.1:0", Upstream: upstream, Settings: s}
}

// A reload adds a listener, retunes a kept one without touching its
// links, and retires a removed one after the drain timeout.
func TestReloadAddsRetunesAndRemovesListeners(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	ended := make(chan LinkStats, 16)
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{listenerCfg("a", peer.Addr(), nil)}
	p := New(cfg, Options{OnLinkEnd: func(s LinkStats) { ended <- s }})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	aAddr := p.Addr("a").String()
	ca, err := net.Dial("tcp", aAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer ca.Close()
	roundTrip(t, ca, []byte("before"))

	// Reload 1: a retuned, b added.
	cfg2 := cfg
	cfg2.Listeners = []policy.Listener{
		listenerCfg("a", peer.Addr(), func(s *policy.Settings) { s.WriteTimeout = policy.Duration(3 * time.Second) }),
		listenerCfg("b", peer.Addr(), nil),
	}
	cfg2.Listeners[0].Listen = cfg.Listeners[0].Listen
	if err := p.Reload(cfg2); err != nil {
		t.Fatal(err)
	}
	roundTrip(t, ca, []byte("a link survives the reload"))
	if got := p.listeners[0].tuning().set.WriteTimeout.D(); got != 3*time.Second {
		t.Fatalf("a's write_timeout for new links = %v, want 3s", got)
	}
	bAddr := p.Addr("b")
	if bAddr == nil {
		t.Fatal("listener b not added")
	}
	cb, err := net.Dial("tcp", bAddr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer cb.Close()
	roundTrip(t, cb, []byte("b works"))

	// Reload 2: b removed; its link gets the drain timeout, then closes.
	cfg3 := cfg2
	cfg3.DrainTimeout = policy.Duration(200 * time.Millisecond)
	cfg3.Listeners = cfg2.Listeners[:1]
	begin := time.Now()
	if err := p.Reload(cfg3); err != nil {
		t.Fatal(err)
	}
	if c, err := net.Dial("tcp", bAddr.String()); err == nil {
		c.Close()
		t.Fatal("removed listener still accepts")
	}
	roundTrip(t, cb, []byte("draining"))
	err, at := waitClosed(t, cb, 2*time.Second)
	if !isCloseSignal(err) || at.Sub(begin) < 150*time.Millisecond {
		t.Fatalf("b's link ended with %v after %v, want a close after the 200ms drain", err, at.Sub(begin))
	}
	if s := <-ended; s.Reason != metrics.ReasonShutdown || s.Listener != "b" {
		t.Fatalf("link end %+v, want b's link closed by the drain", s)
	}
	roundTrip(t, ca, []byte("a is untouched"))
}

// An endpoint that leaves endpoints.disabled is readmitted; one that
// enters it is refused and its links are evicted.
func TestReloadDisabledEndpoints(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{listenerCfg("a", peer.Addr(), nil)}
	cfg.Endpoints.Disabled = []string{peer.Addr()}
	p := New(cfg, Options{})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	addr := p.Addr("a").String()
	expectRefused(t, addr)

	enabled := cfg
	enabled.Endpoints.Disabled = nil
	enabled.Listeners = []policy.Listener{cfg.Listeners[0]} // same listener: kept
	if err := p.Reload(enabled); err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, p: p, addr: addr}
	c := h.dialWhenReadmitted(2 * time.Second)
	roundTrip(t, c, []byte("readmitted by reload"))

	if err := p.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if err, _ := waitClosed(t, c, time.Second); !isCloseSignal(err) {
		t.Fatalf("link to an endpoint disabled by reload saw %v", err)
	}
	expectRefused(t, addr)
}
