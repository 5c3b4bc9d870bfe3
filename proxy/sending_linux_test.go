//go:build linux

package proxy

import (
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
)

// streamBehindRequests starts a proxy (write_timeout wt) in front of a
// Serial peer that answers each request before it reads the next, the
// first one (a mebibyte) at rate bytes per second, and a client that sends that request
// with behind MiB of requests pipelined behind it and reads everything
// promptly (read counts what it read); tune, if any, tunes the proxy
// further. It returns once requests wait in
// the proxy's queue while the server sends its first answer: the server
// reads nothing meanwhile, so it acknowledges nothing.
func streamBehindRequests(t *testing.T, wt time.Duration, rate int64, behind int, tune func(*policy.Settings)) (h *harness, c *net.TCPConn, peer *faultpeer.Server, read *atomic.Int64) {
	t.Helper()
	peer = faultpeer.New(t, faultpeer.Serial, faultpeer.Options{Buffer: 4096})
	peer.SetRate(rate)
	h = start(t, peer.Addr(), func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(wt)
		if tune != nil {
			tune(s)
		}
	})
	c = h.dial()
	reqs := bigFrames(1 + behind)
	go func() { _, _ = c.Write(reqs) }() // ends with c (t.Cleanup)
	read = new(atomic.Int64)
	go func() { _, _ = io.Copy(countingDiscard{read}, c) }()
	e := h.onlyEnd()
	for deadline := time.Now().Add(20 * time.Second); e.lk.q.Bytes() == 0 || peer.Requests() == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) || peer.Answers() > 0 {
			t.Fatalf("no requests queued while the server sent its first answer (queued %d, requests %d, answers %d); %s",
				e.lk.q.Bytes(), peer.Requests(), peer.Answers(), h.story())
		}
	}
	return h, c, peer, read
}

type countingDiscard struct{ n *atomic.Int64 }

func (w countingDiscard) Write(p []byte) (int, error) {
	w.n.Add(int64(len(p)))
	return len(p), nil
}

// A server that reads its next request only once its answer is sent,
// sending a long answer slowly to a client that reads it at once, with
// requests queued behind it: it acknowledges nothing for several
// write_timeouts, and none of its bytes wait unread in the proxy, but its
// bytes keep arriving. It makes progress: the link lives, the endpoint
// stays healthy, and every answer arrives. (The twin, the same server
// stopping mid-answer, is TestServerThatStopsMidAnswerIsJudged.)
func TestServerSendingALongAnswerIsNoWriteStall(t *testing.T) {
	const wt = time.Second
	h, _, peer, read := streamBehindRequests(t, wt, 256<<10, 8, nil) // 4 s of answer
	e := h.onlyEnd()
	// The premise: requests queued and nothing acknowledged for longer
	// than write_timeout while the answer streams.
	acked, _ := e.acked()
	since, longest := time.Now(), time.Duration(0)
	for peer.Answers() == 0 {
		if now, _ := e.acked(); now != acked || e.lk.q.Bytes() == 0 {
			acked, since = now, time.Now()
		}
		longest = max(longest, time.Since(since))
		if len(h.ended) > 0 {
			t.Fatalf("the link ended while the server sent its answer (%d bytes read); %s", read.Load(), h.story())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if longest < 2*wt {
		t.Fatalf("the server acknowledged nothing with requests queued for at most %v, want at least 2 x write_timeout (%v): the test's premise", longest, wt)
	}
	peer.SetRate(0)
	const total = 9 * (1 << 20)
	for deadline := time.Now().Add(30 * time.Second); read.Load() < total; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("read %d of %d answer bytes; %s", read.Load(), total, h.story())
		}
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").WriteTimeouts); got != 0 {
		t.Fatalf("write_timeouts_total = %v for a server sending its answer, want 0; %s", got, h.story())
	}
	if st := h.endpoint(); st.State != "healthy" {
		t.Fatalf("endpoint %s (%s) while it sent its answer, want healthy; %s", st.State, st.Reason, h.story())
	}
	h.noLinkEnded("a server sending its answer")
	t.Logf("nothing acknowledged for %v with requests queued (write_timeout %v); all %d bytes answered", longest, wt, total)
}

// The twin of TestServerSendingALongAnswerIsNoWriteStall: the server
// hangs mid-answer, sending and reading nothing more. Its bytes stop
// arriving, so it is judged write_timeout after its last byte (not
// before, not a write_timeout later), and excluded.
func TestServerThatStopsMidAnswerIsJudged(t *testing.T) {
	const wt = 2 * time.Second
	const rate = 128 << 10 // 8 s of answer
	h, _, peer, read := streamBehindRequests(t, wt, rate, 8, nil)
	// Stop more than twice write_timeout into the answer: without the
	// excuse, the link would have ended by then (a write deadline is
	// judged up to two write_timeouts after the last acknowledgement).
	// Just after a deadline the excuse put off, which the writer's next
	// deadline, were it write_timeout from then, would judge nearly
	// two write_timeouts after the last byte.
	for deadline := time.Now().Add(30 * time.Second); read.Load() < int64(rate*(2*wt+wt/10)/time.Second); time.Sleep(10 * time.Millisecond) {
		if len(h.ended) > 0 || time.Now().After(deadline) {
			t.Fatalf("the link ended, or the answer stopped, after %d bytes, before the server hung; %s", read.Load(), h.story())
		}
	}
	peer.Freeze()
	s := h.linkEnd(3*wt + 10*time.Second)
	if s.Reason != CloseWriteTimeout {
		t.Fatalf("reason %q (%v), want %q; %s", s.Reason, s.Err, CloseWriteTimeout, h.story())
	}
	after := s.Opened.Add(s.Duration).Sub(peer.LastWrite())
	t.Logf("judged %v after the server's last byte (write_timeout %v)", after, wt)
	if after < wt/2 || after > wt+time.Second {
		t.Fatalf("judged %v after the server's last byte, want write_timeout (%v) after it, within a second", after, wt)
	}
	if st := h.endpoint(); st.State != "excluded" || st.Reason != string(CloseWriteTimeout) {
		t.Fatalf("endpoint %s (%s), want excluded for write_timeout; %s", st.State, st.Reason, h.story())
	}
}

// With on_overflow: reject, a client that writes past the high watermark
// while its server sends a long answer (reading nothing, acknowledging
// nothing for more than write_timeout) has its link closed, watermark,
// but the server is not blamed: its bytes kept arriving. (A server that
// stops sending as well is cut by write_timeout at the moment an overflow
// would blame it, so the twin is TestServerThatStopsMidAnswerIsJudged.)
func TestOverflowWhileTheServerSendsBlamesNoUpstream(t *testing.T) {
	const wt = time.Second
	h, c, peer, _ := streamBehindRequests(t, wt, 128<<10, 2, func(s *policy.Settings) { // 8 s of answer
		s.WriteBuffer = policy.WriteBuffer{HighWaterMark: 4 << 20, LowWaterMark: 2 << 20, OnOverflow: policy.OverflowReject}
	})
	e := h.onlyEnd()
	acked, _ := e.acked()
	for since := time.Now(); time.Since(since) < 2*wt; time.Sleep(10 * time.Millisecond) {
		if now, _ := e.acked(); now != acked {
			acked, since = now, time.Now()
		}
		if len(h.ended) > 0 || peer.Answers() > 0 {
			t.Fatalf("the link ended, or the first answer was sent, before 2 x write_timeout with nothing acknowledged: %s", h.story())
		}
	}
	go func() { _, _ = c.Write(bigFrames(6)) }() // past the high watermark; ends with c (t.Cleanup)
	s := h.linkEnd(10 * time.Second)
	if s.Reason != CloseWatermark {
		t.Fatalf("link ended %q (%v), want watermark; %s", s.Reason, s.Err, h.story())
	}
	if peer.Answers() > 0 {
		// The server read again: it acknowledged the queue, and the
		// overflow found progress without its bytes to tell.
		t.Fatalf("the first answer was sent before the overflow closed the link: the test's premise; %s", h.story())
	}
	if st := h.endpoint(); st.State != "healthy" {
		t.Fatalf("endpoint %s (%s) after an overflow while it sent its answer, want healthy; %s", st.State, st.Reason, h.story())
	}
}
