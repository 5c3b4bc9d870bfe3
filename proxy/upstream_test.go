package proxy

import (
	"errors"
	"io"
	"net"
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
	own := 0
	p.ownUp.Range(func(any, any) bool { own++; return true })
	if own != 0 {
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

// ownedCount is how many upstream addresses the loop guard holds.
func (p *Proxy) ownedCount() int {
	n := 0
	p.ownUp.Range(func(any, any) bool { n++; return true })
	return n
}

// The loop guard holds a link's upstream address only while a transparent
// listener accepts: once a reload removed the last one, a new link asks
// the kernel for nothing (its address is not registered), and a link that
// registered before the reload still forgets its address when it ends.
func TestLoopGuardEndsWithTheLastTransparentListener(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	ended := make(chan LinkStats, 4)
	cfg := policy.DefaultConfig()
	tr := policy.Transparent{Match: []policy.Match{{CIDR: "10.9.0.0/16"}},
		MaxDestinations: 16, ForgetExcludedAfter: policy.Duration(time.Minute)}
	cfg.Listeners = []policy.Listener{
		listenerCfg("plain", peer.Addr(), nil),
		{Name: "out", Listen: "127.0.0.1:0", Settings: cfg.Defaults, Transparent: tr},
	}
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
		c, err := net.Dial("tcp", plain)
		if err != nil {
			t.Fatal(err)
		}
		roundTrip(t, c, []byte("hello")) // the link reached its upstream
		return c
	}

	before := dial()
	defer before.Close()
	if n := p.ownedCount(); n != 1 {
		t.Fatalf("with a transparent listener open the loop guard holds %d addresses, want the link's 1", n)
	}

	cfg2 := cfg
	cfg2.Listeners = cfg.Listeners[:1]
	cfg2.Listeners[0].Listen = p.Addr("plain").String()
	if err := p.Reload(cfg2); err != nil {
		t.Fatal(err)
	}
	after := dial()
	defer after.Close()
	if n := p.ownedCount(); n != 1 {
		t.Fatalf("after the last transparent listener went the loop guard holds %d addresses, want only the first link's 1", n)
	}

	before.Close()
	if s := <-ended; s.Client != before.LocalAddr().String() {
		t.Fatalf("link of %s ended, want %s's", s.Client, before.LocalAddr())
	}
	if n := p.ownedCount(); n != 0 {
		t.Fatalf("the link that registered ended; the loop guard still holds %d addresses", n)
	}
	roundTrip(t, after, []byte("the link after the reload works"))
}
