package proxy

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// A peer sidecar reached at a zoned IPv6 link-local address is one for
// which the route check cannot tell (flow.RouteTo asks the kernel for a
// destination, and the zone is the socket's own, not the lookup's): when
// its session is found silent, the verdict stays the peer's, as before
// the check. The peer's host drops what comes to and goes from its mesh
// port: the link ends mesh_dead and the endpoint is excluded mesh_dead.
// Its twin, first: the same link idle for two ping timeouts lives on.
// Were a lookup that cannot tell taken for "no route" (the proxy's own
// network), the link would end local_error and the endpoint stay in.
// TestMeshOwnRouteGoneIsNotThePeers has the lookups that can tell.
func TestMeshZonedPeerSilentIsThePeers(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	pingTimeout := time.Second
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.231.48.1/24", "10.231.48.2/24")
	link.AddAddr(t, "fe80::48:1/64", "fe80::48:2/64")
	peerIP := netip.MustParseAddr("fe80::48:2")
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressIn(t, peer, peerIP.WithZone(link.Peer).String(), srv.Addr(), pingTimeout)
	meshAddr := netip.AddrPortFrom(peerIP.WithZone(link.Local), uint16(in.port))
	pathUp(t, net.TCPAddrFromAddrPort(meshAddr))
	if route, known := flow.RouteTo(meshAddr, 0); known {
		t.Fatalf("premise: the route lookup to %v tells (route %v), want it unable to", meshAddr, route)
	}
	_, srvPort, _ := net.SplitHostPort(srv.Addr())
	eg := startEgress(t, net.JoinHostPort(peerIP.WithZone(link.Local).String(), srvPort), in.port, func(s *policy.Settings) {
		s.Mesh.PingTimeout = policy.Duration(pingTimeout)
	})
	c := eg.dial()
	roundTrip(t, c, []byte("hello over a zoned peer"))
	if got := testutil.ToFloat64(eg.m.MeshFallbacks("test")); got != 0 {
		t.Fatalf("premise: %v fallbacks, want the link through the mesh", got)
	}
	// The healthy twin: idle for two ping timeouts, answered pings.
	time.Sleep(2 * pingTimeout)
	roundTrip(t, c, []byte("idle, and still there"))
	if got := testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)); got != 0 {
		t.Fatalf("%v session deaths on a healthy zoned peer, want none", got)
	}
	dropMeshPort(t, peer, in.port)
	s := eg.linkEnd(pingTimeout + 10*time.Second)
	waitFor(t, 5*time.Second, "the heartbeat's verdict counted", func() bool {
		return testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)) == 1
	})
	ep := eg.endpoint()
	t.Logf("link ended %s (%v); endpoint %s (%s)", s.Reason, s.Err, ep.State, ep.Reason)
	if s.Reason != CloseMeshDead || ep.State != "excluded" || ep.Reason != string(reasonMeshDead) {
		t.Fatalf("a zoned peer sidecar gone silent: link ended %s, endpoint %s (%s); want mesh_dead, excluded mesh_dead: a lookup that cannot tell leaves the verdict the peer's", s.Reason, ep.State, ep.Reason)
	}
}
