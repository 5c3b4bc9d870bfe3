//go:build linux

package proxy

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
)

// A transparent listener on the wildcard address (what the chart accepts,
// and suggests, for both families) also answers on the pod's address. A
// plain connection from another host to it was never redirected and is
// nothing of the proxy's own: it is refused as no_match, not counted as
// an interception loop (link_closes_total{reason="loop"}, what an operator
// alerts on), and the loop's error line, which a real loop repeats per
// connection, is written once a second at most. Before, each of these
// connections was a loop with an error line of its own (found by a
// helper's audit). Real loops: loopguard_linux_test.go.
func TestDirectConnectToWildcardTransparentIsNoLoop(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.242.0.1/24", "10.242.0.2/24")
	const port = "15042"
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	s.UpstreamMark = 0x42
	cfg.Listeners = []policy.Listener{{Name: "wild", Listen: "0.0.0.0:" + port, Settings: s,
		Transparent: policy.Transparent{Match: []policy.Match{{CIDR: "10.243.0.0/24", Ports: []int{9000}}}}}}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	var sink syncBuffer
	log := zerolog.New(&sink)
	m := metrics.New()
	p := New(cfg, Options{metrics: m, Logger: &log})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })

	// The pod's interception rules, as the redirect init container
	// installs them (for other destinations): with them, connection
	// tracking is on in the pod's namespace, as in production.
	if err := netns.LocalNFT(`table inet lpdirect {
	chain out {
		type nat hook output priority -100; policy accept;
		meta mark 0x42 return
		ip daddr 10.243.0.0/24 tcp dport 9000 redirect to :15042
	}
}
`); err != nil {
		t.Fatalf("installing the redirect: %v", err)
	}

	// Another host (the peer namespace) connects to the pod's address on
	// the listener's port, as a port scan, a misdirected client or a
	// health check would. No redirect is installed anywhere.
	target := net.JoinHostPort(link.LocalIP().String(), port)
	const n = 40
	for range n {
		c, err := peer.DialContext(t.Context(), &net.Dialer{Timeout: 2 * time.Second}, "tcp", target)
		if err != nil {
			continue // reset as soon as accepted: it reached the listener
		}
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, _ = c.Read(make([]byte, 1))
		_ = c.Close()
	}
	time.Sleep(200 * time.Millisecond)
	lm := m.ForListener("wild")
	loops := testutil.ToFloat64(lm.Closes(string(CloseLoop)))
	errLines := 0
	for _, l := range strings.Split(sink.String(), "\n") {
		if strings.Contains(l, `"level":"error"`) && strings.Contains(l, "interception loop") {
			errLines++
		}
	}
	t.Logf("%d direct connections from another host: link_closes_total{reason=loop}=%v, %d error lines \"interception loop\"", n, loops, errLines)
	if loops > 0 {
		t.Errorf("%v of %d plain connections from another host (never redirected) counted as interception loops", loops, n)
	}
	if nm := testutil.ToFloat64(lm.Closes(string(CloseNoMatch))); nm < n-5 {
		t.Errorf("%v closed no_match, want about %d", nm, n)
	}
	if errLines > 2 {
		t.Errorf("%d error lines for %d connections from another host: one per connection, unbounded", errLines, n)
	}
}
