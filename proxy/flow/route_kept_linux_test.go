package flow

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// routeFixture adds, in the test's own namespace, a route to
// 10.231.44.0/24 and an unreachable one to 10.231.45.2: the lookups of
// the tests below, one with a route and one without.
func routeFixture(t *testing.T) {
	t.Helper()
	for _, args := range [][]string{
		{"route", "add", "10.231.44.0/24", "dev", "lo"},
		{"route", "add", "unreachable", "10.231.45.2/32"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
}

var (
	routed   = netip.MustParseAddrPort("10.231.44.2:9000")
	unrouted = netip.MustParseAddrPort("10.231.45.2:9000")
)

// A process with no descriptor to spare still looks its route up: the
// lookup asks on the socket KeepRouteLookup opened, and needs no new
// one. Before, each lookup opened a netlink socket of its own, and at
// the descriptor limit every lookup was unknown: a route gone was taken
// for the upstream's death.
func TestRouteToAtTheDescriptorLimit(t *testing.T) {
	if !netns.Reexec(t, "ip") {
		return
	}
	routeFixture(t)
	KeepRouteLookup()
	restore := testutil.FillDescriptors(t, 0)
	_, sockErr := routeSocket()
	r1, k1 := RouteTo(routed, 0)
	r2, k2 := RouteTo(unrouted, 0)
	restore()
	t.Logf("at the descriptor limit (a new socket: %v): %s route %v known %v; %s route %v known %v", sockErr, routed, r1, k1, unrouted, r2, k2)
	if !errors.Is(sockErr, unix.EMFILE) {
		t.Fatalf("a new socket opened (%v): the process was not at its descriptor limit", sockErr)
	}
	if !r1 || !k1 || r2 || !k2 {
		t.Fatalf("at the descriptor limit: %s route %v known %v, %s route %v known %v; want a route and none, both known", routed, r1, k1, unrouted, r2, k2)
	}
}

// The kept socket's answers go to their own lookups: one an earlier
// request left on the socket (its reader gone) is skipped, not read as
// the next lookup's; a socket that fails is replaced and the lookup
// answered; a lookup from a thread in another network namespace is
// that namespace's, not the process's.
func TestRouteToKeptSocket(t *testing.T) {
	if !netns.Reexec(t, "ip") {
		return
	}
	routeFixture(t)
	KeepRouteLookup()

	// A stale answer (a route) waits on the socket; the lookup that
	// comes next has none.
	routeSock.mu.Lock()
	a := routed.Addr()
	err := unix.Sendto(routeSock.fd, routeRequest(a, routed.Port(), 0), 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
	routeSock.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	if r, k := RouteTo(unrouted, 0); r || !k {
		t.Fatalf("with an earlier answer waiting: %s route %v known %v; want none, known: the stale answer read as this one", unrouted, r, k)
	}

	// The socket breaks (another file in its place: sends fail).
	null, err := unix.Open(os.DevNull, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	routeSock.mu.Lock()
	broken := routeSock.fd
	err = unix.Dup3(null, broken, unix.O_CLOEXEC)
	routeSock.mu.Unlock()
	unix.Close(null)
	if err != nil {
		t.Fatal(err)
	}
	if r, k := RouteTo(routed, 0); !r || !k {
		t.Fatalf("after the socket broke: %s route %v known %v; want a route, known", routed, r, k)
	}

	// Another namespace (a thread of its own) has neither route.
	ns := netns.NewNS(t)
	var r, k bool
	if err := ns.Do(func() error { r, k = RouteTo(routed, 0); return nil }); err != nil {
		t.Fatal(err)
	}
	t.Logf("from another namespace: %s route %v known %v", routed, r, k)
	if r || !k {
		t.Fatalf("from another namespace: %s route %v known %v; want that namespace's: none, known", routed, r, k)
	}
	if r, k := RouteTo(routed, 0); !r || !k {
		t.Fatalf("back in the process's namespace: %s route %v known %v; want a route, known", routed, r, k)
	}
}

// Without /proc (none mounted in the process's mount namespace, or a
// kernel without /proc/thread-self) a thread's network namespace cannot
// be read: the lookup is taken to be the process's and asks on the kept
// socket, so a process at its descriptor limit still looks its route up.
// Here one thread of its own mount namespace has an empty /proc. Before,
// such a caller asked on a socket of its own, and at the limit every
// lookup was unknown: a route gone taken for the upstream's death.
func TestRouteToWithoutProc(t *testing.T) {
	if !netns.Reexec(t, "ip") {
		return
	}
	routeFixture(t)
	KeepRouteLookup()
	type result struct {
		sockErr        error
		r1, k1, r2, k2 bool
	}
	ready, ask, done := make(chan error, 1), make(chan struct{}), make(chan result, 1)
	go func() {
		// Never unlocked: the thread ends with this goroutine, its mount
		// namespace with it.
		runtime.LockOSThread()
		ready <- procHidden()
		if _, ok := <-ask; !ok {
			return
		}
		var res result
		_, res.sockErr = routeSocket()
		res.r1, res.k1 = RouteTo(routed, 0)
		res.r2, res.k2 = RouteTo(unrouted, 0)
		done <- res
	}()
	asked := false
	defer func() {
		if !asked {
			close(ask) // the thread ends without asking
		}
	}()
	if err := <-ready; errors.Is(err, errNoMountNS) {
		testutil.SkipOrFail(t, "%v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	restore := testutil.FillDescriptors(t, 0)
	asked = true
	ask <- struct{}{}
	res := <-done
	restore()
	t.Logf("no /proc, at the descriptor limit (a new socket: %v): %s route %v known %v; %s route %v known %v", res.sockErr, routed, res.r1, res.k1, unrouted, res.r2, res.k2)
	if !errors.Is(res.sockErr, unix.EMFILE) {
		t.Fatalf("a new socket opened (%v): the process was not at its descriptor limit", res.sockErr)
	}
	if !res.r1 || !res.k1 || res.r2 || !res.k2 {
		t.Fatalf("no /proc, at the descriptor limit: %s route %v known %v, %s route %v known %v; want a route and none, both known", routed, res.r1, res.k1, unrouted, res.r2, res.k2)
	}
}

// errNoMountNS: the environment refuses the thread a mount namespace of
// its own or a mount in it (as it may refuse the test's namespaces).
var errNoMountNS = errors.New("no mount namespace for a thread")

// procHidden gives the calling thread (locked to its goroutine, never to
// be unlocked) a mount namespace of its own with an empty /proc.
func procHidden() error {
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("%w: unshare(CLONE_NEWNS): %w", errNoMountNS, err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("%w: mount --make-rprivate /: %w", errNoMountNS, err)
	}
	if err := unix.Mount("none", "/proc", "tmpfs", 0, ""); err != nil {
		return fmt.Errorf("%w: mount tmpfs on /proc: %w", errNoMountNS, err)
	}
	var st unix.Stat_t
	if unix.Stat("/proc/thread-self/ns/net", &st) == nil || unix.Stat("/proc/self/ns/net", &st) == nil {
		return errors.New("/proc still readable")
	}
	return nil
}
