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
	"runtime/debug"
	"syscall"
	"time"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/admin"
	"github.com/livenessproxy/livenessproxy/internal/demo"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = ""

const usage = `usage: livenessproxy [run] --config FILE [--log-level LEVEL]
       livenessproxy check --config FILE
       livenessproxy redirect --proxy-port PORT --cidr CIDR[,CIDR...] [--ports P,...] [--exclude-ports P,...]
                              [--proxy-uid UID | --proxy-mark MARK] [--excluded-set] [--dry-run] [--remove]
       livenessproxy demo
       livenessproxy version
`

func main() {
	os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
}

func realMain(args []string, stdout, stderr io.Writer) int {
	verb := "run"
	if len(args) > 0 && args[0] != "" && args[0][0] != '-' {
		verb, args = args[0], args[1:]
	}
	switch verb {
	case "run":
		return cmdRun(args, stderr)
	case "check":
		return cmdCheck(args, stdout, stderr)
	case "redirect":
		return cmdRedirect(args, stdout, stderr)
	case "demo":
		if err := demo.Run(context.Background(), stdout); err != nil {
			fmt.Fprintln(stderr, "demo:", err)
			return 1
		}
		return 0
	case "version":
		fmt.Fprintln(stdout, "livenessproxy", versionString())
		return 0
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "livenessproxy: unknown command %q\n%s", verb, usage)
		return 2
	}
}

func versionString() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "dev"
}

type flags struct {
	config   string
	logLevel string
}

func parseFlags(name string, args []string, stderr io.Writer) (flags, error) {
	var f flags
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&f.config, "config", "", "configuration file (YAML)")
	fs.StringVar(&f.logLevel, "log-level", "", "debug|info|warn|error; overrides log.level")
	if err := fs.Parse(args); err != nil {
		return f, err
	}
	if fs.NArg() > 0 {
		return f, fmt.Errorf("%s: unexpected argument %q", name, fs.Arg(0))
	}
	if f.config == "" {
		return f, fmt.Errorf("%s: --config FILE is required", name)
	}
	return f, nil
}

func cmdCheck(args []string, stdout, stderr io.Writer) int {
	f, err := parseFlags("check", args, stderr)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	if _, err := policy.Load(f.config); err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	fmt.Fprintf(stdout, "%s: ok\n", f.config)
	return 0
}

func newLogger(cfg policy.Log, override string, w io.Writer) (zerolog.Logger, error) {
	level := cfg.Level
	if override != "" {
		level = override
	}
	lvl, err := zerolog.ParseLevel(level)
	if err != nil || level == "" {
		return zerolog.Nop(), fmt.Errorf("invalid log level %q (debug, info, warn or error)", level)
	}
	if cfg.Format == "console" {
		w = zerolog.ConsoleWriter{Out: w, TimeFormat: time.RFC3339}
	}
	return zerolog.New(w).Level(lvl).With().Timestamp().Logger(), nil
}

func cmdRun(args []string, stderr io.Writer) int {
	f, err := parseFlags("run", args, stderr)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	data, err := os.ReadFile(f.config)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	cfg, err := policy.Parse(data)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	log, err := newLogger(cfg.Log, f.logLevel, stderr)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// SIGHUP reloads; caught for the whole run (while starting and
	// draining too), so that it never takes the default action: exit.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	if err := serve(ctx, cfg, log, func(p *proxy.Proxy, m *metrics.Metrics) {
		watchConfig(ctx, f.config, data, hup, p, m, log)
	}); err != nil {
		log.Error().Err(err).Msg("livenessproxy stopped")
		return 1
	}
	return 0
}

// serve runs the proxy and the admin server until ctx is cancelled, then
// drains: stop accepting, let links finish up to drain_timeout, close the rest.
func serve(ctx context.Context, cfg policy.Config, log zerolog.Logger, watch func(*proxy.Proxy, *metrics.Metrics)) error {
	m := metrics.New()
	p := proxy.New(cfg, proxy.Options{Logger: &log, Metrics: m})
	var adm *admin.Server
	if cfg.Admin.Listen != "" {
		var err error
		adm, err = admin.Start(cfg.Admin.Listen, admin.Handler(m.Registry, p.Ready, p), log)
		if err != nil {
			return fmt.Errorf("admin.listen %s: %w", cfg.Admin.Listen, err)
		}
	}
	if err := p.Start(); err != nil {
		if adm != nil {
			_ = adm.Shutdown(context.Background())
		}
		return err
	}
	log.Info().Str("version", versionString()).Int("listeners", len(cfg.Listeners)).Msg("livenessproxy started")

	watched := make(chan struct{})
	go func() {
		defer close(watched)
		if watch != nil {
			watch(p, m)
		}
	}()
	<-ctx.Done()
	<-watched
	drain := p.DrainTimeout() // a reload may have changed it
	log.Info().Dur("drain_timeout", drain).Int("links", p.ActiveLinks()).Msg("draining")
	dctx, cancel := context.WithTimeout(context.Background(), max(drain, 0))
	defer cancel()
	if err := p.Shutdown(dctx); errors.Is(err, context.DeadlineExceeded) {
		log.Warn().Msg("drain timeout: closed the links still open")
	}
	if adm != nil {
		actx, acancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer acancel()
		_ = adm.Shutdown(actx)
	}
	log.Info().Msg("livenessproxy stopped")
	return nil
}
