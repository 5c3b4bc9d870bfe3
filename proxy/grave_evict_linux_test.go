//go:build linux

package proxy

import (
	"fmt"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/dnstest"
	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// A fail-open pool's only member, excluded (unanswered), leaves one DNS
// answer and is forgotten; it comes back, and Register restores its
// exclusion from the grave, delivering the event on a goroutine. Routing
// sees the restored state at once (the pool fails open to it); the data
// plane's handling of the event comes later and evicts only the links
// opened before the exclusion: a fail-open link opened in between stays
// (README: links opened during an exclusion stay). Before (found by a
// review), it was closed on evidence from before it existed. The
// detector's debug line for the event, held here, stands for the
// goroutine's scheduling delay.
func TestRestoredExclusionSparesALinkOpenedAfterIt(t *testing.T) {
	_, addrs := peersOn(t, faultpeer.Echo, "127.0.0.2")
	a := addrs[0]
	port := netip.MustParseAddrPort(a).Port()
	other := fmt.Sprintf("127.0.0.4:%d", port) // refuses
	_ = other
	dns := dnstest.Start(t)
	setRecords(dns, "127.0.0.2")

	var armed atomic.Bool
	g := &gateWriter{msg: "endpoint state changed", also: []string{a}, armed: &armed, reached: make(chan struct{}), release: make(chan struct{})}
	log := zerolog.New(g)
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	s.Detector.InitialDelay = policy.Duration(10 * time.Second)
	s.Detector.MaxDelay = policy.Duration(10 * time.Second)
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Settings: s,
		Pool: policy.Pool{DNS: fmt.Sprintf("pods.svc:%d", port), Refresh: policy.Duration(100 * time.Millisecond), Balance: policy.BalanceRoundRobin, FailOpen: true}}}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	ended := make(chan LinkStats, 16)
	p := startProxy(t, cfg, Options{metrics: metrics.New(), Resolver: dns.Resolver(), Logger: &log, OnLinkEnd: func(s LinkStats) { ended <- s }})
	h := &harness{t: t, p: p, addr: p.Addr("test").String()}
	h.waitMembers([]string{a}, 3*time.Second)
	if !p.det.Report(a, string(CloseUnanswered)) {
		t.Fatal("premise: exclusion")
	}
	setRecords(dns, "127.0.0.4") // one answer leaves it out: no links, forgotten
	h.waitMembers([]string{other}, 3*time.Second)
	waitFor(t, 3*time.Second, a+" forgotten", func() bool { _, ok := p.det.State(a); return !ok })

	armed.Store(true)
	setRecords(dns, "127.0.0.2") // back: its exclusion restored, the event pending
	select {
	case <-g.reached:
	case <-time.After(3 * time.Second):
		t.Fatal("premise: no restored event")
	}
	h.waitMembers([]string{a}, 3*time.Second)
	c := h.dial()
	roundTrip(t, c, []byte("fail-open to the restored, excluded member")) // a link opened on the restored state
	close(g.release)
	time.Sleep(300 * time.Millisecond)
	_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := c.Write([]byte("still there?")); err == nil {
		buf := make([]byte, 64)
		if _, err := c.Read(buf); err == nil {
			return
		}
	}
	select {
	case st := <-ended:
		t.Fatalf("the fail-open link opened after the exclusion was restored was closed (%s, %v, opened %v) by the restored event's eviction: evidence from before the link existed",
			st.Reason, st.Err, st.Opened.Format(time.StampMicro))
	case <-time.After(time.Second):
		t.Fatal("the link failed, no link end recorded")
	}
}
