//go:build linux

package proxy

import (
	"bytes"
	"context"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// Socket options read back from the upstream socket match the config;
// disabled values leave the kernel's defaults. tcp_user_timeout and
// keepalive are set by the window guard's first sample, liveDelay after
// the connect (flow.DialRaw leaves them): unset before, set after, the
// bound raised to keepalive's on the idle link; with no tcp_user_timeout
// (no guard) keepalive is set at the connect.
func TestUpstreamSocketOptions(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	kernelIdle := readSysctl(t, "/proc/sys/net/ipv4/tcp_keepalive_time")
	for _, tc := range []struct {
		name  string
		spec  func(*policy.Settings)
		want  map[string]int
		later bool // set liveDelay after the connect
	}{
		{"configured", func(s *policy.Settings) {
			s.TCPUserTimeout = policy.Duration(2500 * time.Millisecond)
			s.Keepalive = policy.Keepalive{Idle: policy.Duration(7 * time.Second), Interval: policy.Duration(3 * time.Second), Count: 4}
		}, map[string]int{"user_timeout": 19000, "keepalive": 1, "idle": 7, "interval": 3, "count": 4, "nodelay": 1}, true},
		{"keepalive alone", func(s *policy.Settings) {
			s.TCPUserTimeout = 0
			s.Keepalive = policy.Keepalive{Idle: policy.Duration(7 * time.Second), Interval: policy.Duration(3 * time.Second), Count: 4}
		}, map[string]int{"user_timeout": 0, "keepalive": 1, "idle": 7, "interval": 3, "count": 4, "nodelay": 1}, false},
		{"disabled", func(s *policy.Settings) {
			s.TCPUserTimeout = 0
			s.Keepalive = policy.Keepalive{Idle: -1}
		}, map[string]int{"user_timeout": 0, "keepalive": 0, "idle": kernelIdle, "nodelay": 1}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := start(t, peer.Addr(), tc.spec)
			delay := liveDelay(&h.p.listeners[0].current.Load().settings)
			dialled := time.Now() // the proxy dials after this
			c := h.dial()
			roundTrip(t, c, []byte("hello"))
			got := upstreamOptions(t, h.p)
			if early := time.Since(dialled); tc.later && early < delay {
				// The guard's timer, reset after dialled, cannot have fired.
				if got["user_timeout"] != 0 || got["keepalive"] != 0 {
					t.Errorf("%v after the connect (before %v): user_timeout %d, keepalive %d; want both unset",
						early, delay, got["user_timeout"], got["keepalive"])
				}
			} else if tc.later {
				t.Logf("first read %v after the connect, not before %v: the options may be set already", early, delay)
			}
			if tc.later {
				// The link idles: the bound is keepalive's idle +
				// interval x count (19s), not tcp_user_timeout (2.5s),
				// so that a lost probe is not a dead upstream.
				waitFor(t, 10*time.Second, "tcp_user_timeout and keepalive set by the window guard", func() bool {
					got = upstreamOptions(t, h.p)
					return got["keepalive"] == 1 && got["user_timeout"] == tc.want["user_timeout"]
				})
				roundTrip(t, c, []byte("still there"))
			}
			for k, v := range tc.want {
				if got[k] != v {
					t.Errorf("%s = %d, want %d", k, got[k], v)
				}
			}
		})
	}
}

func readSysctl(t *testing.T, path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func upstreamOptions(t *testing.T, p *Proxy) map[string]int {
	t.Helper()
	lk := onlyLink(t, p)
	// An address dials outside net (flow.DialRaw): the socket is a file.
	if _, ok := lk.upstreamConn().(*os.File); !ok {
		t.Fatalf("the upstream socket is a %T, want the *os.File of flow.DialRaw", lk.upstreamConn())
	}
	out := map[string]int{}
	raw := lk.upRaw()
	_ = raw.Control(func(fd uintptr) {
		for name, o := range map[string][2]int{
			"user_timeout": {unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT},
			"keepalive":    {unix.SOL_SOCKET, unix.SO_KEEPALIVE},
			"idle":         {unix.IPPROTO_TCP, unix.TCP_KEEPIDLE},
			"interval":     {unix.IPPROTO_TCP, unix.TCP_KEEPINTVL},
			"count":        {unix.IPPROTO_TCP, unix.TCP_KEEPCNT},
			"nodelay":      {unix.IPPROTO_TCP, unix.TCP_NODELAY},
		} {
			v, err := unix.GetsockoptInt(int(fd), o[0], o[1])
			if err != nil {
				t.Errorf("getsockopt %s: %v", name, err)
			}
			out[name] = v
		}
	})
	return out
}

// TestClientSocketFromRawAccept: a listener accepts outside net
// (flow.Listener): the link's client socket is a file, has TCP_NODELAY
// (the listening socket's, inherited) and no keepalive of the runtime's,
// and the link names the client by the address the client dialled from.
func TestClientSocketFromRawAccept(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	h := start(t, peer.Addr(), nil)
	c := h.dial()
	l := h.p.listeners[0]
	waitFor(t, 5*time.Second, "the link", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return len(l.links) == 1
	})
	lk := onlyLink(t, h.p)
	tc, ok := lk.client.(*tcpClient)
	if !ok {
		t.Fatalf("the client is a %T", lk.client)
	}
	roundTrip(t, c, []byte("hello"))
	if _, ok := tc.sock.(*os.File); !ok {
		t.Fatalf("the client socket is a %T, want the *os.File of flow.Listener", tc.sock)
	}
	if got, want := lk.client.RemoteAddr().String(), c.LocalAddr().String(); got != want {
		t.Errorf("link's client %s, the client dialled from %s", got, want)
	}
	if err := tc.raw(); err != nil {
		t.Fatal(err)
	}
	_ = tc.rc.Control(func(fd uintptr) {
		if v, err := unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NODELAY); err != nil || v == 0 {
			t.Errorf("TCP_NODELAY = %d, %v; want it set", v, err)
		}
		if v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_KEEPALIVE); err != nil || v != 0 {
			t.Errorf("SO_KEEPALIVE = %d, %v; want none", v, err)
		}
	})
	if tc.localAddr().String() != c.RemoteAddr().String() {
		t.Errorf("client socket's local address %s, the client dialled %s", tc.localAddr(), c.RemoteAddr())
	}
}

// TestNotsentLowatSetBeforeItCanMatter: the upstream socket of a raw dial
// gets TCP_NOTSENT_LOWAT before the link has written more than its value
// in all, and not before: a link whose requests add up to no more than
// that leaves the kernel unable to hold more unsent, and saves the call.
func TestNotsentLowatSetBeforeItCanMatter(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	const high = 128 << 10
	lowat := flow.NotsentLowat(high)
	h := start(t, peer.Addr(), func(s *policy.Settings) { s.WriteBuffer.HighWaterMark = high })
	c := h.dial()
	lowatNow := func() int {
		v := -1
		_ = onlyLink(t, h.p).upRaw().Control(func(fd uintptr) {
			var err error
			if v, err = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT); err != nil {
				t.Fatal(err)
			}
		})
		return v
	}
	roundTrip(t, c, []byte("hello"))
	roundTrip(t, c, bytes.Repeat([]byte{'a'}, lowat-5)) // lowat in all
	if v := lowatNow(); v != 0 {
		t.Fatalf("TCP_NOTSENT_LOWAT = %d after %d bytes, want it unset (0) until more than %d", v, lowat, lowat)
	}
	roundTrip(t, c, []byte("b"))
	if v := lowatNow(); v != lowat {
		t.Fatalf("TCP_NOTSENT_LOWAT = %d after %d bytes, want %d", v, lowat+1, lowat)
	}
}

// TestLateLivenessBlame: the window guard's first sample sets the
// liveness options (setLivenessLater). On a socket closed under it (the
// link ending from another goroutine before the guard stopped) that is no
// error of anyone's: nothing is counted or logged. A refusal on an open
// socket (here a keepalive count above the kernel's 127, which config
// validation would have refused) is the proxy's own error: counted and
// logged as such, never the upstream's.
func TestLateLivenessBlame(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	h := start(t, peer.Addr(), nil)
	c := h.dial()
	roundTrip(t, c, []byte("hello"))
	lk := onlyLink(t, h.p)
	l := h.p.listeners[0]
	guardOn := func(s policy.Settings) (*windowGuard, *os.File) {
		ap, err := netip.ParseAddrPort(peer.Addr())
		if err != nil {
			t.Fatal(err)
		}
		f, err := flow.DialRaw(context.Background(), ap, &s, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = f.Close() })
		raw, err := f.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		g := newWindowGuard(lk, raw, s.TCPUserTimeout.D())
		if g == nil {
			t.Fatal("no window guard")
		}
		t.Cleanup(g.stop)
		g.live = &s
		return g, f
	}
	s := *lk.settings
	g, f := guardOn(s)
	_ = f.Close()
	g.check()
	if n, at := l.localErrors.events.Load(), l.localErrors.logged.Load(); n != 0 || at != 0 {
		t.Fatalf("a closed socket under the guard's first sample: %d local errors, logged at %d; want none", n, at)
	}
	bad := s
	bad.Keepalive.Count = 1000
	g, _ = guardOn(bad)
	g.check()
	if n, at := l.localErrors.events.Load(), l.localErrors.logged.Load(); n == 0 && at == 0 {
		t.Fatal("a refused TCP_KEEPCNT was not counted as the proxy's own error")
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s) after the proxy's own refusal, want healthy", ep.State, ep.Reason)
	}
	roundTrip(t, c, []byte("still here"))
}
