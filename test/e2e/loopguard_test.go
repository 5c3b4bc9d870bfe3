//go:build linux

package e2e

import (
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// Finding 6 of issue 20: a transparent listener bound to a wildcard
// address answers on every address of the host. A connection to the pod's
// own address on the proxy's port, inside the match list, is the proxy's
// own destination: refused as a loop at once, never dialled (on main it was
// proxied back to the proxy, one hop later caught by its upstream socket's
// address). The healthy twin: the same port on another host is proxied.
func TestLoopGuardKnowsWildcardAddresses(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	const port = "15003"
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.235.0.1/24", "10.235.0.2/24")
	remote := echoIn(t, peer, net.JoinHostPort(link.PeerIP().String(), port))
	waitReachable(t, remote)
	own := net.JoinHostPort(link.LocalIP().String(), port) // the pod's own address

	const mark = 0x99
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	s.UpstreamMark = mark
	s.HalfCloseTimeout = policy.Duration(200 * time.Millisecond)
	cfg.Listeners = []policy.Listener{{Name: "wild", Listen: "0.0.0.0:" + port,
		Transparent: policy.Transparent{Match: []policy.Match{{CIDR: "10.235.0.0/24"}}}, Settings: s}}
	reg := prometheus.NewRegistry()
	p := proxy.New(cfg, proxy.Options{Registerer: reg})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	if err := netns.LocalNFT(`table inet lpwild {
	chain out {
		type nat hook output priority -100; policy accept;
		meta mark 0x99 return
		ip daddr 10.235.0.0/24 tcp dport 15003 redirect to :15003
	}
}
`); err != nil {
		t.Fatalf("installing the redirect: %v", err)
	}

	// The healthy twin first: another host on the same port.
	c, err := net.Dial("tcp", remote)
	if err != nil {
		t.Fatal(err)
	}
	echoTransfer(t, c, 4096)
	_ = c.Close()

	counter := func(name string, labels ...string) float64 {
		return counterValue(t, reg, name, append([]string{"listener", "wild"}, labels...)...)
	}
	before := counter("links_total")
	if err := expectReset(own); err != nil {
		t.Fatalf("a connection to the pod's own address on the proxy's port: %v, want it reset as a loop", err)
	}
	deadline := time.Now().Add(2 * time.Second)
	for counter("link_closes_total", "reason", string(proxy.CloseLoop)) == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := counter("link_closes_total", "reason", string(proxy.CloseLoop)); got != 1 {
		t.Fatalf("link_closes_total{reason=loop} = %v, want 1", got)
	}
	// Refused at the first hop: the proxy accepted one connection, not a
	// second one from its own upstream socket.
	if got := counter("links_total") - before; got != 1 {
		t.Fatalf("%v connections accepted for one loop, want 1: the proxy dialled itself", got)
	}
}
