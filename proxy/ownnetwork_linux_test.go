package proxy

import (
	"net"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
)

// When the proxy's own network fails under a link (its route to the
// upstream removed, its interface down, an unreachable route of its
// own), the retransmissions fail at its own route lookup, and the kernel
// gives up at tcp_user_timeout with that lookup's error (ENETUNREACH,
// EHOSTUNREACH: inet_sk_rebuild_header keeps it as the soft error), the
// same errors an ICMP message from the upstream's side leaves. The
// upstream is not blamed for it: the link ends local_error and the
// endpoint stays healthy. Before, since the kernel's verdict reported as
// an ICMP error was taken for the upstream's (kernelGaveUp), such a link
// ended upstream_timeout and excluded its endpoint. The twin, an upstream
// gone from a network the proxy still routes to, is
// TestUnreachableAtUserTimeoutIsUpstreamTimeout: excluded.
func TestOwnRouteGoneAtTheVerdictIsNotTheUpstreams(t *testing.T) {
	for _, cut := range []string{"route removed", "interface down", "unreachable route"} {
		t.Run(cut, func(t *testing.T) { ownRouteGone(t, cut) })
	}
}

func ownRouteGone(t *testing.T, cut string) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.231.30.1/24", "10.231.30.2/24")
	addr := netns.Echo(t, peer, net.JoinHostPort(link.PeerIP().String(), "9000"))
	// Retransmissions at about 0.2, 0.6, 1.4 and 3 s after the send: the
	// route goes before one of them even on a slow machine.
	ut := 6 * time.Second
	h := start(t, addr.String(), func(s *policy.Settings) {
		s.TCPUserTimeout = policy.Duration(ut)
		s.Keepalive = policy.Keepalive{Idle: -1} // tcp_user_timeout itself on the idle socket
	})
	c := linkOverVeth(t, h, addr, ut)
	// The peer drops what the link sends from now on: the bytes stay in
	// flight, retransmitted, until the proxy's own route goes.
	if err := peer.NFT(`table inet lpka {
		chain in { type filter hook input priority 0; policy accept; tcp dport 9000 counter drop; }
	}`); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("lost")); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(ut); dropped(t, peer) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the link's bytes never reached the peer")
		}
	}
	switch cut {
	case "route removed":
		ip(t, "route", "del", "10.231.30.0/24", "dev", link.Local)
	case "interface down":
		ip(t, "link", "set", link.Local, "down")
	case "unreachable route":
		ip(t, "route", "add", "unreachable", link.PeerIP().String()+"/32")
	}
	s := h.linkEnd(ut + 5*time.Second)
	ep := h.endpoint()
	t.Logf("%s under the link: link ended %s (%v); endpoint %s (%s)", cut, s.Reason, s.Err, ep.State, ep.Reason)
	if s.Reason != CloseLocalError || ep.State != "healthy" {
		t.Fatalf("the proxy's own network failed (%s), but the link ended %s and the endpoint is %s: the upstream blamed for the proxy's own failure", cut, s.Reason, ep.State)
	}
}
