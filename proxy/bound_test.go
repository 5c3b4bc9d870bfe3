//go:build linux

package proxy

import (
	"net"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
	"golang.org/x/sys/unix"
)

// With reject, what a stalled upstream holds from a client is bounded by
// the high watermark, not by the kernel's send buffer: the proxy keeps the
// upstream socket's unsent backlog small (TCP_NOTSENT_LOWAT), so the bytes
// the proxy accepted before rejecting the link are the watermark, plus the
// small unsent backlog, plus what the peer's kernel acknowledged into its
// own receive buffer (in flight, bounded by the window), plus one read.
func TestStalledUpstreamHoldsAtMostTheWatermark(t *testing.T) {
	const high = 64 << 10
	h, _, sent := stalledUpstream(t, high, policy.OverflowReject)
	s := h.linkEnd(10 * time.Second)
	<-sent
	if s.Reason != CloseWatermark {
		t.Fatalf("link ended %q (%v), want watermark", s.Reason, s.Err)
	}
	// The peer's receive buffer: 4 KiB asked, doubled by the kernel, and
	// the window may run ahead of it by a segment.
	const peerWindow = 16 << 10
	bound := int64(high + flow.NotsentLowat(high) + peerWindow + flow.ChunkSize)
	t.Logf("the proxy took %d bytes from the client (queue peak %d); bound %d", s.BytesUp, s.MaxQueued, bound)
	if s.BytesUp > bound {
		t.Fatalf("the proxy took %d bytes from the client for a stalled upstream, above %d (high_water_mark %d + unsent %d + peer window + one read)",
			s.BytesUp, bound, high, flow.NotsentLowat(high))
	}
}

// The backpressure twin, measured inside the kernel: once the link's
// queue holds the high watermark (the request pump waits for room), the
// upstream socket's unsent bytes (SIOCOUTQNSD) stay within
// TCP_NOTSENT_LOWAT plus what one write may add while under it (the
// kernel admits a write while the unsent backlog is below the mark, up to
// a 64 KiB segment more). SIOCOUTQ, unsent plus sent-but-unacknowledged,
// is logged: the in-flight part is the window's, not the proxy's.
func TestStalledUpstreamUnsentBacklogIsSmall(t *testing.T) {
	const high = 256 << 10
	h, c, sent := stalledUpstream(t, high, policy.OverflowBackpressure)
	lk := h.onlyLink(5 * time.Second)
	for deadline := time.Now().Add(10 * time.Second); lk.q.Bytes() < high; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("queue at %d bytes after 10s, never reached the high watermark %d", lk.q.Bytes(), high)
		}
	}
	unsent, outq := sockQueue(t, lk, unix.SIOCOUTQNSD), sockQueue(t, lk, unix.SIOCOUTQ)
	bound := flow.NotsentLowat(high) + 64<<10
	t.Logf("queue %d (high %d); upstream socket: unsent %d (TCP_NOTSENT_LOWAT %d), unsent+unacked %d",
		lk.q.Bytes(), high, unsent, flow.NotsentLowat(high), outq)
	if lk.q.Bytes() > high {
		t.Fatalf("queue %d above the high watermark %d", lk.q.Bytes(), high)
	}
	if unsent > bound {
		t.Fatalf("the upstream socket holds %d unsent bytes, above TCP_NOTSENT_LOWAT %d plus a segment", unsent, flow.NotsentLowat(high))
	}
	// Nothing ends this link by itself (no write timeout, no user
	// timeout, the pump waits for room and so never sees the client's
	// close): the proxy's shutdown at cleanup does.
	_ = c.Close()
	<-sent
}

// stalledUpstream starts a proxy in front of a peer that never reads (4
// KiB socket buffers), with no write timeout nor user timeout and the
// write buffer's high watermark at high (low at half, onOverflow past
// it), and a client writing 64 MiB to it in 64 KiB writes; sent yields
// when the writes end.
func stalledUpstream(t *testing.T, high policy.Size, onOverflow string) (h *harness, c net.Conn, sent <-chan int) {
	t.Helper()
	peer := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	h = start(t, peer.Addr(), func(s *policy.Settings) {
		s.WriteTimeout, s.TCPUserTimeout = 0, 0
		s.WriteBuffer = policy.WriteBuffer{HighWaterMark: high, LowWaterMark: high / 2, OnOverflow: onOverflow}
	})
	c = h.dial()
	return h, c, writeAsync(c, 64<<20, 64<<10)
}

// sockQueue reads an ioctl byte count (SIOCOUTQ, SIOCOUTQNSD) of the
// link's upstream socket.
func sockQueue(t *testing.T, lk *link, req uint) int {
	t.Helper()
	var n int
	var err error
	if cerr := lk.upRaw().Control(func(fd uintptr) { n, err = unix.IoctlGetInt(int(fd), req) }); cerr != nil {
		t.Fatal(cerr)
	}
	if err != nil {
		t.Fatal(err)
	}
	return n
}
