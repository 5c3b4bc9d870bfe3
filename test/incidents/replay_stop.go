//go:build linux

package main

import (
	"fmt"
	"net"
	"strconv"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy"
)

// replayStop is replay 3, the stopped server (incident 3: a server that
// keeps its connections open and answers nothing).
//
// A server process (with a GET /health endpoint in the same process, like
// a Pinot server's admin port) is queried by a broker straight and by
// another through a proxy process whose detector probes /health (README,
// "Choosing the probe": a connect probe passes against a stopped process,
// whose kernel still completes handshakes). Under load the server is
// stopped with SIGSTOP for stopFor, then continued with SIGCONT. Its kernel
// keeps ACKing: no TCP timer fires, only the proxy's unanswered-request
// tracker can see it. No network fault is needed, so it runs on loopback.
//
// Targets through the proxy: the endpoint is excluded (reason unanswered)
// once threshold requests went unanswered; it is not readmitted while
// stopped, and is readmitted by a probe after SIGCONT. Control: every
// direct query sent while the server is stopped times out.
func replayStop(r *rig) (*Report, error) {
	const (
		queryEvery = 50 * time.Millisecond
		stopFor    = 10 * time.Second
		slack      = 400 * time.Millisecond // judging slack, ticker phase, -race
	)
	rep := &Report{N: 3, Name: "stopped server"}
	srv, err := startServer(r, nil, "127.0.0.1:0", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	_, hp, _ := net.SplitHostPort(srv.health)
	healthPort, err := strconv.Atoi(hp)
	if err != nil {
		return nil, fmt.Errorf("health address %q: %w", srv.health, err)
	}
	px, err := startProxy(r, proxyConfig{upstreams: []string{srv.addr}, httpProbe: healthPort}.yaml())
	if err != nil {
		return nil, err
	}
	pb := newBroker(r, "Broker_proxy", brokerTimeout, 0, nil)
	db := newBroker(r, "Broker_direct", brokerTimeout, 0, nil)
	pl := loads{startLoad(r, pb, px.listeners["s0"], queryEvery, 1000, 40*time.Second)}
	dl := loads{startLoad(r, db, srv.addr, queryEvery, 1000, 40*time.Second)}
	if !pl.waitOK(time.Time{}, 5, 5*time.Second) || !dl.waitOK(time.Time{}, 5, 5*time.Second) {
		return nil, fmt.Errorf("no traffic before the stop")
	}
	rss := sampleRSS(r, px.pid, time.Minute)
	w := watchEndpoint(r, px, srv.addr, time.Minute)
	time.Sleep(300 * time.Millisecond)

	stopAt := time.Now()
	if err := srv.signal(syscall.SIGSTOP); err != nil {
		return nil, err
	}
	if !waitProcState(srv.pid, "T", 2*time.Second) {
		return nil, fmt.Errorf("server process %d not stopped (state %s)", srv.pid, procState(srv.pid))
	}
	rep.event(stopAt, stopAt, "server process stopped (SIGSTOP); its kernel keeps the connections open and ACKs")
	time.Sleep(time.Until(stopAt.Add(stopFor)))
	contAt := time.Now()
	atCont, _ := px.endpoint(srv.addr)
	if err := srv.signal(syscall.SIGCONT); err != nil {
		return nil, err
	}
	waitProcState(srv.pid, "RS", 2*time.Second)
	rep.event(stopAt, contAt, "server process continued (SIGCONT); the endpoint is %s", atCont.State)

	readmitBound := maxDelay + probeTimeout + slack
	pBack := pl.waitOK(contAt, 5, readmitBound+2*time.Second)
	dBack := dl.waitOK(contAt, 5, 5*time.Second)
	time.Sleep(time.Second) // it stays healthy
	endAt := time.Now()
	endLoads(pl, dl, rss, w)
	st, err := srv.stats()
	if err != nil {
		return nil, err
	}

	changes := w.After(stopAt)
	var excludedAt, readmittedAt time.Time
	var excludedReason string
	readmitsWhileStopped := 0
	for _, c := range changes {
		rep.event(stopAt, c.At, "endpoint %s (%s)", c.State, c.Reason)
		switch {
		case c.State == "excluded" && excludedAt.IsZero():
			excludedAt, excludedReason = c.At, c.Reason
		case c.State == "healthy" && c.At.Before(contAt):
			readmitsWhileStopped++
		case c.State == "healthy" && readmittedAt.IsZero():
			readmittedAt = c.At
		}
	}
	last := "?"
	if len(changes) > 0 {
		last = changes[len(changes)-1].State
	}
	reasons := map[string]int{}
	for _, e := range px.ends.All() {
		if e.At.After(stopAt) && e.At.Before(contAt) {
			reasons[e.Reason]++
		}
	}
	okProbes, _ := px.counter("probes_total", "result", "ok")
	failProbes, _ := px.counter("probes_total", "result", "fail")
	rep.event(stopAt, contAt, "while stopped: links closed %v, probes failed %v", reasons, failProbes)
	for _, x := range []struct {
		name string
		l    loads
	}{{"proxied", pl}, {"direct", dl}} {
		if f, ok := firstOK(x.l.records(), contAt); ok {
			rep.event(stopAt, f.Done, "%s: first query after SIGCONT answered", x.name)
		}
	}

	prs, drs := pl.records(), dl.records()
	window := endAt.Sub(stopAt)
	base, peak := rss.growth(stopAt)
	d, p := paths{direct: dl, proxied: pl, from: stopAt, to: endAt, recoveryFrom: contAt, window: endAt.Sub(contAt),
		directQueue: db.Stats().PeakQueueBytes, proxyGrowth: peak - base, stats: st}.rows()
	rep.Rows = []Row{d, p}
	rep.note("one connection per path, a query every %v; stopped for %v; counts are queries sent from SIGSTOP to %.1fs after it; recovery: from SIGCONT until a query succeeds again (none can before); detector probe: http /health",
		queryEvery, stopFor, window.Seconds())
	if !excludedAt.IsZero() {
		rep.note("detection: excluded %s after SIGSTOP; readmitted %s after SIGCONT", secs(excludedAt.Sub(stopAt)), secs(readmittedAt.Sub(contAt)))
	}

	// Targets.
	excludeBound := threshold*queryEvery + requestTimeout + slack
	rep.check(!excludedAt.IsZero() && excludedReason == string(proxy.CloseUnanswered) && excludedAt.Sub(stopAt) <= excludeBound,
		"excluded after the threshold", "excluded %s after SIGSTOP for %q (bound: %d x %v + request_timeout + %v = %s)",
		secs(excludedAt.Sub(stopAt)), excludedReason, threshold, queryEvery, slack, secs(excludeBound))
	rep.check(readmitsWhileStopped == 0 && atCont.State == "excluded", "not readmitted while stopped",
		"%d readmissions while stopped; %s at SIGCONT after %d failed probes", readmitsWhileStopped, atCont.State, atCont.FailedProbes)
	rep.check(!readmittedAt.IsZero() && readmittedAt.Sub(contAt) <= readmitBound && last == "healthy" && pBack && okProbes > 0,
		"readmitted by probe after SIGCONT", "healthy %s after SIGCONT (bound max_delay + probe_timeout + %v = %s), last state %s, probes ok %v; queries succeed again: %v",
		secs(readmittedAt.Sub(contAt)), slack, secs(readmitBound), last, okProbes, pBack)
	during := count(prs, stopAt, contAt)
	rep.check(during.TimedOut == 0 && during.FailedFast > 0, "proxied queries fail fast while stopped",
		"%d failed fast, %d timed out, %d ok", during.FailedFast, during.TimedOut, during.OK)
	// Control: queries sent while stopped (and early enough to time out
	// before SIGCONT) all time out.
	dd := count(drs, stopAt.Add(100*time.Millisecond), contAt.Add(-brokerTimeout))
	rep.check(dd.OK == 0 && dd.FailedFast == 0 && dd.TimedOut > 0 && dBack, "control: direct queries time out while stopped",
		"%d timed out, %d failed fast, %d ok; recovered after SIGCONT: %v", dd.TimedOut, dd.FailedFast, dd.OK, dBack)
	return rep, nil
}
