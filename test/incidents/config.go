//go:build linux

package main

import (
	"fmt"
	"strings"
	"time"
)

// Scaled-down settings shared by the replays: the proxy's defaults (README,
// Configuration reference) and the incidents' numbers, noted on each line,
// divided so that each replay runs in seconds.
const (
	requestTimeout = 500 * time.Millisecond // unanswered.request_timeout (default 3s)
	threshold      = 1                      // unanswered.consecutive_timeouts_threshold (the default: the time rule)
	initialDelay   = 300 * time.Millisecond // detector.initial_delay (default 1s)
	maxDelay       = 2 * time.Second        // detector.max_delay (default 60s)
	probeTimeout   = 300 * time.Millisecond // detector.probe_timeout (default 1s)
	highWaterMark  = 4 << 20                // write_buffer.high_water_mark (default 16MiB)
	keepIdle       = 2 * time.Second        // keepalive.idle (default 10s)
	keepInterval   = time.Second            // keepalive.interval (default 5s)
	keepCount      = 2                      // keepalive.count (default 3)
	userTimeout    = 2 * time.Second        // tcp_user_timeout (default 10s)
	writeTimeout   = 2 * time.Second        // write_timeout (default 10s)
	brokerTimeout  = 2 * time.Second        // the broker's per-query timeout (Pinot: 3s in the incident)
)

// proxyConfig is what a replay varies in the proxy's configuration.
type proxyConfig struct {
	upstreams []string // one listener per upstream, named s0, s1, ...
	httpProbe int      // detector.probe: http on this port; 0: connect
}

// yaml renders the configuration as the ConfigMap a user would write.
func (c proxyConfig) yaml() string {
	probe := "probe: connect"
	if c.httpProbe != 0 {
		probe = fmt.Sprintf("probe: http, http: {port: %d, path: /health}", c.httpProbe)
	}
	var b strings.Builder
	fmt.Fprintf(&b, `admin: {listen: "127.0.0.1:0", control_listen: "127.0.0.1:0"}
log: {level: warn, format: json}
drain_timeout: 0s
defaults:
  connect_timeout: 500ms
  write_timeout: %s
  tcp_user_timeout: %s
  keepalive: {idle: %s, interval: %s, count: %d}
  write_buffer: {high_water_mark: %d, low_water_mark: %d, on_overflow: reject}
  framing: {type: length_field, length_field_length: 4, byte_order: big, max_frame_length: 16MiB}
  unanswered: {track: on, request_timeout: %s, consecutive_timeouts_threshold: %d}
  detector: {%s, probe_timeout: %s, initial_delay: %s, backoff_factor: 2, max_delay: %s, jitter: 0}
listeners:
`, writeTimeout, userTimeout, keepIdle, keepInterval, keepCount, highWaterMark, highWaterMark/2,
		requestTimeout, threshold, probe, probeTimeout, initialDelay, maxDelay)
	for i, u := range c.upstreams {
		fmt.Fprintf(&b, "  - {name: s%d, listen: \"127.0.0.1:0\", upstream: %q}\n", i, u)
	}
	return b.String()
}
