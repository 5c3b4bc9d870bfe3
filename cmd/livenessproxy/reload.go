package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"strings"
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

// watchConfig reloads the configuration when the file's content changes
// or on SIGHUP, until ctx ends. A config that fails validation is logged
// with every problem by key path and the last good one keeps serving.
func watchConfig(ctx context.Context, path string, applied []byte, hup <-chan os.Signal, p *proxy.Proxy, m *metrics.Metrics, log zerolog.Logger) {
	tick := time.NewTicker(watchInterval)
	defer tick.Stop()
	last := applied
	for {
		force := false
		select {
		case <-ctx.Done():
			return
		case <-hup:
			force = true
		case <-tick.C:
		}
		data, err := os.ReadFile(path)
		if err != nil {
			if force {
				log.Error().Err(err).Msg("config reload: cannot read the file; keeping the last good config")
				m.ConfigReload("error")
			}
			continue // mid-swap or briefly missing: try again next tick
		}
		if !force && bytes.Equal(data, last) {
			continue
		}
		last = data
		reload(data, p, m, log)
	}
}

func reload(data []byte, p *proxy.Proxy, m *metrics.Metrics, log zerolog.Logger) {
	cfg, err := policy.Parse(data)
	if err != nil {
		var problems []string
		var es policy.Errors
		if errors.As(err, &es) {
			for _, e := range es {
				problems = append(problems, e.Error())
			}
		} else {
			problems = strings.Split(err.Error(), "\n")
		}
		log.Error().Strs("problems", problems).Msg("config reload rejected; keeping the last good config")
		m.ConfigReload("error")
		return
	}
	if err := p.Reload(cfg); err != nil {
		log.Error().Err(err).Msg("config reload applied in part")
		m.ConfigReload("error")
		return
	}
	m.ConfigReload("ok")
	log.Info().Int("listeners", len(cfg.Listeners)).Msg("config reloaded")
}
