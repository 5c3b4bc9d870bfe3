//go:build linux

package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// A traced run counts the proxy's system calls per operation with
// `strace -c -f -p PID`: ptrace slows every call, so it is a run of its
// own, apart from the measured ones, and only its counts are read. Counts
// do not move with the machine's load the way CPU time and throughput do,
// so a regression in them shows as a number.

// syscallCount is one system call's count in a traced run, per operation.
type syscallCount struct {
	Name   string  `json:"name"`
	PerOp  float64 `json:"per_op"`
	ErrsOp float64 `json:"errors_per_op,omitempty"` // failed calls (a read's EAGAIN)
}

// syscallResult is one traced run of a scenario on a proxy path.
type syscallResult struct {
	Scenario string         `json:"scenario"`
	Path     string         `json:"path"`
	Ops      float64        `json:"ops"` // operations in the traced part of the window
	PerOp    float64        `json:"per_op,omitempty"`
	ErrsOp   float64        `json:"errors_per_op,omitempty"`
	Calls    []syscallCount `json:"calls,omitempty"`
	Skipped  string         `json:"skipped,omitempty"`
}

// tracer is one strace attached to a process for a window.
type tracer struct {
	cmd      *exec.Cmd
	out      string
	attached time.Time
	err      error
}

// straceBin is strace on PATH, or "" when it is not installed.
func straceBin() string {
	p, err := exec.LookPath("strace")
	if err != nil {
		return ""
	}
	return p
}

// startTrace attaches strace to every thread of pid and returns once it
// has (every task's TracerPid is set) or 5 s passed.
func startTrace(bin, dir string, pid int) *tracer {
	t := &tracer{out: filepath.Join(dir, fmt.Sprintf("strace-%d-%d.txt", pid, time.Now().UnixNano()))}
	t.cmd = exec.Command(bin, "-c", "-f", "-q", "-o", t.out, "-p", strconv.Itoa(pid))
	t.cmd.Stderr = io.Discard
	if err := t.cmd.Start(); err != nil {
		t.err = err
		return t
	}
	deadline := time.Now().Add(5 * time.Second)
	for !allTraced(pid) {
		if time.Now().After(deadline) {
			t.err = errors.New("strace did not attach within 5 s")
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.attached = time.Now()
	return t
}

// allTraced reports whether every thread of pid has a tracer.
func allTraced(pid int) bool {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil || len(tasks) == 0 {
		return false
	}
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, task.Name()))
		if err != nil {
			return false
		}
		for line := range strings.SplitSeq(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "TracerPid:"); ok && strings.TrimSpace(v) == "0" {
				return false
			}
		}
	}
	return true
}

// stop detaches strace (SIGINT makes it write its summary) and parses the
// summary. It kills strace, by its PID, if it has not exited in 10 s.
func (t *tracer) stop() (map[string][2]int64, error) {
	if t.cmd.Process == nil {
		return nil, t.err
	}
	_ = t.cmd.Process.Signal(os.Interrupt)
	done := make(chan error, 1)
	go func() { done <- t.cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = t.cmd.Process.Kill()
		<-done
		return nil, errors.New("strace did not exit on SIGINT")
	}
	if t.err != nil {
		return nil, t.err
	}
	f, err := os.Open(t.out)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	defer os.Remove(t.out)
	return parseStraceSummary(f)
}

// parseStraceSummary reads `strace -c` output: per system call its calls
// and errors. Lines are "% time seconds usecs/call calls [errors] syscall".
func parseStraceSummary(r io.Reader) (map[string][2]int64, error) {
	out := map[string][2]int64{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 5 || len(f) > 6 {
			continue
		}
		name := f[len(f)-1]
		if name == "total" || name == "syscall" {
			continue
		}
		if _, err := strconv.ParseFloat(f[0], 64); err != nil {
			continue
		}
		calls, err := strconv.ParseInt(f[3], 10, 64)
		if err != nil {
			continue
		}
		var errs int64
		if len(f) == 6 {
			if errs, err = strconv.ParseInt(f[4], 10, 64); err != nil {
				continue
			}
		}
		out[name] = [2]int64{calls, errs}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("strace summary: no system calls")
	}
	return out, nil
}

// measureSyscalls runs sc on p once more with strace attached to the
// proxy (and the mesh's second sidecar) for the measured window.
func measureSyscalls(ctx context.Context, o options, sc scenario, p path, dir, bin string) syscallResult {
	res := syscallResult{Scenario: sc.name, Path: p.Name}
	if bin == "" {
		res.Skipped = "strace not on PATH"
		return res
	}
	var tracers []*tracer
	var start, end time.Time
	meter := newCPUMeter(nil)
	meter.onBegin = func() {
		start = time.Now()
		tracers = append(tracers, startTrace(bin, dir, p.proc.pid))
		if p.peer != nil {
			tracers = append(tracers, startTrace(bin, dir, p.peer.pid))
		}
	}
	meter.onEnd = func() { end = time.Now() }
	lr, _, err := runLoad(ctx, p.Addr, sc, o.warmup, o.duration, o.maxOps, meter)
	counts := map[string][2]int64{}
	for _, t := range tracers {
		c, terr := t.stop()
		if terr != nil && err == nil {
			err = terr
		}
		for name, v := range c {
			counts[name] = [2]int64{counts[name][0] + v[0], counts[name][1] + v[1]}
		}
	}
	if err != nil {
		res.Skipped = err.Error()
		return res
	}
	// Operations in the traced part of the window (strace attached a few
	// milliseconds after it opened).
	attached := tracers[len(tracers)-1].attached
	if win := end.Sub(start); win > 0 && attached.Before(end) {
		res.Ops = float64(lr.ops) * float64(end.Sub(attached)) / float64(win)
	}
	if res.Ops < 1 {
		res.Skipped = "no operations while traced"
		return res
	}
	for name, v := range counts {
		res.PerOp += float64(v[0]) / res.Ops
		res.ErrsOp += float64(v[1]) / res.Ops
		res.Calls = append(res.Calls, syscallCount{Name: name, PerOp: float64(v[0]) / res.Ops, ErrsOp: float64(v[1]) / res.Ops})
	}
	slices.SortFunc(res.Calls, func(a, b syscallCount) int {
		if a.PerOp != b.PerOp {
			if a.PerOp > b.PerOp {
				return -1
			}
			return 1
		}
		return strings.Compare(a.Name, b.Name)
	})
	return res
}

// writeSyscallTable prints the traced runs: calls per operation, failed
// ones among them, and the calls that make up the count (those at 0.01
// per operation or more).
func writeSyscallTable(w io.Writer, rs []syscallResult) {
	if len(rs) == 0 {
		return
	}
	fmt.Fprintln(w, "\nsystem calls per operation (strace -c -f on the proxy, one traced run each; bulk: per MiB)")
	fmt.Fprintf(w, "%-9s %-16s %8s %8s  %s\n", "scenario", "path", "calls", "failed", "by call (failed)")
	for _, r := range rs {
		if r.Skipped != "" {
			fmt.Fprintf(w, "%-9s %-16s SKIPPED: %s\n", r.Scenario, r.Path, r.Skipped)
			continue
		}
		var parts []string
		for _, c := range r.Calls {
			if c.PerOp < 0.01 {
				continue
			}
			s := fmt.Sprintf("%s %s", c.Name, fmtCount(c.PerOp))
			if c.ErrsOp >= 0.01 {
				s += fmt.Sprintf(" (%s)", fmtCount(c.ErrsOp))
			}
			parts = append(parts, s)
		}
		fmt.Fprintf(w, "%-9s %-16s %8s %8s  %s\n", r.Scenario, r.Path, fmtCount(r.PerOp), fmtCount(r.ErrsOp), strings.Join(parts, ", "))
	}
}

func fmtCount(v float64) string {
	if v >= 100 {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

// traceScenario makes the traced run of sc on every proxy path.
func traceScenario(ctx context.Context, o options, sc scenario, paths []path, dir string) []syscallResult {
	bin := straceBin()
	var out []syscallResult
	for _, p := range paths {
		if p.proc == nil || p.Skipped != "" || ctx.Err() != nil {
			continue
		}
		r := measureSyscalls(ctx, o, sc, p, dir, bin)
		if r.Skipped != "" {
			logf("syscalls %-9s %-16s SKIPPED: %s", sc.name, p.Name, r.Skipped)
		} else {
			logf("syscalls %-9s %-16s %s/op (%s failed)", sc.name, p.Name, fmtCount(r.PerOp), fmtCount(r.ErrsOp))
		}
		out = append(out, r)
		sleepUntil(ctx, time.Now().Add(200*time.Millisecond))
	}
	return out
}
