package flow

import (
	"net"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/policy"
)

// userTimeoutOnSocket dials a local listener with UpstreamControl(s) and
// reads TCP_USER_TIMEOUT back (milliseconds; 0 is the kernel's default).
func userTimeoutOnSocket(t *testing.T, s policy.Settings) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	d := net.Dialer{Timeout: time.Second, Control: UpstreamControl(s)}
	c, err := d.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var got int
	var gerr error
	if err := rc.Control(func(fd uintptr) { got, gerr = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT) }); err != nil {
		t.Fatal(err)
	}
	if gerr != nil {
		t.Fatal(gerr)
	}
	return got
}

// A positive tcp_user_timeout below 1ms (900us, a slip for 900ms) is
// refused, the key named: TCP_USER_TIMEOUT takes whole milliseconds and
// 0 is the kernel's default of about 15 minutes. Before, it validated and
// was set as 0, the very stall the option is there to cut (found by a
// helper's audit).
func TestSubMillisecondUserTimeoutIsRefused(t *testing.T) {
	for key, doc := range map[string]string{
		"defaults.tcp_user_timeout":     "defaults: {tcp_user_timeout: 900us}\nlisteners:\n  - {name: a, listen: '127.0.0.1:0', upstream: '127.0.0.1:9'}\n",
		"listeners[0].tcp_user_timeout": "listeners:\n  - {name: a, listen: '127.0.0.1:0', upstream: '127.0.0.1:9', tcp_user_timeout: 1ns}\n",
	} {
		cfg, err := policy.Parse([]byte(doc))
		if err != nil {
			if !strings.Contains(err.Error(), key+": ") || !strings.Contains(err.Error(), "1ms") {
				t.Errorf("refused, but not naming %s and its 1ms unit: %v", key, err)
			}
			continue
		}
		s := cfg.Defaults
		if key != "defaults.tcp_user_timeout" {
			s = cfg.Listeners[0].Settings
		}
		t.Errorf("%s %v passed validation and is set as TCP_USER_TIMEOUT %d ms (0: the kernel's default, ~15 min)",
			key, s.TCPUserTimeout, userTimeoutOnSocket(t, s))
	}
}

// Its twin: 1ms, the kernel's unit, validates and is set as 1.
func TestMillisecondUserTimeoutIsSetOnTheSocket(t *testing.T) {
	cfg, err := policy.Parse([]byte("defaults: {tcp_user_timeout: 1ms}\nlisteners:\n  - {name: a, listen: '127.0.0.1:0', upstream: '127.0.0.1:9'}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if got := userTimeoutOnSocket(t, cfg.Defaults); got != 1 {
		t.Errorf("tcp_user_timeout 1ms set TCP_USER_TIMEOUT %d ms, want 1", got)
	}
}
