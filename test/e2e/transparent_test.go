//go:build linux

package e2e

import (
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/intercept"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
	"github.com/prometheus/client_golang/prometheus"
)

// echoTransfer sends n random bytes through c and checks that the same
// bytes come back.
func echoTransfer(t *testing.T, c net.Conn, n int) {
	t.Helper()
	data := make([]byte, n)
	_, _ = rand.Read(data)
	go func() { _, _ = c.Write(data) }()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, n)
	_, err := io.ReadFull(c, got)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("echo through the transparent proxy: %d of %d bytes, equal=%v, err %v", len(got), n, bytes.Equal(got, data), err)
	}
}

// The client connects to the server's own address; an nftables REDIRECT in
// the client's namespace sends it to the transparent listener, which reads
// the original destination and proxies it, for IPv4 and IPv6. The proxy's
// own upstream sockets carry a mark the rules exempt; a destination outside
// the match list is refused; a disabled destination is reset at connect
// while others keep working; without the exemption the loop guard refuses
// the proxy's own connection.
func TestTransparentInterception(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.234.0.1/24", "10.234.0.2/24")
	link.AddAddr(t, "fd34::1/64", "fd34::2/64")
	srv4 := echoIn(t, peer, "10.234.0.2:9000")
	srv6 := echoIn(t, peer, "[fd34::2]:9000")
	other := echoIn(t, peer, "10.234.0.2:9001")
	loopy := echoIn(t, peer, "10.234.0.2:9002")
	waitReachable(t, srv4)
	waitReachable(t, srv6)

	const mark = 0x99
	match := policy.Transparent{Match: []policy.Match{
		{CIDR: "10.234.0.0/24", Ports: []int{9000}},
		{CIDR: "fd34::/64", Ports: []int{9000}},
	}}
	cfg := policy.DefaultConfig()
	cfg.Defaults.HalfCloseTimeout = policy.Duration(200 * time.Millisecond) // echoIn never closes its side
	marked := cfg.Defaults
	marked.UpstreamMark = mark
	unmarked := cfg.Defaults
	cfg.Listeners = []policy.Listener{
		{Name: "out4", Listen: "127.0.0.1:15001", Transparent: match, Settings: marked},
		{Name: "out6", Listen: "[::1]:15001", Transparent: match, Settings: marked},
		// No mark: its upstream dial is redirected back to the proxy.
		{Name: "loopy", Listen: "127.0.0.1:15002", Transparent: policy.Transparent{
			Match: []policy.Match{{CIDR: "10.234.0.0/24", Ports: []int{9002}}}}, Settings: unmarked},
	}
	cfg.Interception.ExcludedSet = true
	// The rules, through the real redirect code path: exempt the proxy's
	// mark, redirect the servers' ports, keep sets of excluded destinations.
	rs, err := intercept.Build(intercept.Config{
		ProxyPort:   15001,
		CIDRs:       []netip.Prefix{netip.MustParsePrefix("10.234.0.0/24"), netip.MustParsePrefix("fd34::/64")},
		Ports:       []uint16{9000, 9001},
		ProxyUID:    intercept.NoUID,
		ProxyMark:   mark,
		ExcludedSet: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.Apply(); err != nil {
		t.Fatalf("applying the interception rules: %v", err)
	}
	// An earlier process of the pod (one that crashed before its shutdown
	// took its exclusions out) left srv4 in the excluded set: the proxy
	// empties the sets as it starts, or every connect to srv4 below would
	// be refused by the kernel for good.
	left, err := intercept.OpenSet()
	if err != nil {
		t.Fatal(err)
	}
	if err := left.AddExcluded(netip.MustParseAddrPort(srv4)); err != nil {
		t.Fatal(err)
	}
	_ = left.Close()
	reg := prometheus.NewRegistry()
	ended := make(chan proxy.LinkStats, 32)
	p := proxy.New(cfg, proxy.Options{Registerer: reg, OnLinkEnd: func(s proxy.LinkStats) { ended <- s }})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	// A second, hand-written rule for the loop-guard listener: it exempts
	// nothing, so that listener's own dial comes back to it.
	if err := netns.LocalNFT(`table inet lploop {
	chain out {
		type nat hook output priority -100; policy accept;
		ip daddr 10.234.0.0/24 tcp dport 9002 redirect to :15002
	}
}
`); err != nil {
		t.Fatalf("installing the loop rule: %v", err)
	}

	for _, dst := range []string{srv4, srv6} {
		c, err := net.Dial("tcp", dst)
		if err != nil {
			t.Fatalf("dial %s: %v", dst, err)
		}
		if got := c.RemoteAddr().String(); got != dst {
			t.Fatalf("client sees %s, want the server's own address %s", got, dst)
		}
		echoTransfer(t, c, 1<<20)
		_ = c.Close()
		s := <-ended
		if s.Upstream != dst {
			t.Fatalf("the proxy dialled %q, want the original destination %q", s.Upstream, dst)
		}
		t.Logf("%s: 1 MiB echoed through listener %s, link ended %s", dst, s.Listener, s.Reason)
	}

	// Outside the match list: redirected to the proxy, refused with a reset.
	if err := expectReset(other); err != nil {
		t.Fatalf("unmatched destination %s: %v", other, err)
	}
	if got := counterValue(t, reg, "dial_errors_total", "listener", "out4"); got != 0 {
		t.Fatalf("the proxy dialled something for an unmatched destination (%v dial errors)", got)
	}

	// A disabled destination is refused at connect by the kernel (the
	// proxy put it in the excluded set): the proxy never accepts it. The
	// other destination still works.
	accepted := counterValue(t, reg, "links_total", "listener", "out4")
	if _, err := p.Disable(srv4); err != nil {
		t.Fatal(err)
	}
	if _, err := net.Dial("tcp", srv4); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("connect to disabled %s: %v, want ECONNREFUSED from the excluded set", srv4, err)
	}
	if got := counterValue(t, reg, "links_total", "listener", "out4"); got != accepted {
		t.Fatalf("the proxy accepted a connection to a disabled destination (%v -> %v)", accepted, got)
	}
	if _, err := p.Enable(srv4); err != nil {
		t.Fatal(err)
	}
	c4, err := net.Dial("tcp", srv4)
	if err != nil {
		t.Fatalf("connect after enable: %v", err)
	}
	echoTransfer(t, c4, 1024)
	_ = c4.Close()
	<-ended
	c6, err := net.Dial("tcp", srv6)
	if err != nil {
		t.Fatal(err)
	}
	echoTransfer(t, c6, 64<<10)
	_ = c6.Close()
	<-ended

	// The loop guard: listener "loopy" has no mark, so its own dial to
	// 10.234.0.2:9002 is redirected back to it and must be refused.
	c, err := net.Dial("tcp", loopy)
	if err == nil {
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = c.Read(make([]byte, 1))
		_ = c.Close()
	}
	if err == nil || errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("a looping connection was not cut: %v", err)
	}
	loops := func() float64 {
		return counterValue(t, reg, "link_closes_total", "listener", "loopy", "reason", string(proxy.CloseLoop))
	}
	deadline := time.Now().Add(2 * time.Second)
	for loops() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := loops(); got < 1 {
		t.Fatalf("link_closes_total{reason=loop} = %v, want the loop refused", got)
	}
	t.Logf("loop guard: %v looping connection(s) refused; the client saw %v", loops(), err)
}

// expectReset dials addr and expects the connection to be reset at once,
// before any byte: at connect, or on the first read.
func expectReset(addr string) error {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		if errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) {
			return nil
		}
		return err
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	n, err := c.Read(make([]byte, 1))
	if errors.Is(err, syscall.ECONNRESET) {
		return nil
	}
	return fmt.Errorf("not reset: read %d bytes, err %v", n, err)
}
