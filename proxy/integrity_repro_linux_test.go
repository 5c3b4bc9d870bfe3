package proxy

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
)

// Reproductions of what TestDataPlaneIntegrity found, minimized.

// An upstream's reset reaches the client as a reset, never as a FIN first:
// a FIN would make whatever the client got so far look complete (README,
// "Half-close, and resets travel"). The upstream here resets while the
// proxy's writer waits to hand it queued bytes and its response pump waits
// to read it: the kernel reports the reset's ECONNRESET once, to whichever
// of the two calls first, and when the writer's send takes it, the
// response pump's read finds the socket closed for reading and returns 0,
// which the pump passes on as the upstream's FIN (passFinToClient) before
// the writer's abort resets the client. The race needs both pumps running
// at once (GOMAXPROCS > 1): each attempt is one throw; on two cores 5 to
// 15 attempts of 200 ended with a FIN at the client (the link's error:
// "writev: connection reset by peer"), none of 200 with GOMAXPROCS=1.
func TestUpstreamResetNeverReachesTheClientAsAFin(t *testing.T) {
	countFins(t, 200, upstreamResetSeenAsFin, "upstream resets reached the client")
}

// upstreamResetSeenAsFin makes one attempt: the client writes 2 MiB to a
// server that reads none of it, the proxy queues what the kernel does not
// take, the server resets, and the client, which writes nothing more,
// reads to the end: EOF is a FIN that came before the reset.
func upstreamResetSeenAsFin(t *testing.T) bool { return upstreamResetUnderUpload(t, false) }

// upstreamResetUnderUpload is upstreamResetSeenAsFin's attempt; with
// halfClose the client half-closes after its 2 MiB, and the server resets
// once the proxy has read that FIN with bytes still queued.
func upstreamResetUnderUpload(t *testing.T, halfClose bool) bool {
	ln, accepted := acceptOne(t)
	defer ln.Close()
	h := start(t, ln.Addr().String(), func(s *policy.Settings) { s.WriteTimeout = 0 })
	defer h.p.Close()
	c := h.dial()
	defer c.Close()
	if _, err := c.Write(make([]byte, 2<<20)); err != nil {
		t.Fatal(err)
	}
	if halfClose {
		if err := c.CloseWrite(); err != nil {
			t.Fatal(err)
		}
	}
	srv := <-accepted
	lk := h.onlyLink(2 * time.Second)
	waitFor(t, 5*time.Second, "bytes queued in the proxy (and the client's FIN read)", func() bool {
		lk.finMu.Lock()
		read := lk.firstFin == CloseClientClosed
		lk.finMu.Unlock()
		return (read || !halfClose) && lk.q.Bytes() > 0
	})
	_ = srv.SetLinger(0)
	_ = srv.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := io.Copy(io.Discard, c)
	ls := h.linkEnd(5 * time.Second)
	switch {
	case err == nil: // io.Copy's EOF
		t.Logf("a FIN: the link ended %s (%v)", ls.Reason, ls.Err)
		return true
	case errors.Is(err, syscall.ECONNRESET):
		return false
	}
	t.Fatalf("client read: %v", err)
	return false
}

// A client's reset reaches the upstream as a reset, never as a FIN first:
// a FIN tells the server that the request stream it got is whole. The
// mirror of TestUpstreamResetNeverReachesTheClientAsAFin: the client
// resets while the proxy's response pump waits to hand it the server's
// bytes (it reads none) and its request pump waits to read it; when the
// response pump's send takes the ECONNRESET, the request pump reads 0 and
// passes it on as the client's FIN (requestsEnded) before the response
// pump's abort resets the upstream. On two cores 5 to 12 attempts of
// about 80 ended with a FIN at the server (the link's error: "write:
// connection reset by peer", the response pump's write to the client).
func TestClientResetNeverReachesTheUpstreamAsAFin(t *testing.T) {
	countFins(t, 100, clientResetSeenAsFin, "client resets reached the upstream")
}

// countFins makes up to max attempts (for at most 10 s) and fails the
// test if any saw a FIN where a reset was sent.
func countFins(t *testing.T, max int, attempt func(*testing.T) bool, what string) {
	fins, attempts := 0, 0
	deadline := time.Now().Add(10 * time.Second)
	for ; attempts < max && time.Now().Before(deadline); attempts++ {
		if attempt(t) {
			fins++
		}
	}
	if fins > 0 {
		t.Errorf("%d of %d %s as a FIN (EOF) first", fins, attempts, what)
	}
	t.Logf("%d attempts, %d FINs", attempts, fins)
}

// acceptOne listens on loopback and hands over the first connection it
// accepts (the channel closes after it, or on the listener's close).
func acceptOne(t *testing.T) (net.Listener, <-chan *net.TCPConn) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ln, acceptNext(ln)
}

// clientResetSeenAsFin makes one attempt: the server writes until the
// proxy can take no more (its client reads nothing), stops writing, the
// client resets, and the server reads to the end: EOF is a FIN that came
// before the reset.
func clientResetSeenAsFin(t *testing.T) bool {
	h, _, c, srv, done := proxiedConn(t)
	defer done()
	// Until the write stalls: the proxy's response pump then waits in its
	// write to the client. No write of the server's is left pending.
	_ = srv.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	if _, err := srv.Write(make([]byte, 64<<20)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("server write: %v, want it stalled", err)
	}
	_ = c.SetLinger(0)
	_ = c.Close()
	_ = srv.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := io.Copy(io.Discard, srv)
	ls := h.linkEnd(5 * time.Second)
	switch {
	case err == nil: // io.Copy's EOF
		t.Logf("a FIN: the link ended %s (%v)", ls.Reason, ls.Err)
		return true
	case errors.Is(err, syscall.ECONNRESET):
		return false
	}
	t.Fatalf("server read: %v", err)
	return false
}

// Links waiting for the memory budget must not starve on their own read
// buffers: a request pump that waits for a queue chunk (waitForBudget)
// holds the 64 KiB chunk it read, counted in the budget's Reads. Was: a
// chunk was taken only while Used() (queues, reads and windows) left room
// for it (Budget.takeFor; now queues and windows only). Once the waiters' own buffers fill the budget,
// no queue is left to give a chunk back, no waiter can take one, and none
// is closed (nothing is queued or owed: neither the reaper nor the
// waiter's own stall check fires): every link waits for good, its client
// no longer read, its upstream idle. 20 links and a 1 MiB budget (20 x 64
// KiB of buffers in hand), each uploading 4 MiB (more than the upstream
// socket and the budget take) through the default watermark: the upstream
// reads nothing until all 20 wait, then reads everything as fast as it
// comes; every upload should finish.
func TestBudgetWaitersAreNotStarvedByTheirOwnReadBuffers(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Paced, faultpeer.Options{})
	peer.HoldReads()
	r := startBudget(t, peer.Addr(), policy.Limits{MemoryBudget: 1 << 20}, nil)
	const links, each = 20, 4 << 20
	done := make(chan error, links)
	for range links {
		c := r.dial(r.test)
		go func() {
			got, err := upload(c, each)
			if err == nil && got != each {
				err = fmt.Errorf("the peer read %d of %d bytes", got, each)
			}
			done <- err
		}()
	}
	waitFor(t, 10*time.Second, "every link waiting for the budget", func() bool { return r.p.budget.Nwait.Load() == links })
	peer.ReleaseReads()
	timeout := time.After(10 * time.Second)
	for i := range links {
		select {
		case err := <-done:
			if err != nil {
				t.Error(err)
			}
		case <-timeout:
			b := &r.p.budget
			t.Fatalf("%d of %d uploads finished in 10 s; budget: limit %d, queued %d, reads %d, %d links waiting",
				i, links, b.Limit.Load(), b.Queued.Load(), b.Reads.Load(), b.Nwait.Load())
		}
	}
}

// After the other direction has passed its FIN on to a socket, the end of
// that socket's stream is taken for its peer's FIN without asking the
// kernel (link.finOnly), unless a peek at the socket began (it may have
// taken a reset's error) or the link is ending: then flow.ResetNotFin
// asks, as at every first FIN. The client half-closes here; once the
// proxy has passed that FIN to the server, the server's end needs no
// TCP_INFO, a peek flag set or the link's end brings the check back, and
// the server's FIN reaches the client as a FIN.
func TestSecondFinIsTakenWithoutAskingTheKernel(t *testing.T) {
	h, ln, c, srv, done := proxiedConn(t)
	defer done()
	lk := h.onlyLink(2 * time.Second)
	if lk.finOnly(nil) {
		t.Fatal("finOnly before any FIN was passed: the first FIN must be checked")
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = srv.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := srv.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("server read %d, %v; want the client's FIN", n, err)
	}
	waitFor(t, 2*time.Second, "the client's FIN counted as passed", func() bool {
		lk.finMu.Lock()
		defer lk.finMu.Unlock()
		return lk.fins == 1
	})
	if !lk.finOnly(nil) {
		t.Fatal("finOnly false with the other direction's FIN passed, nothing peeked and the link not ending")
	}
	var peeked atomic.Bool
	peeked.Store(true)
	if lk.finOnly(&peeked) {
		t.Fatal("finOnly true after a peek began: the peek may have taken a reset's error")
	}
	_ = srv.Close() // the server's FIN
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("client read %d, %v; want the server's FIN", n, err)
	}
	if s := h.linkEnd(5 * time.Second); s.Reason != CloseClientClosed {
		t.Fatalf("reason %q, want %q", s.Reason, CloseClientClosed)
	}
	if lk.finOnly(nil) {
		t.Fatal("finOnly true on a link that has ended")
	}

	// A link cut with one FIN passed (here as half_close_timeout cuts
	// it): its sockets may be closed under the reads, which ResetNotFin
	// counts as resets.
	c2 := h.dial()
	defer c2.Close()
	srv2, ok := <-acceptNext(ln)
	if !ok {
		t.Fatal("the proxy did not connect the second link")
	}
	defer srv2.Close()
	if err := c2.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	lk2 := h.onlyLink(2 * time.Second)
	waitFor(t, 2*time.Second, "the second client's FIN counted as passed", func() bool {
		lk2.finMu.Lock()
		defer lk2.finMu.Unlock()
		return lk2.fins == 1
	})
	lk2.abort(CloseHalfCloseTimeout, nil)
	if lk2.finOnly(nil) {
		t.Fatal("finOnly true on a link being cut")
	}
}

// proxiedConn starts a proxy in front of a listener of its own and
// connects a client through it: the proxy, the listener (for more
// connections), the client, the server's end of the connection, and
// done, which closes them all.
func proxiedConn(t *testing.T) (h *harness, ln net.Listener, c, srv *net.TCPConn, done func()) {
	ln, accepted := acceptOne(t)
	h = start(t, ln.Addr().String(), nil)
	c = h.dial()
	srv = <-accepted
	return h, ln, c, srv, func() {
		if srv != nil {
			_ = srv.Close()
		}
		_ = c.Close()
		h.p.Close()
		_ = ln.Close()
	}
}

// acceptNext hands over the next connection ln accepts (the channel
// closes without one when ln is closed first).
func acceptNext(ln net.Listener) <-chan *net.TCPConn {
	ch := make(chan *net.TCPConn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			ch <- c.(*net.TCPConn)
		}
		close(ch)
	}()
	return ch
}
