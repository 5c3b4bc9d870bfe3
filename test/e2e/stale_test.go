//go:build linux

package e2e

import (
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// TestNoStaleBacklogAfterPathStall replays the ending of incident 2, the
// path stall: a path stalls, the client keeps writing, and when the path
// heals the backlog of requests whose deadline has long passed is
// delivered and executed by the server.
//
// Topology: pinotsim server in a peer namespace at 10.231.9.2:9000; in this
// namespace a framed proxy (request_timeout 300ms) with a broker querying
// through it every 20 ms, and a direct broker as the control, both with a
// 1 s query timeout (a request's deadline). The stall: every TCP segment to
// and from port 9000 is dropped in the peer namespace for 2 s (new SYNs
// too: a stalled path, not a restarted server), then the drop is removed.
//
// consecutive_timeouts_threshold is 0 so that only staleness acts on the
// links: the test is about what reaches the server, and exclusion would
// also stop traffic, hiding whether the stale check works. (Dial errors
// during the stall still exclude the endpoint; the detector readmits it
// once a probe gets through.)
//
// Asserted: the server executed no stale request from the proxied broker,
// and the proxy did drop stale frames (reason stale); the control, the
// direct broker, had stale requests executed: its kernel retransmitted the
// backlog once the path healed.
func TestNoStaleBacklogAfterPathStall(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	const (
		requestTimeout = 300 * time.Millisecond
		initialDelay   = 300 * time.Millisecond
		queryEvery     = 20 * time.Millisecond
		brokerTimeout  = time.Second
		stallFor       = 2 * time.Second
	)
	v := startPinotBehindVeth(t, 9)
	peer, srvAddr, srv := v.peer, v.addr, v.srv

	settings := pinotSettings(requestTimeout, 0, initialDelay)
	// A connect that completes through a retransmitted SYN (1 s after the
	// first, within the default connect_timeout of 2s) delivers what the
	// broker wrote while it waited, as a direct connect would: with a 1 s
	// query timeout those are stale. This test is about the backlog of the
	// links open when the path stalled, so it runs with a connect_timeout
	// below the broker's query timeout (as test/incidents does), which is
	// what such a deployment should use.
	settings.ConnectTimeout = policy.Duration(500 * time.Millisecond)
	pp := startPinotProxy(t, srvAddr, settings)
	// 500 x 20ms = 10s at most
	paths := startTwoPaths(t, pinotsim.BrokerConfig{Timeout: brokerTimeout, RequestSize: 512}, pp.addr, srvAddr, queryEvery, 500, 10, "the stall")
	viaProxy, viaDirect := paths.viaProxy, paths.viaDirect
	before := srv.Stats()

	stallAt := time.Now()
	if err := peer.NFT(`table inet lpstall {
	chain in  { type filter hook input  priority 0; policy accept; tcp dport 9000 counter drop; }
	chain out { type filter hook output priority 0; policy accept; tcp sport 9000 counter drop; }
}
`); err != nil {
		t.Fatalf("installing the stall in the peer namespace: %v", err)
	}
	time.Sleep(stallFor)
	if _, err := peer.Run("", "nft", "delete", "table", "inet", "lpstall"); err != nil {
		t.Fatalf("removing the stall: %v", err)
	}
	healAt := time.Now()

	// Both paths recover: the proxy's through a readmission and fresh
	// links, the direct one when the kernel retransmits (RTO backoff).
	if !viaProxy.WaitOK(healAt, 10, 4*time.Second) {
		t.Errorf("proxied queries did not recover within 4s of the heal: %s; state %+v",
			fmtOutcomes(outcomes(viaProxy.Records(), healAt, time.Now())), pp.state())
	}
	if !viaDirect.WaitOK(healAt, 10, 5*time.Second) {
		t.Errorf("direct queries did not recover within 5s of the heal: %s",
			fmtOutcomes(outcomes(viaDirect.Records(), healAt, time.Now())))
	}
	viaProxy.Finish(brokerTimeout + time.Second)
	viaDirect.Finish(brokerTimeout + time.Second)
	// Let the server finish reading what its kernel already holds.
	time.Sleep(200 * time.Millisecond)
	after := srv.Stats()

	pb, db := after.ByBroker["Broker_proxied"], after.ByBroker["Broker_direct"]
	pb0, db0 := before.ByBroker["Broker_proxied"], before.ByBroker["Broker_direct"]
	pr, dr := viaProxy.Records(), viaDirect.Records()
	t.Logf("stall %v; proxied queries sent during it: %s; direct: %s", stallFor,
		fmtOutcomes(outcomes(pr, stallAt, healAt)), fmtOutcomes(outcomes(dr, stallAt, healAt)))
	if f, ok := firstOKAfter(pr, healAt); ok {
		t.Logf("proxied: first success sent %v after the heal", ms(f.Sent.Sub(healAt)))
	}
	if f, ok := firstOKAfter(dr, healAt); ok {
		t.Logf("direct: first success sent %v after the heal", ms(f.Sent.Sub(healAt)))
	}
	t.Logf("server: proxied executed %d (stale %d) during and after the stall; direct executed %d (stale %d)",
		pb.Executed-pb0.Executed, pb.Stale-pb0.Stale, db.Executed-db0.Executed, db.Stale-db0.Stale)
	reasons := map[string]int{}
	for _, e := range pp.links.All() {
		reasons[e.Reason]++
	}
	dropped := pp.counter(t, "stale_frames_dropped_total", "", "")
	t.Logf("proxy: links ended by reason %v; stale_frames_dropped_total=%v; probes ok=%v fail=%v; endpoint %s",
		reasons, dropped, pp.counter(t, "probes_total", "result", "ok"), pp.counter(t, "probes_total", "result", "fail"), pp.state().State)

	if pb.Stale != 0 {
		t.Errorf("the server executed %d stale requests that came through the proxy, want 0", pb.Stale)
	}
	if pb.Executed-pb0.Executed == 0 {
		t.Errorf("the server executed no proxied request after the stall began")
	}
	if reasons[string(proxy.CloseStale)] == 0 || dropped == 0 {
		t.Errorf("the proxy dropped no stale frames (links %v, stale_frames_dropped_total %v): the stall was not seen", reasons, dropped)
	}
	// The control: without the proxy the healed path delivers the backlog.
	if db.Stale-db0.Stale == 0 {
		t.Errorf("control: the direct broker had no stale request executed; the stall did not build a backlog")
	}
}

// TestStaleBoundedWhenPeerStopsReading: the server stops reading (Stall)
// for 1 s and then resumes; it has a small receive buffer. The proxy's
// stale check resets a link whose expired request is still unacknowledged,
// which drops everything in the proxy's queue and kernel send queue. It
// cannot pull back what the server's kernel already acknowledged: those
// requests sit in the server's receive buffer and are executed, stale, when
// it resumes. So through the proxy, stale executions are bounded by what
// the server's receive buffers held: per upstream connection that carried
// requests during the stall, the buffer (SO_RCVBUF, doubled by the kernel)
// divided by the smallest request frame, plus one frame whose header the
// server had already read when it stalled. The direct path, whose client
// kernel and broker queue hold the whole backlog, is logged for contrast.
//
// consecutive_timeouts_threshold is 0 here too: the stalled server still
// accepts connections (as Netty's acceptor does), so a connect probe would
// readmit it at once anyway; staleness alone is under test.
func TestStaleBoundedWhenPeerStopsReading(t *testing.T) {
	const (
		requestTimeout = 300 * time.Millisecond
		queryEvery     = 10 * time.Millisecond
		brokerTimeout  = 500 * time.Millisecond
		stallFor       = time.Second
		recvBuffer     = 4096
		requestSize    = 1000
		table          = "t_REALTIME"
	)
	srv, err := pinotsim.NewServer(pinotsim.ServerConfig{Addr: "127.0.0.1:0", RecvBuffer: recvBuffer})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	pp := startPinotProxy(t, srv.Addr(), pinotSettings(requestTimeout, 0, 200*time.Millisecond))

	// The smallest request frame either broker can send: ids and times
	// only grow the varints, so this frame is a lower bound.
	now := time.Now()
	minFrame := pinotsim.HeaderLen + len(pinotsim.AppendRequest(nil, &pinotsim.Request{
		ID: 1, Table: table, Segments: pinotsim.SegmentsFor(table, requestSize), BrokerID: "Broker_direct",
		CID: "1", SentAt: now, Deadline: now,
	}))
	perConn := 2 * recvBuffer / minFrame

	// 500 x 10ms = 5s at most
	paths := startTwoPaths(t, pinotsim.BrokerConfig{Timeout: brokerTimeout, RequestSize: requestSize, Table: table},
		pp.addr, srv.Addr(), queryEvery, 500, 10, "the stall")
	viaProxy, viaDirect := paths.viaProxy, paths.viaDirect
	before := srv.Stats()
	stallAt := time.Now()
	srv.Stall()
	time.Sleep(stallFor)
	mid := srv.Stats()
	resumeAt := time.Now()
	srv.Resume()
	if !viaProxy.WaitOK(resumeAt, 10, 3*time.Second) {
		t.Errorf("proxied queries did not recover within 3s of the resume")
	}
	viaProxy.Finish(brokerTimeout + time.Second)
	viaDirect.Finish(brokerTimeout + time.Second)
	time.Sleep(200 * time.Millisecond)
	after := srv.Stats()

	// Upstream connections that carried requests while the server was not
	// reading: the one open when it stalled and every one accepted during
	// the stall (threshold 0: no probes; the direct broker never
	// reconnects, its connection is counted in "before").
	conns := 1 + int(mid.Accepted-before.Accepted)
	var links int
	for _, e := range pp.links.All() {
		if e.Opened.Before(resumeAt) && e.At.After(stallAt) && e.BytesUp > 0 {
			links++
		}
	}
	bound := conns*perConn + 1
	pb, db := after.ByBroker["Broker_proxied"], after.ByBroker["Broker_direct"]
	pb0, db0 := before.ByBroker["Broker_proxied"], before.ByBroker["Broker_direct"]
	proxiedStale, directStale := pb.Stale-pb0.Stale, db.Stale-db0.Stale
	t.Logf("min request frame %d B, receive buffer %d B (x2 by the kernel): %d frames per connection; "+
		"%d upstream connections during the stall (%d proxy links ended after it began)", minFrame, recvBuffer, perConn, conns, links)
	t.Logf("stale executed through the proxy: %d (bound %d); direct: %d of %d executed; stale_frames_dropped_total=%v",
		proxiedStale, bound, directStale, db.Executed-db0.Executed, pp.counter(t, "stale_frames_dropped_total", "", ""))
	t.Logf("proxied queries sent during the stall: %s; direct: %s",
		fmtOutcomes(outcomes(viaProxy.Records(), stallAt, resumeAt)), fmtOutcomes(outcomes(viaDirect.Records(), stallAt, resumeAt)))
	if proxiedStale > int64(bound) {
		t.Errorf("%d stale requests executed through the proxy, more than the server's receive buffers could hold (%d)", proxiedStale, bound)
	}
	if pp.counter(t, "stale_frames_dropped_total", "", "") == 0 {
		t.Errorf("the proxy dropped no stale frame while the server was not reading")
	}
	// The control: the direct path executes its whole backlog, stale.
	if directStale <= proxiedStale {
		t.Errorf("control: %d stale requests executed on the direct path, not more than the %d through the proxy",
			directStale, proxiedStale)
	}
}
