//go:build linux

package main

import (
	"fmt"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/harness"
	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
)

// replayIdle is replay 4, the idle link to a dead peer.
//
// A server process runs in a peer namespace. A broker straight to it and
// another through a proxy process send a few queries, then nothing. While
// the links are idle the server's node goes away without a FIN: its
// connections' packets are dropped in the peer namespace and the server is
// killed (a new one starts on the same address, as a restarted pod does).
// After silence of quiet, the brokers send their next queries.
//
// Target through the proxy: the dead link is found by keepalive (the
// upstream socket's short keepalive) before the next query, or that query
// fails fast. Control: the direct broker's next query waits out its
// timeout (the kernel's keepalive would take 2 h 11 min).
func replayIdle(r *rig) (*Report, error) {
	const (
		quiet      = 10 * time.Second // scaled from 30 s
		queryEvery = 500 * time.Millisecond
		next       = 6 // queries after the silence
	)
	rep := &Report{N: 4, Name: "idle link to a dead peer"}
	t, srvAddr, old, px, err := serverBehindProxy(r, 4)
	if err != nil {
		return nil, err
	}
	pxAddr := px.listeners["s0"]
	var pcl, dcl closeLog
	pb := newBroker(r, "Broker_proxy", brokerTimeout, 0, &pcl)
	db := newBroker(r, "Broker_direct", brokerTimeout, 0, &dcl)

	// A little traffic, then silence.
	warm := loads{startLoad(r, pb, pxAddr, 100*time.Millisecond, 5, 5*time.Second), startLoad(r, db, srvAddr, 100*time.Millisecond, 5, 5*time.Second)}
	if !warm.waitOK(time.Time{}, 5, 5*time.Second) {
		return nil, fmt.Errorf("no traffic before the silence")
	}
	warm.finish(brokerTimeout)
	lastTraffic := time.Now()
	rss := sampleRSS(r, px.pid, time.Minute)
	w := watchEndpoint(r, px, srvAddr, time.Minute)
	time.Sleep(500 * time.Millisecond)

	ports, err := t.establishedFrom(9000)
	if err != nil {
		return nil, err
	}
	if len(ports) != 2 {
		return nil, fmt.Errorf("want 2 established connections to the server (proxy, direct), got client ports %v", ports)
	}
	goneAt := time.Now()
	if err := t.dropFlows("lpgone", ports); err != nil {
		return nil, err
	}
	old.kill()
	newSrv, err := startServer(r, t.peer, srvAddr, "")
	if err != nil {
		return nil, err
	}
	rep.event(goneAt, lastTraffic, "last query answered; the links go idle")
	rep.event(goneAt, goneAt, "the server's node drops the idle connections' packets and the server is killed; a new one listens on the same address")

	time.Sleep(time.Until(lastTraffic.Add(quiet)))
	nextAt := time.Now()
	rep.event(goneAt, nextAt, "after %v of silence the brokers send their next queries", quiet)
	pl := loads{startLoad(r, pb, pxAddr, queryEvery, next, time.Minute)}
	dl := loads{startLoad(r, db, srvAddr, queryEvery, next, time.Minute)}
	if !pl[0].WaitSent(next, time.Minute) || !dl[0].WaitSent(next, time.Minute) {
		return nil, fmt.Errorf("the %d queries after the silence were not all sent within a minute", next)
	}
	endLoads(pl, dl, rss, w)
	endAt := time.Now()
	st, err := newSrv.stats()
	if err != nil {
		return nil, err
	}

	var deadEnd *harness.LinkEnd
	for _, e := range px.ends.All() {
		if e.Opened.Before(goneAt) && e.At.After(goneAt) {
			rep.event(goneAt, e.At, "proxy closed the idle link: %s (%s)", e.Reason, e.Err)
			if deadEnd == nil {
				deadEnd = &e
			}
		}
	}
	for _, c := range w.After(goneAt) {
		rep.event(goneAt, c.At, "endpoint %s (%s)", c.State, c.Reason)
	}
	for _, c := range pcl.snapshot() {
		if c.At.After(goneAt) {
			rep.event(goneAt, c.At, "proxied broker saw its connection close (%d queries in flight)", c.FailedFast)
			break
		}
	}
	prs, drs := pl.records(), dl.records()
	for _, x := range []struct {
		name string
		rs   []queryRecord
	}{{"proxied", prs}, {"direct", drs}} {
		if len(x.rs) > 0 {
			q := x.rs[0]
			rep.event(goneAt, q.Done, "%s: the first query after the silence: %s after %s", x.name, q.Outcome, secs(q.Latency))
		}
	}

	base, peak := rss.growth(goneAt)
	dt, p := paths{direct: dl, proxied: pl, from: nextAt, to: endAt, recoveryFrom: nextAt, window: endAt.Sub(nextAt),
		directQueue: db.Stats().PeakQueueBytes, proxyGrowth: peak - base, stats: st}.rows()
	rep.Rows = []Row{dt, p}
	rep.note("one idle connection per path; the peer goes away %s after the last query; %v of silence; counts are the %d queries sent after it, one every %v; recovery: from the first query after the silence until one succeeds",
		secs(goneAt.Sub(lastTraffic)), quiet, next, queryEvery)

	// Target: found before the next query, or that query fails fast.
	found := deadEnd != nil && deadEnd.At.Before(nextAt)
	var first queryRecord
	if len(prs) > 0 {
		first = prs[0]
	}
	fastFail := len(prs) > 0 && first.Outcome == pinotsim.FailedFast && first.Latency < time.Second
	detail := "the proxy closed no pre-silence link"
	if deadEnd != nil {
		detail = fmt.Sprintf("the proxy closed the idle link %s after the peer went away (%s), %s before the next query",
			secs(deadEnd.At.Sub(goneAt)), deadEnd.Reason, secs(nextAt.Sub(deadEnd.At)))
	}
	rep.check(found || fastFail, "found by keepalive before the next query, or it fails fast",
		"%s; the next query: %s after %s", detail, first.Outcome, secs(first.Latency))
	// Control.
	var dFirst queryRecord
	if len(drs) > 0 {
		dFirst = drs[0]
	}
	rep.check(len(drs) > 0 && dFirst.Outcome == pinotsim.TimedOut && dt.OK == 0 && len(dcl.snapshot()) == 0,
		"control: the direct query waits out its timeout", "the direct broker's next query: %s after %s; %d of %d after the silence succeeded; its connection closed: %v",
		dFirst.Outcome, secs(dFirst.Latency), dt.OK, dt.Sent, len(dcl.snapshot()) > 0)
	return rep, nil
}
