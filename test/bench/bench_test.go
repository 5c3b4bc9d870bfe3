//go:build linux

package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// TestScenariosDirect runs every scenario briefly against an in-process
// server and checks that work was done, nothing failed, and every goroutine
// ended (the bench itself runs the server as a child process).
func TestScenariosDirect(t *testing.T) {
	defer goleak.VerifyNone(t)
	addr, stop := serveInProcess(t)
	defer stop()

	for _, sc := range scenarios(2) {
		t.Run(sc.name, func(t *testing.T) {
			meter := newCPUMeter(map[string]int{"client": os.Getpid()})
			lr, win, err := runLoad(context.Background(), addr, sc, 50*time.Millisecond, 200*time.Millisecond, 1_000_000, meter)
			if err != nil {
				t.Fatal(err)
			}
			if lr.errs != 0 || lr.ops == 0 {
				t.Fatalf("ops %d errs %d first %v", lr.ops, lr.errs, lr.firstErr)
			}
			r := newRunResult(sc, pathDirect, 1, lr, win, meter)
			if r.Throughput <= 0 || (!sc.bulk && (r.P50us <= 0 || r.P99us < r.P50us)) {
				t.Fatalf("bad result %+v", r)
			}
		})
	}
}

// TestMaxOpsBoundsRun checks that the operation bound ends a run early.
func TestMaxOpsBoundsRun(t *testing.T) {
	defer goleak.VerifyNone(t)
	addr, stop := serveInProcess(t)
	defer stop()

	sc := scenarios(1)[0] // rr1
	meter := newCPUMeter(map[string]int{})
	start := time.Now()
	lr, _, err := runLoad(context.Background(), addr, sc, 0, 2*time.Second, 10, meter)
	if err != nil {
		t.Fatal(err)
	}
	// The workers stop after 10 operations; runLoad still waits for the
	// window to close, but no more than that.
	if lr.ops != 10 {
		t.Fatalf("ops = %d, want 10", lr.ops)
	}
	if d := time.Since(start); d > 4*time.Second {
		t.Fatalf("run took %v", d)
	}
}

// serveInProcess runs the bench server's accept loop on a loopback
// listener; stop closes it and checks that the loop ended for that reason.
func serveInProcess(t *testing.T) (addr string, stop func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go acceptLoopInto(ln, served)
	return ln.Addr().String(), func() {
		_ = ln.Close()
		if err := <-served; !errors.Is(err, net.ErrClosed) {
			t.Errorf("accept loop: %v", err)
		}
	}
}

func acceptLoopInto(ln net.Listener, out chan<- error) { out <- acceptLoop(ln) }

func TestSummarizeRatiosPerRound(t *testing.T) {
	runs := []runResult{
		{Scenario: "rr1", Path: pathDirect, Round: 1, Throughput: 100, P50us: 10, Unit: "ops/s"},
		{Scenario: "rr1", Path: pathHA, Round: 1, Throughput: 50, P50us: 20, Unit: "ops/s"},
		{Scenario: "rr1", Path: pathDirect, Round: 2, Throughput: 200, P50us: 5, Unit: "ops/s"},
		{Scenario: "rr1", Path: pathHA, Round: 2, Throughput: 100, P50us: 10, Unit: "ops/s"},
		{Scenario: "rr1", Path: pathDirect, Round: 3, Throughput: 300, P50us: 4, Unit: "ops/s"},
		{Scenario: "rr1", Path: pathHA, Round: 3, Throughput: 150, P50us: 8, Unit: "ops/s"},
	}
	s := summarize(runs)
	if len(s) != 2 || s[1].Path != pathHA {
		t.Fatalf("summary %+v", s)
	}
	if s[1].Throughput != 100 || s[1].VsDirect.Throughput != 0.5 || s[1].VsDirect.P50 != 2 {
		t.Fatalf("haproxy summary %+v", s[1])
	}
}

func TestSideBySide(t *testing.T) {
	ss := []summary{
		{Scenario: "cps", Path: pathDirect},
		{Scenario: "cps", Path: pathLP, ProxyCPUus: 150, VsDirect: ratios{Throughput: 0.45}},
		{Scenario: "cps", Path: pathHA, ProxyCPUus: 100, VsDirect: ratios{Throughput: 0.5}},
		{Scenario: "rr1", Path: pathLP, ProxyCPUus: 60}, // no haproxy row: left out
	}
	var b strings.Builder
	writeSideBySide(&b, ss)
	want := "cps              0.50x        0.45x      100.0µs      150.0µs      1.50\n"
	if !strings.Contains(b.String(), want) || strings.Contains(b.String(), "rr1") {
		t.Fatalf("side by side:\n%s\nwant the line\n%s", b.String(), want)
	}
}

func TestPercentile(t *testing.T) {
	xs := make([]int64, 100)
	for i := range xs {
		xs[i] = int64(i + 1)
	}
	if p := percentile(xs, 0.5); p != 50 {
		t.Errorf("p50 = %v", p)
	}
	if p := percentile(xs, 0.99); p != 99 {
		t.Errorf("p99 = %v", p)
	}
	if p := percentile(nil, 0.5); p != 0 {
		t.Errorf("empty p50 = %v", p)
	}
}

func TestParsePinning(t *testing.T) {
	p, err := parsePinning("none")
	if err != nil || len(p.sets) != 0 || p.setFor("server") != nil {
		t.Fatalf("none: %+v %v", p, err)
	}
	p, err = parsePinning("client=0,proxy=0")
	if err != nil {
		t.Fatal(err)
	}
	if p.CPUs["client"] != "0" || p.setFor("server") == nil || p.setFor("server").Count() < 1 {
		t.Fatalf("custom: %+v", p)
	}
	for _, bad := range []string{"client=9999", "bogus=0", "client", "client=1-0"} {
		if _, err := parsePinning(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

// The parser takes `strace -c` output apart: calls and errors per system
// call, the total line left out. When strace is installed the sample is
// strace's own, from tracing a command that fails some calls.
func TestParseStraceSummary(t *testing.T) {
	sample := `% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 64.49    0.000207           5        39        19 openat
 12.77    0.000041           1        30           mmap
  2.49    0.000008           4         2         2 statx
------ ----------- ----------- --------- --------- ----------------
100.00    0.000321           2        71        21 total
`
	got, err := parseStraceSummary(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][2]int64{"openat": {39, 19}, "mmap": {30, 0}, "statx": {2, 2}}
	if len(got) != len(want) {
		t.Fatalf("parsed %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Fatalf("parsed %v, want %v", got, want)
		}
	}
	if _, err := parseStraceSummary(strings.NewReader("strace: attach: ptrace(PTRACE_SEIZE, 1): Operation not permitted\n")); err == nil {
		t.Fatal("no calls parsed from an error message, want an error")
	}
	bin := straceBin()
	if bin == "" {
		return
	}
	out := filepath.Join(t.TempDir(), "s.txt")
	// ls of a path that does not exist: its stat fails (an error counted).
	_ = exec.Command(bin, "-c", "-f", "-q", "-o", out, "ls", filepath.Join(t.TempDir(), "none")).Run()
	f, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	real, err := parseStraceSummary(f)
	if err != nil {
		t.Fatal(err)
	}
	var calls, errs int64
	for _, v := range real {
		calls += v[0]
		errs += v[1]
	}
	if calls == 0 || errs == 0 {
		t.Fatalf("strace's own summary parsed to %d calls, %d failed; want some of each", calls, errs)
	}
}

// TestBaselinePathLikeLivenessproxy starts the livenessproxy and baseline
// paths from one build in front of an in-process server, as the bench
// does: the two get the same config but for their addresses (framing
// included), each carries a connect-per-request run through its own
// process (its links_total grows by at least the operations counted), and
// the comparison pairs the runs of the two by round.
func TestBaselinePathLikeLivenessproxy(t *testing.T) {
	defer goleak.VerifyNone(t)
	serverAddr, stop := serveInProcess(t)
	defer stop()

	ctx := context.Background()
	tmp, bin, baseBin := twoBuilds(t)
	o := options{duration: 300 * time.Millisecond, warmup: 50 * time.Millisecond, rounds: 2, pin: "one-core",
		paths: "direct,livenessproxy,baseline", scenarios: "cps", cpsWorkers: 2, maxOps: 1_000_000,
		lpFraming: "length_field", proxyBin: bin, baselineBin: baseBin}
	if err := o.validate(); err != nil {
		t.Fatal(err)
	}
	pin, err := parsePinning(o.pin)
	if err != nil {
		t.Fatal(err)
	}
	paths := setupPaths(ctx, o, tmp, serverAddr, pin.setFor("proxy"))
	for _, p := range paths {
		if p.proc != nil {
			defer p.proc.stop()
		}
	}
	if len(paths) != 3 || paths[1].Name != pathLP || paths[2].Name != pathBase {
		t.Fatalf("paths %+v, want direct, livenessproxy, baseline", paths)
	}
	for i, want := range []string{bin, baseBin} {
		p := paths[1+i]
		if p.Skipped != "" || p.proc == nil || p.metricsAddr == "" {
			t.Fatalf("path %+v: not started, or without its /metrics", p)
		}
		if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", p.proc.pid)); err != nil || exe != want || p.Bin != want {
			t.Fatalf("path %s runs %q (%v), reports %q; want %s", p.Name, exe, err, p.Bin, want)
		}
		if want := pin.CPUs["proxy"]; p.Affinity != want {
			t.Fatalf("path %s on CPUs %s, want the proxy's %s", p.Name, p.Affinity, want)
		}
	}
	if lp, base := configOf(t, tmp, paths[1]), configOf(t, tmp, paths[2]); lp != base ||
		!strings.Contains(lp, "upstream: "+serverAddr) || !strings.Contains(lp, "type: length_field") {
		t.Fatalf("configs differ or lack the upstream and framing:\nlivenessproxy:\n%s\nbaseline:\n%s", lp, base)
	}

	runs := measureThrough(t, o, scenarios(o.cpsWorkers)[4], paths)
	vs := compareBaseline(runs)
	if len(vs) != 1 || vs[0].Scenario != "cps" || vs[0].Rounds != 2 || vs[0].Throughput.Median <= 0 {
		t.Fatalf("livenessproxy vs baseline %+v, want cps over 2 rounds", vs)
	}
	for _, s := range summarize(runs) {
		if s.Path != pathDirect && s.VsDirect.Throughput <= 0 {
			t.Fatalf("%s has no throughput ratio to direct: %+v", s.Path, s)
		}
	}
}

// -baseline-settings: the baseline path runs the config the livenessproxy
// path runs plus the given lines, and the proxy takes them (its own
// /v1/config says so); a key the proxy does not know skips the path with
// the proxy's error, which names the key.
func TestBaselineSettings(t *testing.T) {
	defer goleak.VerifyNone(t)
	serverAddr, stop := serveInProcess(t)
	defer stop()

	ctx := context.Background()
	_, bin, baseBin := twoBuilds(t)
	start := func(t *testing.T, settings string) (tmp string, paths []path) {
		t.Helper()
		tmp = t.TempDir()
		o := options{duration: time.Second, rounds: 1, paths: "direct,livenessproxy,baseline", scenarios: "rr1",
			cpsWorkers: 1, maxOps: 1, lpFraming: "none", proxyBin: bin, baselineBin: baseBin, baselineSettings: settings}
		if err := o.validate(); err != nil {
			t.Fatal(err)
		}
		paths = setupPaths(ctx, o, tmp, serverAddr, nil)
		for _, p := range paths {
			if p.proc != nil {
				t.Cleanup(p.proc.stop)
			}
		}
		if len(paths) != 3 || paths[1].Skipped != "" {
			t.Fatalf("paths %+v: want direct, livenessproxy and baseline, livenessproxy started", paths)
		}
		return tmp, paths
	}

	t.Run("taken", func(t *testing.T) {
		tmp, paths := start(t, " write_timeout: 0s;keepalive: {idle: 0s} ; ")
		lp, base := paths[1], paths[2]
		if base.Skipped != "" {
			t.Fatalf("baseline not started: %s", base.Skipped)
		}
		const want = "write_timeout: 0s; keepalive: {idle: 0s}"
		if base.Settings != want {
			t.Fatalf("baseline settings %q, want %q", base.Settings, want)
		}
		// Reported where the README says: the path lines, and -json.
		var table bytes.Buffer
		writeTable(&table, document{Paths: paths})
		if !strings.Contains(table.String(), base.Bin+", with "+want+"\n") || strings.Contains(table.String(), lp.Bin+", with") {
			t.Fatalf("path lines name the settings on the baseline only:\n%s", table.String())
		}
		if j, err := json.Marshal(document{Paths: paths}); err != nil || !bytes.Contains(j, []byte(`"settings":"`+want+`"`)) {
			t.Fatalf("-json lacks the baseline's settings (%v): %s", err, j)
		}
		if got, want := configOf(t, tmp, base), configOf(t, tmp, lp)+"    write_timeout: 0s\n    keepalive: {idle: 0s}\n"; got != want {
			t.Fatalf("baseline config:\n%s\nwant the livenessproxy path's with the two lines:\n%s", got, want)
		}
		for _, c := range []struct {
			p                  path
			writeTimeout, idle string
		}{{lp, "10s", "10s"}, {base, "0s", "0s"}} {
			l := configInForce(t, c.p.metricsAddr)
			ka, _ := l["keepalive"].(map[string]any)
			if l["write_timeout"] != c.writeTimeout || ka["idle"] != c.idle {
				t.Errorf("%s runs write_timeout %v, keepalive %v; want %s and idle %s", c.p.Name, l["write_timeout"], ka, c.writeTimeout, c.idle)
			}
		}
	})
	t.Run("refused", func(t *testing.T) {
		_, paths := start(t, "writ_timeout: 0s")
		if base := paths[2]; base.proc != nil || !strings.Contains(base.Skipped, "writ_timeout: unknown key") {
			t.Fatalf("baseline with an unknown key: %+v, want skipped with the proxy's error naming it", base)
		}
	})
}

// twoBuilds builds livenessproxy into tmp, a temp dir, and copies it as
// the baseline binary: each path runs its own file (the tests tell the two
// processes apart by /proc/PID/exe).
func twoBuilds(t *testing.T) (tmp, bin, baseBin string) {
	t.Helper()
	tmp = t.TempDir()
	bin, err := buildLivenessproxy(context.Background(), tmp)
	if err != nil {
		t.Fatal(err)
	}
	baseBin = filepath.Join(t.TempDir(), "livenessproxy-baseline")
	if b, err := os.ReadFile(bin); err != nil || os.WriteFile(baseBin, b, 0o755) != nil {
		t.Fatalf("copy %s: %v", bin, err)
	}
	return tmp, bin, baseBin
}

// configInForce is the first listener of the configuration a livenessproxy
// runs, from its admin server's /v1/config.
func configInForce(t *testing.T, adminAddr string) map[string]any {
	t.Helper()
	resp, err := http.Get("http://" + adminAddr + "/v1/config")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v struct{ Listeners []map[string]any }
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil || len(v.Listeners) == 0 {
		t.Fatalf("GET /v1/config: %v, %d listeners", err, len(v.Listeners))
	}
	return v.Listeners[0]
}

// measureThrough runs sc on every path, round after round as the bench
// does, and checks that each run went through its path's proxy process:
// the proxy's links_total grew by at least the operations counted (sc
// opens a connection per operation).
func measureThrough(t *testing.T, o options, sc scenario, paths []path) []runResult {
	t.Helper()
	var runs []runResult
	for round := 1; round <= o.rounds; round++ {
		for _, p := range roundOrder(paths, round) {
			var before float64
			if p.proc != nil {
				before = linksTotal(t, p.metricsAddr)
			}
			r := measure(context.Background(), o, sc, p, round, os.Getpid())
			if r.Skipped != "" || r.Ops == 0 || r.Errors != 0 {
				t.Fatalf("round %d on %s: %+v", round, p.Name, r)
			}
			if p.proc != nil {
				if got := linksTotal(t, p.metricsAddr) - before; got < float64(r.Ops) {
					t.Fatalf("round %d on %s: %d operations counted, but its links_total grew by %v", round, p.Name, r.Ops, got)
				}
			}
			runs = append(runs, r)
		}
	}
	return runs
}

// configOf is the config path p was started with, its own addresses
// replaced by placeholders.
func configOf(t *testing.T, tmp string, p path) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(tmp, p.Name+".yaml"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.NewReplacer(p.Addr, "LISTEN", p.metricsAddr, "ADMIN").Replace(string(b))
}

// linksTotal is the sum of livenessproxy_links_total on a /metrics page.
func linksTotal(t *testing.T, addr string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	sum, found := 0.0, false
	for line := range strings.SplitSeq(string(body), "\n") {
		if !strings.HasPrefix(line, "livenessproxy_links_total{") {
			continue
		}
		_, val, _ := strings.Cut(line, "} ")
		v, err := strconv.ParseFloat(val, 64)
		if err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		sum, found = sum+v, true
	}
	if !found {
		t.Fatalf("no livenessproxy_links_total on %s/metrics", addr)
	}
	return sum
}

// -paths baseline and -baseline-bin come together; the binary must exist.
func TestValidateBaseline(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	base := options{duration: time.Second, rounds: 1, cpsWorkers: 1, maxOps: 1, lpFraming: "none", scenarios: "rr1"}
	for _, c := range []struct {
		paths, bin, want string // bin: -baseline-bin, then "|" and -baseline-settings; want: a part of the error; "" for none
	}{
		{"direct,livenessproxy", "", ""},
		{"direct,livenessproxy,baseline", exe, ""},
		{"direct,baseline", "", "-paths has baseline but -baseline-bin is not set"},
		{"direct,livenessproxy", exe, "-baseline-bin is set but -paths has no baseline"},
		{"direct,baseline", filepath.Join(t.TempDir(), "none"), "-baseline-bin: stat "},
		{"direct,baseline", t.TempDir(), "is not an executable file"},
		{"direct,livenessproxy,baseline", exe + "|write_timeout: 0s; keepalive: {idle: 0s}", ""},
		{"direct,livenessproxy", "|write_timeout: 0s", "-baseline-settings is set but -paths has no baseline"},
		{"direct,livenessproxy,baseline", exe + "|write_timeout 0s", `"write_timeout 0s" is not a "key: value" line`},
		{"direct,livenessproxy,baseline", exe + "|{write_timeout: 0s}", "is not a \"key: value\" line"},
	} {
		o := base
		o.paths = c.paths
		o.baselineBin, o.baselineSettings, _ = strings.Cut(c.bin, "|")
		err := o.validate()
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("-paths %s -baseline-bin %q: error %v, want %q", c.paths, c.bin, err, c.want)
		}
	}
}

// The two builds trade places in even rounds; the other paths keep theirs.
func TestRoundOrder(t *testing.T) {
	paths := []path{{Name: pathDirect}, {Name: pathLP}, {Name: pathBase}, {Name: pathHA}}
	names := func(ps []path) string {
		var s []string
		for _, p := range ps {
			s = append(s, p.Name)
		}
		return strings.Join(s, ",")
	}
	for round, want := range map[int]string{
		1: "direct,livenessproxy,baseline,haproxy",
		2: "direct,baseline,livenessproxy,haproxy",
		3: "direct,livenessproxy,baseline,haproxy",
	} {
		if got := names(roundOrder(paths, round)); got != want {
			t.Errorf("round %d: %s, want %s", round, got, want)
		}
	}
	if got := names(paths); got != "direct,livenessproxy,baseline,haproxy" {
		t.Errorf("roundOrder changed its argument: %s", got)
	}
	noBase := paths[:2]
	if got := names(roundOrder(noBase, 2)); got != "direct,livenessproxy" {
		t.Errorf("without baseline, round 2: %s", got)
	}
}

// livenessproxy / baseline is taken within each round; the table gives
// the median and the range, and a figure one side lacks is left out.
func TestCompareBaseline(t *testing.T) {
	runs := []runResult{
		{Scenario: "rr1", Path: pathDirect, Round: 1, Throughput: 500},
		{Scenario: "rr1", Path: pathLP, Round: 1, Throughput: 100, P50us: 10, ProxyCPUus: 50},
		{Scenario: "rr1", Path: pathBase, Round: 1, Throughput: 100, P50us: 10, ProxyCPUus: 40},
		{Scenario: "rr1", Path: pathBase, Round: 2, Throughput: 400, P50us: 5, ProxyCPUus: 50},
		{Scenario: "rr1", Path: pathLP, Round: 2, Throughput: 360, P50us: 6, ProxyCPUus: 50},
		{Scenario: "rr1", Path: pathLP, Round: 3, Throughput: 110, P50us: 9, ProxyCPUus: 60},
		{Scenario: "rr1", Path: pathBase, Round: 3, Throughput: 100, P50us: 10, ProxyCPUus: 50},
		{Scenario: "bulk", Path: pathLP, Round: 1, Throughput: 90, ProxyCPUus: 600},
		{Scenario: "bulk", Path: pathBase, Round: 1, Throughput: 100, ProxyCPUus: 500},
		{Scenario: "cps", Path: pathLP, Round: 1, Throughput: 90}, // no baseline run: left out
	}
	got := compareBaseline(runs)
	want := []baselineRatios{
		{Scenario: "rr1", Rounds: 3, Throughput: spread{1, 0.9, 1.1}, P50: spread{1, 0.9, 1.2}, ProxyCPU: spread{1.2, 1, 1.25}},
		{Scenario: "bulk", Rounds: 1, Throughput: spread{0.9, 0.9, 0.9}, ProxyCPU: spread{1.2, 1.2, 1.2}},
	}
	if len(got) != len(want) {
		t.Fatalf("got %+v\nwant %+v", got, want)
	}
	for i := range want {
		if !closeRatios(got[i], want[i]) {
			t.Fatalf("got %+v\nwant %+v", got[i], want[i])
		}
	}
	var b strings.Builder
	writeBaseline(&b, got)
	for _, line := range []string{
		"rr1            3 1.000 [0.90-1.10] 1.000 [0.90-1.20] 1.200 [1.00-1.25]\n",
		"bulk           1 0.900             -                 1.200\n",
	} {
		if !strings.Contains(b.String(), line) {
			t.Errorf("table:\n%s\nwant the line\n%q", b.String(), line)
		}
	}
}

func closeRatios(a, b baselineRatios) bool {
	near := func(x, y spread) bool {
		return math.Abs(x.Median-y.Median) < 1e-9 && math.Abs(x.Min-y.Min) < 1e-9 && math.Abs(x.Max-y.Max) < 1e-9
	}
	return a.Scenario == b.Scenario && a.Rounds == b.Rounds &&
		near(a.Throughput, b.Throughput) && near(a.P50, b.P50) && near(a.ProxyCPU, b.ProxyCPU)
}

// TestFloorRelays builds the floor relay and starts each design as the
// bench does (-paths floor-goroutines,floor-raw,floor-own,floor-epoll), in front of an
// in-process server, and checks that it relays: round trips on one link,
// 4 MiB each way at once byte for byte, a half-close (the server sees the
// client's EOF and its answer after it still arrives whole, then EOF), 200
// short links from 8 clients at once, and that it prints nothing and exits
// by itself on SIGTERM. Nothing here depends on timing.
func TestFloorRelays(t *testing.T) {
	defer goleak.VerifyNone(t)
	srv := startFloorServer(t)
	defer srv.stop()

	ctx := context.Background()
	tmp := t.TempDir()
	o := options{duration: time.Second, rounds: 1, pin: "one-core", paths: "direct,floor-goroutines,floor-raw,floor-own,floor-epoll",
		scenarios: "cps", cpsWorkers: 1, maxOps: 1, lpFraming: "none"}
	if err := o.validate(); err != nil {
		t.Fatal(err)
	}
	pin, err := parsePinning(o.pin)
	if err != nil {
		t.Fatal(err)
	}
	paths := setupPaths(ctx, o, tmp, srv.addr, pin.setFor("proxy"))
	for _, p := range paths {
		if p.proc != nil {
			defer p.proc.stop()
		}
	}
	if len(paths) != 5 || paths[1].Name != pathFloorG || paths[2].Name != pathFloorR || paths[3].Name != pathFloorO || paths[4].Name != pathFloorE {
		t.Fatalf("paths %+v, want direct, floor-goroutines, floor-raw, floor-own, floor-epoll", paths)
	}
	for _, p := range paths[1:] {
		t.Run(p.Name, func(t *testing.T) {
			if p.Skipped != "" || p.proc == nil {
				t.Fatalf("not started: %s", p.Skipped)
			}
			want := filepath.Join(tmp, "floor")
			if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", p.proc.pid)); err != nil || exe != want || p.Bin != want {
				t.Fatalf("runs %q (%v), reports %q; want %s", exe, err, p.Bin, want)
			}
			if want := pin.CPUs["proxy"]; p.Affinity != want {
				t.Fatalf("on CPUs %s, want the proxy's %s", p.Affinity, want)
			}
			roundTrips(t, p.Addr)
			bothWays(t, p.Addr, 4<<20)
			halfClose(t, p.Addr)
			shortLinks(t, p.Addr, 8, 25)

			p.proc.stop()
			if !p.proc.exited() || p.proc.waitErr != nil {
				t.Fatalf("on SIGTERM: exited %v, %v (%s)", p.proc.exited(), p.proc.waitErr, p.proc.logTail())
			}
			if b, err := os.ReadFile(p.proc.logPath); err != nil || len(b) != 0 {
				t.Fatalf("printed %q (%v), want nothing", b, err)
			}
		})
	}
}

// floorServer serves the bench protocol (the bench probes each new path
// with a request) and, on links whose first byte is floorEcho, echoes
// every byte until the client's EOF and then sends floorAnswer.
type floorServer struct {
	ln    net.Listener
	addr  string
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]bool
}

const floorEcho = 'E'

// floorAnswer is what the echo server sends after the client's EOF: the
// count and digest of what it read (so the client knows the server saw
// EOF after all of it), then 1 MiB that only the answer has.
func floorAnswer(n int64, sum []byte) []byte {
	head := fmt.Sprintf("EOF after %d bytes, sha256 %x\n", n, sum)
	return append([]byte(head), answerTail...)
}

var answerTail = pattern(7, 1<<20)

// answerTo is floorAnswer for a client that sent sent and nothing more.
func answerTo(sent []byte) []byte {
	sum := sha256.Sum256(sent)
	return floorAnswer(int64(len(sent)), sum[:])
}

// pattern is n pseudo-random bytes, the same for the same seed.
func pattern(seed byte, n int) []byte {
	b := make([]byte, n)
	_, _ = rand.NewChaCha8([32]byte{seed}).Read(b)
	return b
}

func startFloorServer(t *testing.T) *floorServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &floorServer{ln: ln, addr: ln.Addr().String(), conns: map[net.Conn]bool{}}
	s.wg.Add(1)
	go s.acceptAll()
	return s
}

func (s *floorServer) acceptAll() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns[c] = true
		s.mu.Unlock()
		s.wg.Add(1)
		go s.serve(c.(*net.TCPConn))
	}
}

// stop closes the listener and every link, and waits for their goroutines.
func (s *floorServer) stop() {
	_ = s.ln.Close()
	s.mu.Lock()
	for c := range s.conns {
		_ = c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

func (s *floorServer) serve(c *net.TCPConn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		_ = c.Close()
	}()
	r := bufio.NewReader(c)
	first, err := r.Peek(1)
	if err != nil {
		return
	}
	if first[0] != floorEcho {
		serveConn(readerConn{c, r})
		return
	}
	h := sha256.New()
	var n int64
	buf := make([]byte, 32<<10)
	for {
		k, err := r.Read(buf)
		if k > 0 {
			h.Write(buf[:k])
			n += int64(k)
			if _, err := c.Write(buf[:k]); err != nil {
				return
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return
		}
	}
	_, _ = c.Write(floorAnswer(n, h.Sum(nil)))
}

// readerConn is a net.Conn whose reads come through r (which has peeked).
type readerConn struct {
	net.Conn
	r *bufio.Reader
}

func (c readerConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// dialFloor dials addr with a deadline that only keeps a broken relay
// from hanging the test.
func dialFloor(t *testing.T, addr string) *net.TCPConn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.SetDeadline(time.Now().Add(2 * time.Minute)); err != nil {
		t.Fatal(err)
	}
	return c.(*net.TCPConn)
}

// roundTrips makes request/response exchanges of several sizes on one
// link, then half-closes it and reads the answer.
func roundTrips(t *testing.T, addr string) {
	c := dialFloor(t, addr)
	defer c.Close()
	sent := []byte{floorEcho}
	if _, err := c.Write(sent); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 1)
	if _, err := io.ReadFull(c, got); err != nil || got[0] != floorEcho {
		t.Fatalf("first byte %q, %v", got, err)
	}
	for i, size := range []int{1, 200, 2048, 65535, 65536, 65537, 300_000, 7} {
		req := pattern(byte(100+i), size)
		if _, err := c.Write(req); err != nil {
			t.Fatal(err)
		}
		resp := make([]byte, size)
		if _, err := io.ReadFull(c, resp); err != nil {
			t.Fatalf("round trip %d (%d B): %v", i, size, err)
		}
		if !bytes.Equal(resp, req) {
			t.Fatalf("round trip %d (%d B): the response differs from the request", i, size)
		}
		sent = append(sent, req...)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	rest, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if want := answerTo(sent); !bytes.Equal(rest, want) {
		t.Fatalf("after EOF: %d B, want the %d B answer (%q...)", len(rest), len(want), rest[:min(len(rest), 80)])
	}
}

// bothWays sends n bytes while the echo comes back, then reads the answer.
func bothWays(t *testing.T, addr string, n int) {
	c := dialFloor(t, addr)
	defer c.Close()
	req := append([]byte{floorEcho}, pattern(3, n)...)
	wrote := make(chan error, 1)
	go func() {
		_, err := c.Write(req)
		if err == nil {
			err = c.CloseWrite()
		}
		wrote <- err
	}()
	got, err := io.ReadAll(c)
	if werr := <-wrote; werr != nil {
		t.Fatalf("write: %v", werr)
	}
	if err != nil {
		t.Fatalf("read: %v after %d B", err, len(got))
	}
	want := append(slices.Clone(req), answerTo(req)...)
	if !bytes.Equal(got, want) {
		i := 0
		for i < min(len(got), len(want)) && got[i] == want[i] {
			i++
		}
		t.Fatalf("read %d B, want %d B; the first difference at byte %d", len(got), len(want), i)
	}
}

// halfClose sends a request and its EOF at once: the server answers only
// after it has seen EOF, and the answer arrives whole, then EOF.
func halfClose(t *testing.T, addr string) {
	c := dialFloor(t, addr)
	defer c.Close()
	req := append([]byte{floorEcho}, pattern(5, 1000)...)
	if _, err := c.Write(req); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if want := append(slices.Clone(req), answerTo(req)...); !bytes.Equal(got, want) {
		t.Fatalf("read %d B, want %d B", len(got), len(want))
	}
}

// shortLinks has workers clients each make n links: connect, one request,
// its response, close.
func shortLinks(t *testing.T, addr string, workers, n int) {
	errs := make(chan error, workers)
	for w := range workers {
		go func() {
			for i := range n {
				req := []byte(fmt.Sprintf("%cworker %d link %d", floorEcho, w, i))
				errs <- func() error {
					c, err := net.Dial("tcp", addr)
					if err != nil {
						return err
					}
					defer c.Close()
					if err := c.SetDeadline(time.Now().Add(2 * time.Minute)); err != nil {
						return err
					}
					if _, err := c.Write(req); err != nil {
						return err
					}
					got := make([]byte, len(req))
					if _, err := io.ReadFull(c, got); err != nil {
						return fmt.Errorf("worker %d link %d: %w", w, i, err)
					}
					if !bytes.Equal(got, req) {
						return fmt.Errorf("worker %d link %d: got %q", w, i, got)
					}
					return nil
				}()
			}
		}()
	}
	for range workers * n {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

// A link whose upstream refuses the connect is reset (SO_LINGER 0), in
// every design, not closed as if the upstream had answered and left.
func TestFloorRefusedUpstream(t *testing.T) {
	defer goleak.VerifyNone(t)
	tmp := t.TempDir()
	bin, err := floorBinary(context.Background(), tmp)
	if err != nil {
		t.Fatal(err)
	}
	for _, design := range []string{"goroutines", "goroutines-raw", "goroutines-own", "epoll"} {
		t.Run(design, func(t *testing.T) {
			addr, err1 := testutil.PickClosedAddr()
			refused, err2 := testutil.PickClosedAddr()
			if err := errors.Join(err1, err2); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(bin, "-listen", addr, "-upstream", refused, "-design", design)
			c, err := startChild("floor-"+design, cmd, nil, filepath.Join(tmp, design+".log"))
			if err != nil {
				t.Fatal(err)
			}
			defer c.stop()
			if err := waitListening(context.Background(), addr, c, readyWait); err != nil {
				t.Fatal(err)
			}
			// The reset may come before the dial has seen its connect
			// complete (SO_ERROR is then ECONNRESET), or after.
			conn, err := net.Dial("tcp", addr)
			if err == nil {
				defer conn.Close()
				if err = conn.SetDeadline(time.Now().Add(2 * time.Minute)); err == nil {
					_, err = io.ReadAll(conn)
				}
			}
			if !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("dial and read: %v, want a reset", err)
			}
		})
	}
}

// The floors table has a column per proxy path of the run, in a fixed
// order, and only when a floor path ran.
func TestFloorsTable(t *testing.T) {
	ss := []summary{
		{Scenario: "rr1", Path: pathDirect},
		{Scenario: "rr1", Path: pathLP, ProxyCPUus: 60, VsDirect: ratios{Throughput: 0.4}},
		{Scenario: "rr1", Path: pathFloorE, ProxyCPUus: 20, VsDirect: ratios{Throughput: 0.8}},
		{Scenario: "rr1", Path: pathFloorG, ProxyCPUus: 30, VsDirect: ratios{Throughput: 0.7}},
		{Scenario: "cps", Path: pathLP, ProxyCPUus: 150, VsDirect: ratios{Throughput: 0.45}},
	}
	var b strings.Builder
	writeFloors(&b, ss)
	for _, line := range []string{
		"scenario         livenessproxy     floor-goroutines          floor-epoll\n",
		"rr1            0.40x    60.0µs      0.70x    30.0µs      0.80x    20.0µs\n",
		"cps            0.45x   150.0µs                    -                    -\n",
	} {
		if !strings.Contains(b.String(), line) {
			t.Errorf("table:\n%s\nwant the line\n%q", b.String(), line)
		}
	}
	b.Reset()
	writeFloors(&b, ss[:2])
	if b.Len() != 0 {
		t.Errorf("no floor path, yet a table:\n%s", b.String())
	}
}
