package proxy

import (
	"net"
	"strings"
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
	eachCut(t, ownCuts, ownRouteGone)
}

func ownRouteGone(t *testing.T, cut string) {
	// Retransmissions at about 0.2, 0.6, 1.4 and 3 s after the send: the
	// route goes before one of them even on a slow machine.
	ut := 6 * time.Second
	peer, link, h, c := ownNetworkLink(t, "10.231.30", ut)
	// The peer drops what the link sends from now on: the bytes stay in
	// flight, retransmitted, until the proxy's own route goes.
	blackholePeer(t, peer)
	if _, err := c.Write([]byte("lost")); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(ut); dropped(t, peer) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the link's bytes never reached the peer")
		}
	}
	cutOwnRoute(t, cut, link)
	s := h.linkEnd(ut + 5*time.Second)
	ep := h.endpoint()
	t.Logf("%s under the link: link ended %s (%v); endpoint %s (%s)", cut, s.Reason, s.Err, ep.State, ep.Reason)
	if s.Reason != CloseLocalError || ep.State != "healthy" {
		t.Fatalf("the proxy's own network failed (%s), but the link ended %s and the endpoint is %s: the upstream blamed for the proxy's own failure", cut, s.Reason, ep.State)
	}
}

// When the proxy's own network fails before a link's bytes are first sent
// (its route to the upstream removed, its interface down, an unreachable
// route of its own), nothing is ever sent: each attempt fails at the
// proxy's own route lookup, none leaves an ICMP error, and the kernel
// gives up at tcp_user_timeout with ETIMEDOUT, the dead upstream's
// verdict. The upstream is not blamed: the link ends local_error and the
// endpoint stays healthy. Before, the link ended upstream_timeout and
// excluded its endpoint. The twin, an upstream that stops answering
// behind a route the proxy still has: upstream_timeout, excluded, within
// tcp_user_timeout and a second of the send.
func TestOwnRouteGoneBeforeTheSendIsNotTheUpstreams(t *testing.T) {
	eachCut(t, append(ownCuts, "twin: upstream gone, route kept"), ownRouteGoneBeforeSend)
}

func ownRouteGoneBeforeSend(t *testing.T, cut string) {
	ut := 3 * time.Second
	peer, link, h, c := ownNetworkLink(t, "10.231.36", ut)
	twin := strings.HasPrefix(cut, "twin")
	if twin {
		blackholePeer(t, peer) // the upstream's host stops answering; the proxy's route stays
	} else {
		cutOwnRoute(t, cut, link)
	}
	sent := time.Now()
	if _, err := c.Write([]byte("lost")); err != nil {
		t.Fatal(err)
	}
	s := h.linkEnd(ut + 5*time.Second)
	ep := h.endpoint()
	took := s.Opened.Add(s.Duration).Sub(sent)
	t.Logf("%s before the send: link ended %s %v after it (%v); endpoint %s (%s)", cut, s.Reason, took.Round(time.Millisecond), s.Err, ep.State, ep.Reason)
	if twin {
		if s.Reason != CloseUpstreamTimeout || ep.State != "excluded" || took > ut+time.Second {
			t.Fatalf("a dead upstream behind a working route: link ended %s %v after the send, endpoint %s; want upstream_timeout within %v, excluded", s.Reason, took, ep.State, ut+time.Second)
		}
		return
	}
	if s.Reason != CloseLocalError || ep.State != "healthy" {
		t.Fatalf("the proxy's own network failed before the send (%s), but the link ended %s and the endpoint is %s: the upstream blamed for the proxy's own failure", cut, s.Reason, ep.State)
	}
}

// ownNetworkLink is a proxy in front of an echo server in a peer
// namespace, over a veth on net (three octets: net.1 here, net.2 there),
// with tcp_user_timeout ut (keepalive off: ut itself on the idle socket),
// and a link of it that made a round trip.
func ownNetworkLink(t *testing.T, net3 string, ut time.Duration) (*netns.NS, *netns.Link, *harness, *net.TCPConn) {
	t.Helper()
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, net3+".1/24", net3+".2/24")
	addr := netns.Echo(t, peer, net.JoinHostPort(link.PeerIP().String(), "9000"))
	h := start(t, addr.String(), func(s *policy.Settings) {
		s.TCPUserTimeout = policy.Duration(ut)
		s.Keepalive = policy.Keepalive{Idle: -1}
	})
	return peer, link, h, linkOverVeth(t, h, addr, ut)
}

// ownCuts are the ways cutOwnRoute takes the proxy's route away.
var ownCuts = []string{"route removed", "interface down", "unreachable route"}

// eachCut runs f for each cut, each in network namespaces of its own.
func eachCut(t *testing.T, cuts []string, f func(t *testing.T, cut string)) {
	for _, cut := range cuts {
		t.Run(cut, func(t *testing.T) {
			if netns.Reexec(t, "ip", "nft") {
				f(t, cut)
			}
		})
	}
}

// cutOwnRoute takes the proxy's own route to link's peer away: the route
// removed, the interface down, or an unreachable route of its own.
func cutOwnRoute(t *testing.T, cut string, link *netns.Link) {
	t.Helper()
	switch cut {
	case "route removed":
		ip(t, "route", "del", link.LocalAddrs[0].Masked().String(), "dev", link.Local)
	case "interface down":
		ip(t, "link", "set", link.Local, "down")
	case "unreachable route":
		ip(t, "route", "add", "unreachable", link.PeerIP().String()+"/32")
	default:
		t.Fatalf("no such cut: %s", cut)
	}
}
