//go:build linux

package e2e

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/harness"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// startPinotIn starts a pinotsim server listening inside ns (the listening
// socket, and so every accepted one, belongs to ns).
func startPinotIn(t *testing.T, ns *netns.NS, cfg pinotsim.ServerConfig) *pinotsim.Server {
	t.Helper()
	var srv *pinotsim.Server
	if err := ns.Do(func() error {
		var err error
		srv, err = pinotsim.NewServer(cfg)
		return err
	}); err != nil {
		t.Fatalf("pinotsim server in the peer namespace on %s: %v", cfg.Addr, err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	return srv
}

// establishedPeers lists the client ports of the TCP connections
// established to local port port inside ns whose client address is from.
func establishedPeers(t *testing.T, ns *netns.NS, port, from string) []string {
	t.Helper()
	testutil.RequireCommand(t, "ss")
	out, err := ns.Run("", "ss", "-Htn", "state", "established", fmt.Sprintf("( sport = :%s )", port))
	if err != nil {
		t.Fatalf("ss in the peer namespace: %v", err)
	}
	var ports []string
	for _, line := range strings.Split(string(out), "\n") {
		for _, f := range strings.Fields(line) {
			host, p, err := net.SplitHostPort(f)
			if err == nil && host == from {
				ports = append(ports, p)
			}
		}
	}
	return ports
}

// TestNodeFlapWithoutFIN replays incident 1, the node flap: a server node
// flaps, its old connections vanish without a FIN or RST reaching the
// client, and a new server comes up on the same address.
//
// Topology: pinotsim server in a peer namespace at 10.231.8.2:9000; in this
// namespace a framed proxy (request_timeout 500ms, threshold 3,
// initial_delay 300ms) with a broker querying through it, and a second,
// direct broker as the control. The flap: the established connections to
// the server (the proxy's upstream and the direct broker's) are dropped in
// both directions in the peer namespace, by their client ports, so new
// connections still pass; the old server is closed (its FIN/RST is
// dropped too) and a new one listens on the same address.
//
// Asserted: through the proxy, queries succeed again on a fresh upstream
// connection within 3 s of the flap; the proxy itself closed the dead link
// (its reason is logged); the direct broker, which keeps its cached
// connection until the kernel gives up (~15 min), is still stuck after the
// same time: not one query succeeded and its connection is still "open".
func TestNodeFlapWithoutFIN(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	const (
		requestTimeout = 500 * time.Millisecond
		threshold      = 3
		initialDelay   = 300 * time.Millisecond
		queryEvery     = 50 * time.Millisecond
		brokerTimeout  = 2 * time.Second
		recoverBound   = 3 * time.Second
	)
	v := startPinotBehindVeth(t, 8)
	peer, link, srvAddr, oldSrv := v.peer, v.link, v.addr, v.srv

	pp := startPinotProxy(t, srvAddr, pinotSettings(requestTimeout, threshold, initialDelay))
	paths := startTwoPaths(t, pinotsim.BrokerConfig{Timeout: brokerTimeout}, pp.addr, srvAddr, queryEvery, 300, 5, "the flap")
	direct, viaProxy, viaDirect := paths.direct, paths.viaProxy, paths.viaDirect

	// The flap. Drop the established flows by client port: the proxy's
	// upstream connection and the direct broker's.
	ports := establishedPeers(t, peer, "9000", link.LocalIP().String())
	if len(ports) != 2 {
		t.Fatalf("want 2 established connections to the server (proxy, direct broker), got ports %v", ports)
	}
	set := strings.Join(ports, ", ")
	flapAt := time.Now()
	if err := peer.NFT(fmt.Sprintf(`table inet lpflap {
	chain in  { type filter hook input  priority 0; policy accept; tcp dport 9000 tcp sport { %[1]s } counter drop; }
	chain out { type filter hook output priority 0; policy accept; tcp sport 9000 tcp dport { %[1]s } counter drop; }
}
`, set)); err != nil {
		t.Fatalf("installing the flow drop in the peer namespace: %v", err)
	}
	// The drop is in force from here: nft returns once the kernel took
	// the rules (forking it can take 100 ms on a loaded machine). The
	// proxy's bounds count from flapAt, before it (stricter); the control
	// from here.
	ruleAt := time.Now()
	_ = oldSrv.Close() // its FIN (or RST) goes nowhere
	newSrv := startPinotIn(t, peer, pinotsim.ServerConfig{Addr: srvAddr})
	restartedIn := time.Since(flapAt)

	if !viaProxy.WaitOK(flapAt, 3, recoverBound+time.Second) {
		t.Errorf("no 3 successful queries through the proxy within %v of the flap: %s; state %+v",
			recoverBound+time.Second, fmtOutcomes(outcomes(viaProxy.Records(), flapAt, time.Now())), pp.state())
	}
	// Observe the control for as long as the bound, plus one broker
	// timeout so that queries sent in the bound have all ended.
	time.Sleep(time.Until(flapAt.Add(recoverBound + brokerTimeout)))
	obsEnd := flapAt.Add(recoverBound)
	directStillConnected := direct.Connected(srvAddr)
	viaProxy.Finish(brokerTimeout + time.Second)
	viaDirect.Finish(brokerTimeout + time.Second)

	pr, dr := viaProxy.Records(), viaDirect.Records()
	first, ok := firstOKAfter(pr, flapAt)
	recovered := first.Done.Sub(flapAt)
	t.Logf("new server listening %v after the flap; first query through the proxy to succeed was sent +%v and answered +%v after the flap",
		ms(restartedIn), ms(first.Sent.Sub(flapAt)), ms(recovered))
	if !ok || recovered > recoverBound {
		t.Errorf("through the proxy: first success %v after the flap (found %v), want <= %v", ms(recovered), ok, recoverBound)
	}
	t.Logf("proxied queries sent in the %v after the flap: %s", recoverBound, fmtOutcomes(outcomes(pr, flapAt, obsEnd)))
	t.Logf("direct  queries sent in the %v after the flap: %s; direct broker still holds its connection: %v",
		recoverBound, fmtOutcomes(outcomes(dr, flapAt, obsEnd)), directStillConnected)
	if n := outcomes(pr, flapAt, obsEnd)[pinotsim.TimedOut]; n != 0 {
		t.Errorf("%d proxied queries timed out at the broker (%v) after the flap; the proxy should fail them fast", n, brokerTimeout)
	}
	// The control: the replay is real only if the direct path stays stuck.
	if n := outcomes(dr, ruleAt, obsEnd)[pinotsim.OK]; n != 0 {
		t.Errorf("control: %d direct queries succeeded after the flap; the fault did not cut the old connection", n)
	}
	if n := outcomes(dr, flapAt, obsEnd)[pinotsim.TimedOut]; n == 0 {
		t.Errorf("control: no direct query timed out after the flap")
	}
	if !directStillConnected {
		t.Errorf("control: the direct broker's cached connection closed; a flap without FIN should leave it open")
	}

	// The dead link: opened before the flap, closed by the proxy after it.
	var dead []harness.LinkEnd
	for _, e := range pp.links.All() {
		if e.Opened.Before(flapAt) && e.At.After(flapAt) {
			dead = append(dead, e)
		}
	}
	if len(dead) != 1 {
		t.Fatalf("want 1 pre-flap link closed after the flap, got %d: %+v", len(dead), dead)
	}
	d := dead[0]
	t.Logf("dead link closed %v after the flap, reason %q (err %v), %d B up / %d B down",
		ms(d.At.Sub(flapAt)), d.Reason, d.Err, d.BytesUp, d.BytesDown)
	switch d.Reason {
	case string(proxy.CloseStale), string(proxy.CloseUnanswered), string(proxy.CloseUpstreamTimeout), string(proxy.CloseWriteTimeout):
	default:
		t.Errorf("dead link ended for %q, want the proxy to have closed it (stale, unanswered, upstream_timeout, write_timeout)", d.Reason)
	}
	if lim := requestTimeout + (threshold-1)*queryEvery + 300*time.Millisecond; d.At.Sub(flapAt) > lim {
		t.Errorf("dead link closed %v after the flap, want <= %v", ms(d.At.Sub(flapAt)), lim)
	}
	st := newSrv.Stats()
	t.Logf("new server: accepted %d, executed %d (%v); endpoint %s (%s); stale_frames_dropped_total=%v unanswered_timeouts_total=%v",
		st.Accepted, st.Executed, st.ByBroker, pp.state().State, pp.state().Reason,
		pp.counter(t, "stale_frames_dropped_total", "", ""), pp.counter(t, "unanswered_timeouts_total", "", ""))
	if st.ByBroker["Broker_proxied"].Executed == 0 {
		t.Errorf("the new server executed no proxied query")
	}
	if out, err := peer.Run("", "nft", "list", "table", "inet", "lpflap"); err == nil {
		t.Logf("flap table:\n%s", out)
	}
}
