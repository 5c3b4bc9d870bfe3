package proxy

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// framed tunes a listener for Pinot's framing with unanswered tracking.
func framed(timeout time.Duration, threshold int, more func(*policy.Settings)) func(*policy.Settings) {
	return func(s *policy.Settings) {
		s.Framing = policy.Framing{Type: policy.FramingLengthField, LengthFieldLength: 4,
			ByteOrder: policy.ByteOrderBig, MaxFrameLength: 1 << 20}
		// length_field cannot know which frames get an answer: tracking is
		// off unless asked for.
		s.Unanswered = policy.Unanswered{Track: policy.TrackOn, RequestTimeout: policy.Duration(timeout), ConsecutiveTimeoutsThreshold: threshold}
		s.Detector.InitialDelay = policy.Duration(10 * time.Second) // tests that readmit set their own
		s.Detector.Jitter = 0
		if more != nil {
			more(s)
		}
	}
}

func sendFrame(t *testing.T, c net.Conn, payload string) {
	t.Helper()
	b := binary.BigEndian.AppendUint32(nil, uint32(len(payload)))
	if _, err := c.Write(append(b, payload...)); err != nil {
		t.Fatalf("send frame: %v", err)
	}
}

func readFrame(t *testing.T, c net.Conn, within time.Duration) string {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(within))
	defer func() { _ = c.SetReadDeadline(time.Time{}) }()
	var hdr [4]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		t.Fatalf("read frame: %v", err)
	}
	p := make([]byte, binary.BigEndian.Uint32(hdr[:]))
	if _, err := io.ReadFull(c, p); err != nil {
		t.Fatalf("read frame body: %v", err)
	}
	return string(p)
}

// waitUnanswered waits until the endpoint counts n consecutive unanswered
// requests (the count the proxy keeps, so the test does not guess how
// long judging takes on a loaded machine).
func (h *harness) waitUnanswered(n int64, within time.Duration) {
	h.t.Helper()
	for deadline := time.Now().Add(within); h.endpoint().ConsecutiveUnanswered != n; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			h.t.Fatalf("consecutive unanswered %d after %v, want %d", h.endpoint().ConsecutiveUnanswered, within, n)
		}
	}
}

func (h *harness) endpoint() EndpointStatus {
	h.t.Helper()
	eps := h.p.Endpoints()
	if len(eps) != 1 {
		h.t.Fatalf("%d endpoints, want 1", len(eps))
	}
	return eps[0]
}

func (h *harness) waitState(state string, within time.Duration) EndpointStatus {
	h.t.Helper()
	deadline := time.Now().Add(within)
	for {
		ep := h.endpoint()
		if ep.State == state {
			return ep
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("endpoint %s still %s (%s) after %v, want %s", ep.Endpoint, ep.State, ep.Reason, within, state)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func expectRefused(t *testing.T, addr string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err == nil {
		_ = c.Close()
		t.Fatal("connect succeeded, want it refused while the endpoint is out of routing")
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("connect: %v, want ECONNREFUSED", err)
	}
}

// A framed server that answers nothing (threshold 3, request timeout
// 300ms): two unanswered requests change nothing, the third marks the
// endpoint suspect, its links close, new connections are refused.
func TestUnansweredThresholdExcludesEndpoint(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	peer.SetAnswer(func(int64) (time.Duration, bool) { return 0, false })
	h := start(t, peer.Addr(), framed(300*time.Millisecond, 3, nil))
	c, other := h.dial(), h.dial()

	sendFrame(t, c, "q1")
	sendFrame(t, c, "q2")
	h.waitUnanswered(2, 5*time.Second) // both judged: 300ms + 30ms slack
	if ep := h.endpoint(); ep.State != "healthy" || ep.ConsecutiveUnanswered != 2 {
		t.Fatalf("after 2 unanswered: %+v, want healthy with 2 consecutive", ep)
	}
	begin := time.Now()
	sendFrame(t, c, "q3")
	err, at := waitClosed(t, c, 2*time.Second)
	if !isCloseSignal(err) {
		t.Fatalf("client saw %v, want EOF or reset", err)
	}
	if d := at.Sub(begin); d < 300*time.Millisecond || d > 800*time.Millisecond {
		t.Fatalf("link closed %v after the third request, want request_timeout (300ms) plus slack", d)
	}
	// Every link to the endpoint closes, not just the one that tripped.
	if err, _ := waitClosed(t, other, 5*time.Second); !isCloseSignal(err) {
		t.Fatalf("second link saw %v", err)
	}
	for range 2 {
		if s := h.linkEnd(5 * time.Second); s.Reason != CloseUnanswered {
			t.Fatalf("reason %q, want unanswered", s.Reason)
		}
	}
	ep := h.waitState("excluded", 5*time.Second)
	if ep.Reason != string(CloseUnanswered) {
		t.Fatalf("excluded for %q, want unanswered", ep.Reason)
	}
	expectRefused(t, h.addr)
	m := h.m.ForListener("test")
	if got := testutil.ToFloat64(m.UnansweredTimeouts); got != 3 {
		t.Errorf("unanswered_timeouts_total = %v, want 3", got)
	}
	if got := testutil.ToFloat64(m.EndpointSuspect); got != 1 {
		t.Errorf("endpoint_suspect_total = %v, want 1", got)
	}
}

// A late answer to a request that already timed out resets the count:
// the next timeouts start over.
func TestLateAnswerResetsCount(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	peer.SetAnswer(func(n int64) (time.Duration, bool) {
		if n == 1 {
			return 400 * time.Millisecond, true // late: after its 200ms timeout
		}
		return 0, false
	})
	h := start(t, peer.Addr(), framed(200*time.Millisecond, 3, nil))
	c := h.dial()
	sendFrame(t, c, "late")
	h.waitUnanswered(1, 5*time.Second)
	if got := h.endpoint().ConsecutiveUnanswered; got != 1 {
		t.Fatalf("consecutive = %d after the first timeout, want 1", got)
	}
	if got := readFrame(t, c, time.Second); got != "late" {
		t.Fatalf("late answer %q", got)
	}
	if got := h.endpoint().ConsecutiveUnanswered; got != 0 {
		t.Fatalf("consecutive = %d after the late answer, want 0", got)
	}
	sendFrame(t, c, "q2")
	sendFrame(t, c, "q3")
	h.waitUnanswered(2, 5*time.Second)
	// Without the reset this would be 3 and the endpoint excluded.
	if ep := h.endpoint(); ep.State != "healthy" || ep.ConsecutiveUnanswered != 2 {
		t.Fatalf("after the reset and 2 more timeouts: %+v, want healthy with 2", ep)
	}
	sendFrame(t, c, "q4")
	h.waitState("excluded", 5*time.Second)
}

// A slow server that still answers never reaches the threshold: every
// request is judged unanswered (its answer comes only after its 200ms
// deadline), and every answer starts the count over, so the count never
// passes 1 (threshold 2). The client has one request in flight at a time,
// as many clients do: the proxy records an answer before it passes it on,
// so the next request goes out after the reset. The server answers each
// request once the proxy has judged it, and 150ms after that: late
// whatever the machine's load, so the counts are the proxy's own.
func TestSlowServerThatAnswersNeverTrips(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	h := start(t, peer.Addr(), framed(200*time.Millisecond, 2, nil))
	m := h.m.ForListener("test")
	peer.SetAnswer(func(n int64) (time.Duration, bool) {
		// Runs in the peer's read loop: the next request is read after.
		for deadline := time.Now().Add(10 * time.Second); testutil.ToFloat64(m.UnansweredTimeouts) < float64(n); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				break // the test fails on the count below
			}
		}
		return 150 * time.Millisecond, true
	})
	c := h.dial()
	const n = 8
	for i := range n {
		sendFrame(t, c, string(rune('a'+i)))
		if got := readFrame(t, c, 15*time.Second); got != string(rune('a'+i)) {
			t.Fatalf("answer %d: %q", i, got)
		}
		if got := h.endpoint().ConsecutiveUnanswered; got != 0 {
			t.Fatalf("consecutive = %d after answer %d reached the client, want 0 (an answer starts the count over)", got, i)
		}
	}
	ep := h.endpoint()
	if ep.State != "healthy" {
		t.Fatalf("slow but answering server was %s (%s)", ep.State, ep.Reason)
	}
	if got := testutil.ToFloat64(m.UnansweredTimeouts); got != n {
		t.Fatalf("unanswered_timeouts_total = %v, want %d: each request judged once, before its answer", got, n)
	}
	if got := testutil.ToFloat64(m.EndpointSuspect); got != 0 {
		t.Fatalf("endpoint_suspect_total = %v, want 0", got)
	}
}

// The server comes back: a probe over a fresh connection readmits it,
// links opened before the exclusion are gone, a link opened during it
// (on_excluded: allow) reaches the process the probe found healthy and
// stays, a new link works.
func TestProbeReadmitsAndEvictsOldLinks(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	addr := peer.Addr()
	peer.SetAnswer(func(int64) (time.Duration, bool) { return 0, false })
	h := start(t, addr, framed(200*time.Millisecond, 2, func(s *policy.Settings) {
		s.Detector.InitialDelay = policy.Duration(300 * time.Millisecond)
		s.Detector.BackoffFactor = 1
		s.OnExcluded = policy.OnExcludedAllow // so a link can be opened while excluded
	}))
	c := h.dial()
	sendFrame(t, c, "q1")
	sendFrame(t, c, "q2")
	// Both requests reached the server (so the proxy, which records a
	// request before passing it on, is tracking them); then the server
	// dies: probes are refused until it is back.
	for deadline := time.Now().Add(5 * time.Second); peer.Requests() < 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the server received %d of 2 requests within 5s", peer.Requests())
		}
	}
	peer.Close()
	h.waitState("excluded", 2*time.Second)
	waitClosed(t, c, 5*time.Second)
	h.linkEnd(5 * time.Second)

	// Probes are refused while the server is down (each one 300ms after
	// the last); the endpoint stays excluded.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		ep := h.endpoint()
		if ep.State != "excluded" {
			t.Fatalf("dead server: %+v, want excluded", ep)
		}
		if ep.FailedProbes >= 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dead server: %+v, want failed probes within 5s", ep)
		}
	}

	// The server is back on the same address; the next probe readmits it.
	back := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{Addr: addr})
	during := h.dial() // opened while still excluded: kept at readmission
	roundTripFrame(t, during, "while excluded")
	ep := h.waitState("healthy", 2*time.Second)
	t.Logf("readmitted after %d failed probes", ep.FailedProbes)
	roundTripFrame(t, during, "after readmission, on the link opened during the exclusion")
	if got := testutil.ToFloat64(h.m.ForListener("test").Evictions(metrics.EvictReadmitted)); got != 0 {
		t.Errorf("%v links evicted at readmission, want none (the one open was opened during the exclusion)", got)
	}
	fresh := h.dial()
	roundTripFrame(t, fresh, "after readmission")
	// The probe's verdict is counted just after the state it sets (the
	// probe goroutine's OnProbe): wait for it, then for no more.
	probesOK := func() float64 { return testutil.ToFloat64(h.m.ForListener("test").ProbesOK) }
	waitFor(t, 5*time.Second, "the readmitting probe counted", func() bool { return probesOK() >= 1 })
	if got := probesOK(); got != 1 {
		t.Errorf("probes_total{result=ok} = %v, want 1", got)
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").ProbesFailed); got < 1 {
		t.Errorf("probes_total{result=fail} = %v, want at least 1", got)
	}
	_ = back
}

func roundTripFrame(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	sendFrame(t, c, msg)
	if got := readFrame(t, c, 2*time.Second); got != msg {
		t.Fatalf("answer %q, want %q", got, msg)
	}
}

// A frame the proxy cannot follow (longer than max_frame_length, or a
// negative length) stops tracking that link, and only that link: its
// bytes are still forwarded untouched, nothing is held against the
// server, and untracked_links_total says why.
func TestUnfollowableFramesAreForwardedUntracked(t *testing.T) {
	for _, tc := range []struct {
		name  string
		bytes []byte
	}{
		{"oversized", []byte{0, 0x20, 0, 0, 'x'}},    // 2 MiB > max_frame_length 1 MiB
		{"negative", []byte{0xff, 0xff, 0xff, 0xff}}, // -1 as Pinot's (Java) int
	} {
		t.Run(tc.name, func(t *testing.T) {
			peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
			h := start(t, peer.Addr(), framed(time.Second, 3, nil))
			good, odd := h.dial(), h.dial()
			roundTripFrame(t, good, "before")
			roundTrip(t, odd, tc.bytes)
			roundTrip(t, odd, []byte("and whatever follows"))
			if got := testutil.ToFloat64(h.m.ForListener("test").Untracked(metrics.UntrackedLimit)); got != 1 {
				t.Fatalf("untracked_links_total{reason=limit} = %v, want 1", got)
			}
			roundTripFrame(t, good, "after")
			if ep := h.endpoint(); ep.State != "healthy" || h.p.ActiveLinks() != 2 {
				t.Fatalf("endpoint %s with %d links after a client's odd frame, want healthy with both", ep.State, h.p.ActiveLinks())
			}
		})
	}
}

// A client that ends its stream inside a frame closes only its own link,
// with reason bad_frame, and is not held against the server.
func TestTruncatedFrameClosesOnlyItsLink(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	h := start(t, peer.Addr(), framed(time.Second, 3, nil))
	good, bad := h.dial(), h.dial()
	roundTripFrame(t, good, "before")
	if _, err := bad.Write([]byte{0, 0, 0, 100, 'p', 'a', 'r', 't'}); err != nil {
		t.Fatal(err)
	}
	_ = bad.CloseWrite()
	if err, _ := waitClosed(t, bad, 2*time.Second); !isCloseSignal(err) {
		t.Fatalf("bad link saw %v", err)
	}
	if s := h.linkEnd(5 * time.Second); s.Reason != CloseBadFrame {
		t.Fatalf("reason %q (%v), want bad_frame", s.Reason, s.Err)
	}
	roundTripFrame(t, good, "after")
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s after a client's bad frame, want healthy", ep.State)
	}
}

// Operator disable refuses new links and evicts old ones; enable is a
// readmission.
func TestOperatorDisableEnableEvict(t *testing.T) {
	peer, h, c := startEcho(t, nil, "x")
	if _, err := h.p.Disable("127.0.0.1:1"); !errors.Is(err, ErrUnknownEndpoint) {
		t.Fatalf("disable of an unknown endpoint: %v", err)
	}
	changed, err := h.p.Disable(peer.Addr())
	if err != nil || !changed {
		t.Fatalf("disable: %v, %v", changed, err)
	}
	if err, _ := waitClosed(t, c, 5*time.Second); !isCloseSignal(err) {
		t.Fatalf("link to a disabled endpoint saw %v", err)
	}
	h.waitState("disabled", 5*time.Second)
	expectRefused(t, h.addr)
	if changed, _ := h.p.Enable(peer.Addr()); !changed {
		t.Fatal("enable changed nothing")
	}
	c2 := h.dialWhenReadmitted(2 * time.Second)
	roundTrip(t, c2, []byte("y"))
	if n, err := h.p.Evict(peer.Addr()); err != nil || n != 1 {
		t.Fatalf("evict: %d, %v; want 1 link closed", n, err)
	}
	if err, _ := waitClosed(t, c2, 5*time.Second); !isCloseSignal(err) {
		t.Fatalf("evicted link saw %v", err)
	}
}

// Clients that close a link on their own (shorter) timeout must not hide
// a dead server: requests of links that ended are still judged.
func TestUnansweredCountsAfterClientCloses(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	peer.SetAnswer(func(int64) (time.Duration, bool) { return 0, false })
	h := start(t, peer.Addr(), framed(time.Second, 3, nil))
	for i := range 3 {
		c := h.dial()
		sendFrame(t, c, "q")
		// The client gives up first: once the request has reached the
		// server (so the proxy tracks it), well within its 1s deadline.
		// (A fixed 100ms sleep that ran past a 300ms deadline on a slow
		// machine had the link judged while open.)
		waitFor(t, 5*time.Second, "the request at the server", func() bool { return peer.Requests() >= int64(i+1) })
		_ = c.Close()
		if s := h.linkEnd(5 * time.Second); s.Reason != CloseClientClosed && s.Reason != CloseClientError {
			t.Fatalf("link %d ended with %q", i, s.Reason)
		}
	}
	ep := h.waitState("excluded", 5*time.Second)
	if ep.Reason != string(CloseUnanswered) {
		t.Fatalf("excluded for %q, want unanswered", ep.Reason)
	}
}

// An endpoint in endpoints.disabled is refused from the first connect.
func TestDisabledEndpointRefusedFromStart(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	cfg := policy.DefaultConfig()
	cfg.Endpoints.Disabled = []string{peer.Addr()}
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: cfg.Defaults}}
	p := New(cfg, Options{})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	addr := p.Addr("test").String()
	expectRefused(t, addr)
	if peer.Accepted() != 0 {
		t.Fatalf("the disabled upstream was dialled %d times", peer.Accepted())
	}
	if changed, _ := p.Enable(peer.Addr()); !changed {
		t.Fatal("enable changed nothing")
	}
	h := &harness{t: t, p: p, addr: addr}
	roundTrip(t, h.dialWhenReadmitted(2*time.Second), []byte("enabled"))
}

// Dials cut short by shutdown are not held against a healthy upstream.
func TestShutdownDuringDialsDoesNotExclude(t *testing.T) {
	addr := blackholeListener(t)
	h := start(t, addr, func(s *policy.Settings) { s.ConnectTimeout = policy.Duration(5 * time.Second) })
	for range 20 {
		h.dial()
	}
	deadline := time.Now().Add(2 * time.Second)
	for h.p.ActiveLinks() < 20 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_ = h.p.Shutdown(ctx)
	for range 20 {
		if s := h.linkEnd(5 * time.Second); s.Reason != CloseShutdown {
			t.Fatalf("reason %q, want shutdown", s.Reason)
		}
	}
	if st := h.endpoint().State; st != "healthy" {
		t.Fatalf("endpoint %s after shutdown, want healthy", st)
	}
}

// write_timeout is about progress: a peer that reads slowly but steadily
// is not a stalled one.
func TestSlowReaderIsNotAWriteTimeout(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.HashOnEOF, faultpeer.Options{Buffer: 4096})
	peer.SetReadDelay(0, 20*time.Millisecond) // about 400 KB/s
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(300 * time.Millisecond)
		s.TCPUserTimeout = 0
	})
	c := h.dial()
	data := bytes.Repeat([]byte("slow"), 128<<10) // 512 KiB: over 1 s to drain
	want := sha256.Sum256(data)
	if _, err := c.Write(data); err != nil {
		t.Fatal(err)
	}
	_ = c.CloseWrite()
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil || !bytes.Equal(got, want[:]) {
		t.Fatalf("slow reader got a cut stream: %x, %v", got, err)
	}
	if s := h.linkEnd(5 * time.Second); s.Reason != CloseClientClosed {
		t.Fatalf("reason %q, want client_closed", s.Reason)
	}
}

// The readmission's fresh start does not wait for the proxy to apply the
// readmission's event, which comes a moment after the detector's state
// (on a busy machine, a while): requests sent before the readmission and
// judged in between are no verdict against the endpoint readmitted. The
// test holds the readmission's event until the requests of a link that
// ended before the exclusion (b's, the endpoint's to judge) have been
// counted, as a machine that runs the delivery late does. Before, they
// made the readmitted endpoint suspect, and it was excluded again. Its
// twin: requests sent after the readmission, unanswered, still exclude it.
func TestReadmissionAppliedLateIsStillAFreshStart(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	peer.SetAnswer(func(int64) (time.Duration, bool) { return 0, false })
	h := start(t, peer.Addr(), framed(time.Second, 2, func(s *policy.Settings) {
		s.Detector.InitialDelay = policy.Duration(100 * time.Millisecond)
	}))
	unanswered := func() float64 { return testutil.ToFloat64(h.m.ForListener("test").UnansweredTimeouts) }
	premise := make(chan error, 1)
	hold := func(ev health.Event) {
		if ev.To != health.Healthy {
			return
		}
		// The readmission, held back until b's two requests are counted.
		if n := unanswered(); n != 2 {
			premise <- fmt.Errorf("%v requests counted when the readmission came, want a's 2 (b's not yet due)", n)
			return
		}
		for deadline := time.Now().Add(10 * time.Second); unanswered() < 4; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				premise <- fmt.Errorf("b's requests not counted within 10s of the readmission")
				return
			}
		}
		time.Sleep(100 * time.Millisecond) // and their verdict reported
		premise <- nil
	}
	testHookHealthEvent.Store(&hold)
	t.Cleanup(func() { testHookHealthEvent.Store(nil) })

	a, b := h.dial(), h.dial()
	sendFrame(t, a, "a1")
	sendFrame(t, a, "a2")
	waitFor(t, 5*time.Second, "a's requests at the server", func() bool { return peer.Requests() >= 2 })
	time.Sleep(700 * time.Millisecond) // b's fall due 700 ms after a's, 600 ms after the readmission
	sendFrame(t, b, "b1")
	sendFrame(t, b, "b2")
	waitFor(t, 5*time.Second, "b's requests at the server", func() bool { return peer.Requests() >= 4 })
	_ = b.Close() // b's requests are judged by the endpoint, after the link
	h.waitReadmittedOf(peer.Addr(), 5*time.Second)
	select {
	case err := <-premise:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the readmission's event never came")
	}
	if st, _ := h.p.det.State(peer.Addr()); st != health.Healthy {
		t.Fatalf("%s after requests sent before the readmission were judged, want healthy", st)
	}
	testHookHealthEvent.Store(nil)

	// The twin: the readmitted server answers nothing either; requests
	// sent to it after the readmission exclude it at their deadline.
	c := h.dialWhenReadmitted(5 * time.Second) // the listener resumes as the event is applied
	sendFrame(t, c, "c1")
	sendFrame(t, c, "c2")
	ep := h.waitState("excluded", 5*time.Second)
	if ep.Reason != string(CloseUnanswered) {
		t.Fatalf("excluded for %s, want unanswered", ep.Reason)
	}
}

// A readmission is a fresh start: requests sent to the previous
// incarnation (on links that ended before their judgement) do not exclude
// the endpoint again before the readmitted server could answer anything.
func TestReadmissionIsAFreshStart(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	peer.SetAnswer(func(int64) (time.Duration, bool) { return 0, false })
	h := start(t, peer.Addr(), framed(300*time.Millisecond, 2, func(s *policy.Settings) {
		s.Detector.InitialDelay = policy.Duration(100 * time.Millisecond)
	}))
	a := h.dial()
	sendFrame(t, a, "a1")
	sendFrame(t, a, "a2")
	time.Sleep(150 * time.Millisecond)
	b := h.dial()
	sendFrame(t, b, "b1")
	sendFrame(t, b, "b2")
	time.Sleep(10 * time.Millisecond)
	_ = b.Close()                                  // b's requests are judged by the endpoint, after the link
	h.waitReadmittedOf(peer.Addr(), 2*time.Second) // excluded, then the connect probe readmits
	// b's requests fall due now; they belong to the previous incarnation.
	deadline := time.Now().Add(500 * time.Millisecond)
	for time.Now().Before(deadline) {
		if ep := h.endpoint(); ep.State != "healthy" {
			t.Fatalf("re-excluded %s after readmission, for requests sent before it", ep.Reason)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Requests sent after a readmission, unanswered, exclude the endpoint at
// their deadline even when the count they complete also holds a request
// sent before it (on a link opened during the exclusion, on_excluded:
// allow, which the readmission keeps: it reaches the very process the
// probe readmitted). Before, the whole count was no verdict (its silence
// began before the readmission) and went with it: d's two requests, the
// threshold on their own, excluded nothing, and d's client waited on a
// hung server with no verdict at all.
func TestPostReadmissionRequestsNotLostToAnEarlierOne(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	peer.SetAnswer(func(int64) (time.Duration, bool) { return 0, false })
	h := start(t, peer.Addr(), framed(2*time.Second, 2, func(s *policy.Settings) {
		s.Detector.InitialDelay = policy.Duration(time.Second)
		s.OnExcluded = policy.OnExcludedAllow // c, opened while excluded
	}))
	a := h.dial()
	sendFrame(t, a, "a1")
	sendFrame(t, a, "a2")
	h.waitState("excluded", 10*time.Second)
	c := h.dial()
	sendFrame(t, c, "c1") // due a second after the readmission
	waitFor(t, 5*time.Second, "c1 at the server", func() bool { return peer.Requests() >= 3 })
	if st := h.endpoint().State; st != "excluded" {
		t.Fatalf("premise: %s when c1 reached the server, want still excluded (initial_delay 1s)", st)
	}
	h.waitReadmittedOf(peer.Addr(), 10*time.Second)
	d := h.dial()
	sendFrame(t, d, "d1")
	sendFrame(t, d, "d2")
	waitFor(t, 5*time.Second, "d's requests at the server", func() bool { return peer.Requests() >= 5 })
	// c1 is counted (1), then d1 and d2 (3, past the threshold of 2).
	ep := h.waitState("excluded", 10*time.Second)
	if ep.Reason != string(CloseUnanswered) {
		t.Fatalf("excluded for %s, want unanswered", ep.Reason)
	}
}
