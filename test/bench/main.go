//go:build linux

// Command bench measures, on loopback, what a proxy hop costs: the same
// workloads go client -> server directly, through livenessproxy, and through
// HAProxy (when installed), interleaved per scenario; with -baseline-bin,
// also through a livenessproxy built from another commit, and on request
// through the floor relays of ./test/bench/floor. See README.md.
//
//	go run ./test/bench [-duration 3s] [-rounds N] [-pin proxy-core] [-json]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

type options struct {
	duration   time.Duration
	warmup     time.Duration
	rounds     int
	jsonOut    bool
	pin        string
	proxyBin   string
	haproxyBin string
	paths      string
	scenarios  string
	cpsWorkers int
	maxOps     int64
	lpFraming  string
	idleLinks  int
	syscalls   bool
	serverPort string
	// baselineBin is the livenessproxy of the baseline path (another
	// commit's build); "" leaves the path out.
	baselineBin string
	// baselineSettings are listener settings the baseline path's config
	// adds ("key: value" lines, ';' between them): one build measured
	// against itself with a setting changed.
	baselineSettings string
}

func main() {
	if os.Getenv(serverEnv) == "1" {
		os.Exit(serverMain())
	}
	var o options
	flag.DurationVar(&o.duration, "duration", 3*time.Second, "measured time per scenario and path")
	flag.DurationVar(&o.warmup, "warmup", 500*time.Millisecond, "warm-up before each measured run (same workload, not counted)")
	flag.IntVar(&o.rounds, "rounds", 1, "repeat every scenario on every path N times (interleaved) and report medians")
	flag.BoolVar(&o.jsonOut, "json", false, "print a JSON document instead of the table")
	flag.StringVar(&o.pin, "pin", "none", "CPU affinity: "+pinPresetNames())
	flag.StringVar(&o.proxyBin, "proxy-bin", "", "prebuilt livenessproxy binary (default: go build ./cmd/livenessproxy)")
	flag.StringVar(&o.baselineBin, "baseline-bin", "", "prebuilt livenessproxy binary of another commit, measured as the baseline path (with -paths ...,baseline) exactly like livenessproxy")
	flag.StringVar(&o.baselineSettings, "baseline-settings", "", "listener settings the baseline path adds to the config both paths share, as YAML \"key: value\" lines separated by ';' (e.g. \"write_timeout: 0s; keepalive: {idle: 0s}\"): with the same binary as -baseline-bin, what a setting costs")
	flag.StringVar(&o.haproxyBin, "haproxy-bin", "haproxy", "HAProxy binary, looked up on PATH")
	flag.StringVar(&o.paths, "paths", "direct,livenessproxy,haproxy", "paths to measure: direct, livenessproxy, baseline (the -baseline-bin livenessproxy), haproxy, mesh (two livenessproxy sidecars), mesh-tls (the same over mutual TLS), floor-goroutines, floor-raw (goroutines, sockets outside net), floor-own (the same outside the runtime's poller too) and floor-epoll (minimal relays of the data-plane designs, ./test/bench/floor); direct is always measured: ratios need it")
	flag.StringVar(&o.scenarios, "scenarios", "rr1,rr64,pipe8x16,bulk,cps", "scenarios to run, in order")
	flag.IntVar(&o.cpsWorkers, "cps-workers", 4, "concurrent workers in the cps scenario")
	flag.Int64Var(&o.maxOps, "max-ops", 20_000_000, "upper bound on operations per run (a safety bound; the duration normally ends a run)")
	flag.StringVar(&o.lpFraming, "lp-framing", "none", "livenessproxy listener framing: none | length_field (4-byte big-endian, like the bench protocol) | kafka | pinot (requests carry a Kafka or Pinot header that the profile reads)")
	flag.IntVar(&o.idleLinks, "idle", 0, "after the scenarios, hold N idle links through each proxy (one 64 KiB exchange each way) and report memory per link; -1: as many as the descriptor limit allows")
	flag.BoolVar(&o.syscalls, "syscalls", false, "after round 1 of each scenario, one more run per proxy with strace -c attached: system calls per operation (skipped when strace is not on PATH)")
	flag.StringVar(&o.serverPort, "server-port", "below-range", "the bench server's port: below-range (a free port below the kernel's local port range, where production servers listen), kernel (the kernel's pick, inside that range: a client that guards against connecting to itself pays a getsockname per connect) or a number")
	flag.Parse()
	if err := o.validate(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		stop()
		os.Exit(1)
	}
}

func (o options) validate() error {
	switch {
	case o.duration <= 0 || o.duration > 10*time.Minute:
		return errors.New("-duration must be in (0, 10m]")
	case o.warmup < 0 || o.warmup > time.Minute:
		return errors.New("-warmup must be in [0, 1m]")
	case o.rounds < 1 || o.rounds > 100:
		return errors.New("-rounds must be in [1, 100]")
	case o.cpsWorkers < 1 || o.cpsWorkers > 256:
		return errors.New("-cps-workers must be in [1, 256]")
	case o.maxOps < 1:
		return errors.New("-max-ops must be positive")
	case o.idleLinks < -1 || o.idleLinks > maxIdleLinks():
		return fmt.Errorf("-idle must be in [-1, %d] (the descriptor limit: two per link in the proxy)", maxIdleLinks())
	case !slices.Contains([]string{"none", "length_field", "kafka", "pinot"}, o.lpFraming):
		return errors.New("-lp-framing must be none, length_field, kafka or pinot")
	}
	for p := range strings.SplitSeq(o.paths, ",") {
		if !slices.Contains([]string{pathDirect, pathLP, pathBase, pathHA, pathMesh, pathMeshTLS, pathFloorG, pathFloorR, pathFloorO, pathFloorE}, p) {
			return fmt.Errorf("-paths: unknown path %q", p)
		}
	}
	if err := o.validateBaseline(); err != nil {
		return err
	}
	_, err := o.selectedScenarios()
	return err
}

// validateBaseline checks that -paths baseline and -baseline-bin come
// together, and that the binary is there to run.
func (o options) validateBaseline() error {
	switch {
	case o.wants(pathBase) && o.baselineBin == "":
		return errors.New("-paths has baseline but -baseline-bin is not set: give the livenessproxy binary to compare against (go build -o FILE ./cmd/livenessproxy at that commit)")
	case !o.wants(pathBase) && o.baselineBin != "":
		return errors.New("-baseline-bin is set but -paths has no baseline: add baseline to -paths to measure it")
	case !o.wants(pathBase) && o.baselineSettings != "":
		return errors.New("-baseline-settings is set but -paths has no baseline: add baseline to -paths (and -baseline-bin) to measure it")
	case o.baselineBin == "":
		return nil
	}
	for _, l := range baselineSettingLines(o.baselineSettings) {
		if k, _, ok := strings.Cut(l, ":"); !ok || strings.TrimSpace(k) == "" || strings.ContainsAny(k, " {}[]\"'") {
			return fmt.Errorf("-baseline-settings: %q is not a \"key: value\" line", l)
		}
	}
	fi, err := os.Stat(o.baselineBin)
	if err != nil {
		return fmt.Errorf("-baseline-bin: %w", err)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("-baseline-bin: %s is not an executable file", o.baselineBin)
	}
	return nil
}

func (o options) selectedScenarios() ([]scenario, error) {
	all := scenarios(o.cpsWorkers)
	var out []scenario
	if o.scenarios == "" {
		return nil, nil // -idle alone
	}
	for name := range strings.SplitSeq(o.scenarios, ",") {
		i := slices.IndexFunc(all, func(s scenario) bool { return s.name == name })
		if i < 0 {
			return nil, fmt.Errorf("-scenarios: unknown scenario %q", name)
		}
		out = append(out, all[i])
	}
	return out, nil
}

func (o options) wants(p string) bool {
	return slices.Contains(strings.Split(o.paths, ","), p)
}

func run(ctx context.Context, o options) error {
	scs, _ := o.selectedScenarios()
	requestHead = o.lpFraming
	pin, err := parsePinning(o.pin)
	if err != nil {
		return err
	}
	if o.idleLinks == -1 {
		o.idleLinks = maxIdleLinks()
	}
	if o.idleLinks > 0 {
		raiseNoFile()
	}
	tmp, err := os.MkdirTemp("", "lpbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)

	doc := document{Started: time.Now().UTC(), Pinning: pin}
	doc.Host = hostInfo{CPUs: runtime.NumCPU(), GoVersion: runtime.Version(), Kernel: kernelRelease()}
	doc.Settings = settings{Duration: o.duration.String(), Warmup: o.warmup.String(), Rounds: o.rounds,
		CPSWorkers: o.cpsWorkers, MaxOps: o.maxOps, LPFraming: o.lpFraming}
	for _, sc := range scs {
		doc.Scenarios = append(doc.Scenarios, scenInfo{Name: sc.name, About: sc.about})
	}

	server, serverAddr, err := startServer(ctx, tmp, o.serverPort, pin.setFor("server"))
	if err != nil {
		return err
	}
	defer server.stop()
	logf("server pid %d on %s, CPUs %s", server.pid, serverAddr, affinityOf(server.pid))

	paths := setupPaths(ctx, o, tmp, serverAddr, pin.setFor("proxy"))
	for _, p := range paths {
		if p.peer != nil {
			defer p.peer.stop()
		}
		if p.proc != nil {
			defer p.proc.stop()
			logf("%s pid %d on %s, CPUs %s", p.Name, p.proc.pid, p.Addr, p.Affinity)
		}
		if p.Skipped != "" {
			logf("%s SKIPPED: %s", p.Name, p.Skipped)
		}
	}
	// Pin the client last: starting pinned children briefly changes the
	// mask of one of our threads, and a thread spawned meanwhile would
	// inherit it.
	if err := pin.pinSelf(); err != nil {
		return fmt.Errorf("pin client: %w", err)
	}
	doc.Host.ClientProc = runtime.GOMAXPROCS(0)
	doc.Paths = paths

	if err := measureRounds(ctx, o, scs, paths, tmp, server.pid, &doc); err != nil {
		return err
	}
	doc.Summary = summarize(doc.Runs)
	doc.VsBaseline = compareBaseline(doc.Runs)
	if o.idleLinks > 0 {
		for _, p := range paths {
			if p.proc == nil || p.Skipped != "" {
				continue
			}
			r := measureIdle(ctx, p, o.idleLinks)
			logf("idle %-16s %d links: %s RSS/link (%s)", p.Name, r.Links, fmtKiB(r.RSSPerLink), r.Skipped)
			doc.Idle = append(doc.Idle, r)
			// Let the closed links end before the next proxy's run.
			sleepUntil(ctx, time.Now().Add(2*time.Second))
		}
	}
	if o.jsonOut {
		return writeJSON(os.Stdout, doc)
	}
	writeTable(os.Stdout, doc)
	return nil
}

// setupPaths starts the proxies -paths asks for, each on cpus; direct,
// client straight to the server, comes first.
func setupPaths(ctx context.Context, o options, tmp, serverAddr string, cpus *unix.CPUSet) []path {
	paths := []path{{Name: pathDirect, Addr: serverAddr}}
	if o.wants(pathLP) {
		logf("setting up livenessproxy ...")
		paths = append(paths, withFreshPorts(func() path { return setupLivenessproxy(ctx, o, tmp, serverAddr, cpus) }))
	}
	if o.wants(pathBase) {
		logf("setting up the baseline livenessproxy (%s) ...", o.baselineBin)
		paths = append(paths, withFreshPorts(func() path { return setupBaseline(ctx, o, tmp, serverAddr, cpus) }))
	}
	if o.wants(pathMesh) {
		logf("setting up the mesh (two livenessproxy sidecars) ...")
		paths = append(paths, withFreshPorts(func() path { return setupMesh(ctx, o, tmp, serverAddr, cpus, false) }))
	}
	if o.wants(pathMeshTLS) {
		logf("setting up the mesh over mutual TLS ...")
		paths = append(paths, withFreshPorts(func() path { return setupMesh(ctx, o, tmp, serverAddr, cpus, true) }))
	}
	for _, f := range []struct{ name, design string }{{pathFloorG, "goroutines"}, {pathFloorR, "goroutines-raw"}, {pathFloorO, "goroutines-own"}, {pathFloorE, "epoll"}} {
		if o.wants(f.name) {
			logf("setting up the %s relay ...", f.name)
			paths = append(paths, withFreshPorts(func() path { return setupFloor(ctx, f.name, f.design, tmp, serverAddr, cpus) }))
		}
	}
	if o.wants(pathHA) {
		logf("setting up haproxy ...")
		paths = append(paths, withFreshPorts(func() path { return setupHAProxy(ctx, o, tmp, serverAddr, cpus) }))
	}
	return paths
}

// withFreshPorts runs setup, which starts a path's processes on ports it
// picks closed (testutil.PickClosedAddr), and runs it again, twice at
// most, when the path was skipped because a process could not bind its
// port: another process took it in between (a test run has other
// packages' tests beside it).
func withFreshPorts(setup func() path) path {
	p := setup()
	for try := 1; try < 3 && portTaken(p.Skipped); try++ {
		logf("%s: a port was taken before it was bound; again with new ones", p.Name)
		p = setup()
	}
	return p
}

// portTaken reports whether why (a skipped path's reason, with its
// process's last lines) says a bind found its address in use.
func portTaken(why string) bool {
	return strings.Contains(strings.ToLower(why), "address already in use")
}

// measureRounds runs every scenario on every path, round after round, into
// doc.Runs (and, with -syscalls, the traced runs after round 1 into
// doc.Syscalls).
func measureRounds(ctx context.Context, o options, scs []scenario, paths []path, tmp string, serverPID int, doc *document) error {
	for round := 1; round <= o.rounds; round++ {
		for _, sc := range scs {
			for _, p := range roundOrder(paths, round) {
				if p.Skipped != "" {
					continue
				}
				if err := ctx.Err(); err != nil {
					return err
				}
				r := measure(ctx, o, sc, p, round, serverPID)
				logf("round %d %-9s %-16s %s", round, sc.name, p.Name, oneLine(r))
				doc.Runs = append(doc.Runs, r)
				// Let the previous run's sockets and goroutines settle.
				sleepUntil(ctx, time.Now().Add(200*time.Millisecond))
			}
			if o.syscalls && round == 1 {
				doc.Syscalls = append(doc.Syscalls, traceScenario(ctx, o, sc, paths, tmp)...)
			}
		}
	}
	return nil
}

// roundOrder is the order of the paths in a round: as set up, except that
// livenessproxy and baseline trade places in every even round, so that
// neither of the two builds always runs first (a drift within a scenario's
// runs then moves their ratio both ways instead of one).
func roundOrder(paths []path, round int) []path {
	lp := slices.IndexFunc(paths, func(p path) bool { return p.Name == pathLP })
	base := slices.IndexFunc(paths, func(p path) bool { return p.Name == pathBase })
	if round%2 == 1 || lp < 0 || base < 0 {
		return paths
	}
	out := slices.Clone(paths)
	out[lp], out[base] = out[base], out[lp]
	return out
}

// measure runs one scenario on one path and turns it into a runResult.
func measure(ctx context.Context, o options, sc scenario, p path, round, serverPID int) runResult {
	pids := map[string]int{"client": os.Getpid(), "server": serverPID}
	if p.proc != nil {
		if p.proc.exited() {
			return runResult{Scenario: sc.name, Path: p.Name, Round: round,
				Skipped: fmt.Sprintf("%s exited: %v (%s)", p.Name, p.proc.waitErr, p.proc.logTail())}
		}
		pids["proxy"] = p.proc.pid
	}
	if p.peer != nil {
		pids["peer"] = p.peer.pid // the mesh's ingress sidecar: its CPU is the proxy's too
	}
	meter := newCPUMeter(pids)
	lr, win, err := runLoad(ctx, p.Addr, sc, o.warmup, o.duration, o.maxOps, meter)
	if err != nil {
		return runResult{Scenario: sc.name, Path: p.Name, Round: round, Skipped: err.Error()}
	}
	return newRunResult(sc, p.Name, round, lr, win, meter)
}

func oneLine(r runResult) string {
	if r.Skipped != "" {
		return "FAILED: " + r.Skipped
	}
	s := fmt.Sprintf("%s %s p50 %s p99 %s", groupThousands(r.Throughput), r.Unit, fmtUs(r.P50us), fmtUs(r.P99us))
	if r.ProxyCPUus != 0 {
		s += fmt.Sprintf(" proxyCPU %s/op", fmtUs(r.ProxyCPUus))
	}
	if r.Errors != 0 {
		s += fmt.Sprintf(" errors %d (first: %s)", r.Errors, r.FirstError)
	}
	return s
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
}

func kernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return ""
	}
	return unix.ByteSliceToString(u.Release[:])
}
