package proxy

import (
	"bytes"
	"errors"
	"io"
	"net"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// startParking starts a proxy in front of upstream whose links park after
// after idle (0: never), with settings tuned by tune; start is this with
// the default.
func startParking(t *testing.T, upstream string, after time.Duration, tune func(*policy.Settings)) *harness {
	t.Helper()
	cfg := policy.DefaultConfig()
	cfg.Limits.ParkIdleAfter = policy.Duration(after)
	s := cfg.Defaults
	if tune != nil {
		tune(&s)
	}
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Upstream: upstream, Settings: s}}
	h := &harness{t: t, m: metrics.New(), ended: make(chan LinkStats, 256)}
	h.p = New(cfg, Options{metrics: h.m, Logger: testLogger(), OnLinkEnd: func(s LinkStats) { h.ended <- s }})
	if err := h.p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.p.Close() })
	h.addr = h.p.Addr("test").String()
	return h
}

// noLinkEnded fails the test if a link ended (what says when).
func (h *harness) noLinkEnded(what string) {
	h.t.Helper()
	select {
	case s := <-h.ended:
		h.t.Fatalf("%s: %+v", what, s)
	default:
	}
}

// parked is the parker's own count of parked pumps.
func (h *harness) parked() int { return int(testutil.ToFloat64(h.m.ParkedPumps)) }

// waitParked waits until the parker holds n pumps.
func (h *harness) waitParked(n int, within time.Duration) {
	h.t.Helper()
	deadline := time.Now().Add(within)
	for h.parked() != n {
		if time.Now().After(deadline) {
			h.t.Fatalf("%d pumps parked after %v, want %d", h.parked(), within, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// allStacks is every goroutine's stack (runtime.Stack), whole.
func allStacks() string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return string(buf[:n])
		}
		buf = make([]byte, 2*len(buf))
	}
}

// pumpGoroutines counts the goroutines running a TCP end's pump.
func pumpGoroutines() int {
	st := allStacks()
	return strings.Count(st, "(*tcpEnd).pumpRequests(") + strings.Count(st, "(*tcpEnd).pumpResponses(")
}

// waitNoPumpGoroutines waits until no goroutine runs a pump: a pump
// counted as parked ends its goroutine just after (it adds its socket to
// the epoll set first).
func waitNoPumpGoroutines(t *testing.T, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for n := pumpGoroutines(); n != 0; n = pumpGoroutines() {
		if time.Now().After(deadline) {
			t.Fatalf("%d pump goroutines %v after every pump was counted as parked", n, within)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// onlyEnd is the TCP end of h's one link.
func (h *harness) onlyEnd() *tcpEnd {
	h.t.Helper()
	lk := h.onlyLink(5 * time.Second)
	lk.connMu.Lock()
	defer lk.connMu.Unlock()
	return lk.up.(*tcpEnd)
}

// upstreamPair is a link through h to a listener the test goroutine
// serves itself: the client's end and the upstream's.
func upstreamPair(t *testing.T, h *harness, ln net.Listener) (c, u *net.TCPConn) {
	t.Helper()
	c = h.dial()
	roundTripVia(t, c, nil, []byte("hello"))
	_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(10 * time.Second))
	a, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	u = a.(*net.TCPConn)
	t.Cleanup(func() { _ = u.Close() })
	roundTripVia(t, u, c, nil) // the hello, and its answer
	return c, u
}

// roundTripVia writes msg to from when given, or else answers on from
// what arrives; with to it reads the same bytes back there. For
// upstreamPair: the client writes, the upstream reads and answers.
func roundTripVia(t *testing.T, from, to *net.TCPConn, msg []byte) {
	t.Helper()
	if msg != nil {
		if _, err := from.Write(msg); err != nil {
			t.Fatal(err)
		}
		return
	}
	_ = from.SetDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, 5)
	if _, err := io.ReadFull(from, got); err != nil {
		t.Fatal(err)
	}
	if _, err := from.Write(got); err != nil {
		t.Fatal(err)
	}
	_ = to.SetDeadline(time.Now().Add(10 * time.Second))
	back := make([]byte, len(got))
	if _, err := io.ReadFull(to, back); err != nil || !bytes.Equal(back, got) {
		t.Fatalf("the answer through the proxy: %q, %v", back, err)
	}
	_ = from.SetDeadline(time.Time{})
	_ = to.SetDeadline(time.Time{})
}

func listenLoopback(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	return ln
}

// An idle link's pumps park (their goroutines end) and resume on the next
// bytes from either side, which arrive whole and in order, as often as
// the link idles again.
func TestIdleLinkParksAndResumes(t *testing.T) {
	ln := listenLoopback(t)
	h := startParking(t, ln.Addr().String(), 50*time.Millisecond, nil)
	c, u := upstreamPair(t, h, ln)
	for round := range 3 {
		h.waitParked(2, 10*time.Second)
		waitNoPumpGoroutines(t, 10*time.Second)
		// A request wakes the request pump, its answer the response pump.
		msg := []byte{'r', 'e', 'q', '0' + byte(round), '.'}
		roundTripVia(t, c, nil, msg)
		roundTripVia(t, u, c, nil)
		// The upstream speaks first: bytes toward a client whose request
		// pump stays parked.
		h.waitParked(2, 10*time.Second)
		push := []byte{'p', 'u', 's', 'h', '0' + byte(round)}
		if _, err := u.Write(push); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(push))
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, push) {
			t.Fatalf("round %d: the upstream's bytes reached the client as %q, %v", round, got, err)
		}
	}
	h.noLinkEnded("the link ended while it parked")
}

// A parked link ends as a waiting one would: a FIN from either side is
// passed on, a reset from the upstream resets the client, and the
// reasons are those of an unparked link.
func TestParkedLinkEndsAsWaitingLinkDoes(t *testing.T) {
	cases := []struct {
		name   string
		end    func(c, u *net.TCPConn)
		reason CloseReason
	}{
		{"upstream FIN", func(c, u *net.TCPConn) {
			_ = u.CloseWrite()
			if err, _ := waitClosed(t, c, 10*time.Second); !errors.Is(err, io.EOF) {
				t.Errorf("the client read %v after the upstream's FIN, want EOF", err)
			}
			_ = c.CloseWrite()
		}, CloseUpstreamClosed},
		{"client FIN", func(c, u *net.TCPConn) {
			_ = c.CloseWrite()
			if err, _ := waitClosed(t, u, 10*time.Second); !errors.Is(err, io.EOF) {
				t.Errorf("the upstream read %v after the client's FIN, want EOF", err)
			}
			_ = u.CloseWrite()
		}, CloseClientClosed},
		{"upstream reset", func(c, u *net.TCPConn) {
			_ = u.SetLinger(0)
			_ = u.Close()
			if err, _ := waitClosed(t, c, 10*time.Second); !errors.Is(err, syscall.ECONNRESET) {
				t.Errorf("the client read %v after the upstream's reset, want a reset", err)
			}
		}, CloseUpstreamError},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ln := listenLoopback(t)
			h := startParking(t, ln.Addr().String(), 50*time.Millisecond, nil)
			h.t = t
			c, u := upstreamPair(t, h, ln)
			h.waitParked(2, 10*time.Second)
			tc.end(c, u)
			if s := h.linkEndOf(c, 10*time.Second); s.Reason != tc.reason {
				t.Fatalf("the parked link ended with %q (%v), want %q", s.Reason, s.Err, tc.reason)
			}
			h.waitParked(0, 10*time.Second)
		})
	}
}

// A parked link's close from elsewhere (an eviction, the shutdown)
// resumes its pumps, which end the link as they would from their wait.
func TestParkedLinkClosedFromElsewhere(t *testing.T) {
	ln := listenLoopback(t)
	h := startParking(t, ln.Addr().String(), 50*time.Millisecond, nil)
	c, _ := upstreamPair(t, h, ln)
	h.waitParked(2, 10*time.Second)
	ep := h.p.lookupEndpoint(ln.Addr().String())
	if ep == nil {
		t.Fatal("no endpoint for the upstream")
	}
	if n := ep.evict(time.Now(), CloseEvicted, "test"); n != 1 {
		t.Fatalf("evicted %d links, want 1", n)
	}
	if s := h.linkEndOf(c, 10*time.Second); s.Reason != CloseEvicted {
		t.Fatalf("the parked link ended with %q, want %q", s.Reason, CloseEvicted)
	}
	if err, _ := waitClosed(t, c, 10*time.Second); !isCloseSignal(err) {
		t.Fatalf("the client read %v after the eviction", err)
	}
	h.waitParked(0, 10*time.Second)

	// Shutdown with a parked link: cut (its context is done) and every
	// goroutine ends (TestMain's goleak checks the rest).
	c2, _ := upstreamPair(t, h, ln)
	h.waitParked(2, 10*time.Second)
	if err := h.p.Close(); err != nil {
		t.Fatal(err)
	}
	if s := h.linkEndOf(c2, 10*time.Second); s.Reason != CloseShutdown {
		t.Fatalf("the parked link ended with %q at shutdown, want %q", s.Reason, CloseShutdown)
	}
	if h.p.ActiveLinks() != 0 {
		t.Fatalf("%d links open after Close", h.p.ActiveLinks())
	}
}

// The twin of the detection tests: a request the upstream answers late
// (within request_timeout) parks the link while it waits, and the answer
// still reaches the client whole, counted as an answer: parking is no
// verdict on anything, and the tracker judges on its own timer.
func TestParkedLinkKeepsSlowAnswer(t *testing.T) {
	ln := listenLoopback(t)
	h := startParking(t, ln.Addr().String(), 20*time.Millisecond, func(s *policy.Settings) {
		s.Unanswered.RequestTimeout = policy.Duration(30 * time.Second)
	})
	c, u := upstreamPair(t, h, ln)
	if _, err := c.Write([]byte("slowq")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 5)
	_ = u.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(u, got); err != nil {
		t.Fatal(err)
	}
	h.waitParked(2, 10*time.Second) // the answer is late: both pumps parked meanwhile
	answer := bytes.Repeat([]byte("a"), 256<<10)
	go func() { _, _ = u.Write(answer) }()
	back := make([]byte, len(answer))
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, back); err != nil || !bytes.Equal(back, answer) {
		t.Fatalf("the late answer through a parked link: %v", err)
	}
	if n := testutil.ToFloat64(h.m.ForListener("test").UnansweredTimeouts); n != 0 {
		t.Fatalf("%v unanswered timeouts for a request answered within its timeout", n)
	}
	h.noLinkEnded("the link ended")
}

// The sweep asks a link to park only once no byte moved for
// park_idle_after: a link that moves bytes between sweeps is never asked,
// however long it lives. Judged on the sweep's own clock (idleEnds takes
// the time), not the scheduler's.
func TestParkSweepAsksOnlyIdleLinks(t *testing.T) {
	ln := listenLoopback(t)
	h := startParking(t, ln.Addr().String(), 0, nil) // 0: the loop never sweeps; the test sweeps by hand
	c, u := upstreamPair(t, h, ln)
	l := h.p.listeners[0]
	after := int64(time.Second)
	now := time.Now().UnixNano()
	sweep := func(at int64) int { return len(l.idleEnds(at, after, nil)) }
	if n := sweep(now); n != 0 {
		t.Fatalf("first sight of the link: %d asked to park", n)
	}
	// Bytes moved at every sweep: never idle, over many park_idle_after.
	for i := range 10 {
		roundTripVia(t, c, nil, []byte("busy."))
		roundTripVia(t, u, c, nil)
		now += 2 * after
		if n := sweep(now); n != 0 {
			t.Fatalf("sweep %d: a link that moved bytes since the last sweep was asked to park", i)
		}
	}
	// No bytes: not before park_idle_after has passed, then once.
	if n := sweep(now + after - 1); n != 0 {
		t.Fatal("a link idle for less than park_idle_after was asked to park")
	}
	if n := sweep(now + after); n != 1 {
		t.Fatalf("a link idle for park_idle_after: %d asked to park, want 1", n)
	}
	if n := sweep(now + after + 1); n != 0 {
		t.Fatal("a link asked to park was asked again before another park_idle_after")
	}
}

// The sweep marks a pump, then sets the deadline that wakes it; a pump
// may see the mark first, park, and find the deadline only once resumed.
// Such a late deadline, without a mark, is never taken for the link's
// error: the pump clears it and reads on.
func TestLateParkDeadlineCutsNothing(t *testing.T) {
	ln := listenLoopback(t)
	h := startParking(t, ln.Addr().String(), 0, nil) // 0: no sweep of its own
	c, u := upstreamPair(t, h, ln)
	e := h.onlyEnd()
	for round := range 3 {
		_ = e.lk.client.(*tcpClient).SetReadDeadline(pastDeadline)
		_ = e.conn.SetReadDeadline(pastDeadline)
		msg := []byte{'l', 'a', 't', 'e', '0' + byte(round)}
		roundTripVia(t, c, nil, msg)
		roundTripVia(t, u, c, nil)
	}
	h.noLinkEnded("a late park deadline ended the link")
	if n := h.parked(); n != 0 {
		t.Fatalf("%d pumps parked without being asked", n)
	}
}

// Should the parker's wait fail (the proxy's own failure), its parked
// pumps get their goroutines back and the links carry on unparked: none
// is left in a set nobody waits on, and none is cut.
func TestParkerFailureResumesParkedPumps(t *testing.T) {
	ln := listenLoopback(t)
	h := startParking(t, ln.Addr().String(), 20*time.Millisecond, nil)
	c, u := upstreamPair(t, h, ln)
	h.waitParked(2, 10*time.Second)
	h.p.parker.set.close() // its wait fails as a broken epoll set's would
	h.waitParked(0, 10*time.Second)
	h.p.parkAfter.Store(0) // the loop sweeps no more: the test asks by hand
	e := h.onlyEnd()
	for round := range 3 {
		roundTripVia(t, c, nil, []byte{'a', 'f', 't', 'e', '0' + byte(round)})
		roundTripVia(t, u, c, nil)
		// Asked to park again: each pump takes the request, the parker
		// refuses it, and the pump reads on.
		e.requestPark()
		for deadline := time.Now().Add(10 * time.Second); e.parkReq.Load() != 0; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: the pumps did not take the request to park (marks %b)", round, e.parkReq.Load())
			}
		}
	}
	if n := h.parked(); n != 0 {
		t.Fatalf("%d pumps parked after the parker stopped", n)
	}
	h.noLinkEnded("the link ended")
}

// Detection does not wait for a pump: a server that answers nothing
// (request_timeout 300ms, threshold 1) is judged by the tracker's own
// timer while both links' pumps are parked, and the eviction that follows
// ends the parked links within the same bound as unparked ones
// (TestUnansweredThresholdExcludesEndpoint).
func TestParkedLinksStillJudged(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	peer.SetAnswer(func(int64) (time.Duration, bool) { return 0, false })
	h := startParking(t, peer.Addr(), 20*time.Millisecond, framed(300*time.Millisecond, 1, nil))
	c, other := h.dial(), h.dial()
	h.waitParked(4, 10*time.Second)
	begin := time.Now()
	sendFrame(t, c, "q1")
	err, at := waitClosed(t, c, 3*time.Second)
	if !isCloseSignal(err) {
		t.Fatalf("client saw %v, want EOF or reset", err)
	}
	if d := at.Sub(begin); d < 300*time.Millisecond || d > 1300*time.Millisecond {
		t.Fatalf("parked link closed %v after its unanswered request, want request_timeout (300ms) and at most a second", d)
	}
	if err, _ := waitClosed(t, other, 2*time.Second); !isCloseSignal(err) {
		t.Fatalf("the other parked link saw %v", err)
	}
	for range 2 {
		if s := h.linkEnd(2 * time.Second); s.Reason != CloseUnanswered {
			t.Fatalf("reason %q, want unanswered", s.Reason)
		}
	}
	h.waitState("excluded", 2*time.Second)
	h.waitParked(0, 10*time.Second)
}
