//go:build linux

package proxy

import (
	"fmt"
	"net/netip"
	"testing"
	"time"
)

// A pool member excluded by the detector has no links (they were
// evicted, or it refused its connects), so when one DNS answer leaves it
// out (a resolver answering with a subset of the records, Consul, a
// headless Service flapping) its drain ends at once and it is forgotten.
// The next answer that has it again brings it back excluded, not healthy:
// no probe has passed. Before, it came back healthy ("registered") while
// as dead as before (found by a helper's audit).
func TestChurnedExcludedMemberStaysExcluded(t *testing.T) {
	// The peer serves 127.0.0.3 only: 127.0.0.2 (same port) refuses.
	h, dns, _, addrs := dnsPool(t, []string{"127.0.0.3"}, []string{"127.0.0.2", "127.0.0.3"})
	port := netip.MustParseAddrPort(addrs[0]).Port()
	dead := fmt.Sprintf("127.0.0.2:%d", port)
	h.waitMembers([]string{dead, addrs[0]}, 3*time.Second)
	// Round robin sends one of the first links to the dead member: its
	// refused connect excludes it (the link fails over to the live one).
	for range 4 {
		roundTrip(t, h.dial(), []byte("hello"))
	}
	waitFor(t, 3*time.Second, dead+" excluded", func() bool { return h.stateOf(dead) == "excluded" })

	setRecords(dns, "127.0.0.3") // one answer leaves the dead member out
	h.waitMembers(addrs, 3*time.Second)
	waitFor(t, 3*time.Second, dead+" forgotten", func() bool { return h.p.lookupEndpoint(dead) == nil })
	setRecords(dns, "127.0.0.2", "127.0.0.3") // and the next has it again
	h.waitMembers([]string{dead, addrs[0]}, 3*time.Second)

	// No probe can have passed (the port refuses; the first probe is
	// 10 s after the exclusion): the member must still be out.
	for _, ep := range h.p.Endpoints() {
		if ep.Endpoint == dead && ep.State == "healthy" {
			t.Fatalf("%s is healthy (reason %q, failed probes %d) after one DNS answer left it out: readmitted without a probe, still refusing",
				dead, ep.Reason, ep.FailedProbes)
		}
	}
}
