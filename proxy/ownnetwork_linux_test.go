package proxy

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/prometheus/client_golang/prometheus/testutil"
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
// tcp_user_timeout and a second of the send. The bytes never left, so
// the never-sent check (flow.NeverSent) alone keeps these local_error;
// the route check's ETIMEDOUT is guarded by
// TestOwnRouteGoneUnderAnIdleLinkIsNotTheUpstreams, where no byte waits.
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
	ownVerdict(t, h, cut+" before the send", twin, h.linkEnd(ut+5*time.Second), sent, ut+time.Second)
}

// ownVerdict checks the end s of a link whose upstream died (twin) or
// whose proxy's own network failed (what says how): upstream_timeout
// within bound of since and the endpoint excluded, or local_error and the
// endpoint healthy.
func ownVerdict(t *testing.T, h *harness, what string, twin bool, s LinkStats, since time.Time, bound time.Duration) {
	t.Helper()
	ep := h.endpoint()
	took := s.Opened.Add(s.Duration).Sub(since)
	t.Logf("%s: link ended %s %v after it (%v); endpoint %s (%s)", what, s.Reason, took.Round(time.Millisecond), s.Err, ep.State, ep.Reason)
	if twin {
		if s.Reason != CloseUpstreamTimeout || ep.State != "excluded" || took > bound {
			t.Fatalf("a dead upstream behind a working route (%s): link ended %s %v after it, endpoint %s; want upstream_timeout within %v, excluded", what, s.Reason, took, ep.State, bound)
		}
		return
	}
	if s.Reason != CloseLocalError || ep.State != "healthy" {
		t.Fatalf("the proxy's own network failed (%s), but the link ended %s and the endpoint is %s: the upstream blamed for the proxy's own failure", what, s.Reason, ep.State)
	}
}

// A rule of the proxy's own host that drops or rejects what its upstream
// socket sends, in place before a link's bytes are first sent (an
// operator's, a mesh CNI's in the pod's own namespace): the bytes never
// leave, the kernel keeps probing an open window, and gives up at
// tcp_user_timeout with ETIMEDOUT (a drop) or EHOSTUNREACH (a reject
// answered by the host's own ICMP), while the route is there. The
// upstream is not blamed: the bytes never left (flow.NeverSent), the link
// ends local_error, the endpoint stays healthy. Before, upstream_timeout,
// excluded. The twin is TestOwnRouteGoneBeforeTheSendIsNotTheUpstreams's:
// an upstream that stops answering with the bytes in flight is excluded.
func TestOwnDropRuleBeforeTheSendIsNotTheUpstreams(t *testing.T) {
	eachCut(t, []string{"own drop rule", "own reject rule"}, ownRouteGoneBeforeSend)
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
// removed, the interface down, or an unreachable route of its own; or
// has a rule of its own netfilter output drop or reject what goes there.
func cutOwnRoute(t *testing.T, cut string, link *netns.Link) {
	t.Helper()
	switch cut {
	case "route removed":
		ip(t, "route", "del", link.LocalAddrs[0].Masked().String(), "dev", link.Local)
	case "interface down":
		ip(t, "link", "set", link.Local, "down")
	case "unreachable route":
		ip(t, "route", "add", "unreachable", link.PeerIP().String()+"/32")
	case "own drop rule", "own reject rule":
		verdict := map[string]string{"own drop rule": "drop", "own reject rule": "reject with icmpx host-unreachable"}[cut]
		if out, err := netns.LocalRun(`table inet own {
			chain out { type filter hook output priority 0; policy accept; tcp dport 9000 counter `+verdict+`; }
		}`, "nft", "-f", "-"); err != nil {
			t.Fatalf("nft: %v: %s", err, out)
		}
	default:
		t.Fatalf("no such cut: %s", cut)
	}
}

// A connect that fails at the proxy's own route lookup is the proxy's
// own failure: with its route removed, its interface down or an
// unreachable route of its own, the connect fails at once (ENETUNREACH,
// EHOSTUNREACH, what an ICMP error from the upstream's side leaves), and
// a route gone while the SYN waits for an answer ends the connect at
// connect_timeout. Neither is held against the endpoint: the link ends
// local_error (the client reset), no dial error is counted, the endpoint
// stays healthy. Before, each was a dial_error: the one at once excluded
// the endpoint, two timeouts in a row did. The twins: the upstream's
// host unreachable (an ICMP host unreachable from its side) and an
// upstream that answers no SYN, behind a route the proxy has: dial_error,
// excluded.
func TestOwnRouteGoneAtTheConnectIsNotTheUpstreams(t *testing.T) {
	eachCut(t, append(ownCuts, "twin: upstream unreachable", "route gone under the SYN", "twin: SYN unanswered, route kept"), ownRouteGoneAtConnect)
}

func ownRouteGoneAtConnect(t *testing.T, cut string) {
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.231.37.1/24", "10.231.37.2/24")
	addr := netns.Echo(t, peer, net.JoinHostPort(link.PeerIP().String(), "9000"))
	pathUp(t, addr)
	h := start(t, addr.String(), func(s *policy.Settings) {
		s.ConnectTimeout = policy.Duration(time.Second)
		s.ConnectAttempts = 1 // a link, a connect
	})
	twin := strings.HasPrefix(cut, "twin")
	var s LinkStats
	switch cut {
	case "twin: upstream unreachable":
		unreachableAtPeer(t, peer)
		s = h.dialEnd()
	case "route gone under the SYN", "twin: SYN unanswered, route kept":
		// Two connects in a row time out: the second would exclude.
		blackholePeer(t, peer)
		for i := range 2 {
			c := h.dial()
			for deadline := time.Now().Add(5 * time.Second); dropped(t, peer) <= i; time.Sleep(5 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("the connect's SYN never reached the peer")
				}
			}
			if !twin {
				cutOwnRoute(t, "route removed", link)
			}
			s = h.linkEnd(10 * time.Second)
			t.Logf("connect %d: link ended %s (%v)", i+1, s.Reason, s.Err)
			_ = c.Close()
			if !twin {
				ip(t, "route", "add", link.LocalAddrs[0].Masked().String(), "dev", link.Local)
			}
		}
	default:
		cutOwnRoute(t, cut, link)
		s = h.dialEnd()
	}
	ep := h.endpoint()
	dialErrors := testutil.ToFloat64(h.m.ForListener("test").DialErrors)
	t.Logf("%s: link ended %s (%v); endpoint %s (%s); dial errors counted %v", cut, s.Reason, s.Err, ep.State, ep.Reason, dialErrors)
	if twin {
		if s.Reason != CloseDialError || ep.State != "excluded" {
			t.Fatalf("an upstream that takes no connect behind a route the proxy has: link ended %s, endpoint %s; want dial_error, excluded", s.Reason, ep.State)
		}
		return
	}
	if s.Reason != CloseLocalError || ep.State != "healthy" || dialErrors != 0 {
		t.Fatalf("the proxy's own route failed the connect (%s), but the link ended %s, the endpoint is %s, %v dial errors counted: the upstream blamed for the proxy's own failure", cut, s.Reason, ep.State, dialErrors)
	}
}

// dialEnd is the end of a link whose connect fails at once. The proxy may
// reset the client before its own connect returns.
func (h *harness) dialEnd() LinkStats {
	h.t.Helper()
	if c, err := net.Dial("tcp", h.addr); err == nil {
		h.t.Cleanup(func() { _ = c.Close() })
	}
	return h.linkEnd(10 * time.Second)
}

// A pool's link whose connect to one member fails at the proxy's own
// route lookup tries the next member, as it would after that member's
// failure, and the member is not blamed: the client is served, the member
// stays healthy, no dial error is counted. The twin: the member's host
// unreachable from its side (an ICMP host unreachable) is its failure:
// the client is served by the next member and the member is excluded.
func TestOwnRouteGoneAtTheConnectTriesTheNextMember(t *testing.T) {
	eachCut(t, []string{"route removed", "twin: member unreachable"}, ownRouteGoneInPool)
}

func ownRouteGoneInPool(t *testing.T, cut string) {
	peer, link, far, near, h := farNearPool(t, "10.231.38", nil)
	twin := strings.HasPrefix(cut, "twin")
	if twin {
		unreachableAtPeer(t, peer)
	} else {
		cutOwnRoute(t, cut, link)
	}
	attempts := 0
	for i := range 2 { // round robin: one of the two picks the far member first
		c := h.dial()
		roundTrip(t, c, []byte{byte(i)})
		_ = c.Close()
		attempts += h.linkEnd(5 * time.Second).ConnectAttempts
	}
	if attempts < 3 || near.Accepted() != 2 {
		t.Fatalf("%d connects for two links, %d to the near member; want 3 or more, 2: the far one tried", attempts, near.Accepted())
	}
	var state string
	for _, ep := range h.p.Endpoints() {
		if ep.Endpoint == far.String() {
			state = ep.State
		}
	}
	dialErrors := testutil.ToFloat64(h.m.ForListener("test").DialErrors)
	t.Logf("%s: both clients served, %d connects; far member %s; dial errors counted %v", cut, attempts, state, dialErrors)
	if twin && state != "excluded" || !twin && (state != "healthy" || dialErrors != 0) {
		t.Fatalf("%s: far member %s, %v dial errors counted", cut, state, dialErrors)
	}
}

// farNearPool is a round-robin pool (connect_attempts 2) of a far member,
// an echo server in a peer namespace over a veth on net3 (.1 here, .2
// there), and a near one, an echo server on loopback; tune, if not nil,
// changes its settings further.
func farNearPool(t *testing.T, net3 string, tune func(*policy.Settings)) (*netns.NS, *netns.Link, net.Addr, *faultpeer.Server, *harness) {
	t.Helper()
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, net3+".1/24", net3+".2/24")
	far := netns.Echo(t, peer, net.JoinHostPort(link.PeerIP().String(), "9000"))
	pathUp(t, far)
	near := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	h := startPool(t, policy.Pool{Endpoints: []string{far.String(), near.Addr()}}, nil, func(s *policy.Settings) {
		s.ConnectAttempts = 2
		if tune != nil {
			tune(s)
		}
	})
	return peer, link, far, near, h
}

// unreachableAtPeer has the peer's host answer every segment to its server
// (port 9000) with an ICMP host unreachable: the upstream's side says it
// is gone.
func unreachableAtPeer(t *testing.T, peer *netns.NS) {
	t.Helper()
	if err := peer.NFT(`table inet lpka {
		chain in { type filter hook input priority 0; policy accept; tcp dport 9000 counter reject with icmpx host-unreachable; }
	}`); err != nil {
		t.Fatal(err)
	}
}

// An upstream the route check cannot ask about (a link-local address
// with a zone) is judged on the kernel's word, as before the check: its
// host unreachable from its side (an ICMP address unreachable, EHOSTUNREACH
// at the connect) is a dial_error, and it is excluded. Only a lookup that
// finds no route makes a failure the proxy's own.
func TestUnaskedRouteLeavesTheVerdictTheUpstreams(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.231.39.1/24", "10.231.39.2/24")
	link.AddAddr(t, "fe80::39:1/64", "fe80::39:2/64")
	addr := netns.Echo(t, peer, "[fe80::39:2%"+link.Peer+"]:9000")
	upstream := "[fe80::39:2%" + link.Local + "]:9000"
	pathUp(t, &net.TCPAddr{IP: net.ParseIP("fe80::39:2"), Port: 9000, Zone: link.Local})
	h := start(t, upstream, func(s *policy.Settings) { s.ConnectAttempts = 1 })
	unreachableAtPeer(t, peer)
	s := h.dialEnd()
	ep := h.endpoint()
	t.Logf("%s (peer %s) unreachable from its side: link ended %s (%v); endpoint %s (%s)", upstream, addr, s.Reason, s.Err, ep.State, ep.Reason)
	if s.Reason != CloseDialError || ep.State != "excluded" {
		t.Fatalf("an upstream whose host is unreachable, its route not asked (a zone): link ended %s, endpoint %s; want dial_error, excluded", s.Reason, ep.State)
	}
}

// An upstream the proxy's host routes to only by a policy rule that
// matches what its upstream sockets are (TCP, to the upstream's port, as
// `ip rule add ipproto tcp lookup T` or `dport N lookup T` do, with no
// route in the main table) is routed: when it dies, its verdict is its
// own. A link's bytes unanswered for tcp_user_timeout end it
// upstream_timeout and exclude the endpoint within tcp_user_timeout and
// a second of the send; a connect its host answers with an ICMP host
// unreachable is a dial_error that excludes it. The route check must make
// the lookup the upstream's segments make: a datagram to another port
// finds no route here, and took each of these for the proxy's own
// network (local_error, the dead upstream never judged).
func TestPolicyRoutedDeadUpstreamIsJudged(t *testing.T) {
	eachCut(t, []string{"ipproto tcp rule: link", "dport rule: link", "ipproto tcp rule: connect", "dport rule: connect"}, policyRoutedDeadUpstream)
}

func policyRoutedDeadUpstream(t *testing.T, cut string) {
	rule, at, _ := strings.Cut(cut, ": ")
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.231.40.1/24", "10.231.40.2/24")
	addr := netns.Echo(t, peer, net.JoinHostPort(link.PeerIP().String(), "9000"))
	selector := map[string][]string{"ipproto tcp rule": {"ipproto", "tcp"}, "dport rule": {"dport", "9000"}}[rule]
	ip(t, append(append([]string{"rule", "add"}, selector...), "lookup", "140", "pref", "140")...)
	ip(t, "route", "add", "10.231.40.0/24", "dev", link.Local, "table", "140")
	ip(t, "route", "del", "10.231.40.0/24", "dev", link.Local) // the main table has none
	ut := 3 * time.Second
	h := start(t, addr.String(), func(s *policy.Settings) {
		s.TCPUserTimeout = policy.Duration(ut)
		s.Keepalive = policy.Keepalive{Idle: -1}
		s.ConnectAttempts = 1
	})
	var s LinkStats
	var took time.Duration
	want := CloseUpstreamTimeout
	if at == "connect" {
		pathUp(t, addr)
		unreachableAtPeer(t, peer)
		s, want = h.dialEnd(), CloseDialError
	} else {
		c := linkOverVeth(t, h, addr, ut)
		blackholePeer(t, peer)
		sent := time.Now()
		if _, err := c.Write([]byte("lost")); err != nil {
			t.Fatal(err)
		}
		s = h.linkEnd(ut + 5*time.Second)
		took = s.Opened.Add(s.Duration).Sub(sent)
	}
	ep := h.endpoint()
	t.Logf("%s, upstream dead: link ended %s (%v), %v after the send (0 for a connect); endpoint %s (%s)", cut, s.Reason, s.Err, took.Round(time.Millisecond), ep.State, ep.Reason)
	if s.Reason != want || ep.State != "excluded" || took > ut+time.Second {
		t.Fatalf("a dead upstream the proxy routes to by a %s: link ended %s %v after the send, endpoint %s; want %s within %v, excluded: the dead upstream escaped its verdict", rule, s.Reason, took, ep.State, want, ut+time.Second)
	}
}

// When the proxy's own route goes under an idle link with keepalive on
// (its route removed, its interface down, an unreachable route of its
// own), every keepalive probe fails at the proxy's own route lookup,
// which leaves no error on the socket, and no byte waits: the kernel
// gives up with ETIMEDOUT, a dead upstream's verdict, and only the route
// check can tell it from one (the never-sent check needs waiting bytes).
// The upstream is not blamed: local_error, endpoint healthy. The twin, an
// upstream that stops answering behind a route the proxy keeps:
// upstream_timeout, excluded, within keepalive's idle + interval x count
// and a second of the last segment.
func TestOwnRouteGoneUnderAnIdleLinkIsNotTheUpstreams(t *testing.T) {
	eachCut(t, append(ownCuts, "twin: upstream gone, route kept"), ownRouteGoneUnderIdleLink)
}

func ownRouteGoneUnderIdleLink(t *testing.T, cut string) {
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.231.44.1/24", "10.231.44.2/24")
	addr := netns.Echo(t, peer, net.JoinHostPort(link.PeerIP().String(), "9000"))
	pathUp(t, addr)
	h := start(t, addr.String(), keepaliveSettings)
	c := h.dial()
	roundTrip(t, c, []byte("hello"))
	twin := strings.HasPrefix(cut, "twin")
	if twin {
		blackholePeer(t, peer)
	} else {
		cutOwnRoute(t, cut, link)
	}
	// The path died here: the upstream's last segment came at the round
	// trip or, where the fault took over a keepalive idle to apply (a
	// loaded machine), at a probe's answer before now; the kernel counts
	// from that one.
	died := time.Now()
	ownVerdict(t, h, cut+" under an idle link, since the path died", twin, h.linkEnd(kaDeadAfter+10*time.Second), died, kaDeadAfter+time.Second)
}

// A pool member whose connect found no route of the proxy's own is not
// blamed, and not dialled again by every new link either: for a second
// the pool passes it over while another member can serve, so new links
// neither fail a connect to it nor wait the retry's pause. Counted by the
// links' own connect attempts: at most one more than the links per
// second that passed. Before, every link made two (the unroutable member
// first, 40 for 20 links, each also waiting connectBackoff, 25 ms). Its
// twin: once the route is back, the member takes links again.
func TestOwnRouteGoneMemberIsPassedOver(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	_, link, far, _, h := farNearPool(t, "10.231.46", nil)
	cutOwnRoute(t, "route removed", link)
	links, attempts, began := 20, 0, time.Now()
	for i := range links {
		c := h.dial()
		roundTrip(t, c, []byte{byte(i)})
		_ = c.Close()
		attempts += h.linkEnd(5 * time.Second).ConnectAttempts
	}
	seconds := int(time.Since(began) / noRouteFor)
	state := h.endpointAt(far.String()).State
	t.Logf("route gone: %d links, %d connects in %d whole seconds; far member %s", links, attempts, seconds, state)
	if attempts > links+1+seconds || state != "healthy" {
		t.Fatalf("%d connects for %d links in %d s (want at most %d), far member %s: the unroutable member dialled by every link", attempts, links, seconds, links+1+seconds, state)
	}
	ip(t, "route", "add", link.LocalAddrs[0].Masked().String(), "dev", link.Local)
	back := time.Now()
	for i := 0; ; i++ {
		if time.Since(back) > 10*time.Second {
			t.Fatal("the route is back, but no link went to the far member within 10 s")
		}
		c := h.dial()
		roundTrip(t, c, []byte{byte(i)})
		// The far member's echo keeps a half-closed link open: its link
		// is counted, a near one ends.
		if h.endpointAt(far.String()).LiveLinks > 0 {
			t.Logf("route back: the far member took link %d, %v after it", i+1, time.Since(back).Round(time.Millisecond))
			return
		}
		_ = c.Close()
		h.linkEnd(5 * time.Second)
		time.Sleep(50 * time.Millisecond)
	}
}
