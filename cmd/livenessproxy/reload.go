package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"reflect"
	"time"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// watchInterval is how often the config file is read for changes. A
// Kubernetes ConfigMap volume changes by swapping a symlink (..data), so
// the file's content is compared, not its inode or mtime.
const watchInterval = time.Second

// unreadableTicks is how many ticks in a row may find the config file
// missing or unreadable before that is a failed reload (logged once,
// counted, config_last_reload_successful 0 until the file is applied
// again): a ConfigMap's ..data swap leaves it missing for milliseconds,
// which a tick may see. Three ticks in a row is a file gone for two
// seconds and more.
const unreadableTicks = 3

// Reload triggers, for the log.
const (
	triggerFile   = "file"
	triggerSIGHUP = "sighup"
)

// watchConfig reloads the configuration when the file's content changes
// (and two reads a tick apart agree on it: settle) or on SIGHUP, until
// ctx ends. A config that fails validation is logged
// with every problem by key path and the last good one keeps serving; so
// is a file that cannot be read on a SIGHUP, or for unreadableTicks ticks
// in a row.
// started is the configuration the process started with: the keys that
// need a restart keep its values.
func watchConfig(ctx context.Context, path string, applied []byte, hup <-chan os.Signal, p *proxy.Proxy, m *metrics.Process, run *running, log zerolog.Logger) {
	started := run.config()
	tick := time.NewTicker(watchInterval)
	defer tick.Stop()
	last := applied
	var settled settle
	// Ticks in a row that could not read the file, and whether that is
	// on record yet (logged, counted), by them or by a SIGHUP.
	failedTicks, reported := 0, false
	for {
		trigger := triggerFile
		select {
		case <-ctx.Done():
			return
		case <-hup:
			trigger = triggerSIGHUP
		case <-tick.C:
		}
		data, err := policy.ReadFile(path)
		if err != nil {
			if trigger == triggerFile {
				failedTicks++ // mid-swap or briefly missing, at first
			}
			if trigger == triggerSIGHUP || failedTicks == unreadableTicks && !reported {
				log.Error().Err(err).Str("path", path).Str("trigger", trigger).
					Msg("config reload: cannot read the file; keeping the last good config")
				m.ConfigReload("error")
				// The failure is on record (config_last_reload_successful
				// 0) until a reload succeeds: the file, once it can be read
				// again, is applied even if its content is what was
				// applied before, so that the record clears.
				last, reported = nil, true
			}
			continue
		}
		if reported {
			log.Info().Str("path", path).Msg("config file readable again")
		}
		failedTicks, reported = 0, false
		if trigger == triggerFile && !settled.ready(data, last) {
			continue
		}
		settled = settle{}
		last = data
		if cfg, ok := reload(data, trigger, p, m, started, log); ok {
			run.applied(cfg)
		}
	}
}

// settle holds a change of the config file until a second read finds
// the same content: a file written in place, not swapped, can be read
// half-written, and the first part of a configuration often parses on its
// own (the listeners after the cut would be retired). A ConfigMap's swap
// is atomic, and waits one read more for nothing worse than a second.
type settle struct{ seen []byte }

// ready reports whether data, read now, is to be applied: it differs from
// last, the content applied, and the read before found it too.
func (s *settle) ready(data, last []byte) bool {
	if bytes.Equal(data, last) {
		s.seen = nil
		return false
	}
	if !bytes.Equal(data, s.seen) {
		s.seen = data
		return false
	}
	return true
}

// reload applies data, a new configuration file, and logs what trigger
// caused it and what changed. It returns the configuration now in force
// and true when the proxy applied it (in part too: the keys beyond the
// listener that failed are in force), with the keys that need a restart
// kept at their started values.
func reload(data []byte, trigger string, p *proxy.Proxy, m *metrics.Process, started policy.Config, log zerolog.Logger) (policy.Config, bool) {
	cfg, err := policy.Parse(data)
	if err != nil {
		log.Error().Str("trigger", trigger).Strs("problems", problems(err)).
			Msg("config reload rejected; keeping the last good config")
		m.ConfigReload("error")
		return cfg, false
	}
	inForce := cfg
	inForce.Admin, inForce.Log, inForce.Interception = started.Admin, started.Log, started.Interception
	ch, err := p.Apply(cfg)
	if errors.Is(err, proxy.ErrNothingApplied) {
		log.Error().Err(err).Str("trigger", trigger).Msg("config reload rejected; keeping the last good config")
		m.ConfigReload("error")
		return cfg, false
	}
	if err != nil {
		ev := log.Error().Err(err).Str("trigger", trigger)
		changes(ev, ch).Msg("config reload applied in part")
		m.ConfigReload("error")
		// The listeners that run, not the file's: one whose bind failed
		// is bound nowhere.
		inForce.Listeners = p.ListenerConfigs()
		return inForce, true
	}
	m.ConfigReload("ok")
	ev := log.Info().Str("trigger", trigger).Int("listeners", len(cfg.Listeners))
	if keys := restartNeeded(started, cfg); len(keys) > 0 {
		ev = ev.Strs("restart_needed", keys)
	}
	changes(ev, ch).Msg("config reloaded")
	return inForce, true
}

// changes adds to ev the parts of ch that are not empty.
func changes(ev *zerolog.Event, ch proxy.Changes) *zerolog.Event {
	for _, f := range []struct {
		key  string
		vals []string
	}{
		{"listeners_added", ch.ListenersAdded},
		{"listeners_removed", ch.ListenersRemoved},
		{"listeners_retuned", ch.ListenersRetuned},
		{"endpoints_disabled", ch.EndpointsDisabled},
		{"endpoints_enabled", ch.EndpointsEnabled},
	} {
		if len(f.vals) > 0 {
			ev = ev.Strs(f.key, f.vals)
		}
	}
	return ev
}

// restartNeeded returns the keys that a reload cannot change whose value
// in cfg differs from the one the process started with: the new value
// waits for a restart.
func restartNeeded(started, cfg policy.Config) []string {
	var keys []string
	for _, k := range []struct {
		key      string
		old, new any
	}{
		{"admin.listen", started.Admin.Listen, cfg.Admin.Listen},
		{"admin.control_listen", started.Admin.ControlListen, cfg.Admin.ControlListen},
		{"admin.token_file", started.Admin.TokenFile, cfg.Admin.TokenFile},
		{"log.level", started.Log.Level, cfg.Log.Level},
		{"log.format", started.Log.Format, cfg.Log.Format},
		{"log.access", started.Log.Access, cfg.Log.Access},
		{"interception.excluded_set", started.Interception.ExcludedSet, cfg.Interception.ExcludedSet},
	} {
		if !reflect.DeepEqual(k.old, k.new) {
			keys = append(keys, k.key)
		}
	}
	return keys
}
