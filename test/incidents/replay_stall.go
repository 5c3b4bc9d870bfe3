//go:build linux

package main

import (
	"fmt"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
)

// replayStall is replay 2, the path stall (incident 2: connections stop
// delivering with no restart, the broker's outbound queue grows without
// bound, and on recovery the servers execute the stale backlog).
//
// N servers run in a peer namespace; one broker queries all of them
// straight, another through a proxy process (a listener per server), at a
// steady rate with requests of Pinot's size for many segments. The stall:
// in the peer namespace, every packet of three of the N connections of
// each path is dropped for stallFor (no restart: the servers live on, new
// connections pass), then the drop is removed.
//
// Targets through the proxy: the stalled links fail fast within 3 s (the
// broker's connection is closed and its in-flight queries fail; none runs
// into the broker's timeout); the proxy's memory grows by at most the high
// watermark per stalled link plus 10 MiB; no stale request is executed
// after the recovery. Control: the direct broker's queries to the stalled
// servers time out for the whole stall, its outbound queue grows, and its
// backlog is executed stale once the path heals.
func replayStall(r *rig) (*Report, error) {
	const (
		n           = 5
		stalled     = 3
		queryEvery  = 20 * time.Millisecond // 50 queries/s per connection
		requestSize = 16 << 10              // ~300 segments' names: 800 KiB/s per connection
		stallFor    = 10 * time.Second
	)
	rep := &Report{N: 2, Name: "path stall"}
	t, err := newTopo(r, 2)
	if err != nil {
		return nil, err
	}
	var addrs []string
	var servers []*pinotsim.Server
	for i := range n {
		addr := t.addr(9000 + i)
		var srv *pinotsim.Server
		if err := t.peer.Do(func() error {
			var err error
			srv, err = pinotsim.NewServer(pinotsim.ServerConfig{Addr: addr})
			return err
		}); err != nil {
			return nil, fmt.Errorf("server %s: %w", addr, err)
		}
		r.cleanup(func() { _ = srv.Close() })
		if err := waitReachable(addr); err != nil {
			return nil, err
		}
		addrs = append(addrs, addr)
		servers = append(servers, srv)
	}
	px, err := startProxy(r, proxyConfig{upstreams: addrs}.yaml())
	if err != nil {
		return nil, err
	}
	var pcl, dcl closeLog
	pb := newBroker(r, "Broker_proxy", brokerTimeout, requestSize, &pcl)
	db := newBroker(r, "Broker_direct", brokerTimeout, requestSize, &dcl)
	var pl, dl loads
	for i := range n {
		pl = append(pl, startLoad(r, pb, px.listeners[fmt.Sprint("s", i)], queryEvery, 3000, 50*time.Second))
		dl = append(dl, startLoad(r, db, addrs[i], queryEvery, 3000, 50*time.Second))
	}
	if !pl.waitOK(time.Time{}, 5, 5*time.Second) || !dl.waitOK(time.Time{}, 5, 5*time.Second) {
		return nil, fmt.Errorf("no traffic before the stall")
	}
	rss := sampleRSS(r, px.pid, time.Minute)
	time.Sleep(500 * time.Millisecond)

	var stalledPorts []int
	for i := range stalled {
		stalledPorts = append(stalledPorts, 9000+i)
	}
	ports, err := t.establishedFrom(stalledPorts...)
	if err != nil {
		return nil, err
	}
	if len(ports) != 2*stalled {
		return nil, fmt.Errorf("want %d established connections to the stalled servers (proxy and direct), got client ports %v", 2*stalled, ports)
	}
	stallAt := time.Now()
	if err := t.dropFlows("lpstall", ports); err != nil {
		return nil, err
	}
	rep.event(stallAt, stallAt, "stall: every packet of %d of %d connections per path dropped (servers %v..%v)", stalled, n, addrs[0], addrs[stalled-1])

	// The stall lasts; the direct broker's queue grows.
	time.Sleep(stallFor)
	queueAtHeal := db.Stats().QueueBytes
	if err := t.heal("lpstall"); err != nil {
		return nil, err
	}
	healAt := time.Now()
	rep.event(stallAt, healAt, "path heals; the direct broker's outbound queue holds %s", mib(queueAtHeal))

	// Recovery: the proxied queries recovered long ago; the direct ones
	// once the kernel retransmits (RTO backoff) and the backlog drains.
	directBack := loads(dl[:stalled]).waitOK(healAt, 5, 30*time.Second)
	time.Sleep(time.Second)
	endAt := time.Now()
	endLoads(pl, dl, rss, nil)
	time.Sleep(300 * time.Millisecond) // the servers finish reading what their kernels hold
	var pStale, dStale, pExec int64
	for _, s := range servers {
		st := s.Stats()
		pStale += countOf(st, "Broker_proxy").Stale
		dStale += countOf(st, "Broker_direct").Stale
		pExec += countOf(st, "Broker_proxy").Executed
	}

	// The proxied broker's connections to the stalled servers' listeners.
	stalledListener := map[string]int{}
	for i := range stalled {
		stalledListener[px.listeners[fmt.Sprint("s", i)]] = i
	}
	firstClose := map[int]pinotsim.ConnClose{}
	for _, c := range pcl.snapshot() {
		i, ok := stalledListener[c.Addr]
		if _, seen := firstClose[i]; ok && !seen && c.At.After(stallAt) {
			firstClose[i] = c
			rep.event(stallAt, c.At, "proxied broker: connection to stalled server %d closed, %d in-flight queries failed fast", i, c.FailedFast)
		}
	}
	var maxQueued int64
	reasons := map[string]int{}
	for _, e := range px.ends.All() {
		if e.Opened.Before(stallAt) && e.At.After(stallAt) {
			reasons[e.Reason]++
			maxQueued = max(maxQueued, e.MaxQueued)
			rep.event(stallAt, e.At, "proxy closed a stalled link: %s (queued at most %s)", e.Reason, mib(e.MaxQueued))
		}
	}
	for i := range stalled {
		if f, ok := firstOK(pl[i].Records(), stallAt); ok {
			rep.event(stallAt, f.Done, "proxied: first query to stalled server %d answered again", i)
		}
		if f, ok := firstOK(dl[i].Records(), stallAt.Add(100*time.Millisecond)); ok {
			rep.event(stallAt, f.Done, "direct: first query to stalled server %d answered again", i)
		}
	}
	if len(dcl.snapshot()) > 0 {
		rep.event(stallAt, dcl.snapshot()[0].At, "direct broker: a connection closed")
	}

	prs, drs := loads(pl[:stalled]).records(), loads(dl[:stalled]).records()
	pt, dt := count(prs, stallAt, endAt), count(drs, stallAt, endAt)
	window := endAt.Sub(stallAt)
	pRec, pOK := recovery(pl[:stalled], stallAt)
	dRec, dOK := recovery(dl[:stalled], stallAt.Add(100*time.Millisecond))
	if dOK {
		dRec += 100 * time.Millisecond
	}
	base, peak := rss.growth(stallAt)
	growth := max(peak-base, 0)
	dPeak := db.Stats().PeakQueueBytes
	rep.Rows = []Row{
		row("direct", dt, dRec, dOK, window, "queue "+mib(dPeak), dStale),
		row("proxy", pt, pRec, pOK, window, "RSS +"+mib(growth), pStale),
	}
	rep.note("%d of %d connections per path stalled for %v; %d queries/s per connection, %s requests; counts are queries to the stalled servers sent from the stall to %.1fs after it; recovery: from the stall until queries to every stalled server succeed again",
		stalled, n, stallFor, int(time.Second/queryEvery), mib(requestSize), window.Seconds())

	// Targets.
	worst := time.Duration(0)
	for i := range stalled {
		c, ok := firstClose[i]
		if !ok {
			worst = time.Hour
			break
		}
		worst = max(worst, c.At.Sub(stallAt))
	}
	inStall := count(prs, stallAt, healAt)
	rep.check(len(firstClose) == stalled && worst <= 3*time.Second && inStall.TimedOut == 0, "stalled links fail fast within 3s",
		"%d of %d proxied connections to stalled servers closed, the last %s after the stall began; proxied queries to them during the stall: %d failed fast, %d timed out, %d ok",
		len(firstClose), stalled, secs(worst), inStall.FailedFast, inStall.TimedOut, inStall.OK)
	limit := int64(stalled*highWaterMark + 10<<20)
	rep.check(peak > 0 && growth <= limit, "proxy memory growth <= high watermark per stalled link + 10 MiB",
		"proxy RSS %s before the stall, peak %s: +%s (limit %s); links closed %v, at most %s queued on one",
		mib(base), mib(peak), mib(growth), mib(limit), reasons, mib(maxQueued))
	rep.check(pStale == 0 && pExec > 0, "0 stale requests executed",
		"the servers executed %d stale requests from the proxied broker (of %d)", pStale, pExec)
	// Controls.
	dIn := count(drs, stallAt.Add(100*time.Millisecond), healAt)
	rep.check(dIn.OK == 0 && dIn.TimedOut > 0 && dIn.FailedFast == 0 && dStale > 0 && directBack, "control: direct path stalls, queues and runs its backlog stale",
		"direct queries to the stalled servers during the stall: %d ok, %d timed out, %d failed fast; queue peak %s; %d stale executed after the heal; recovered: %v",
		dIn.OK, dIn.TimedOut, dIn.FailedFast, mib(dPeak), dStale, directBack)
	return rep, nil
}
