//go:build linux

package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
)

// replayFlap is replay 1, the node flap without FIN (incident 1: server
// pods restart without a FIN, and the broker keeps writing into its cached
// connection, which still looks open, until the kernel gives up).
//
// A server process runs in a peer namespace (the server's node). K brokers
// query it straight, K others through a proxy process, each on its own
// connection, at a steady rate. The flap: in the peer namespace, every
// packet of the established connections is dropped (both directions: no
// FIN or RST from the dying server reaches anyone), the server is killed
// with SIGKILL and a new one is started on the same address. New
// connections pass.
//
// Targets through the proxy: queries succeed again on every connection
// within request_timeout + 2 s; the queries lost are at most those in
// flight on the dead connections when the proxy closed them plus one
// request_timeout and one initial_delay of queries per connection (refused
// while the endpoint is out of routing), and none times out. Control: the direct brokers keep their connections, and
// every query they send after the flap times out.
func replayFlap(r *rig) (*Report, error) {
	const (
		k          = 3
		queryEvery = 200 * time.Millisecond
		observe    = 6 * time.Second
	)
	rep := &Report{N: 1, Name: "node flap without FIN"}
	t, srvAddr, old, px, err := serverBehindProxy(r, 1)
	if err != nil {
		return nil, err
	}
	pxAddr := px.listeners["s0"]

	var pl, dl loads
	var direct []*pinotsim.Broker
	pcloses := make([]*closeLog, k)
	for i := range k {
		pcloses[i] = &closeLog{}
		pb := newBroker(r, fmt.Sprintf("Broker_proxy_%d", i), brokerTimeout, 0, pcloses[i])
		db := newBroker(r, fmt.Sprintf("Broker_direct_%d", i), brokerTimeout, 0, nil)
		direct = append(direct, db)
		pl = append(pl, startLoad(r, pb, pxAddr, queryEvery, 200, 40*time.Second))
		dl = append(dl, startLoad(r, db, srvAddr, queryEvery, 200, 40*time.Second))
	}
	if !pl.waitOK(time.Time{}, 3, 5*time.Second) || !dl.waitOK(time.Time{}, 3, 5*time.Second) {
		return nil, fmt.Errorf("no traffic before the flap")
	}
	rss := sampleRSS(r, px.pid, time.Minute)
	w := watchEndpoint(r, px, srvAddr, time.Minute)
	time.Sleep(300 * time.Millisecond)

	ports, err := t.establishedFrom(9000)
	if err != nil {
		return nil, err
	}
	if len(ports) != 2*k {
		return nil, fmt.Errorf("want %d established connections to the server (%d proxy upstreams, %d direct), got client ports %v", 2*k, k, k, ports)
	}
	flapAt := time.Now()
	if err := t.dropFlows("lpflap", ports); err != nil {
		return nil, err
	}
	old.kill()
	newSrv, err := startServer(r, t.peer, srvAddr, "")
	if err != nil {
		return nil, err
	}
	rep.event(flapAt, flapAt, "flap: the %d established connections' packets dropped at the server's node, server killed (kill -9)", len(ports))
	rep.event(flapAt, time.Now(), "new server process listening on the same address %s", srvAddr)

	time.Sleep(time.Until(flapAt.Add(observe)))
	obsEnd := time.Now()
	stillConnected := 0
	for _, db := range direct {
		if db.Connected(srvAddr) {
			stillConnected++
		}
	}
	endLoads(pl, dl, rss, w)
	st, err := newSrv.stats()
	if err != nil {
		return nil, err
	}

	// What happened on the proxy's side.
	for _, c := range w.After(flapAt) {
		rep.event(flapAt, c.At, "endpoint %s (%s)", c.State, c.Reason)
	}
	for _, e := range px.ends.All() {
		switch {
		case e.Opened.Before(flapAt) && e.At.After(flapAt):
			rep.event(flapAt, e.At, "proxy closed a pre-flap link: %s (%d B up, %d B down)", e.Reason, e.BytesUp, e.BytesDown)
		case e.At.After(flapAt) && e.At.Before(obsEnd):
			rep.event(flapAt, e.At, "proxy closed a link opened %+.2fs: %s (%d B up, %d B down)", e.Opened.Sub(flapAt).Seconds(), e.Reason, e.BytesUp, e.BytesDown)
		}
	}
	inflight := 0
	for i, cl := range pcloses {
		for _, c := range cl.snapshot() {
			if c.At.After(flapAt) {
				rep.event(flapAt, c.At, "proxied broker %d saw its connection close: %d in-flight queries failed fast", i, c.FailedFast)
				inflight += c.FailedFast
				break // the first close after the flap is the pre-flap connection's
			}
		}
	}
	for i, l := range pl {
		if f, ok := firstOK(l.Records(), flapAt); ok {
			rep.event(flapAt, f.Done, "proxied broker %d: first query after the flap answered (sent %+.2fs)", i, f.Sent.Sub(flapAt).Seconds())
		}
	}
	prs, drs := pl.records(), dl.records()
	rep.event(flapAt, obsEnd, "end of observation: direct brokers still holding their dead connection: %d of %d", stillConnected, k)

	var dQueue int64
	for _, db := range direct {
		dQueue += db.Stats().PeakQueueBytes
	}
	base, peak := rss.growth(flapAt)
	d, p := paths{direct: dl, proxied: pl, from: flapAt, to: obsEnd, recoveryFrom: flapAt, window: observe,
		directQueue: dQueue, proxyGrowth: peak - base, stats: st}.rows()
	rep.Rows = []Row{d, p}
	pRec, pOK := p.Recovery, p.Recovered
	rep.note("%d connections per path, a query every %v on each; counts are queries sent in the %v after the flap; recovery: from the flap until every connection had a query succeed", k, queryEvery, observe)

	// Targets.
	bound := requestTimeout + 2*time.Second
	rep.check(pOK && pRec <= bound, "recovered within request_timeout + 2s",
		"every proxied connection had a query succeed %s after the flap (bound %s)", secs(pRec), secs(bound))
	pAll := count(prs, time.Time{}, obsEnd)
	// Beyond those in flight when the proxy closed the dead links, a query
	// is lost only while the endpoint is out of routing (refused at
	// connect: failed fast), from the first request's deadline until the
	// probe readmits the new server: one request_timeout and one
	// initial_delay of queries per connection at most.
	perConn := int((requestTimeout + initialDelay + queryEvery - 1) / queryEvery)
	rep.check(pAll.Lost()-inflight <= perConn*k && pAll.TimedOut == 0,
		"queries lost <= in flight + one request_timeout and initial_delay of queries per connection, none timed out",
		"lost %d (%d failed fast, %d timed out), of which %d were in flight on the dead connections when the proxy closed them; %d <= %d x %d",
		pAll.Lost(), pAll.FailedFast, pAll.TimedOut, inflight, pAll.Lost()-inflight, perConn, k)
	// A readmission is a fresh start: requests sent before it (on links
	// that had already ended) must not exclude the endpoint again before
	// the readmitted server could answer anything.
	changes := w.After(flapAt)
	reexcluded := ""
	for i := 1; i < len(changes); i++ {
		a, b := changes[i-1], changes[i]
		if a.State == "healthy" && a.Reason == "probe_ok" && b.State == "excluded" && b.Reason == "unanswered" &&
			b.At.Sub(a.At) < requestTimeout {
			reexcluded = fmt.Sprintf("readmitted at %+.2fs, excluded again at %+.2fs", a.At.Sub(flapAt).Seconds(), b.At.Sub(flapAt).Seconds())
			break
		}
	}
	rep.check(reexcluded == "", "no re-exclusion for requests sent before a readmission",
		"state changes after the flap: %d; %s", len(changes), reexcluded)

	// Controls.
	late := count(drs, flapAt.Add(100*time.Millisecond), obsEnd)
	rep.check(late.OK == 0 && late.TimedOut > 0 && stillConnected == k, "control: direct path stuck",
		"direct queries sent after the flap: %d ok, %d timed out, %d failed fast; %d of %d connections still open",
		late.OK, late.TimedOut, late.FailedFast, stillConnected, k)
	if st.ByBroker == nil || countOf(st, "Broker_proxy").Executed == 0 {
		rep.check(false, "new server executed proxied queries", "executed %v", st.ByBroker)
	}
	return rep, nil
}

// countOf sums the server's work (requests executed, stale ones among
// them) for brokers whose id starts with prefix.
func countOf(st pinotsim.ServerStats, prefix string) pinotsim.BrokerCount {
	var n pinotsim.BrokerCount
	for id, c := range st.ByBroker {
		if strings.HasPrefix(id, prefix) {
			n.Executed += c.Executed
			n.Stale += c.Stale
		}
	}
	return n
}
