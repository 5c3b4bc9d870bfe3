package proxy

import (
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// When the proxy's own route to a peer sidecar goes under a mesh session
// (its route removed, its interface down, an unreachable route of its
// own), the heartbeat hears nothing and declares the session dead: its
// links end, as they cannot go on, but local_error, and no endpoint
// reached through the peer is excluded: the proxy's own failure is not
// held against them. Before, every one of them was excluded mesh_dead.
// The twin, the peer sidecar gone silent behind a route the proxy still
// has (a drop at its side): the link ends mesh_dead and the endpoint is
// excluded mesh_dead, both within ping_timeout and a second of the cut.
func TestMeshOwnRouteGoneIsNotThePeers(t *testing.T) {
	eachCut(t, append(ownCuts, "twin: peer sidecar blackholed, route kept"), meshOwnRouteGone)
}

func meshOwnRouteGone(t *testing.T, cut string) {
	pingTimeout := time.Second
	peer, link, in, eg := meshOverVeth(t, "10.231.38", pingTimeout, nil)
	c := eg.dial()
	roundTrip(t, c, []byte("hello"))
	twin := strings.HasPrefix(cut, "twin")
	stalls := meterStalls(t)
	if twin {
		dropMeshPort(t, peer, in.port) // the proxy's route stays
	} else {
		cutOwnRoute(t, cut, link)
	}
	// The path died here (the rule or the route change applied): the
	// peer was last heard then or before; an nft or ip run slow on a
	// loaded machine is no part of the heartbeat's time.
	cutAt := time.Now()
	s := eg.linkEnd(pingTimeout + 5*time.Second)
	ep := eg.endpoint()
	took := s.Opened.Add(s.Duration).Sub(cutAt)
	// Time this process could not run meanwhile (a loaded machine, -race)
	// is not the peer's: the heartbeat does not count it (mesh.silence).
	bound := pingTimeout + time.Second + stalls()
	t.Logf("%s: link ended %s %v after it (bound %v) (%v); endpoint %s (%s)", cut, s.Reason, took.Round(time.Millisecond), bound.Round(time.Millisecond), s.Err, ep.State, ep.Reason)
	// The heartbeat counts its verdict after the session's close, which
	// may end the link first.
	for deadline := time.Now().Add(5 * time.Second); testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)) != 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v mesh session deaths, want 1: the heartbeat's verdict is what this tests", cut, testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)))
		}
	}
	if took > bound {
		t.Fatalf("%s: the link ended %v after it, want within ping_timeout %v, a second and the time this process could not run (%v)", cut, took, pingTimeout, bound)
	}
	if twin {
		if s.Reason != CloseMeshDead || ep.State != "excluded" || ep.Reason != string(reasonMeshDead) {
			t.Fatalf("a peer sidecar gone silent behind a working route: link ended %s, endpoint %s (%s); want mesh_dead, excluded mesh_dead", s.Reason, ep.State, ep.Reason)
		}
		return
	}
	if s.Reason != CloseLocalError || ep.State != "healthy" {
		t.Fatalf("the proxy's own route to the peer sidecar failed (%s), but the link ended %s and the endpoint is %s (%s): the endpoints behind the peer blamed for the proxy's own failure", cut, s.Reason, ep.State, ep.Reason)
	}
}

// meshOverVeth is an egress proxy (a harness, its mesh's ping_timeout
// pingTimeout, tune changing its settings further if not nil) whose
// upstream, an echo server on 127.0.0.2, it reaches through an ingress
// sidecar in a peer namespace over a veth on net3 (.1 here, .2 there).
func meshOverVeth(t *testing.T, net3 string, pingTimeout time.Duration, tune func(*policy.Settings)) (*netns.NS, *netns.Link, *ingressProxy, *harness) {
	t.Helper()
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, net3+".1/24", net3+".2/24")
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressIn(t, peer, link.PeerIP().String(), srv.Addr(), pingTimeout)
	pathUp(t, &net.TCPAddr{IP: link.PeerIP().AsSlice(), Port: in.port})
	_, srvPort, _ := net.SplitHostPort(srv.Addr())
	eg := startEgress(t, net.JoinHostPort(link.PeerIP().String(), srvPort), in.port, func(s *policy.Settings) {
		s.Mesh.PingTimeout = policy.Duration(pingTimeout)
		if tune != nil {
			tune(s)
		}
	})
	return peer, link, in, eg
}

// dropMeshPort has the peer sidecar's host drop what comes to and goes
// from its mesh port (table inet meshdrop).
func dropMeshPort(t *testing.T, peer *netns.NS, port int) {
	t.Helper()
	p := strconv.Itoa(port)
	if err := peer.NFT(`table inet meshdrop {
		chain in { type filter hook input priority 0; policy accept; tcp dport ` + p + ` drop; }
		chain out { type filter hook output priority 0; policy accept; tcp sport ` + p + ` drop; }
	}`); err != nil {
		t.Fatal(err)
	}
}

// startIngressIn is an ingress sidecar whose mesh port listens on host in
// ns (its listener bound there; everything else of it, its connects to
// local included, in the test's own namespace), with the mesh's
// ping_timeout pingTimeout.
func startIngressIn(t *testing.T, ns *netns.NS, host, local string, pingTimeout time.Duration) *ingressProxy {
	t.Helper()
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	fastMesh(&s)
	s.Mesh.PingTimeout = policy.Duration(pingTimeout)
	cfg.Listeners = []policy.Listener{{Name: "ingress", Listen: net.JoinHostPort(host, "0"),
		Ingress: policy.Ingress{Local: local, CheckInterval: policy.Duration(50 * time.Millisecond)}, Settings: s}}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	in := &ingressProxy{m: metrics.New(), cfg: cfg}
	in.p = New(cfg, Options{metrics: in.m, Logger: testLogger()})
	if err := ns.Do(in.p.Start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = in.p.Close() })
	in.port = in.p.Addr("ingress").(*net.TCPAddr).Port
	return in
}

// When the proxy's own route to a peer sidecar goes while a session's
// handshake waits for its answer (the connect done, the preface sent),
// the handshake hears nothing for ping_timeout, as from a dead sidecar;
// but that is the proxy's own failure: the link ends local_error, no
// endpoint reached through the peer is excluded and no session death is
// counted. Before, every one of them was excluded mesh_dead. The twin,
// the same silent sidecar behind a route the proxy keeps: the link ends
// mesh_dead, the endpoint is excluded mesh_dead, both within
// ping_timeout and a second of the handshake's start.
func TestMeshOwnRouteGoneUnderTheHandshakeIsNotThePeers(t *testing.T) {
	eachCut(t, append(ownCuts, "twin: peer sidecar silent, route kept"), meshOwnRouteGoneUnderHandshake)
}

func meshOwnRouteGoneUnderHandshake(t *testing.T, cut string) {
	const pingTimeout = time.Second
	ns := netns.NewNS(t)
	link := netns.Veth(t, ns, "10.231.39.1/24", "10.231.39.2/24")
	silent, accepted := silentListenerIn(t, ns, net.JoinHostPort(link.PeerIP().String(), "0"))
	pathUp(t, silent)
	waitFor(t, 5*time.Second, "pathUp's connection accepted", func() bool { return accepted() >= 1 })
	eg := startEgress(t, net.JoinHostPort(link.PeerIP().String(), "9000"), silent.(*net.TCPAddr).Port, func(s *policy.Settings) {
		s.Mesh.PingTimeout = policy.Duration(pingTimeout)
		// The link's connect budget outlasts ping_timeout: the
		// handshake's own deadline judges.
		s.ConnectTimeout = policy.Duration(3 * pingTimeout)
		s.ConnectAttempts = 1
	})
	stalls := meterStalls(t)
	began := time.Now()
	eg.dial()
	waitFor(t, 5*time.Second, "the session's connection accepted", func() bool { return accepted() >= 2 })
	twin := strings.HasPrefix(cut, "twin")
	if !twin {
		cutOwnRoute(t, cut, link)
	}
	s := eg.linkEnd(3*pingTimeout + 5*time.Second)
	ep := eg.endpoint()
	took := s.Opened.Add(s.Duration).Sub(began)
	bound := pingTimeout + time.Second + stalls()
	deaths := testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress))
	t.Logf("%s: link ended %s %v after the dial (bound %v) (%v); endpoint %s (%s); %v session deaths", cut, s.Reason, took.Round(time.Millisecond), bound.Round(time.Millisecond), s.Err, ep.State, ep.Reason, deaths)
	if took > bound {
		t.Fatalf("%s: the link ended %v after the dial, want within ping_timeout %v, a second and the time this process could not run (%v)", cut, took, pingTimeout, bound)
	}
	if twin {
		if s.Reason != CloseMeshDead || ep.State != "excluded" || ep.Reason != string(reasonMeshDead) || deaths != 1 {
			t.Fatalf("a silent peer sidecar behind a working route: link ended %s, endpoint %s (%s), %v session deaths; want mesh_dead, excluded mesh_dead, 1", s.Reason, ep.State, ep.Reason, deaths)
		}
		return
	}
	if s.Reason != CloseLocalError || ep.State != "healthy" || deaths != 0 {
		t.Fatalf("the proxy's own route to the peer sidecar failed under the handshake (%s), but the link ended %s, the endpoint is %s (%s), %v session deaths: the endpoints behind the peer blamed for the proxy's own failure", cut, s.Reason, ep.State, ep.Reason, deaths)
	}
}

// silentListenerIn listens on address in ns, accepts and holds every
// connection without reading or writing: a sidecar that answers no
// handshake. accepted counts the connections accepted.
func silentListenerIn(t *testing.T, ns *netns.NS, address string) (addr net.Addr, accepted func() int) {
	t.Helper()
	ln, err := ns.Listen("tcp", address)
	if err != nil {
		t.Fatal(err)
	}
	var n atomic.Int32
	serveConns(t, ln, func(_ net.Conn, done <-chan struct{}) {
		n.Add(1)
		<-done
	})
	return ln.Addr(), func() int { return int(n.Load()) }
}
