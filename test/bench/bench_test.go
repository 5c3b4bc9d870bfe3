//go:build linux

package main

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// TestScenariosDirect runs every scenario briefly against an in-process
// server and checks that work was done, nothing failed, and every goroutine
// ended (the bench itself runs the server as a child process).
func TestScenariosDirect(t *testing.T) {
	defer goleak.VerifyNone(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go acceptLoopInto(ln, served)
	defer func() {
		_ = ln.Close()
		if err := <-served; !errors.Is(err, net.ErrClosed) {
			t.Errorf("accept loop: %v", err)
		}
	}()

	for _, sc := range scenarios(2) {
		t.Run(sc.name, func(t *testing.T) {
			meter := newCPUMeter(map[string]int{"client": os.Getpid()})
			lr, win, err := runLoad(context.Background(), ln.Addr().String(), sc, 50*time.Millisecond, 200*time.Millisecond, 1_000_000, meter)
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
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go acceptLoopInto(ln, served)
	defer func() { _ = ln.Close(); <-served }()

	sc := scenarios(1)[0] // rr1
	meter := newCPUMeter(map[string]int{})
	start := time.Now()
	lr, _, err := runLoad(context.Background(), ln.Addr().String(), sc, 0, 2*time.Second, 10, meter)
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
