// Package demo is `livenessproxy demo`: replay 1 of the incident suite
// (test/incidents), the node flap without FIN, in-process on loopback, with
// and without the proxy, in about ten seconds and without root.
//
// Simulated Pinot brokers that behave like Pinot did in the incidents
// (package pinotsim) query a simulated server at a steady rate, some
// straight, some through a livenessproxy, each on its own connection. The
// network between them is an in-process relay. The flap: the relay stops
// forwarding anything on the connections open at that moment, in both
// directions, and closes nothing (it stands in for the drop rule that the
// namespace replay installs at the server's node: no FIN or reset from the
// dying server reaches anyone); the server is closed and a new one starts
// on the same address. New connections reach it. Everything printed is
// measured during the run.
package demo

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// params shape a run. Run uses defaultParams; tests may change them.
type params struct {
	warmup, observe time.Duration // before and after the flap
	conns           int           // connections (brokers) per path
	queryEvery      time.Duration // per connection
	queryTimeout    time.Duration // the broker's per-query timeout

	requestTimeout time.Duration
	threshold      int
	initialDelay   time.Duration
}

func defaultParams() params {
	return params{
		warmup:       2 * time.Second,
		observe:      6 * time.Second,
		conns:        2,
		queryEvery:   200 * time.Millisecond,
		queryTimeout: 2 * time.Second,

		requestTimeout: 500 * time.Millisecond,
		threshold:      1, // the default: the time rule
		initialDelay:   300 * time.Millisecond,
	}
}

const listener = "pinot-server-0"

// pathResult is what was measured on one path, over the queries sent from
// the flap to the end of the observation.
type pathResult struct {
	pinotsim.Tally
	// Recovery is the time from the flap until every connection of the
	// path had a query sent after it succeed; Recovered is false if one
	// never did during the observation.
	Recovery  time.Duration
	Recovered bool
	// OpenAtEnd counts the connections opened before the flap that the
	// brokers still held at the end of the observation.
	OpenAtEnd int
	// OKAfterFlap counts queries sent at least 100 ms after the flap that
	// succeeded.
	OKAfterFlap int
}

// result is everything a run measured.
type result struct {
	Direct, Proxied pathResult
	FlapAt          time.Duration // since the start
	// LinkEnds are the proxy's links that ended after the flap, with At
	// relative to the flap.
	LinkEnds []linkEnd
	// States are the endpoint's state changes after the flap.
	States []stateChange
}

type linkEnd struct {
	At    time.Duration
	Stats proxy.LinkStats
}

type stateChange struct {
	At            time.Duration
	State, Reason string
}

// Run replays the node flap with and without the proxy and writes a short
// timeline and the two-row table to w. It takes about ten seconds; it
// returns early with ctx.Err() when ctx ends.
func Run(ctx context.Context, w io.Writer) error {
	_, err := run(ctx, w, defaultParams())
	return err
}

// measure sums a path's loads over the queries sent from flapAt on.
func measure(ls []*pinotsim.Load, flapAt time.Time) pathResult {
	var rs []pinotsim.Record
	for _, l := range ls {
		rs = append(rs, l.Records()...)
	}
	r := pathResult{Tally: pinotsim.Count(rs, flapAt, time.Time{})}
	r.OKAfterFlap = pinotsim.Count(rs, flapAt.Add(100*time.Millisecond), time.Time{}).OK
	r.Recovery, r.Recovered = pinotsim.Recovery(ls, flapAt)
	return r
}

// run replays the flap: it builds the loopback world (rig), loads both
// paths, flaps the server's node, prints the events as they happen and
// then the table, and returns what it measured.
func run(ctx context.Context, w io.Writer, p params) (res *result, err error) {
	start := time.Now()
	out := &printer{w: w, start: start}
	r := &rig{}
	defer r.close()
	if err := r.startServer(); err != nil {
		return nil, err
	}
	if err := r.startProxy(p); err != nil {
		return nil, err
	}
	r.addBrokers(p)
	printPlan(out, p)
	r.startLoads(p)
	out.line(time.Now(), "load starts on both paths")
	r.watchStates(ctx)
	if err := sleep(ctx, p.warmup); err != nil {
		return nil, err
	}
	flapAt, err := r.flap(out)
	if err != nil {
		return nil, err
	}
	if err := r.watcher(flapAt, out).until(ctx, flapAt.Add(p.observe)); err != nil {
		return nil, err
	}
	res = r.measure(p, flapAt, flapAt.Sub(start))
	printResult(out, res, p)
	r.shutdown()
	return res, ctx.Err()
}

// printPlan says what the run will do, before the load starts.
func printPlan(out *printer, p params) {
	out.raw("livenessproxy demo: a server node flaps without a FIN, replayed on loopback with and without the proxy (~%s)",
		(p.warmup + p.observe + p.queryTimeout).Round(time.Second))
	out.raw("  load     %d connections per path, a query every %s on each (Pinot-style broker, %s query timeout)", p.conns, p.queryEvery, p.queryTimeout)
	out.raw("  direct   brokers → network → server")
	out.raw("  proxied  brokers → livenessproxy → network → server (request_timeout %s, threshold %d, connect probe after %s)",
		p.requestTimeout, p.threshold, p.initialDelay)
}

// printResult prints the direct path's state at the end and the table.
func printResult(out *printer, res *result, p params) {
	state := fmt.Sprintf("%d of %d connections still open", res.Direct.OpenAtEnd, p.conns)
	out.line(time.Now(), "direct: %d queries sent since the flap, %d answered, %d timed out; %s (the kernel retransmits for ~15 min)",
		res.Direct.Sent, res.Direct.OK, res.Direct.TimedOut, state)

	out.raw("")
	out.table([][]string{
		{"path", "sent", "succeeded", "failed fast", "timed out", "time to recovery"},
		row("direct", res.Direct, p.observe),
		row("via proxy", res.Proxied, p.observe),
	})
	out.raw("(queries sent in the %s after the flap; recovery: until every connection had a query answered again)", p.observe)
}

// watcher prints the events after the flap as they happen: each dead
// link the proxy closes, each state change of the endpoint, and the
// proxied path's recovery.
type watcher struct {
	flapAt  time.Time
	out     *printer
	proxied []*pinotsim.Load
	ends    func() ([]proxy.LinkStats, []time.Time) // the links ended so far, and when
	states  func() []stateChange                    // the state changes after the flap so far

	endsSeen, statesSeen int
	recovered            bool
}

// watchEvery is how often the watcher looks for new events.
const watchEvery = 20 * time.Millisecond

// until prints events as they come until end (or ctx ends).
func (w *watcher) until(ctx context.Context, end time.Time) error {
	tick := time.NewTicker(watchEvery)
	defer tick.Stop()
	for {
		w.poll()
		if !time.Now().Before(end) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}

func (w *watcher) poll() {
	ends, at := w.ends()
	for ; w.endsSeen < len(ends); w.endsSeen++ {
		e, when := ends[w.endsSeen], at[w.endsSeen]
		if when.After(w.flapAt) && e.Opened.Before(w.flapAt) {
			w.out.line(when, "proxy closes a dead link (%s): its broker's in-flight queries fail at once", e.Reason)
		}
	}
	states := w.states()
	for ; w.statesSeen < len(states); w.statesSeen++ {
		c := states[w.statesSeen]
		what := map[string]string{"excluded": "endpoint excluded: new connections refused", "healthy": "endpoint readmitted"}[c.State]
		if what == "" {
			what = "endpoint " + c.State
		}
		w.out.line(w.flapAt.Add(c.At), "%s (%s)", what, c.Reason)
	}
	if !w.recovered {
		if rec, ok := pinotsim.Recovery(w.proxied, w.flapAt); ok {
			w.recovered = true
			w.out.line(w.flapAt.Add(rec), "proxied: every connection answered again, by the new server")
		}
	}
}

// sleep waits for d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func row(name string, r pathResult, window time.Duration) []string {
	rec := fmt.Sprintf("none in %.0fs", window.Seconds())
	if r.Recovered {
		rec = fmt.Sprintf("%.2fs", r.Recovery.Seconds())
	}
	return []string{name, fmt.Sprint(r.Sent), fmt.Sprint(r.OK), fmt.Sprint(r.FailedFast), fmt.Sprint(r.TimedOut), rec}
}

// printer writes timeline lines stamped relative to the start.
type printer struct {
	w     io.Writer
	start time.Time
}

func (p *printer) line(at time.Time, format string, args ...any) {
	fmt.Fprintf(p.w, "%8s  %s\n", fmt.Sprintf("+%.2fs", at.Sub(p.start).Seconds()), fmt.Sprintf(format, args...))
}

func (p *printer) raw(format string, args ...any) { fmt.Fprintf(p.w, format+"\n", args...) }

func (p *printer) table(rows [][]string) {
	widths := make([]int, len(rows[0]))
	for _, r := range rows {
		for i, c := range r {
			widths[i] = max(widths[i], len([]rune(c)))
		}
	}
	for _, r := range rows {
		var b strings.Builder
		for i, c := range r {
			if i == 0 {
				fmt.Fprintf(&b, "%-*s", widths[i], c)
			} else {
				fmt.Fprintf(&b, "  %*s", widths[i], c)
			}
		}
		fmt.Fprintln(p.w, b.String())
	}
}
