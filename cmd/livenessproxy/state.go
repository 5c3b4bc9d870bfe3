package main

import (
	"fmt"
	"sync/atomic"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/policy"
)

// running is what the process knows beyond the proxy: the configuration
// in force (the one it started with, or the last one a reload applied)
// and the log level, which the control API changes at run time.
type running struct {
	cfg atomic.Pointer[policy.Config]
}

func newRunning(cfg policy.Config) *running {
	r := &running{}
	r.cfg.Store(&cfg)
	return r
}

// config returns the configuration in force.
func (r *running) config() policy.Config { return *r.cfg.Load() }

// applied records cfg, which a reload has applied.
func (r *running) applied(cfg policy.Config) { r.cfg.Store(&cfg) }

// effective is GET /v1/config: the configuration in force as YAML, every
// default filled in, log.level the level now in force.
func (r *running) effective() ([]byte, error) {
	cfg := r.config()
	cfg.Log.Level = runLevel{}.Get()
	return cfg.Effective()
}

// runLevel is the run-time log level (admin.Level). The run's logger is
// built at debug, the lowest level, and zerolog's global level filters
// every logger derived from it, so that a change applies to all of them
// at once (and costs nothing for the events it filters out). Only `run`
// sets it, once per process.
type runLevel struct{}

// withRunLevel returns log at debug with the global level set to log's
// own: from then on runLevel changes what is logged.
func withRunLevel(log zerolog.Logger) zerolog.Logger {
	zerolog.SetGlobalLevel(log.GetLevel())
	return log.Level(zerolog.DebugLevel)
}

func (runLevel) Get() string { return zerolog.GlobalLevel().String() }

func (runLevel) Set(name string) error {
	lvl, ok := logLevels[name]
	if !ok {
		return fmt.Errorf("log level %q is not one of debug, info, warn, error", name)
	}
	zerolog.SetGlobalLevel(lvl)
	return nil
}
