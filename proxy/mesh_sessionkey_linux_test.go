package proxy

import (
	"cmp"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/policy"
)

// sessionUserTimeouts is the TCP_USER_TIMEOUT, in ms, of each live session
// to the peer.
func sessionUserTimeouts(t *testing.T, pr *meshPeer) []int {
	t.Helper()
	var uts []int
	for _, ms := range pr.liveSessions() {
		raw, err := ms.Conn.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var ut int
		var serr error
		if err := raw.Control(func(fd uintptr) { ut, serr = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT) }); err != nil || serr != nil {
			t.Fatal(err, serr)
		}
		uts = append(uts, ut)
	}
	slices.Sort(uts)
	return uts
}

// A reload that changes the socket options a session's connection gets
// (here tcp_user_timeout; the mark, keepalive and the high-water mark
// behind TCP_NOTSENT_LOWAT alike), and no mesh setting, gives new links a
// session dialled with the new options; the link open on the old session
// lives on. Before, sessions were keyed by the mesh settings alone: the
// new link went on the old session, under the old options, for as long
// as that session lived.
func TestMeshSessionsKeyedBySocketOptions(t *testing.T) {
	eg, cfg, pr := egressOfOneSession(t)
	want := func() int {
		s := eg.p.listeners[0].spec().settings
		return int(cmp.Or(s.MeshSessionUserTimeout(), s.TCPUserTimeout.D()).Milliseconds())
	}
	a := eg.dial()
	roundTrip(t, a, []byte("a"))
	before := want()
	if got := sessionUserTimeouts(t, pr); !slices.Equal(got, []int{before}) {
		t.Fatalf("sessions' TCP_USER_TIMEOUT %v ms, want [%d]", got, before)
	}
	cfg.Listeners[0].Settings.TCPUserTimeout = policy.Duration(3 * time.Second)
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if _, err := eg.p.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	after := want()
	if after == before {
		t.Fatalf("the reload left the session's TCP_USER_TIMEOUT at %d ms: no change to test", after)
	}
	b := eg.dial()
	roundTrip(t, b, []byte("b"))
	got := sessionUserTimeouts(t, pr)
	t.Logf("sessions' TCP_USER_TIMEOUT after the reload and a new link: %v ms (before %d, after %d)", got, before, after)
	if !slices.Contains(got, after) || !slices.Contains(got, before) {
		t.Fatalf("sessions' TCP_USER_TIMEOUT %v ms, want the old link's session (%d) and a new one for the new link (%d)", got, before, after)
	}
	roundTrip(t, a, []byte("a lives on"))
}
