package policy

import (
	"math"
	"testing"
	"time"
)

// IdleUserTimeout is the bound the window guard keeps on an idle upstream
// socket: keepalive's idle + interval x count (in the kernel's whole
// seconds) where that is above tcp_user_timeout, so that the kernel's
// keepalive timer, which with TCP_USER_TIMEOUT set gives up at its first
// probe unanswered past that bound, waits for count probes.
func TestIdleUserTimeout(t *testing.T) {
	ka := func(idle, interval time.Duration, count int) Keepalive {
		return Keepalive{Idle: Duration(idle), Interval: Duration(interval), Count: count}
	}
	d := DefaultConfig().Defaults
	for _, c := range []struct {
		name string
		ut   time.Duration
		ka   Keepalive
		want time.Duration
	}{
		{"defaults", d.TCPUserTimeout.D(), d.Keepalive, 25 * time.Second},
		{"tcp_user_timeout the longer", time.Minute, d.Keepalive, time.Minute},
		{"keepalive off", 2 * time.Second, Keepalive{}, 2 * time.Second},
		{"keepalive disabled", 2 * time.Second, ka(-1, 0, 0), 2 * time.Second},
		{"no tcp_user_timeout", 0, d.Keepalive, 0},
		{"the kernel's seconds", time.Second, ka(1500*time.Millisecond, 200*time.Millisecond, 3), 5 * time.Second},
		{"the kernel's limit", time.Second, ka(32767*time.Second, 32767*time.Second, 127), time.Duration(math.MaxInt32) * time.Millisecond},
	} {
		s := Settings{TCPUserTimeout: Duration(c.ut), Keepalive: c.ka}
		if got := s.IdleUserTimeout(); got != c.want {
			t.Errorf("%s: IdleUserTimeout %v, want %v", c.name, got, c.want)
		}
	}
}

// A mesh session's connection keeps tcp_user_timeout (0) where the
// heartbeat declares a silence dead well before the kernel could cut it
// after one lost keepalive probe (the defaults: ping_timeout 3s against
// 15s), and gets keepalive's bound where it does not.
func TestMeshSessionUserTimeout(t *testing.T) {
	d := DefaultConfig().Defaults
	heartbeat := func(interval, timeout time.Duration) Mesh {
		return Mesh{PingInterval: Duration(interval), PingTimeout: Duration(timeout), WriteTimeout: Duration(time.Second)}
	}
	for _, c := range []struct {
		name string
		ut   time.Duration
		ka   Keepalive
		mesh Mesh
		want time.Duration
	}{
		{"defaults", d.TCPUserTimeout.D(), d.Keepalive, Mesh{}, 0},
		{"a heartbeat slower than keepalive", d.TCPUserTimeout.D(), d.Keepalive, heartbeat(10*time.Second, 30*time.Second), 25 * time.Second},
		{"ping_timeout half the one-probe cut", d.TCPUserTimeout.D(), d.Keepalive, heartbeat(5*time.Second, 7500*time.Millisecond), 0},
		{"just above half", d.TCPUserTimeout.D(), d.Keepalive, heartbeat(5*time.Second, 7501*time.Millisecond), 25 * time.Second},
		{"tcp_user_timeout the longer", time.Minute, d.Keepalive, heartbeat(10*time.Second, time.Hour), 0},
		{"keepalive off", d.TCPUserTimeout.D(), Keepalive{}, heartbeat(10*time.Second, time.Hour), 0},
	} {
		s := Settings{TCPUserTimeout: Duration(c.ut), Keepalive: c.ka, Mesh: c.mesh}
		if got := s.MeshSessionUserTimeout(); got != c.want {
			t.Errorf("%s: MeshSessionUserTimeout %v, want %v", c.name, got, c.want)
		}
	}
}

// A probe's connection keeps tcp_user_timeout (0) with the default
// probe_timeout (1s), and gets keepalive's bound where probe_timeout
// outlasts the kernel's cut after one lost probe.
func TestProbeUserTimeout(t *testing.T) {
	d := DefaultConfig().Defaults
	for _, c := range []struct {
		name    string
		timeout time.Duration
		want    time.Duration
	}{
		{"defaults", d.Detector.ProbeTimeout.D(), 0},
		{"at the one-probe cut", 15 * time.Second, 0},
		{"past it", 16 * time.Second, 25 * time.Second},
	} {
		s := d
		s.Detector.ProbeTimeout = Duration(c.timeout)
		if got := s.ProbeUserTimeout(); got != c.want {
			t.Errorf("%s: ProbeUserTimeout %v, want %v", c.name, got, c.want)
		}
	}
}
