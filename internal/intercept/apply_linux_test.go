//go:build linux

package intercept

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

const (
	local4  = "10.232.0.1/24"
	peer4   = "10.232.0.2/24"
	local6  = "fd32::1/64"
	peer6   = "fd32::2/64"
	svcPort = 9000
	testMrk = 0x99
)

// serve accepts up to 32 connections on ln and answers each with one line,
// answer(conn), then closes it. t.Cleanup closes ln and waits for the
// goroutine.
func serve(t *testing.T, ln net.Listener, answer func(c *net.TCPConn) string) {
	t.Helper()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for range 32 { // bounded: each test dials a handful of times
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.SetDeadline(time.Now().Add(2 * time.Second))
			_, _ = fmt.Fprintln(c, answer(c.(*net.TCPConn)))
			_ = c.Close()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		wg.Wait()
	})
}

// proxyListener listens on the loopback address of the given family and
// answers every connection with "redirected <original destination>". It
// returns the port.
func proxyListener(t *testing.T, loopback string) uint16 {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(loopback, "0"))
	if err != nil {
		t.Fatal(err)
	}
	serve(t, ln, func(c *net.TCPConn) string {
		dst, err := originalDst(c)
		if err != nil {
			return "error " + err.Error()
		}
		return "redirected " + dst.String()
	})
	return uint16(ln.Addr().(*net.TCPAddr).Port)
}

// peerServer listens on addr inside ns and answers "peer".
func peerServer(t *testing.T, ns *netns.NS, addr string) {
	t.Helper()
	ln, err := ns.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	serve(t, ln, func(*net.TCPConn) string { return "peer" })
}

// originalDst reads SO_ORIGINAL_DST (IPv4) or IP6T_SO_ORIGINAL_DST (IPv6)
// of an accepted, redirected connection; neither needs privilege.
func originalDst(c *net.TCPConn) (netip.AddrPort, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var (
		ap   netip.AddrPort
		serr error
	)
	is6 := c.LocalAddr().(*net.TCPAddr).IP.To4() == nil
	err = rc.Control(func(fd uintptr) {
		if !is6 {
			m, err := unix.GetsockoptIPv6Mreq(int(fd), unix.SOL_IP, unix.SO_ORIGINAL_DST)
			if err != nil {
				serr = err
				return
			}
			b := m.Multiaddr[:] // struct sockaddr_in
			ap = netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[4:8])), binary.BigEndian.Uint16(b[2:4]))
			return
		}
		const ip6tSoOriginalDst = 80 // not in x/sys
		mi, err := unix.GetsockoptIPv6MTUInfo(int(fd), unix.SOL_IPV6, ip6tSoOriginalDst)
		if err != nil {
			serr = err
			return
		}
		var port [2]byte
		binary.NativeEndian.PutUint16(port[:], mi.Addr.Port) // stored in network order
		ap = netip.AddrPortFrom(netip.AddrFrom16(mi.Addr.Addr), binary.BigEndian.Uint16(port[:]))
	})
	return ap, errors.Join(err, serr)
}

// ask dials addr (with SO_MARK mark unless 0) and returns the one line the
// server answers.
func ask(addr string, mark int) (string, error) {
	d := net.Dialer{Timeout: 2 * time.Second}
	if mark != 0 {
		d.Control = func(_, _ string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, mark)
			})
			return errors.Join(err, serr)
		}
	}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("reading the answer from %s: %w", addr, err)
	}
	return strings.TrimSpace(line), nil
}

func mustAsk(t *testing.T, addr string, mark int, want string) {
	t.Helper()
	got, err := ask(addr, mark)
	if err != nil {
		t.Fatalf("dial %s (mark %#x): %v", addr, mark, err)
	}
	if got != want {
		t.Fatalf("dial %s (mark %#x): answer %q, want %q", addr, mark, got, want)
	}
}

// waitAnswer dials addr until it answers (a fresh veth may need a moment).
func waitAnswer(t *testing.T, addr string) {
	t.Helper()
	var err error
	for range 100 { // ~5 s
		if _, err = ask(addr, 0); err == nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("%s not reachable over the veth: %v", addr, err)
}

// setup builds the topology: a peer namespace over a veth (IPv4, and IPv6
// if with6), a "peer" server on port 9000 of each peer address.
func setup(t *testing.T, with6 bool) *netns.Link {
	t.Helper()
	testutil.RequireCommand(t, "ip")
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, local4, peer4)
	if with6 {
		link.AddAddr(t, local6, peer6)
	}
	for _, p := range link.PeerAddrs {
		addr := netip.AddrPortFrom(p.Addr(), svcPort).String()
		peerServer(t, peer, addr)
		waitAnswer(t, addr)
	}
	t.Cleanup(func() {
		if err := Remove(); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	return link
}

func mustApply(t *testing.T, c Config) *Ruleset {
	t.Helper()
	rs, err := Build(c)
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.Apply(); err != nil {
		t.Fatalf("Apply: %v", err)
	}
	return rs
}

// installed counts the project's tables, their chains, the rules of the
// output chain and the named sets, as the kernel reports them.
func installed(t *testing.T) (tables, chains, rules, sets int) {
	t.Helper()
	c, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	ts, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		t.Fatal(err)
	}
	for _, tb := range ts {
		if tb.Name != TableName {
			continue
		}
		tables++
		chs, err := c.ListChainsOfTableFamily(nftables.TableFamilyINet)
		if err != nil {
			t.Fatal(err)
		}
		for _, ch := range chs {
			if ch.Table.Name != TableName {
				continue
			}
			chains++
			rs, err := c.GetRules(tb, ch)
			if err != nil {
				t.Fatal(err)
			}
			rules += len(rs)
		}
		ss, err := c.GetSets(tb)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range ss {
			if !s.Anonymous {
				sets++
			}
		}
	}
	return
}

// TestApplyRedirectIPv4 installs the rules with the real Apply code path and
// checks: a connect to a matched destination lands on the proxy's port with
// the original destination readable; re-applying leaves one table; the
// proxy's marked sockets and unmatched ports go to the real peer; Remove
// restores direct connections.
func TestApplyRedirectIPv4(t *testing.T) {
	if !netns.Reexec(t) {
		return
	}
	link := setup(t, false)
	target := netip.AddrPortFrom(link.PeerIP(), svcPort).String()
	port := proxyListener(t, "127.0.0.1")
	cfg := Config{
		ProxyPort: port,
		CIDRs:     []netip.Prefix{netip.MustParsePrefix("10.232.0.0/24")},
		Ports:     []uint16{svcPort},
		ProxyUID:  DefaultProxyUID,
		ProxyMark: testMrk,
	}
	rs := mustApply(t, cfg)
	mustAsk(t, target, 0, "redirected "+target)

	// Idempotent: a second Apply leaves one table, one chain, one rule set.
	mustApply(t, cfg)
	tables, chains, rules, sets := installed(t)
	if tables != 1 || chains != 1 || rules != len(rs.Rules) || sets != 0 {
		t.Fatalf("after two Apply: %d tables, %d chains, %d rules, %d sets; want 1, 1, %d, 0",
			tables, chains, rules, sets, len(rs.Rules))
	}
	mustAsk(t, target, 0, "redirected "+target)

	// The proxy's own upstream sockets carry the mark and are not looped.
	mustAsk(t, target, testMrk, "peer")

	// Loopback destinations are exempt even when a CIDR covers them.
	lo, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", fmt.Sprint(svcPort)))
	if err != nil {
		t.Fatal(err)
	}
	serve(t, lo, func(*net.TCPConn) string { return "loopback" })
	loCfg := cfg
	loCfg.CIDRs = append(loCfg.CIDRs, netip.MustParsePrefix("127.0.0.0/8"))
	mustApply(t, loCfg)
	mustAsk(t, lo.Addr().String(), 0, "loopback")
	mustAsk(t, target, 0, "redirected "+target)

	if err := Remove(); err != nil {
		t.Fatalf("Remove: %v", err)
	}
	if tables, _, _, _ := installed(t); tables != 0 {
		t.Fatalf("%d tables after Remove", tables)
	}
	mustAsk(t, target, 0, "peer")
	if err := Remove(); err != nil {
		t.Fatalf("second Remove: %v", err)
	}
}

// TestApplyLeavesOtherTablesAlone: Apply and Remove touch only the table
// inet livenessproxy.
func TestApplyLeavesOtherTablesAlone(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	if err := netns.LocalNFT("table inet other {\n\tchain c {\n\t\ttype filter hook output priority 0; policy accept;\n\t}\n}\n"); err != nil {
		t.Fatal(err)
	}
	cfg := Config{ProxyPort: 15001, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.232.0.0/24")}, ProxyUID: 0}
	mustApply(t, cfg)
	if err := Remove(); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("nft", "list", "tables").CombinedOutput()
	if err != nil {
		t.Fatalf("nft list tables: %v\n%s", err, out)
	}
	if got := strings.TrimSpace(string(out)); got != "table inet other" {
		t.Fatalf("tables after Apply and Remove: %q, want only the unrelated table", got)
	}
}

// TestExcludedSetRejects: with the excluded set, an endpoint added through
// the proxy's API is refused at connect time (TCP reset, ECONNREFUSED),
// other destinations are still redirected, and removing it readmits it.
func TestExcludedSetRejects(t *testing.T) {
	if !netns.Reexec(t) {
		return
	}
	link := setup(t, true)
	target4 := netip.AddrPortFrom(link.PeerIP(), svcPort)
	target6 := netip.AddrPortFrom(link.PeerAddrs[1].Addr(), svcPort)
	other4 := netip.AddrPortFrom(link.PeerIP(), svcPort+1)
	port4 := proxyListener(t, "127.0.0.1")

	// Without the sets, OpenSet refuses.
	cfg := Config{
		ProxyPort: port4,
		CIDRs:     []netip.Prefix{netip.MustParsePrefix("10.232.0.0/24"), netip.MustParsePrefix("fd32::/64")},
		ProxyUID:  DefaultProxyUID,
		ProxyMark: testMrk,
	}
	mustApply(t, cfg)
	if h, err := OpenSet(); err == nil {
		_ = h.Close()
		t.Fatal("OpenSet succeeded on a table without the excluded sets")
	}

	cfg.ExcludedSet = true
	rs := mustApply(t, cfg)
	if tables, chains, rules, sets := installed(t); tables != 1 || chains != 1 || rules != len(rs.Rules) || sets != 2 {
		t.Fatalf("%d tables, %d chains, %d rules, %d sets; want 1, 1, %d, 2", tables, chains, rules, sets, len(rs.Rules))
	}
	h, err := OpenSet()
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()

	mustAsk(t, target4.String(), 0, "redirected "+target4.String())
	for range 2 { // adding twice is fine
		for _, ap := range []netip.AddrPort{target4, target6} {
			if err := h.AddExcluded(ap); err != nil {
				t.Fatalf("AddExcluded(%s): %v", ap, err)
			}
		}
	}
	got, err := h.Excluded()
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0] != target4 || got[1] != target6 {
		t.Fatalf("Excluded() = %v, want [%s %s]", got, target4, target6)
	}

	for _, ap := range []netip.AddrPort{target4, target6} {
		start := time.Now()
		_, err := ask(ap.String(), 0)
		if !errors.Is(err, unix.ECONNREFUSED) {
			t.Fatalf("dial excluded %s: %v, want ECONNREFUSED", ap, err)
		}
		t.Logf("dial excluded %s: %v after %v", ap, err, time.Since(start).Round(time.Microsecond))
	}
	// Another port of the same host is still redirected, and the proxy's
	// own (marked) socket still reaches the excluded endpoint, e.g. to probe it.
	mustAsk(t, other4.String(), 0, "redirected "+other4.String())
	mustAsk(t, target4.String(), testMrk, "peer")

	if err := h.RemoveExcluded(target4); err != nil {
		t.Fatal(err)
	}
	if err := h.RemoveExcluded(target4); err != nil {
		t.Fatalf("removing an absent element: %v", err)
	}
	mustAsk(t, target4.String(), 0, "redirected "+target4.String())
	if got, err := h.Excluded(); err != nil || len(got) != 1 || got[0] != target6 {
		t.Fatalf("Excluded() = %v, %v; want [%s]", got, err, target6)
	}
	if err := h.AddExcluded(netip.MustParseAddrPort("[::ffff:10.232.0.2]:9000")); err != nil {
		t.Fatalf("AddExcluded of an IPv4-mapped address: %v", err)
	}
	if _, err := ask(target4.String(), 0); !errors.Is(err, unix.ECONNREFUSED) {
		t.Fatalf("dial %s excluded via its IPv4-mapped form: %v, want ECONNREFUSED", target4, err)
	}
	if err := h.AddExcluded(netip.AddrPort{}); err == nil {
		t.Fatal("AddExcluded of an invalid AddrPort succeeded")
	}

	// Clear empties both sets (what a proxy does as it starts, to what an
	// earlier process left), and says how many it took out.
	if n, err := h.Clear(); err != nil || n != 2 {
		t.Fatalf("Clear() = %d, %v; want 2 (target4, target6), nil", n, err)
	}
	if got, err := h.Excluded(); err != nil || len(got) != 0 {
		t.Fatalf("Excluded() after Clear = %v, %v; want none", got, err)
	}
	mustAsk(t, target4.String(), 0, "redirected "+target4.String())
	if n, err := h.Clear(); err != nil || n != 0 {
		t.Fatalf("Clear() of empty sets = %d, %v; want 0, nil", n, err)
	}
}

// TestApplyRedirectIPv6: the same inet table redirects IPv6 to [::1]:P and
// IP6T_SO_ORIGINAL_DST returns the original destination.
func TestApplyRedirectIPv6(t *testing.T) {
	if !netns.Reexec(t) {
		return
	}
	link := setup(t, true)
	target := netip.AddrPortFrom(link.PeerAddrs[1].Addr(), svcPort).String()
	// The redirect keeps the port, so listen on the same port on both
	// loopbacks, as the proxy does.
	port := proxyListener(t, "::1")
	ln4, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", fmt.Sprint(port)))
	if err != nil {
		t.Fatal(err)
	}
	serve(t, ln4, func(*net.TCPConn) string { return "ipv4 listener" })
	mustApply(t, Config{
		ProxyPort: port,
		CIDRs:     []netip.Prefix{netip.MustParsePrefix("10.232.0.0/24"), netip.MustParsePrefix("fd32::/64")},
		Ports:     []uint16{svcPort, svcPort + 1},
		ProxyUID:  DefaultProxyUID,
		ProxyMark: testMrk,
	})
	mustAsk(t, target, 0, "redirected "+target)
	mustAsk(t, target, testMrk, "peer")
	mustAsk(t, netip.AddrPortFrom(link.PeerIP(), svcPort).String(), 0, "ipv4 listener")
	// Port 9002 is not in --ports: the connect goes to the real peer,
	// where nothing listens.
	if _, err := ask(netip.AddrPortFrom(link.PeerAddrs[1].Addr(), svcPort+2).String(), 0); !errors.Is(err, unix.ECONNREFUSED) {
		t.Fatalf("dial an unmatched port: %v, want ECONNREFUSED from the peer", err)
	}
}

// TestRenderMatchesApply: the nft -f script of Render and the netlink
// executor produce the same table, as nft lists it.
func TestRenderMatchesApply(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	list := func() string {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, "nft", "list", "table", "inet", TableName).CombinedOutput()
		if err != nil {
			t.Fatalf("nft list: %v\n%s", err, out)
		}
		return string(out)
	}
	rs, err := Build(representative())
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.Apply(); err != nil {
		t.Fatal(err)
	}
	viaNetlink := list()
	if err := Remove(); err != nil {
		t.Fatal(err)
	}
	if err := netns.LocalNFT(rs.Render()); err != nil {
		t.Fatalf("nft -f of Render: %v", err)
	}
	if err := netns.LocalNFT(rs.Render()); err != nil { // the script is idempotent too
		t.Fatalf("nft -f of Render, twice: %v", err)
	}
	viaScript := list()
	if viaNetlink != viaScript {
		t.Fatalf("netlink and script differ:\n--- Apply\n%s\n--- nft -f Render\n%s", viaNetlink, viaScript)
	}
	t.Logf("installed:\n%s", viaNetlink)
	if err := netns.LocalNFT(RemoveScript()); err != nil {
		t.Fatal(err)
	}
}
