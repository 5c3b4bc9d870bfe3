package proxy

import (
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/policy"
)

// opaqueTracked tunes a listener for opaque bytes with unanswered
// tracking on: a request is a burst of bytes sent since the last answer.
func opaqueTracked(timeout time.Duration) func(*policy.Settings) {
	return func(s *policy.Settings) {
		s.Unanswered = policy.Unanswered{Track: policy.TrackOn, RequestTimeout: policy.Duration(timeout), ConsecutiveTimeoutsThreshold: 1}
		s.Detector.InitialDelay = policy.Duration(10 * time.Second)
		s.Detector.Jitter = 0
	}
}

// linkRecordBound is the README's bound on a link's records ("A link
// keeps at most 1,024 records").
const linkRecordBound = 1024

// pingPong makes n one-byte round trips on c.
func pingPong(t *testing.T, c net.Conn, n int) {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(60 * time.Second))
	defer func() { _ = c.SetDeadline(time.Time{}) }()
	b := []byte{'x'}
	for i := range n {
		if _, err := c.Write(b); err != nil {
			t.Fatalf("round trip %d: %v", i, err)
		}
		if _, err := io.ReadFull(c, b); err != nil {
			t.Fatalf("round trip %d: %v", i, err)
		}
	}
}

// A link's tracker keeps at most linkRecordBound records (the README: "A link
// keeps at most 1,024 records"), in opaque mode too, where a request is a
// burst since the last answer: a client in a fast request/response loop
// with a live server starts a burst at every request, each answered at
// once. Each record was kept until its request_timeout passed, though it
// was answered and opaque mode checks no staleness: a link held its
// requests of the last request_timeout, one record each, unbounded
// (here 3,073 records after 3,072 round trips, 64 B each; this loop ran
// at about 23,000 round trips a second, so 4.4 MB a link with the 3 s
// default and 88 MB with a minute's request_timeout). Now a burst's
// answer ends its record: the link holds one.
func TestOpaqueTrackerBoundedWithALiveServer(t *testing.T) {
	_, h, c := startEcho(t, opaqueTracked(time.Minute), "a")
	const rounds = 3 * linkRecordBound
	pingPong(t, c, rounds)
	lk := h.onlyLink(5 * time.Second)
	if n := lk.trk.Pending(); n > linkRecordBound {
		t.Fatalf("%d records kept after %d answered round trips, want at most %d", n, rounds, linkRecordBound)
	}
	if n := lk.trk.Recorded(); n < rounds {
		t.Fatalf("%d bursts recorded, want at least %d: the test did not exercise the tracker", n, rounds)
	}
	if s := h.endpoint(); s.State != "healthy" {
		t.Fatalf("endpoint %s (%s) after answered round trips, want healthy", s.State, s.Reason)
	}
}

// The twin: past the bound's worth of answered round trips, a server that
// stops answering is still found by the next burst's own deadline, not
// once the answered records have aged out.
func TestOpaqueTrackerJudgesAfterManyAnsweredBursts(t *testing.T) {
	var silent atomic.Bool
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := serveConns(t, ln, func(c net.Conn, done <-chan struct{}) {
		b := make([]byte, 4096)
		for {
			n, err := c.Read(b)
			if err != nil {
				return
			}
			if !silent.Load() {
				if _, err := c.Write(b[:n]); err != nil {
					return
				}
			}
		}
	})
	const timeout = 2 * time.Second
	h := start(t, addr, opaqueTracked(timeout))
	c := h.dial()
	pingPong(t, c, 3*linkRecordBound)
	silent.Store(true)
	sent := time.Now()
	if _, err := c.Write([]byte{'y'}); err != nil {
		t.Fatal(err)
	}
	h.excludedUnanswered(sent, timeout, timeout+5*time.Second)
}
