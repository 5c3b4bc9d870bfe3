package flow

import (
	"net/netip"
	"os/exec"
	"strings"
	"testing"

	"github.com/livenessproxy/livenessproxy/internal/netns"
)

// RouteTo makes the lookup the upstream socket's segments make: no route,
// an unreachable route, a prohibit one and a blackhole are no route (IPv4
// and IPv6); a route that only the upstream's mark selects (policy
// routing by fwmark) is one for that mark, and not without it; one that
// only a rule for TCP or for the upstream's port selects is one for a
// TCP segment to that port, and not for another port.
func TestRouteToIsTheTCPLookup(t *testing.T) {
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
		{"route", "add", "prohibit", "10.231.36.2/32"},
		{"route", "add", "10.231.41.0/24", "dev", "lo", "table", "141"},
		{"rule", "add", "ipproto", "tcp", "to", "10.231.41.0/24", "lookup", "141", "pref", "141"},
		{"route", "add", "10.231.42.0/24", "dev", "lo", "table", "142"},
		{"rule", "add", "dport", "9000", "to", "10.231.42.0/24", "lookup", "142", "pref", "142"},
		{"-6", "route", "add", "fd00:231:32::/64", "dev", "lo"},
		{"-6", "route", "add", "unreachable", "fd00:231:33::2/128"},
		{"-6", "route", "add", "blackhole", "fd00:231:34::2/128"},
		{"-6", "route", "add", "prohibit", "fd00:231:36::2/128"},
		{"-6", "route", "add", "fd00:231:42::/64", "dev", "lo", "table", "142"},
		{"-6", "rule", "add", "dport", "9000", "to", "fd00:231:42::/64", "lookup", "142", "pref", "142"},
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
		{"10.231.32.2:9000", 0, true, true},
		{"[::ffff:10.231.32.2]:9000", 0, true, true},
		{"10.231.31.2:9000", 0, false, true}, // no route at all
		{"10.231.33.2:9000", 0, false, true},
		{"10.231.34.2:9000", 0, false, true},
		{"10.231.35.2:9000", 0, false, true},
		{"10.231.35.2:9000", 7, true, true},
		{"10.231.36.2:9000", 0, false, true},
		{"10.231.41.2:9000", 0, true, true},
		{"10.231.42.2:9000", 0, true, true},
		{"10.231.42.2:9001", 0, false, true},
		{"[fd00:231:32::2]:9000", 0, true, true},
		{"[fd00:231:31::2]:9000", 0, false, true},
		{"[fd00:231:33::2]:9000", 0, false, true},
		{"[fd00:231:34::2]:9000", 0, false, true},
		{"[fd00:231:36::2]:9000", 0, false, true},
		{"[fd00:231:42::2]:9000", 0, true, true},
		{"[fd00:231:42::2]:9001", 0, false, true},
		{"[fe80::1%lo]:9000", 0, false, false}, // a zone: not asked
	} {
		route, known := RouteTo(netip.MustParseAddrPort(c.dst), c.mark)
		t.Logf("%s mark %d: route %v, known %v", c.dst, c.mark, route, known)
		if route != c.route || known != c.know {
			t.Errorf("RouteTo(%s, mark %d) = %v, %v; want %v, %v", c.dst, c.mark, route, known, c.route, c.know)
		}
	}
}
