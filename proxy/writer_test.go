package proxy

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
)

// The writer that drains a link's queue toward the upstream ends once it
// has written everything (flow.Drained), so that an idle link keeps only
// its two pumps, and the next bytes that have to queue start another: two
// transfers far larger than the kernel takes at once, each followed by a
// link with two goroutines, every byte echoed in order.
func TestWriterEndsWhenDrained(t *testing.T) {
	// Small buffers at the peer: the upstream's window fills long before
	// the transfer ends, so bytes have to queue.
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Buffer: 16 << 10})
	h := start(t, peer.Addr(), nil)
	c := h.dial()
	var lk *link
	for round := range 2 {
		echoLarge(t, c, 8<<20, byte(round))
		if lk == nil {
			lk = onlyLink(t, h.p)
		}
		if lk.q.Peak() == 0 {
			t.Fatal("nothing was ever queued: the test did not start a writer")
		}
		deadline := time.Now().Add(10 * time.Second)
		for lk.live.Load() != 2 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if n := lk.live.Load(); n != 2 {
			t.Fatalf("round %d: the drained link has %d goroutines, want its 2 pumps (the writer ends)", round, n)
		}
	}
}

// echoLarge sends n bytes of a pattern through c to an echo peer while
// reading them back, and checks every byte.
func echoLarge(t *testing.T, c net.Conn, n int, seed byte) {
	t.Helper()
	msg := make([]byte, n)
	for i := range msg {
		msg[i] = byte(i) + seed
	}
	werr := make(chan error, 1)
	go func() { _, err := c.Write(msg); werr <- err }()
	got := make([]byte, n)
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Time{})
	if err := <-werr; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, msg) {
		t.Fatal("the echo differs from what was sent")
	}
}

// onlyLink is the one live link of p's first listener.
func onlyLink(t *testing.T, p *Proxy) *link {
	t.Helper()
	l := p.listeners[0]
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.links) != 1 {
		t.Fatalf("%d live links, want 1", len(l.links))
	}
	for lk := range l.links {
		return lk
	}
	return nil
}

// Do no harm: a link whose writer once ran (a transfer larger than the
// kernel took at once) and that then idles for longer than write_timeout
// is alive, and its next request goes through. The writer's write
// deadline must not outlive the writer: a direct write of the next
// request found it passed and ended the link as an upstream error,
// blaming a healthy server (the twin: TestWriteTimeoutClosesStalledLink).
func TestLinkThatQueuedSurvivesIdleBeyondWriteTimeout(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Buffer: 16 << 10})
	const wt = 300 * time.Millisecond
	h := start(t, peer.Addr(), func(s *policy.Settings) { s.WriteTimeout = policy.Duration(wt) })
	c := h.dial()
	echoLarge(t, c, 8<<20, 7)
	lk := onlyLink(t, h.p)
	if lk.q.Peak() == 0 {
		t.Fatal("nothing was ever queued: the test did not start a writer")
	}
	time.Sleep(3 * wt) // idle: no bytes wait, nothing is judged
	roundTrip(t, c, []byte("after the pause"))
	if r := lk.reason.Load(); r != nil {
		t.Fatalf("the link ended (%s) after an idle pause longer than write_timeout", *r)
	}
}
