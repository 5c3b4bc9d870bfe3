package proxy

import (
	"errors"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	lptestutil "github.com/livenessproxy/livenessproxy/internal/testutil"
)

// A proxy at its descriptor limit (when links pile up, exactly when its
// own failures come) still tells its own network from an upstream's
// death: the route lookup of the verdict asks on the socket the proxy
// keeps (flow.KeepRouteLookup) and opens none. With its route removed
// under a link's bytes in flight, the link ends local_error and the
// endpoint stays healthy. Before, the lookup needed a new descriptor,
// found none, and the kernel's word stood: upstream_timeout, the
// endpoint excluded. The twin, at the same limit: the upstream's host
// stops answering behind a route the proxy still has, and the link ends
// upstream_timeout, the endpoint excluded, as with descriptors to spare.
func TestOwnRouteGoneAtTheDescriptorLimitIsNotTheUpstreams(t *testing.T) {
	eachCut(t, []string{"route removed", "twin: upstream gone, route kept"}, ownRouteGoneAtTheDescriptorLimit)
}

func ownRouteGoneAtTheDescriptorLimit(t *testing.T, cut string) {
	ut := 6 * time.Second
	peer, link, h, c := ownNetworkLink(t, "10.231.48", ut)
	blackholePeer(t, peer) // the link's bytes stay in flight, retransmitted
	sent := time.Now()
	if _, err := c.Write([]byte("lost")); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(ut); dropped(t, peer) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the link's bytes never reached the peer")
		}
	}
	twin := strings.HasPrefix(cut, "twin")
	if !twin {
		cutOwnRoute(t, cut, link)
	}
	restore := lptestutil.FillDescriptors(t, 0)
	_, sockErr := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	s := h.linkEnd(ut + 5*time.Second)
	restore()
	if !errors.Is(sockErr, unix.EMFILE) {
		t.Fatalf("a new socket opened (%v): the proxy was not at its descriptor limit", sockErr)
	}
	ownVerdict(t, h, cut+" at the descriptor limit", twin, s, sent, ut+time.Second)
}
