//go:build linux

package main

import (
	"fmt"
	"time"
)

// replayReadmit is replay 5, readmission: no query may go to a connection
// opened before a server was readmitted (readmission closes every link
// opened before it: README, The failure detector).
//
// A server process runs in a peer namespace. A broker queries it straight,
// another through a proxy process; each through a measuring tap that
// records which connection every request frame went out on (a broker does
// not tell). The operator disables the server through the proxy's admin
// API (real HTTP), restarts it (its node drops the old connections, so no
// FIN reaches a client, and a new process listens on the same address),
// and enables it again.
//
// Target through the proxy: after the enable, 0 request frames on
// connections opened before it, and queries succeed. Control: the direct
// broker keeps sending on its pre-restart connection, where every query
// times out.
func replayReadmit(r *rig) (*Report, error) {
	const (
		queryEvery = 100 * time.Millisecond
		observe    = 4 * time.Second
	)
	rep := &Report{N: 5, Name: "readmission"}
	t, srvAddr, old, px, err := serverBehindProxy(r, 5)
	if err != nil {
		return nil, err
	}
	ptap, err := startTap(r, px.listeners["s0"])
	if err != nil {
		return nil, err
	}
	dtap, err := startTap(r, srvAddr)
	if err != nil {
		return nil, err
	}
	var pcl closeLog
	pb := newBroker(r, "Broker_proxy", brokerTimeout, 0, &pcl)
	db := newBroker(r, "Broker_direct", brokerTimeout, 0, nil)
	pl := loads{startLoad(r, pb, ptap.addr(), queryEvery, 300, 30*time.Second)}
	dl := loads{startLoad(r, db, dtap.addr(), queryEvery, 300, 30*time.Second)}
	if !pl.waitOK(time.Time{}, 5, 5*time.Second) || !dl.waitOK(time.Time{}, 5, 5*time.Second) {
		return nil, fmt.Errorf("no traffic before the disable")
	}
	rss := sampleRSS(r, px.pid, time.Minute)
	w := watchEndpoint(r, px, srvAddr, time.Minute)
	time.Sleep(300 * time.Millisecond)

	disableAt := time.Now()
	res, err := px.action(srvAddr, "disable")
	if err != nil {
		return nil, err
	}
	rep.event(disableAt, disableAt, "POST /v1/endpoints/%s/disable: %v", srvAddr, res["changed"])
	time.Sleep(300 * time.Millisecond)
	// The disable evicts the endpoint's links; each leaves its count once
	// its goroutines have ended it, which a loaded machine may do later
	// than the pause above: waited for (5 s at most), the check below
	// says what it came to.
	disabled, err := px.endpoint(srvAddr)
	for deadline := time.Now().Add(5 * time.Second); err == nil && disabled.LiveLinks > 0 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		disabled, err = px.endpoint(srvAddr)
	}
	if err != nil {
		return nil, err
	}

	// The restart: the node drops the old connections, the old process
	// dies, a new one listens on the same address.
	ports, err := t.establishedFrom(9000)
	if err != nil {
		return nil, err
	}
	restartAt := time.Now()
	if len(ports) > 0 {
		if err := t.dropFlows("lprestart", ports); err != nil {
			return nil, err
		}
	}
	old.kill()
	newSrv, err := startServer(r, t.peer, srvAddr, "")
	if err != nil {
		return nil, err
	}
	rep.event(disableAt, restartAt, "server restarted: %d old connection(s) dropped at its node, old process killed, new one listening", len(ports))
	time.Sleep(700 * time.Millisecond)

	res, err = px.action(srvAddr, "enable")
	if err != nil {
		return nil, err
	}
	enabled, err := px.endpoint(srvAddr)
	if err != nil {
		return nil, err
	}
	enableAt := enabled.Since // the readmission, by the proxy's clock
	rep.event(disableAt, enableAt, "POST /v1/endpoints/%s/enable: %v; endpoint %s (%s)", srvAddr, res["changed"], enabled.State, enabled.Reason)

	pBack := pl.waitOK(enableAt, 5, 3*time.Second)
	time.Sleep(time.Until(enableAt.Add(observe)))
	endAt := time.Now()
	endLoads(pl, dl, rss, w)
	st, err := newSrv.stats()
	if err != nil {
		return nil, err
	}

	for _, c := range w.After(disableAt) {
		rep.event(disableAt, c.At, "endpoint %s (%s)", c.State, c.Reason)
	}
	for _, e := range px.ends.All() {
		if e.Opened.Before(disableAt) && e.At.After(disableAt) {
			rep.event(disableAt, e.At, "proxy closed a pre-disable link: %s", e.Reason)
		}
	}
	for _, c := range pcl.snapshot() {
		if c.At.After(disableAt) {
			rep.event(disableAt, c.At, "proxied broker saw its connection close (%d queries in flight)", c.FailedFast)
			break
		}
	}
	pFrames, pConns := ptap.framesOnOlder(enableAt)
	dFrames, dConns := dtap.framesOnOlder(enableAt)
	prs, drs := pl.records(), dl.records()
	if f, ok := firstOK(prs, enableAt); ok {
		rep.event(disableAt, f.Done, "proxied: first query after the enable answered")
	}

	base, peak := rss.growth(disableAt)
	d, p := paths{direct: dl, proxied: pl, from: disableAt, to: endAt, recoveryFrom: enableAt, window: endAt.Sub(enableAt),
		directQueue: db.Stats().PeakQueueBytes, proxyGrowth: peak - base, stats: st}.rows()
	rep.Rows = []Row{d, p}
	rep.note("one connection per path, a query every %v; disabled %s, then enabled and observed for %v; counts are queries sent from the disable on; recovery: from the enable until a query succeeds",
		queryEvery, secs(enableAt.Sub(disableAt)), observe)

	// Target.
	after := count(prs, enableAt, endAt)
	rep.check(pFrames == 0 && pBack && disabled.State == "disabled" && disabled.LiveLinks == 0,
		"0 queries on pre-enable connections after the enable",
		"%d request frames on %d connections opened before the enable (endpoint %s with %d live links before it); after it: %d ok, %d failed fast, %d timed out",
		pFrames, pConns, disabled.State, disabled.LiveLinks, after.OK, after.FailedFast, after.TimedOut)
	// Control.
	dAfter := count(drs, enableAt, endAt)
	rep.check(dFrames > 0 && dAfter.OK == 0, "control: the direct broker keeps its pre-restart connection",
		"%d request frames on %d connections opened before the enable; after it: %d ok, %d timed out", dFrames, dConns, dAfter.OK, dAfter.TimedOut)
	return rep, nil
}
