// Package policy owns livenessproxy's configuration: the ConfigMap schema,
// its defaults, strict decoding with key-path errors, and validation.
//
// Every key has a default and a ConfigMap may set any subset. Durations are
// written as Go durations (10s, 500ms), sizes with binary units (16MiB).
// A non-positive duration or size disables the mechanism it controls.
package policy

import "time"

// Config is the whole configuration file.
type Config struct {
	// Admin is the HTTP server for /metrics, /healthz and /readyz.
	Admin Admin `yaml:"admin"`
	// Log controls the structured logger.
	Log Log `yaml:"log"`
	// DrainTimeout is how long SIGTERM waits for open links to finish
	// after the listeners stop accepting; links still open then are closed.
	// Non-positive closes them at once.
	DrainTimeout Duration `yaml:"drain_timeout"`
	// Defaults are the link settings every listener starts from; a listener
	// may override any of them.
	Defaults Settings `yaml:"defaults"`
	// Listeners are the explicit listeners, one upstream each.
	Listeners []Listener `yaml:"listeners"`
}

// Admin configures the admin HTTP server.
type Admin struct {
	// Listen is the host:port the admin server binds. Empty disables it.
	// Loopback by default: the admin API is not meant to be reachable from
	// outside the pod.
	Listen string `yaml:"listen"`
}

// Log configures logging.
type Log struct {
	// Level is one of debug, info, warn, error.
	Level string `yaml:"level"`
	// Format is json (one object per line) or console (human-readable).
	Format string `yaml:"format"`
}

// Listener is one explicit listener proxying to one upstream.
type Listener struct {
	// Name labels the listener's metrics and logs; unique, [a-zA-Z0-9_.-].
	Name string `yaml:"name"`
	// Listen is the host:port the listener binds.
	Listen string `yaml:"listen"`
	// Upstream is the host:port every link of this listener dials.
	Upstream string `yaml:"upstream"`
	// Settings override the defaults for this listener's links.
	Settings `yaml:",inline"`
}

// Settings are the per-link liveness settings, set under defaults and
// overridable per listener.
type Settings struct {
	// ConnectTimeout bounds the upstream dial. Non-positive: the kernel's
	// own SYN retry limit (minutes).
	ConnectTimeout Duration `yaml:"connect_timeout"`
	// WriteTimeout closes the link when the upstream kernel has not accepted
	// a queued write for this long. Non-positive disables.
	WriteTimeout Duration `yaml:"write_timeout"`
	// TCPUserTimeout is TCP_USER_TIMEOUT on the upstream socket: data left
	// unacknowledged this long makes the kernel fail the socket.
	// Non-positive leaves the kernel default (tcp_retries2, ~15 min).
	TCPUserTimeout Duration `yaml:"tcp_user_timeout"`
	// Keepalive sets TCP keepalive on the upstream socket.
	Keepalive Keepalive `yaml:"keepalive"`
	// WriteBuffer bounds the bytes queued toward the upstream per link.
	WriteBuffer WriteBuffer `yaml:"write_buffer"`
	// HalfCloseTimeout bounds how long the other direction may keep flowing
	// after one side sent FIN. Non-positive: unbounded.
	HalfCloseTimeout Duration `yaml:"half_close_timeout"`
}

// Keepalive is TCP keepalive on upstream sockets.
type Keepalive struct {
	// Idle is the idle time before the first probe (TCP_KEEPIDLE).
	// Non-positive leaves keepalive off (the kernel default).
	Idle Duration `yaml:"idle"`
	// Interval is the time between probes (TCP_KEEPINTVL).
	Interval Duration `yaml:"interval"`
	// Count is the number of unanswered probes before the socket fails
	// (TCP_KEEPCNT).
	Count int `yaml:"count"`
}

// Overflow policies for WriteBuffer.OnOverflow.
const (
	OverflowReject       = "reject"
	OverflowBackpressure = "backpressure"
)

// WriteBuffer is the per-link queue toward the upstream.
type WriteBuffer struct {
	// HighWaterMark is the most bytes queued toward the upstream per link.
	// Non-positive: unbounded (not recommended).
	HighWaterMark Size `yaml:"high_water_mark"`
	// LowWaterMark is where backpressure resumes reading the client; it
	// must be below HighWaterMark. Non-positive: resume when empty.
	LowWaterMark Size `yaml:"low_water_mark"`
	// OnOverflow is reject (close the link: the client fails fast) or
	// backpressure (stop reading the client until below LowWaterMark).
	OnOverflow string `yaml:"on_overflow"`
}

// DefaultSettings returns the link settings used where a config says nothing.
// The numbers come from the incidents in the project's seeds.
func DefaultSettings() Settings {
	return Settings{
		ConnectTimeout:   Duration(time.Second),
		WriteTimeout:     Duration(10 * time.Second),
		TCPUserTimeout:   Duration(10 * time.Second),
		Keepalive:        Keepalive{Idle: Duration(10 * time.Second), Interval: Duration(5 * time.Second), Count: 3},
		WriteBuffer:      WriteBuffer{HighWaterMark: 16 * MiB, LowWaterMark: 8 * MiB, OnOverflow: OverflowReject},
		HalfCloseTimeout: Duration(30 * time.Second),
	}
}

// DefaultConfig returns a configuration with every default and no listeners.
func DefaultConfig() Config {
	return Config{
		Admin:        Admin{Listen: "127.0.0.1:9901"},
		Log:          Log{Level: "info", Format: "json"},
		DrainTimeout: Duration(15 * time.Second),
		Defaults:     DefaultSettings(),
	}
}
