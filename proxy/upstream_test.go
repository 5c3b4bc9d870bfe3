package proxy

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// upRaw is the raw socket of the link's TCP upstream end (nil before the
// dial, or for a mesh end). It takes no lock: a caller racing the dial
// holds connMu.
func (lk *link) upRaw() syscall.RawConn {
	if e, ok := lk.up.(*tcpEnd); ok {
		return e.raw
	}
	return nil
}

// upstreamConn is the link's TCP upstream connection (nil as for upRaw).
func (lk *link) upstreamConn() upstreamSocket {
	if e, ok := lk.up.(*tcpEnd); ok {
		return e.conn
	}
	return nil
}

// refusingClient is a client side whose transport refuses the news that
// the link reached its upstream, as a mesh stream does when its ack
// cannot be written (the peer reset it meanwhile).
type refusingClient struct{ closed atomic.Bool }

func (*refusingClient) read(int) (*[]byte, int, error) { return nil, 0, io.EOF }
func (*refusingClient) readEach(flow.ChunkSink) (*[]byte, int, error, error) {
	return nil, 0, io.EOF, nil
}
func (*refusingClient) Write(p []byte) (int, error) { return len(p), nil }
func (*refusingClient) CloseWrite() error           { return nil }
func (*refusingClient) abortive()                   {}
func (*refusingClient) upstreamConnected() error {
	return errors.New("the stream was reset before its ack")
}
func (c *refusingClient) Close() error { c.closed.Store(true); return nil }
func (*refusingClient) RemoteAddr() net.Addr {
	return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}
}

// A link whose start fails after its upstream connected gives back what
// its end holds: the upstream socket is closed and the loop guard of a
// transparent proxy forgets it (it used to keep the address for as long
// as the process lived).
func TestFailedStartReleasesItsEnd(t *testing.T) {
	srv, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := srv.Accept()
		if err == nil {
			accepted <- c
		}
		close(accepted)
	}()
	p, l := transparentProxy(t, func(tr *policy.Transparent) {
		tr.Match = append(tr.Match, policy.Match{CIDR: "127.0.0.0/8"})
	})
	ep := p.transparentEndpoint(srv.Addr().String(), l)
	if ep == nil {
		t.Fatal("no endpoint for the server")
	}
	client := &refusingClient{}
	lk := newLink(l, ep, client)
	l.linkWG.Add(1)
	l.serveLink(lk)

	if s := lk.stats(); s.Reason != CloseClientError {
		t.Fatalf("link ended %q, want %q", s.Reason, CloseClientError)
	}
	if !client.closed.Load() {
		t.Fatal("the client side was not closed")
	}
	if own := p.ownUp.len(); own != 0 {
		t.Fatalf("the loop guard still holds %d upstream address(es) of a link that ended", own)
	}
	// The upstream was connected, and is closed (the server reads its end).
	c, ok := <-accepted
	if !ok {
		t.Fatal("the link never connected its upstream")
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("the upstream connection is still open")
	}
}

// The loop guard holds a link's upstream address while a transparent
// listener accepts, and only then: a reload that keeps one keeps the
// guard, one that removes the last one ends it (a link registered before
// still forgets its address when it ends), a transparent listener whose
// bind failed does not turn it on, and one added back does.
func TestLoopGuardFollowsTheTransparentListeners(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	ended := make(chan LinkStats, 8)
	cfg := policy.DefaultConfig()
	tr := policy.Transparent{Match: []policy.Match{{CIDR: "10.9.0.0/16"}},
		MaxDestinations: 16, ForgetExcludedAfter: policy.Duration(time.Minute)}
	plainCfg := listenerCfg("plain", peer.Addr(), nil)
	out := policy.Listener{Name: "out", Listen: "127.0.0.1:0", Settings: cfg.Defaults, Transparent: tr}
	cfg.Listeners = []policy.Listener{plainCfg, out}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := New(cfg, Options{OnLinkEnd: func(s LinkStats) { ended <- s }})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	plain := p.Addr("plain").String()
	dial := func() net.Conn {
		t.Helper()
		c, err := net.Dial("tcp", plain)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		roundTrip(t, c, []byte("hello")) // the link reached its upstream
		return c
	}
	end := func(c net.Conn) {
		t.Helper()
		_ = c.Close()
		select {
		case s := <-ended:
			if s.Client != c.LocalAddr().String() {
				t.Fatalf("link of %s ended, want %s's", s.Client, c.LocalAddr())
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("link of %s did not end", c.LocalAddr())
		}
	}
	want := func(n int, when string) {
		t.Helper()
		if got := p.ownUp.len(); got != n {
			t.Fatalf("%s: the loop guard holds %d addresses, want %d", when, got, n)
		}
	}
	reload := func(ls ...policy.Listener) error {
		c := cfg
		c.Listeners = ls
		return p.Reload(c)
	}

	first := dial()
	want(1, "a transparent listener open")

	retuned := out
	retuned.Settings.WriteTimeout = policy.Duration(3 * time.Second)
	if err := reload(plainCfg, retuned); err != nil {
		t.Fatal(err)
	}
	second := dial()
	want(2, "after a reload that kept the transparent listener")
	end(second)
	want(1, "the second link ended")

	if err := reload(plainCfg); err != nil {
		t.Fatal(err)
	}
	third := dial()
	want(1, "after the last transparent listener went (only the first link's)")
	end(first)
	want(0, "the first link, registered before the reload, ended")

	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	unbound := out
	unbound.Name, unbound.Listen = "unbound", busy.Addr().String()
	if err := reload(plainCfg, unbound); err == nil {
		t.Fatal("a listener on a taken address was bound")
	}
	dial()
	want(0, "after a transparent listener's bind failed")

	if err := reload(plainCfg, out); err != nil {
		t.Fatal(err)
	}
	dial()
	want(1, "a transparent listener added back")
	roundTrip(t, third, []byte("the link from between the reloads still works"))
}

// addrFunc is a func as ownConn's localAddrer.
type addrFunc func() net.Addr

func (f addrFunc) localAddr() net.Addr { return f() }

// Two upstream sockets may share a local address (the kernel gives
// connections to different destinations the same local port when it
// can): the guard holds it until both have ended.
func TestLoopGuardCountsASharedAddress(t *testing.T) {
	p, l := transparentProxy(t, nil)
	a := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 40000}
	dst := netip.MustParseAddrPort("10.9.0.1:8098")
	local := addrFunc(func() net.Addr { return a })
	if !l.ownConn(local) || !l.ownConn(local) {
		t.Fatal("an upstream address was not registered with a transparent listener open")
	}
	l.forgetConn(a)
	if own, _ := p.isOwn(dst, a); !own {
		t.Fatal("one of two sockets with the address ended; the other is no longer guarded")
	}
	l.forgetConn(a)
	if own, _ := p.isOwn(dst, a); own {
		t.Fatal("both sockets ended; the address is still guarded")
	}
}

// Without a transparent listener, a new link's ask of the loop guard
// (attach) allocates nothing: the socket goes as an interface, where a
// method value was a closure made on the heap at every link.
func TestOwnConnAllocatesNothingWithoutTransparent(t *testing.T) {
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{{Name: "plain", Listen: "127.0.0.1:0", Upstream: "127.0.0.1:9", Settings: cfg.Defaults}}
	p := startProxy(t, cfg, Options{})
	p.mu.Lock()
	var host linkHost = p.listeners[0]
	p.mu.Unlock()
	e := &tcpEnd{}
	if n := testing.AllocsPerRun(1000, func() {
		if host.ownConn(e) {
			t.Fatal("registered without a transparent listener")
		}
	}); n != 0 {
		t.Errorf("ownConn: %v allocations per call, want 0", n)
	}
}
