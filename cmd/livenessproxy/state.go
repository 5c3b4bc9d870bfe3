package main

import (
	"sync/atomic"

	"github.com/livenessproxy/livenessproxy/policy"
)

// running is what the process knows beyond the proxy: the configuration
// in force, the one it started with or the last one a reload applied
// (for GET /v1/config and the shutdown grace).
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
