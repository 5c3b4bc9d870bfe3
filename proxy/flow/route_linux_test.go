package flow

import (
	"net/netip"
	"os/exec"
	"strings"
	"testing"

	"github.com/livenessproxy/livenessproxy/internal/netns"
)

// RouteTo makes the lookup the upstream socket's segments make: no route,
// an unreachable route and a blackhole are no route; a route that only
// the upstream's mark selects (policy routing by fwmark) is one for that
// mark, and not without it.
func TestRouteToFollowsTheMark(t *testing.T) {
	if !netns.Reexec(t, "ip") {
		return
	}
	for _, args := range [][]string{
		{"route", "add", "10.231.32.0/24", "dev", "lo"},
		{"route", "add", "unreachable", "10.231.33.2/32"},
		{"route", "add", "blackhole", "10.231.34.2/32"},
		{"route", "add", "unreachable", "10.231.35.2/32"},
		{"route", "add", "10.231.35.2/32", "dev", "lo", "table", "100"},
		{"rule", "add", "fwmark", "7", "lookup", "100", "pref", "100"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	for _, c := range []struct {
		dst         string
		mark        int
		route, know bool
	}{
		{"10.231.32.2", 0, true, true},
		{"10.231.31.2", 0, false, true}, // no route at all
		{"10.231.33.2", 0, false, true},
		{"10.231.34.2", 0, false, true},
		{"10.231.35.2", 0, false, true},
		{"10.231.35.2", 7, true, true},
		{"fe80::1%lo", 0, false, false}, // a zone: not asked
	} {
		route, known := RouteTo(netip.MustParseAddr(c.dst), c.mark)
		t.Logf("%s mark %d: route %v, known %v", c.dst, c.mark, route, known)
		if route != c.route || known != c.know {
			t.Errorf("RouteTo(%s, mark %d) = %v, %v; want %v, %v", c.dst, c.mark, route, known, c.route, c.know)
		}
	}
}
