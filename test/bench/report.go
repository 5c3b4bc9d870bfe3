//go:build linux

package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"
)

// cpuMeter reads utime+stime of the client, server and proxy processes at
// the edges of the measured window.
type cpuMeter struct {
	pids           map[string]int // role -> pid
	atStart, atEnd map[string]time.Duration
	failed         map[string]bool
	// onBegin and onEnd, when set, run at the window's edges after the
	// snapshots (a traced run attaches strace there).
	onBegin, onEnd func()
}

func newCPUMeter(pids map[string]int) *cpuMeter {
	return &cpuMeter{pids: pids, atStart: map[string]time.Duration{}, atEnd: map[string]time.Duration{}, failed: map[string]bool{}}
}

func (m *cpuMeter) snap(into map[string]time.Duration) {
	for role, pid := range m.pids {
		t, err := cpuTime(pid)
		if err != nil {
			m.failed[role] = true
			continue
		}
		into[role] = t
	}
}

func (m *cpuMeter) begin() {
	m.snap(m.atStart)
	if m.onBegin != nil {
		m.onBegin()
	}
}

func (m *cpuMeter) end() {
	m.snap(m.atEnd)
	if m.onEnd != nil {
		m.onEnd()
	}
}

// used returns the CPU time role spent in the window.
func (m *cpuMeter) used(role string) (time.Duration, bool) {
	if _, ok := m.pids[role]; !ok || m.failed[role] {
		return 0, false
	}
	return m.atEnd[role] - m.atStart[role], true
}

// runResult is one scenario on one path in one round. Zero means "not
// measured" for every metric (omitted from JSON, "-" in the table).
type runResult struct {
	Scenario   string  `json:"scenario"`
	Path       string  `json:"path"`
	Round      int     `json:"round"`
	Seconds    float64 `json:"seconds"`
	Ops        int64   `json:"ops"`
	Errors     int64   `json:"errors,omitempty"`
	FirstError string  `json:"first_error,omitempty"`
	Throughput float64 `json:"throughput"` // in Unit
	Unit       string  `json:"unit"`
	P50us      float64 `json:"p50_us,omitempty"`
	P99us      float64 `json:"p99_us,omitempty"`
	// CPU per operation, µs (bulk: per 1 MiB frame, i.e. per MiB).
	ProxyCPUus  float64 `json:"proxy_cpu_us_per_op,omitempty"`
	ServerCPUus float64 `json:"server_cpu_us_per_op,omitempty"`
	ClientCPUus float64 `json:"client_cpu_us_per_op,omitempty"`
	TotalCPUus  float64 `json:"total_cpu_us_per_op,omitempty"`
	// ProxyCores is the proxy's CPU time over wall time (1.0 = one core busy).
	ProxyCores float64 `json:"proxy_cores,omitempty"`
	Skipped    string  `json:"skipped,omitempty"`
}

func newRunResult(sc scenario, p string, round int, lr loadResult, win window, m *cpuMeter) runResult {
	secs := win.end.Sub(win.start).Seconds()
	r := runResult{Scenario: sc.name, Path: p, Round: round, Seconds: secs, Ops: lr.ops, Errors: lr.errs, Unit: "ops/s"}
	if lr.firstErr != nil {
		r.FirstError = lr.firstErr.Error()
	}
	if secs <= 0 || lr.ops == 0 {
		return r
	}
	r.Throughput = float64(lr.ops) / secs
	if sc.bulk {
		r.Unit = "MiB/s"
		r.Throughput *= float64(sc.reqLen) / (1 << 20)
	} else {
		r.P50us = percentile(lr.lat, 0.50) / 1e3
		r.P99us = percentile(lr.lat, 0.99) / 1e3
	}
	perOp := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(lr.ops) }
	total, complete := 0.0, true
	for _, role := range roles {
		d, ok := m.used(role)
		if !ok {
			if _, present := m.pids[role]; present {
				complete = false
			}
			continue
		}
		total += perOp(d)
		switch role {
		case "proxy":
			if pd, ok := m.used("peer"); ok {
				d += pd // the mesh path's second sidecar
				total += perOp(pd)
			}
			r.ProxyCPUus = perOp(d)
			r.ProxyCores = d.Seconds() / secs
		case "server":
			r.ServerCPUus = perOp(d)
		case "client":
			r.ClientCPUus = perOp(d)
		}
	}
	if complete {
		r.TotalCPUus = total
	}
	return r
}

// percentile of sorted ns samples, nearest rank.
func percentile(sorted []int64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return float64(sorted[min(max(i, 0), len(sorted)-1)])
}

// ratios of a path to direct, per round; the summary takes their median.
type ratios struct {
	Throughput float64 `json:"throughput,omitempty"`
	P50        float64 `json:"p50,omitempty"`
	P99        float64 `json:"p99,omitempty"`
	TotalCPU   float64 `json:"total_cpu_per_op,omitempty"`
}

// summary is the median over rounds of one scenario on one path.
type summary struct {
	Scenario    string  `json:"scenario"`
	Path        string  `json:"path"`
	Rounds      int     `json:"rounds"`
	Throughput  float64 `json:"throughput"`
	Unit        string  `json:"unit"`
	P50us       float64 `json:"p50_us,omitempty"`
	P99us       float64 `json:"p99_us,omitempty"`
	ProxyCPUus  float64 `json:"proxy_cpu_us_per_op,omitempty"`
	ProxyCores  float64 `json:"proxy_cores,omitempty"`
	ServerCPUus float64 `json:"server_cpu_us_per_op,omitempty"`
	ClientCPUus float64 `json:"client_cpu_us_per_op,omitempty"`
	TotalCPUus  float64 `json:"total_cpu_us_per_op,omitempty"`
	Errors      int64   `json:"errors,omitempty"`
	FirstError  string  `json:"first_error,omitempty"`
	VsDirect    ratios  `json:"vs_direct"`
}

// median of the non-zero values (zero means not measured).
func median(xs []float64) float64 {
	var v []float64
	for _, x := range xs {
		if x != 0 && !math.IsNaN(x) && !math.IsInf(x, 0) {
			v = append(v, x)
		}
	}
	if len(v) == 0 {
		return 0
	}
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

func ratio(a, b float64) float64 {
	if a == 0 || b == 0 {
		return 0
	}
	return a / b
}

// summarize groups runs by scenario and path (in first-seen order) and
// takes medians. A ratio is computed inside each round, against that
// round's direct run, and the median of those ratios is reported: paired
// ratios cancel drift that affects one round as a whole.
func summarize(runs []runResult) []summary {
	type key struct{ sc, path string }
	var order []key
	groups := map[key][]runResult{}
	direct := map[string]map[int]runResult{} // scenario -> round -> run
	for _, r := range runs {
		k := key{r.Scenario, r.Path}
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], r)
		if r.Path == pathDirect {
			if direct[r.Scenario] == nil {
				direct[r.Scenario] = map[int]runResult{}
			}
			direct[r.Scenario][r.Round] = r
		}
	}
	var out []summary
	for _, k := range order {
		g := groups[k]
		s := summary{Scenario: k.sc, Path: k.path, Rounds: len(g), Unit: g[0].Unit}
		col := func(f func(runResult) float64) float64 {
			xs := make([]float64, len(g))
			for i, r := range g {
				xs[i] = f(r)
			}
			return median(xs)
		}
		s.Throughput = col(func(r runResult) float64 { return r.Throughput })
		s.P50us = col(func(r runResult) float64 { return r.P50us })
		s.P99us = col(func(r runResult) float64 { return r.P99us })
		s.ProxyCPUus = col(func(r runResult) float64 { return r.ProxyCPUus })
		s.ProxyCores = col(func(r runResult) float64 { return r.ProxyCores })
		s.ServerCPUus = col(func(r runResult) float64 { return r.ServerCPUus })
		s.ClientCPUus = col(func(r runResult) float64 { return r.ClientCPUus })
		s.TotalCPUus = col(func(r runResult) float64 { return r.TotalCPUus })
		rel := func(f func(runResult) float64) float64 {
			var xs []float64
			for _, r := range g {
				if d, ok := direct[k.sc][r.Round]; ok {
					xs = append(xs, ratio(f(r), f(d)))
				}
			}
			return median(xs)
		}
		s.VsDirect = ratios{
			Throughput: rel(func(r runResult) float64 { return r.Throughput }),
			P50:        rel(func(r runResult) float64 { return r.P50us }),
			P99:        rel(func(r runResult) float64 { return r.P99us }),
			TotalCPU:   rel(func(r runResult) float64 { return r.TotalCPUus }),
		}
		for _, r := range g {
			s.Errors += r.Errors
			if s.FirstError == "" {
				s.FirstError = r.FirstError
				if s.FirstError == "" && r.Skipped != "" {
					s.FirstError = "skipped: " + r.Skipped
				}
			}
		}
		out = append(out, s)
	}
	return out
}

// document is what -json prints.
type document struct {
	Started   time.Time       `json:"started"`
	Host      hostInfo        `json:"host"`
	Settings  settings        `json:"settings"`
	Pinning   pinning         `json:"pinning"`
	Paths     []path          `json:"paths"`
	Scenarios []scenInfo      `json:"scenarios"`
	Summary   []summary       `json:"summary"`
	Runs      []runResult     `json:"runs"`
	Idle      []idleResult    `json:"idle,omitempty"`
	Syscalls  []syscallResult `json:"syscalls,omitempty"`
	// VsBaseline is livenessproxy over the baseline build, per scenario.
	VsBaseline []baselineRatios `json:"livenessproxy_vs_baseline,omitempty"`
}

type hostInfo struct {
	CPUs       int    `json:"cpus"`
	GoVersion  string `json:"go_version"`
	Kernel     string `json:"kernel,omitempty"`
	ClientProc int    `json:"client_gomaxprocs"`
}

type settings struct {
	Duration   string `json:"duration"`
	Warmup     string `json:"warmup"`
	Rounds     int    `json:"rounds"`
	CPSWorkers int    `json:"cps_workers"`
	MaxOps     int64  `json:"max_ops_per_run"`
	LPFraming  string `json:"livenessproxy_framing"`
}

type scenInfo struct {
	Name  string `json:"name"`
	About string `json:"about"`
}

func writeJSON(w io.Writer, d document) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(d)
}

// writeTable prints the header, the paths and one block per scenario.
func writeTable(w io.Writer, d document) {
	fmt.Fprintf(w, "livenessproxy bench: %d CPUs, %s, kernel %s\n", d.Host.CPUs, d.Host.GoVersion, d.Host.Kernel)
	fmt.Fprintf(w, "duration %s per run after %s warm-up, %d round(s)", d.Settings.Duration, d.Settings.Warmup, d.Settings.Rounds)
	if d.Settings.Rounds > 1 {
		fmt.Fprint(w, " (medians; ratios are medians of per-round ratios)")
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "pinning: %s\n", d.Pinning.describe())
	for _, p := range d.Paths {
		switch {
		case p.Skipped != "":
			fmt.Fprintf(w, "path %-16s SKIPPED: %s\n", p.Name, p.Skipped)
		case p.Name == pathDirect:
			fmt.Fprintf(w, "path %-16s client -> server %s\n", p.Name, p.Addr)
		case p.Bin != "":
			with := ""
			if p.Settings != "" {
				with = ", with " + p.Settings
			}
			fmt.Fprintf(w, "path %-16s %s, proxy CPUs %s, %s, %s%s\n", p.Name, p.Addr, p.Affinity, p.Version, p.Bin, with)
		default:
			fmt.Fprintf(w, "path %-16s %s, proxy CPUs %s, %s\n", p.Name, p.Addr, p.Affinity, p.Version)
		}
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "%-9s %-16s %14s %9s %9s %9s %6s %9s %5s | %5s %5s %5s %5s\n",
		"scenario", "path", "throughput", "p50", "p99", "proxyCPU", "proxy", "totalCPU", "errs",
		"thr", "p50", "p99", "CPU")
	fmt.Fprintf(w, "%-9s %-16s %14s %9s %9s %9s %6s %9s %5s | %s\n",
		"", "", "", "", "", "/op", "cores", "/op", "", "ratio to direct")
	prev := ""
	for _, s := range d.Summary {
		name := s.Scenario
		if name == prev {
			name = ""
		} else if prev != "" {
			fmt.Fprintln(w)
		}
		prev = s.Scenario
		fmt.Fprintf(w, "%-9s %-16s %14s %9s %9s %9s %6s %9s %5s | %5s %5s %5s %5s\n",
			name, s.Path, fmtThroughput(s.Throughput, s.Unit), fmtUs(s.P50us), fmtUs(s.P99us),
			fmtUs(s.ProxyCPUus), fmtF(s.ProxyCores, 2), fmtUs(s.TotalCPUus), fmtErrs(s.Errors),
			fmtF(s.VsDirect.Throughput, 2), fmtF(s.VsDirect.P50, 2), fmtF(s.VsDirect.P99, 2), fmtF(s.VsDirect.TotalCPU, 2))
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "CPU/op: utime+stime from /proc/PID/stat (10 ms ticks) over the window, per operation")
	fmt.Fprintln(w, "(bulk: per 1 MiB frame); totalCPU = client + server + proxy. Ratios: path / direct;")
	fmt.Fprintln(w, "thr below 1 and p50/p99/CPU above 1 are the cost of the hop.")
	for _, s := range d.Summary {
		if s.FirstError != "" {
			fmt.Fprintf(w, "note: %s/%s: %d error(s), first: %s\n", s.Scenario, s.Path, s.Errors, s.FirstError)
		}
	}
	writeBaseline(w, d.VsBaseline)
	writeSideBySide(w, d.Summary)
	writeFloors(w, d.Summary)
	writeSyscallTable(w, d.Syscalls)
	writeIdleTable(w, d.Idle)
}

func fmtThroughput(v float64, unit string) string {
	if v == 0 {
		return "-"
	}
	return fmt.Sprintf("%s %s", groupThousands(v), unit)
}

func groupThousands(v float64) string {
	s := fmt.Sprintf("%.0f", v)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}

func fmtUs(us float64) string {
	switch {
	case us == 0:
		return "-"
	case us < 10:
		return fmt.Sprintf("%.2fµs", us)
	case us < 1000:
		return fmt.Sprintf("%.1fµs", us)
	default:
		return fmt.Sprintf("%.2fms", us/1000)
	}
}

func fmtF(v float64, prec int) string {
	if v == 0 {
		return "-"
	}
	return fmt.Sprintf("%.*f", prec, v)
}

func fmtErrs(n int64) string {
	if n == 0 {
		return "0"
	}
	return fmt.Sprint(n)
}

// writeSideBySide prints livenessproxy beside HAProxy per scenario: each
// one's throughput ratio to direct and the proxy's own CPU per operation,
// and livenessproxy's CPU over HAProxy's (at or below 1 is the goal).
func writeSideBySide(w io.Writer, ss []summary) {
	find := func(sc, p string) (summary, bool) {
		i := slices.IndexFunc(ss, func(s summary) bool { return s.Scenario == sc && s.Path == p })
		if i < 0 {
			return summary{}, false
		}
		return ss[i], true
	}
	header := false
	for _, s := range ss {
		if s.Path != pathLP {
			continue
		}
		ha, ok := find(s.Scenario, pathHA)
		if !ok {
			continue
		}
		if !header {
			fmt.Fprintln(w, "\nside by side (medians): throughput vs direct, and the proxy's own CPU per op")
			fmt.Fprintf(w, "%-9s %12s %12s %12s %12s %9s\n", "scenario", "haproxy thr", "lp thr", "haproxy CPU", "lp CPU", "lp/ha CPU")
			header = true
		}
		fmt.Fprintf(w, "%-9s %11sx %11sx %12s %12s %9s\n", s.Scenario, fmtF(ha.VsDirect.Throughput, 2), fmtF(s.VsDirect.Throughput, 2),
			fmtUs(ha.ProxyCPUus), fmtUs(s.ProxyCPUus), fmtF(ratio(s.ProxyCPUus, ha.ProxyCPUus), 2))
	}
}

// writeFloors prints, when a floor relay was measured, each proxy path per
// scenario: its throughput ratio to direct and its own CPU per operation,
// livenessproxy and HAProxy beside the floors of the two data-plane designs.
func writeFloors(w io.Writer, ss []summary) {
	if !slices.ContainsFunc(ss, func(s summary) bool {
		return s.Path == pathFloorG || s.Path == pathFloorR || s.Path == pathFloorO || s.Path == pathFloorE
	}) {
		return
	}
	var cols []string
	for _, p := range []string{pathLP, pathFloorG, pathFloorR, pathFloorO, pathFloorE, pathHA} {
		if slices.ContainsFunc(ss, func(s summary) bool { return s.Path == p }) {
			cols = append(cols, p)
		}
	}
	fmt.Fprintln(w, "\nthe floors (medians): per proxy, throughput vs direct and the proxy's own CPU per op")
	fmt.Fprintf(w, "%-9s", "scenario")
	for _, c := range cols {
		fmt.Fprintf(w, " %20s", c)
	}
	fmt.Fprintln(w)
	var scs []string
	for _, s := range ss {
		if !slices.Contains(scs, s.Scenario) {
			scs = append(scs, s.Scenario)
		}
	}
	for _, sc := range scs {
		fmt.Fprintf(w, "%-9s", sc)
		for _, c := range cols {
			i := slices.IndexFunc(ss, func(s summary) bool { return s.Scenario == sc && s.Path == c })
			cell := "-"
			if i >= 0 {
				cell = fmt.Sprintf("%sx %9s", fmtF(ss[i].VsDirect.Throughput, 2), fmtUs(ss[i].ProxyCPUus))
			}
			fmt.Fprintf(w, " %20s", cell)
		}
		fmt.Fprintln(w)
	}
}

// spread is one figure of livenessproxy over the baseline: the median of
// its per-round ratios, and their lowest and highest.
type spread struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
}

// baselineRatios is livenessproxy / baseline in one scenario. Each ratio
// is taken within a round (the two builds ran minutes apart at most, one
// right after the other), so drift that hits a round hits both; the spread
// over rounds is the noise a difference has to stand out of. Two equal
// builds read about 1: a regression is throughput below 1, p50 or proxy
// CPU per op above 1.
type baselineRatios struct {
	Scenario   string `json:"scenario"`
	Rounds     int    `json:"rounds"` // rounds in which both ran
	Throughput spread `json:"throughput"`
	P50        spread `json:"p50"`
	ProxyCPU   spread `json:"proxy_cpu_per_op"`
}

// compareBaseline pairs the livenessproxy and baseline runs of each
// scenario by round (scenarios in first-seen order). A figure one of the
// two did not measure (zero) is left out of its ratios.
func compareBaseline(runs []runResult) []baselineRatios {
	type key struct {
		sc    string
		round int
	}
	base := map[key]runResult{}
	for _, r := range runs {
		if r.Path == pathBase {
			base[key{r.Scenario, r.Round}] = r
		}
	}
	var out []baselineRatios
	pairs := map[string][][2]runResult{}
	for _, r := range runs {
		b, ok := base[key{r.Scenario, r.Round}]
		if r.Path != pathLP || !ok {
			continue
		}
		if _, seen := pairs[r.Scenario]; !seen {
			out = append(out, baselineRatios{Scenario: r.Scenario})
		}
		pairs[r.Scenario] = append(pairs[r.Scenario], [2]runResult{r, b})
	}
	for i := range out {
		ps := pairs[out[i].Scenario]
		of := func(f func(runResult) float64) spread {
			xs := make([]float64, len(ps))
			for j, p := range ps {
				xs[j] = ratio(f(p[0]), f(p[1]))
			}
			return spreadOf(xs)
		}
		out[i].Rounds = len(ps)
		out[i].Throughput = of(func(r runResult) float64 { return r.Throughput })
		out[i].P50 = of(func(r runResult) float64 { return r.P50us })
		out[i].ProxyCPU = of(func(r runResult) float64 { return r.ProxyCPUus })
	}
	return out
}

// spreadOf is the median, lowest and highest of the measured (non-zero)
// values; all zero when none was measured.
func spreadOf(xs []float64) spread {
	s := spread{Median: median(xs)}
	if s.Median == 0 {
		return s
	}
	for _, x := range xs {
		if x == 0 || math.IsNaN(x) || math.IsInf(x, 0) {
			continue
		}
		if s.Min == 0 || x < s.Min {
			s.Min = x
		}
		s.Max = max(s.Max, x)
	}
	return s
}

// writeBaseline prints livenessproxy over the baseline build per scenario:
// the median of the per-round ratios and, over more than one round, their
// range.
func writeBaseline(w io.Writer, bs []baselineRatios) {
	if len(bs) == 0 {
		return
	}
	fmt.Fprintln(w, "\nlivenessproxy / baseline (per-round ratios, median [min-max]): a regression is thr below 1, p50 or proxyCPU/op above 1")
	fmt.Fprintf(w, "%-9s %6s %-17s %-17s %s\n", "scenario", "rounds", "thr", "p50", "proxyCPU/op")
	for _, b := range bs {
		fmt.Fprintf(w, "%-9s %6d %-17s %-17s %s\n", b.Scenario, b.Rounds, fmtSpread(b.Throughput), fmtSpread(b.P50), fmtSpread(b.ProxyCPU))
	}
}

func fmtSpread(s spread) string {
	if s.Median == 0 {
		return "-"
	}
	if s.Min == s.Max {
		return fmtF(s.Median, 3)
	}
	return fmt.Sprintf("%s [%s-%s]", fmtF(s.Median, 3), fmtF(s.Min, 2), fmtF(s.Max, 2))
}
