//go:build linux

package netns

import (
	"fmt"
	"net/netip"
	"sync/atomic"
	"testing"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// vethSeq makes veth names unique within the process.
var vethSeq atomic.Uint32

// Link is a veth pair between the current network namespace (Local) and a
// peer NS (Peer).
type Link struct {
	// Local and Peer are the interface names in the current namespace and in
	// the peer namespace.
	Local, Peer string
	// LocalAddrs and PeerAddrs are the prefixes assigned, in order.
	LocalAddrs, PeerAddrs []netip.Prefix

	peer *NS
}

// Veth creates a veth pair between the current namespace and peer, assigns
// localCIDR / peerCIDR (e.g. "10.231.0.1/24", "10.231.0.2/24") and sets both
// ends up. The local end is deleted in t.Cleanup (the peer end goes with it).
// It uses the ip command (iproute2) and, to protect the host, works only in
// a Reexec child. Any failure is fatal; a missing ip binary is a
// testutil.SkipOrFail.
func Veth(t testing.TB, peer *NS, localCIDR, peerCIDR string) *Link {
	t.Helper()
	testutil.RequireCommand(t, "ip")
	if !Inside() {
		t.Fatalf("netns: Veth must run inside a Reexec child, not in the host namespace")
	}
	n := vethSeq.Add(1)
	l := &Link{
		Local: fmt.Sprintf("lpv%dl", n),
		Peer:  fmt.Sprintf("lpv%dp", n),
		peer:  peer,
	}
	if _, err := runLocal("", "ip", "link", "add", l.Local, "type", "veth",
		"peer", "name", l.Peer, "netns", peer.Path()); err != nil {
		t.Fatalf("netns: creating veth: %v", err)
	}
	t.Cleanup(func() {
		// Fails harmlessly if the peer namespace is already gone, which
		// removes both ends.
		_, _ = runLocal("", "ip", "link", "del", l.Local)
	})
	l.AddAddr(t, localCIDR, peerCIDR)
	if _, err := runLocal("", "ip", "link", "set", l.Local, "up"); err != nil {
		t.Fatalf("netns: %v", err)
	}
	if _, err := peer.Run("", "ip", "link", "set", l.Peer, "up"); err != nil {
		t.Fatalf("netns: %v", err)
	}
	return l
}

// AddAddr assigns one more address pair, e.g. "fd31::1/64", "fd31::2/64".
// IPv6 addresses are added with nodad so that they are usable immediately.
func (l *Link) AddAddr(t testing.TB, localCIDR, peerCIDR string) {
	t.Helper()
	lp, err := netip.ParsePrefix(localCIDR)
	if err != nil {
		t.Fatalf("netns: local address: %v", err)
	}
	pp, err := netip.ParsePrefix(peerCIDR)
	if err != nil {
		t.Fatalf("netns: peer address: %v", err)
	}
	if lp.Addr().Is4() != pp.Addr().Is4() {
		t.Fatalf("netns: address families differ: %s / %s", lp, pp)
	}
	local := []string{"addr", "add", lp.String(), "dev", l.Local}
	remote := []string{"addr", "add", pp.String(), "dev", l.Peer}
	if lp.Addr().Is6() {
		local = append(local, "nodad")
		remote = append(remote, "nodad")
	}
	if _, err := runLocal("", "ip", local...); err != nil {
		t.Fatalf("netns: %v", err)
	}
	if _, err := l.peer.Run("", "ip", remote...); err != nil {
		t.Fatalf("netns: %v", err)
	}
	l.LocalAddrs = append(l.LocalAddrs, lp)
	l.PeerAddrs = append(l.PeerAddrs, pp)
}

// LocalIP returns the first local address.
func (l *Link) LocalIP() netip.Addr { return l.LocalAddrs[0].Addr() }

// PeerIP returns the first peer address.
func (l *Link) PeerIP() netip.Addr { return l.PeerAddrs[0].Addr() }

// Both runs the command name (ip or tc) with args in the current namespace
// and in the peer's, each time with that end's interface name in place of
// every "DEV" argument: a path degraded the same way in both directions,
// e.g. Both(t, "ip", "link", "set", "dev", "DEV", "mtu", "1000") or
// Both(t, "tc", "qdisc", "add", "dev", "DEV", "root", "tbf", ...). Any
// failure is fatal.
func (l *Link) Both(t testing.TB, name string, args ...string) {
	t.Helper()
	for _, end := range []struct {
		dev string
		run func(stdin, name string, args ...string) ([]byte, error)
	}{{l.Local, LocalRun}, {l.Peer, l.peer.Run}} {
		a := make([]string, len(args))
		for i, s := range args {
			if s == "DEV" {
				s = end.dev
			}
			a[i] = s
		}
		if _, err := end.run("", name, a...); err != nil {
			t.Fatalf("netns: %v", err)
		}
	}
}

// LocalRun runs the command name with args in the current process's
// namespace, as NS.Run does in another (30 s at most, its combined output
// returned). It refuses to run outside a Reexec child, so that it never
// changes the host's network.
func LocalRun(stdin string, name string, args ...string) ([]byte, error) {
	return runLocal(stdin, name, args...)
}
