//go:build linux

package proxy

import (
	"errors"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
)

// A redirect rule that does not exempt the proxy's own connects sends
// each one back to the proxy. The SYN reaches the listener's accept queue
// inside the connect(2) call, so the looping connection can be accepted,
// and judged, before the connect that sent it has said its local address.
// Before the loop guard knew the connects in flight (it learnt each
// address once the handshake had completed, at attach), the proxy then
// proxied its own connection on, and again, until one hop happened to be
// judged after its connect had registered.
//
// Here every connect is held right after connect(2) returns, before its
// address is asked for, for 300 ms: the looping connection is accepted
// meanwhile, and must still be refused at the first hop (one loop, two
// links, one connect). The healthy twin: a connect held the same way
// through a listener whose connects the rule exempts (upstream_mark) is
// proxied, not refused.
func TestLoopGuardKnowsAConnectInFlight(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	const mark = 0x77
	faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.3:9005"}) // the twin's server

	cfg := policy.DefaultConfig()
	// Bounds a loop the guard misses, so that the test fails fast
	// instead of feeding it: the links past 6 are refused.
	cfg.Limits.MaxLinks = 6
	loopy, marked := cfg.Defaults, cfg.Defaults
	marked.UpstreamMark = mark
	cfg.Listeners = []policy.Listener{
		{Name: "loopy", Listen: "127.0.0.1:15004", Settings: loopy,
			Transparent: policy.Transparent{Match: []policy.Match{{CIDR: "127.0.0.2/32"}}}},
		{Name: "marked", Listen: "127.0.0.1:15005", Settings: marked,
			Transparent: policy.Transparent{Match: []policy.Match{{CIDR: "127.0.0.3/32"}}}},
	}
	ended := make(chan LinkStats, 64)
	m := metrics.New()
	p := New(cfg, Options{metrics: m, Logger: testLogger(), OnLinkEnd: func(s LinkStats) { ended <- s }})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	if err := netns.LocalNFT(`table inet lpinflight {
	chain out {
		type nat hook output priority -100; policy accept;
		meta mark 0x77 return
		ip daddr 127.0.0.2 tcp dport 9004 redirect to :15004
		ip daddr 127.0.0.3 tcp dport 9005 redirect to :15005
	}
}
`); err != nil {
		t.Fatalf("installing the redirect: %v", err)
	}

	var held atomic.Int32
	hold := func() {
		held.Add(1)
		time.Sleep(300 * time.Millisecond)
	}
	testHookConnected.Store(&hold)
	t.Cleanup(func() { testHookConnected.Store(nil) })

	// The twin first: a held connect that does not loop is proxied.
	c, err := net.Dial("tcp", "127.0.0.3:9005")
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	roundTrip(t, c.(*net.TCPConn), []byte("not a loop"))
	_ = c.Close()
	if s := nextEnd(t, ended); s.Listener != "marked" || s.Reason == CloseLoop {
		t.Fatalf("the twin's link ended %+v, want listener marked, not a loop", s)
	}
	if got := held.Load(); got != 1 {
		t.Fatalf("%d connects held, want the twin's one", got)
	}

	// The loop: refused at the first hop, whatever the order.
	c, err = net.Dial("tcp", "127.0.0.2:9004")
	if err == nil {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
		_ = c.Close()
	}
	if err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the client's connection through a loop: %v, want it ended", err)
	}
	// The client's link ends once its upstream, the looping connection,
	// is refused; the refusal is counted, not ended as a link.
	if s := nextEnd(t, ended); s.Listener != "loopy" || s.Reason == CloseLoop {
		t.Fatalf("the client's link ended %+v, want listener loopy ended by its upstream", s)
	}
	lm := m.ForListener("loopy")
	counts := func() (loops, links float64) {
		return testutil.ToFloat64(lm.Closes(string(CloseLoop))), testutil.ToFloat64(lm.LinksTotal)
	}
	check := func(when string) {
		t.Helper()
		if loops, links := counts(); loops != 1 || links != 2 || held.Load() != 2 {
			t.Fatalf("%s: %v loop(s) refused, %v connection(s) accepted, %d connect(s) in all; want 1, 2 (the client's and its one hop) and 2 (the twin's and the hop's)",
				when, loops, links, held.Load())
		}
	}
	check("once the client's link ended")
	// An absence: long enough for a second hop's connect to be held and
	// its connection judged.
	time.Sleep(700 * time.Millisecond)
	check("0.7s later")
	if n := p.ownUp.len(); n != 0 {
		t.Fatalf("the loop guard still holds %d address(es) after every link ended", n)
	}
}

// nextEnd waits (10s at most) for the next link to end.
func nextEnd(t *testing.T, ended chan LinkStats) LinkStats {
	t.Helper()
	select {
	case s := <-ended:
		return s
	case <-time.After(10 * time.Second):
		t.Fatal("no link ended within 10s")
		return LinkStats{}
	}
}
