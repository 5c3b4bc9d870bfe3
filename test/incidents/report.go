//go:build linux

package main

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
)

// Report is what one replay measured.
type Report struct {
	N    int
	Name string
	// Rows: direct first, then through the proxy.
	Rows []Row
	// Checks are the targets the proxied path must meet (recovery within a
	// bound, bounded memory, nothing stale executed, ...) and the controls
	// (the direct path shows the failure, so the replay is known to be real).
	Checks []Check
	// Timeline is what happened, relative to the fault.
	Timeline []Event
	// Notes say what a column means in this replay.
	Notes []string
}

// Row is one path of a replay.
type Row struct {
	Path       string // "direct" or "proxy"
	Sent       int
	OK         int
	FailedFast int
	TimedOut   int
	// Recovery is the time until queries succeed again (see the replay's
	// note for where it is measured from); Recovered false: not within the
	// observation window Window.
	Recovery  time.Duration
	Recovered bool
	Window    time.Duration
	// PeakMem is the peak memory, already formatted with what it is.
	PeakMem string
	Stale   int64
}

// Check is one asserted target or control.
type Check struct {
	Name   string
	OK     bool
	Detail string
}

func (r *Report) check(ok bool, name, format string, args ...any) {
	r.Checks = append(r.Checks, Check{Name: name, OK: ok, Detail: fmt.Sprintf(format, args...)})
}

// Event is one line of a replay's timeline.
type Event struct {
	At   time.Duration // since the fault
	Text string
}

func (r *Report) event(t0, at time.Time, format string, args ...any) {
	r.Timeline = append(r.Timeline, Event{At: at.Sub(t0), Text: fmt.Sprintf(format, args...)})
}

// Lines returns the timeline in time order, one formatted line per event.
func (r *Report) Lines() []string {
	ev := append([]Event(nil), r.Timeline...)
	sort.SliceStable(ev, func(i, j int) bool { return ev[i].At < ev[j].At })
	out := make([]string, len(ev))
	for i, e := range ev {
		out[i] = fmt.Sprintf("%+8.2fs  %s", e.At.Seconds(), e.Text)
	}
	return out
}

func (r *Report) note(format string, args ...any) {
	r.Notes = append(r.Notes, fmt.Sprintf(format, args...))
}

// Failed returns the checks that did not pass.
func (r *Report) Failed() []Check {
	var out []Check
	for _, c := range r.Checks {
		if !c.OK {
			out = append(out, c)
		}
	}
	return out
}

func row(path string, t tally, rec time.Duration, recovered bool, window time.Duration, mem string, stale int64) Row {
	return Row{Path: path, Sent: t.Sent, OK: t.OK, FailedFast: t.FailedFast, TimedOut: t.TimedOut,
		Recovery: rec, Recovered: recovered, Window: window, PeakMem: mem, Stale: stale}
}

func (r Row) recoveryString() string {
	if !r.Recovered {
		return fmt.Sprintf("none in %.0fs", r.Window.Seconds())
	}
	return fmt.Sprintf("%.2fs", r.Recovery.Seconds())
}

// writeTable prints the reports side by side: a row per path.
func writeTable(w io.Writer, reports []*Report) {
	rows := [][]string{{"replay", "path", "sent", "succeeded", "failed fast", "timed out", "time to recovery", "peak memory", "stale executed"}}
	for _, rep := range reports {
		for i, r := range rep.Rows {
			name := ""
			if i == 0 {
				name = fmt.Sprintf("%d. %s", rep.N, rep.Name)
			}
			rows = append(rows, []string{name, r.Path, fmt.Sprint(r.Sent), fmt.Sprint(r.OK), fmt.Sprint(r.FailedFast),
				fmt.Sprint(r.TimedOut), r.recoveryString(), r.PeakMem, fmt.Sprint(r.Stale)})
		}
	}
	widths := make([]int, len(rows[0]))
	for _, r := range rows {
		for i, c := range r {
			widths[i] = max(widths[i], len([]rune(c)))
		}
	}
	line := func(cells []string) {
		var b strings.Builder
		b.WriteString("|")
		for i, c := range cells {
			pad := widths[i] - len([]rune(c))
			if i <= 1 || i == 7 {
				fmt.Fprintf(&b, " %s%s |", c, strings.Repeat(" ", pad))
			} else {
				fmt.Fprintf(&b, " %s%s |", strings.Repeat(" ", pad), c)
			}
		}
		fmt.Fprintln(w, b.String())
	}
	line(rows[0])
	var sep strings.Builder
	sep.WriteString("|")
	for i, wd := range widths {
		if i <= 1 || i == 7 {
			sep.WriteString(" " + strings.Repeat("-", wd) + " |")
		} else {
			sep.WriteString(" " + strings.Repeat("-", wd-1) + ": |")
		}
	}
	fmt.Fprintln(w, sep.String())
	for _, r := range rows[1:] {
		line(r)
	}
}

// writeChecks prints each replay's notes and checks.
func writeChecks(w io.Writer, reports []*Report, timelines bool) {
	for _, rep := range reports {
		fmt.Fprintf(w, "\n%d. %s\n", rep.N, rep.Name)
		for _, n := range rep.Notes {
			fmt.Fprintf(w, "   note: %s\n", n)
		}
		if timelines {
			for _, e := range rep.Lines() {
				fmt.Fprintf(w, "   %s\n", e)
			}
		}
		for _, c := range rep.Checks {
			mark := "ok   "
			if !c.OK {
				mark = "FAIL "
			}
			fmt.Fprintf(w, "   [%s] %s: %s\n", mark, c.Name, c.Detail)
		}
	}
}

// mib formats a byte count.
func mib(n int64) string {
	switch {
	case n >= 1<<20 || n <= -1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10 || n <= -1<<10:
		return fmt.Sprintf("%.0f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// secs formats a duration in seconds.
func secs(d time.Duration) string { return fmt.Sprintf("%.2fs", d.Seconds()) }

// paths is what a replay measured on its two paths, for the table's rows.
type paths struct {
	direct, proxied loads
	from, to        time.Time     // the counts: queries sent in [from, to)
	recoveryFrom    time.Time     // recovery: from then until every load had a query succeed
	window          time.Duration // how long recovery was watched for
	directQueue     int64         // the direct brokers' peak outbound queue
	proxyGrowth     int64         // the proxy process's RSS growth
	stats           pinotsim.ServerStats
}

// rows returns the direct and the proxy row.
func (m paths) rows() (direct, proxied Row) {
	dRec, dOK := recovery(m.direct, m.recoveryFrom)
	pRec, pOK := recovery(m.proxied, m.recoveryFrom)
	direct = row("direct", count(m.direct.records(), m.from, m.to), dRec, dOK, m.window,
		"queue "+mib(m.directQueue), countOf(m.stats, "Broker_direct").Stale)
	proxied = row("proxy", count(m.proxied.records(), m.from, m.to), pRec, pOK, m.window,
		"RSS +"+mib(max(m.proxyGrowth, 0)), countOf(m.stats, "Broker_proxy").Stale)
	return direct, proxied
}

// endLoads lets the queries in flight on both paths end (each at the
// latest a second after the broker's timeout) and stops the samplers (w
// may be nil).
func endLoads(pl, dl loads, rss *rssSampler, w *stateWatcher) {
	append(append(loads(nil), pl...), dl...).finish(brokerTimeout + time.Second)
	rss.stop()
	if w != nil {
		w.Stop()
	}
}
