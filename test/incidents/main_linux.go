//go:build linux

package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// replay is one incident replay.
type replay struct {
	n    int
	name string
	run  func(*rig) (*Report, error)
}

// replays are the five incidents, numbered as in docs/incidents.md.
var replays = []replay{
	{1, "node flap without FIN", replayFlap},
	{2, "path stall", replayStall},
	{3, "stopped server", replayStop},
	{4, "idle link to a dead peer", replayIdle},
	{5, "readmission", replayReadmit},
}

func runMain(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("incidents", flag.ContinueOnError)
	fs.SetOutput(stderr)
	table := fs.Bool("table", false, "print the side-by-side table before the checks")
	only := fs.String("only", "", "comma-separated replay numbers to run (default: all)")
	verbose := fs.Bool("v", false, "print each replay's timeline and progress")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	selected := map[int]bool{}
	if *only != "" {
		for _, s := range strings.Split(*only, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil || n < 1 || n > len(replays) {
				fmt.Fprintf(stderr, "incidents: -only %q: want numbers from 1 to %d\n", *only, len(replays))
				return 2
			}
			selected[n] = true
		}
	}
	if os.Getenv(mainChildEnv) == "" {
		return reexecMain(args, stdout, stderr)
	}
	if _, err := run("", "ip", "link", "set", "lo", "up"); err != nil {
		fmt.Fprintf(stderr, "incidents: bringing lo up in the new namespace: %v\n", err)
		return 1
	}

	logf := func(string, ...any) {}
	if *verbose {
		logf = func(format string, args ...any) { fmt.Fprintf(stderr, "  "+format+"\n", args...) }
	}
	start := time.Now()
	var reports []*Report
	failed := 0
	for _, rp := range replays {
		if len(selected) > 0 && !selected[rp.n] {
			continue
		}
		fmt.Fprintf(stderr, "incidents: replay %d (%s)...\n", rp.n, rp.name)
		t0 := time.Now()
		r := newRig(logf)
		rep, err := rp.run(r)
		r.close()
		if err != nil {
			fmt.Fprintf(stderr, "incidents: replay %d (%s) could not run: %v\n", rp.n, rp.name, err)
			failed++
			continue
		}
		fmt.Fprintf(stderr, "incidents: replay %d done in %.1fs: %d checks, %d failed\n",
			rp.n, time.Since(t0).Seconds(), len(rep.Checks), len(rep.Failed()))
		if len(rep.Failed()) > 0 {
			failed++
		}
		reports = append(reports, rep)
	}
	fmt.Fprintf(stdout, "Incident replays: direct vs through livenessproxy (%d replays in %.0fs)\n\n", len(reports), time.Since(start).Seconds())
	if *table && len(reports) > 0 {
		writeTable(stdout, reports)
		fmt.Fprintln(stdout)
		fmt.Fprintf(stdout, "Settings: request_timeout %v, consecutive_timeouts_threshold %d, broker query timeout %v, keepalive %v/%v/%d, tcp_user_timeout %v, write_timeout %v, high_water_mark %s, detector initial_delay %v max_delay %v.\n",
			requestTimeout, threshold, brokerTimeout, keepIdle, keepInterval, keepCount, userTimeout, writeTimeout, mib(highWaterMark), initialDelay, maxDelay)
		fmt.Fprintln(stdout, "Peak memory: direct = the broker's outbound queue at its peak (the client's own memory); proxy = growth of the proxy process's RSS over its value when the fault began.")
	}
	writeChecks(stdout, reports, *verbose)
	if failed > 0 {
		fmt.Fprintf(stdout, "\n%d replay(s) failed a check or could not run\n", failed)
		return 1
	}
	return 0
}

// reexecMain runs this command again in a new user and network namespace
// (uid 0 inside, mapped to ours), where it may create namespaces, veths and
// nftables rules without root and without touching the host's network: the
// main's equivalent of netns.Reexec.
func reexecMain(args []string, stdout, stderr io.Writer) int {
	cmd := exec.Command(self, args...)
	cmd.Env = append(os.Environ(), mainChildEnv+"=1")
	cmd.Stdin = nil
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER | syscall.CLONE_NEWNET,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}},
		Pdeathsig:   syscall.SIGKILL,
	}
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		fmt.Fprintf(stderr, "incidents: cannot create a user and network namespace (%v); "+
			"unprivileged user namespaces may be disabled\n", err)
		return 1
	}
	return 0
}
