// Command livenessproxy is a sidecar TCP proxy that enforces liveness on a
// client's long-lived upstream connections. This file is wiring only.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/admin"
	"github.com/livenessproxy/livenessproxy/internal/demo"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// timeFormat is RFC 3339 with milliseconds: what every log line carries.
const timeFormat = "2006-01-02T15:04:05.000Z07:00"

func init() {
	// Set once, before any logger exists: zerolog reads them on every
	// event. Durations are logged as milliseconds, and their keys say so
	// (drain_timeout_ms).
	zerolog.TimeFieldFormat = timeFormat
	zerolog.DurationFieldUnit = time.Millisecond
	zerolog.DurationFieldInteger = false
}

// verb is one of the binary's commands.
type verb struct {
	name    string
	summary string // one line, for livenessproxy --help
	run     func(args []string, stdout, stderr io.Writer) int
}

// verbs in the order --help lists them.
var verbs = []verb{
	{"run", "proxy the configured listeners until SIGTERM (the default verb)", cmdRun},
	{"check", "validate a configuration file and print every problem, one per line", cmdCheck},
	{"ctl", "talk to a running proxy's control server: endpoints, pools, disable, enable, evict, drain, config, log-level, wait-ready", cmdCtl},
	{"redirect", "install the nftables rules that send outgoing TCP to the proxy (the init container)", cmdRedirect},
	{"demo", "replay a node flap without FIN, in-process on loopback, with and without the proxy", cmdDemo},
	{"version", "print the version (and, for a local build, the VCS revision)", cmdVersion},
}

func usage() string {
	var b strings.Builder
	b.WriteString(`livenessproxy: a sidecar TCP proxy that enforces liveness on a client's upstream connections.

usage: livenessproxy [VERB] [FLAGS]

verbs:
`)
	for _, v := range verbs {
		fmt.Fprintf(&b, "  %-9s %s\n", v.name, v.summary)
	}
	b.WriteString(`
"livenessproxy VERB --help" lists a verb's flags. "livenessproxy --version"
is "livenessproxy version". Exit codes: 0 success, 1 failure, 2 bad usage.
`)
	return b.String()
}

func main() {
	os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
}

// realMain runs the verb args name ("run" when the first argument is a
// flag, or there is none) and returns the exit code.
func realMain(args []string, stdout, stderr io.Writer) int {
	name := "run"
	if len(args) > 0 {
		switch a := args[0]; a {
		case "-h", "-help", "--help":
			fmt.Fprint(stdout, usage())
			return 0
		case "-version", "--version":
			return cmdVersion(args[1:], stdout, stderr)
		case "help":
			if len(args) == 1 {
				fmt.Fprint(stdout, usage())
				return 0
			}
			// "help VERB" is "VERB --help".
			name, args = args[1], []string{"--help"}
		default:
			if a != "" && a[0] != '-' {
				name, args = a, args[1:]
			}
		}
	}
	for _, v := range verbs {
		if v.name == name {
			return v.run(args, stdout, stderr)
		}
	}
	fmt.Fprintf(stderr, "livenessproxy: unknown verb %q\n\n%s", name, usage())
	return 2
}

// command is a verb's flag set and help text.
type command struct {
	fs   *flag.FlagSet
	help string // usage lines and a description; the flags follow
}

func newCommand(name, help string) *command {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Usage = func() {} // parse prints help and hints itself
	return &command{fs: fs, help: help}
}

// parse parses args. With --help or -h it prints the help on stdout and
// returns 0, false; with a bad flag or an argument it prints the problem
// and a hint on stderr and returns 2, false.
func (c *command) parse(args []string, stdout, stderr io.Writer) (code int, ok bool) {
	c.fs.SetOutput(stderr) // where the flag package reports a bad flag
	err := c.fs.Parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		c.printHelp(stdout)
		return 0, false
	case err != nil:
		// The flag package has said what is wrong.
	case c.fs.NArg() > 0:
		fmt.Fprintf(stderr, "%s: unexpected argument %q\n", c.fs.Name(), c.fs.Arg(0))
	default:
		return 0, true
	}
	fmt.Fprintf(stderr, "run \"livenessproxy %s --help\" for its flags\n", c.fs.Name())
	return 2, false
}

// printHelp prints the help text and every flag, GNU style (--name).
func (c *command) printHelp(w io.Writer) {
	fmt.Fprint(w, c.help)
	n := 0
	c.fs.VisitAll(func(*flag.Flag) { n++ })
	if n == 0 {
		fmt.Fprintln(w, "\nno flags")
		return
	}
	fmt.Fprintln(w, "\nflags:")
	c.fs.VisitAll(func(f *flag.Flag) {
		arg, text := flag.UnquoteUsage(f)
		head := "--" + f.Name
		if len(f.Name) == 1 {
			head = "-" + f.Name // -o, as people type it
		}
		if arg != "" {
			head += " " + arg
		}
		if f.DefValue != "" && f.DefValue != "0" && f.DefValue != "false" {
			text += fmt.Sprintf(" (default %s)", f.DefValue)
		}
		fmt.Fprintf(w, "  %-22s %s\n", head, text)
	})
}

// logLevels are the levels --log-level and log.level accept.
var logLevels = map[string]zerolog.Level{
	"debug": zerolog.DebugLevel,
	"info":  zerolog.InfoLevel,
	"warn":  zerolog.WarnLevel,
	"error": zerolog.ErrorLevel,
}

const runHelp = `usage: livenessproxy [run] --config FILE [--log-level LEVEL]

Binds the configured listeners and the admin servers and proxies until
SIGTERM or SIGINT; then serves on for shutdown_grace (ended early once no
link has been open for shutdown_idle), stops accepting and drains for
drain_timeout. The configuration is read
again when the file changes and on SIGHUP. Logs go to stderr, in log.format
(json by default).
`

func cmdRun(args []string, stdout, stderr io.Writer) int {
	cmd := newCommand("run", runHelp)
	config := cmd.fs.String("config", "", "the configuration `FILE` (YAML); required")
	level := cmd.fs.String("log-level", "", "the log `LEVEL`: debug, info, warn or error; overrides log.level")
	if code, ok := cmd.parse(args, stdout, stderr); !ok {
		return code
	}
	switch _, known := logLevels[*level]; {
	case *config == "":
		fmt.Fprintln(stderr, "run: --config FILE is required")
		return 2
	case *level != "" && !known:
		fmt.Fprintf(stderr, "run: --log-level %q is not one of debug, info, warn, error\n", *level)
		return 2
	}

	// Until the configuration's log section is known, log as the default
	// configuration says: JSON, at info.
	data, err := policy.ReadFile(*config)
	if err != nil {
		log := newLogger(policy.DefaultConfig().Log, *level, stderr)
		log.Error().Err(err).Str("config", *config).Msg("cannot read the configuration; not starting")
		return 1
	}
	cfg, err := policy.Parse(data)
	if err != nil {
		logCfg := policy.DefaultConfig().Log
		if logSectionValid(err) {
			logCfg = cfg.Log
		}
		log := newLogger(logCfg, *level, stderr)
		log.Error().Str("config", *config).Strs("problems", problems(err)).Msg("invalid configuration; not starting")
		return 1
	}
	log := withRunLevel(newLogger(cfg.Log, *level, stderr))

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// SIGHUP reloads; caught for the whole run (while starting and
	// draining too), so that it never takes the default action: exit.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	run := newRunning(cfg)
	if err := serve(ctx, run, log, func(p *proxy.Proxy, m *metrics.Process) {
		watchConfig(ctx, *config, data, hup, p, m, run, log)
	}); err != nil {
		log.Error().Err(err).Msg("livenessproxy stopped")
		return 1
	}
	return 0
}

// logSectionValid reports whether the log section of a configuration that
// failed to parse was itself fine: no problem lies in it, and none is with
// the file as a whole (a syntax error: nothing decoded).
func logSectionValid(err error) bool {
	var es policy.Errors
	if !errors.As(err, &es) {
		return false
	}
	for _, e := range es {
		var ke *policy.KeyError
		if !errors.As(e, &ke) || ke.Path == "" || ke.Path == "log" || strings.HasPrefix(ke.Path, "log.") {
			return false
		}
	}
	return true
}

// problems returns every problem of a configuration error, one per element.
func problems(err error) []string {
	var es policy.Errors
	if !errors.As(err, &es) {
		return strings.Split(err.Error(), "\n")
	}
	out := make([]string, len(es))
	for i, e := range es {
		out[i] = e.Error()
	}
	return out
}

// newLogger returns the logger a configuration's log section asks for:
// its level (or override, when set), JSON or console to w. The console
// format is coloured only when w is a terminal. An unknown level (which
// validation rejects) is info.
func newLogger(cfg policy.Log, override string, w io.Writer) zerolog.Logger {
	name := cfg.Level
	if override != "" {
		name = override
	}
	lvl, ok := logLevels[name]
	if !ok {
		lvl = zerolog.InfoLevel
	}
	if cfg.Format == "console" {
		w = zerolog.ConsoleWriter{Out: w, NoColor: !isTerminal(w), TimeFormat: timeFormat}
	}
	return zerolog.New(w).Level(lvl).With().Timestamp().Logger()
}

// isTerminal reports whether w is a file that is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(interface{ Fd() uintptr })
	return ok && (isatty.IsTerminal(f.Fd()) || isatty.IsCygwinTerminal(f.Fd()))
}

const checkHelp = `usage: livenessproxy check --config FILE

Validates the configuration file as run would load it. Prints every problem
on its own line, by key path and line, and exits 1; or the process limits
it would run under here (memory and where it came from, GOMEMLIMIT, the
memory budget, max_links, descriptors, GOMAXPROCS, with a warning for each
problem)
and "FILE: ok", and exits 0.
`

func cmdCheck(args []string, stdout, stderr io.Writer) int {
	cmd := newCommand("check", checkHelp)
	config := cmd.fs.String("config", "", "the configuration `FILE` (YAML); required")
	if code, ok := cmd.parse(args, stdout, stderr); !ok {
		return code
	}
	if *config == "" {
		fmt.Fprintln(stderr, "check: --config FILE is required")
		return 2
	}
	cfg, err := policy.Load(*config)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	printLimits(stdout, proxy.PlanLimits(cfg))
	fmt.Fprintf(stdout, "%s: ok\n", *config)
	return 0
}

const demoHelp = `usage: livenessproxy demo

Replays a node flap without FIN in-process on loopback: simulated Pinot
brokers query a simulated server, some straight and some through a
livenessproxy, the server's node stops answering without a FIN, and a new
server takes its address. Prints what each path saw. About ten seconds; no
root needed.
`

func cmdDemo(args []string, stdout, stderr io.Writer) int {
	cmd := newCommand("demo", demoHelp)
	if code, ok := cmd.parse(args, stdout, stderr); !ok {
		return code
	}
	if err := demo.Run(context.Background(), stdout); err != nil {
		fmt.Fprintln(stderr, "demo:", err)
		return 1
	}
	return 0
}

const versionHelp = `usage: livenessproxy version
       livenessproxy --version

Prints the version the binary was built with (-ldflags "-X main.version=V"),
or for a build without one, the module version Go recorded with the VCS
revision, whether the tree was modified, the commit time and the Go version.
`

func cmdVersion(args []string, stdout, stderr io.Writer) int {
	cmd := newCommand("version", versionHelp)
	if code, ok := cmd.parse(args, stdout, stderr); !ok {
		return code
	}
	fmt.Fprintln(stdout, "livenessproxy", currentBuild().String())
	return 0
}

// serve runs the proxy and the admin servers until ctx is cancelled, then
// keeps serving for the shutdown grace (shutdownGrace) and drains: stop
// accepting, let links finish up to drain_timeout, close the rest.
func serve(ctx context.Context, run *running, log zerolog.Logger, watch func(*proxy.Proxy, *metrics.Process)) error {
	cfg := run.config()
	b := currentBuild()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m := metrics.NewProcess(reg)
	m.SetBuildInfo(b.version, b.revision, b.goVersion)
	p := proxy.New(cfg, proxy.Options{Logger: &log, Registerer: reg, AccessLog: cfg.Log.Access, ManageRuntime: true})
	adm, err := admin.Start(admin.Config{
		Listen:        cfg.Admin.Listen,
		ControlListen: cfg.Admin.ControlListen,
		TokenFile:     cfg.Admin.TokenFile,
		Runtime:       admin.Runtime{Config: run.effective, Level: runLevel{}},
	}, reg, p.Ready, p, log)
	if err != nil {
		return err // it names the key
	}
	if err := p.Start(); err != nil {
		_ = adm.Shutdown(context.Background())
		return err
	}
	logLimits(log, p.Limits())
	log.Info().Str("version", b.version).Str("revision", b.revision).Int("listeners", len(cfg.Listeners)).
		Msg("livenessproxy started")

	watched := make(chan struct{})
	go func() {
		defer close(watched)
		if watch != nil {
			watch(p, m)
		}
	}()
	<-ctx.Done()
	<-watched
	now := run.config() // a reload may have changed the shutdown keys
	shutdownGrace(now.ShutdownGrace.D(), now.ShutdownIdle.D(), p.ActiveLinks, log)
	drain := p.DrainTimeout()
	log.Info().Dur("drain_timeout_ms", drain).Int("links", p.ActiveLinks()).Msg("draining")
	dctx, cancel := context.WithTimeout(context.Background(), max(drain, 0))
	defer cancel()
	if err := p.Shutdown(dctx); errors.Is(err, context.DeadlineExceeded) {
		log.Warn().Msg("drain timeout: closed the links still open")
	}
	actx, acancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer acancel()
	_ = adm.Shutdown(actx)
	log.Info().Msg("livenessproxy stopped")
	return nil
}
