//go:build linux

package proxy

import (
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// With reject, what a stalled upstream holds from a client is bounded by
// the high watermark, not by the kernel's send buffer: the proxy keeps the
// upstream socket's unsent backlog small (TCP_NOTSENT_LOWAT), so the bytes
// the proxy accepted before rejecting the link are the watermark, plus the
// small unsent backlog, plus what the peer's kernel acknowledged into its
// own receive buffer (in flight, bounded by the window), plus one read.
func TestStalledUpstreamHoldsAtMostTheWatermark(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	const high = 64 << 10
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.WriteTimeout, s.TCPUserTimeout = 0, 0
		s.WriteBuffer = policy.WriteBuffer{HighWaterMark: high, LowWaterMark: high / 2, OnOverflow: policy.OverflowReject}
	})
	c := h.dial()
	sent := writeAsync(c, 64<<20, 64<<10)
	s := h.linkEnd(10 * time.Second)
	<-sent
	if s.Reason != metrics.ReasonWatermark {
		t.Fatalf("link ended %q (%v), want watermark", s.Reason, s.Err)
	}
	// The peer's receive buffer: 4 KiB asked, doubled by the kernel, and
	// the window may run ahead of it by a segment.
	const peerWindow = 16 << 10
	bound := int64(high + notsentLowat(high) + peerWindow + chunkSize)
	t.Logf("the proxy took %d bytes from the client (queue peak %d); bound %d", s.BytesUp, s.MaxQueued, bound)
	if s.BytesUp > bound {
		t.Fatalf("the proxy took %d bytes from the client for a stalled upstream, above %d (high_water_mark %d + unsent %d + peer window + one read)",
			s.BytesUp, bound, high, notsentLowat(high))
	}
}
