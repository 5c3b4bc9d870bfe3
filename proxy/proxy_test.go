package proxy

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	lptestutil "github.com/livenessproxy/livenessproxy/internal/testutil"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// harness is one proxy with one listener in front of upstream.
type harness struct {
	t     *testing.T
	p     *Proxy
	m     *metrics.Metrics
	ended chan LinkStats
	addr  string
	// passed keeps the ends linkEndOf passed over, by client address:
	// two links that end together tell their ends in either order.
	passed map[string]LinkStats
}

func start(t *testing.T, upstream string, tune func(*policy.Settings)) *harness {
	t.Helper()
	return startParking(t, upstream, policy.DefaultParkIdleAfter.D(), tune)
}

// startEcho starts a proxy (tuned by tune) in front of an echo peer and
// returns both with one client connection, on which hello made a round
// trip.
func startEcho(t *testing.T, tune func(*policy.Settings), hello string) (*faultpeer.Server, *harness, *net.TCPConn) {
	t.Helper()
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	h := start(t, peer.Addr(), tune)
	c := h.dial()
	roundTrip(t, c, []byte(hello))
	return peer, h, c
}

// startConfig starts a proxy from cfg with opts and connects to its
// listener "test"; t.Cleanup closes both.
func startConfig(t *testing.T, cfg policy.Config, opts Options) (*Proxy, *net.TCPConn) {
	t.Helper()
	p := New(cfg, opts)
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	c, err := net.Dial("tcp", p.Addr("test").String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return p, c.(*net.TCPConn)
}

func (h *harness) dial() *net.TCPConn {
	h.t.Helper()
	c, err := net.Dial("tcp", h.addr)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { _ = c.Close() })
	return c.(*net.TCPConn)
}

// dialWhenReadmitted connects once the listener accepts again.
func (h *harness) dialWhenReadmitted(within time.Duration) *net.TCPConn {
	h.t.Helper()
	deadline := time.Now().Add(within)
	for {
		c, err := net.Dial("tcp", h.addr)
		if err == nil {
			h.t.Cleanup(func() { _ = c.Close() })
			return c.(*net.TCPConn)
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("listener not accepting within %v: %v", within, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// linkEnd waits for the next link to end.
func (h *harness) linkEnd(within time.Duration) LinkStats {
	h.t.Helper()
	select {
	case s := <-h.ended:
		return s
	case <-time.After(within):
		h.t.Fatalf("no link ended within %v", within)
		return LinkStats{}
	}
}

// story says, for a failure message, how the links that ended so far
// ended (without waiting), the listener's write and unanswered timeouts
// and stale frames, and each endpoint's state: what a test that waited in vain for a state
// needs to tell the proxy's doing from its own premise.
func (h *harness) story() string {
	var b strings.Builder
	for more := true; more; {
		select {
		case s := <-h.ended:
			fmt.Fprintf(&b, "link ended %q (%v) after %v: %d bytes up, %d down, at most %d queued; ",
				s.Reason, s.Err, s.Duration, s.BytesUp, s.BytesDown, s.MaxQueued)
		default:
			more = false
		}
	}
	if b.Len() == 0 {
		b.WriteString("no link ended; ")
	}
	m := h.m.ForListener("test")
	fmt.Fprintf(&b, "write_timeouts_total %v, unanswered_timeouts_total %v, stale_frames_dropped_total %v",
		testutil.ToFloat64(m.WriteTimeouts), testutil.ToFloat64(m.UnansweredTimeouts), testutil.ToFloat64(m.StaleFramesDropped))
	for _, ep := range h.p.Endpoints() {
		fmt.Fprintf(&b, "; endpoint %s %s (%s) since %v, evidence %q",
			ep.Endpoint, ep.State, ep.Reason, ep.Since.Format("15:04:05.000"), ep.Evidence)
	}
	return b.String()
}

// linkEndOf waits for the link of client c to end, passing over the ends of
// other links (such as probe dials the listener accepted before it closed).
// An end passed over is kept for a later linkEndOf: links closed by one
// event (an eviction, and the end that caused it) tell their ends in the
// order their goroutines happen to run.
func (h *harness) linkEndOf(c net.Conn, within time.Duration) LinkStats {
	h.t.Helper()
	if s, ok := h.passed[c.LocalAddr().String()]; ok {
		delete(h.passed, c.LocalAddr().String())
		return s
	}
	deadline := time.After(within)
	for {
		select {
		case s := <-h.ended:
			if s.Client == c.LocalAddr().String() {
				return s
			}
			if h.passed == nil {
				h.passed = make(map[string]LinkStats)
			}
			h.passed[s.Client] = s
		case <-deadline:
			h.t.Fatalf("link of %v did not end within %v", c.LocalAddr(), within)
			return LinkStats{}
		}
	}
}

// waitClosed reads from c until it fails and returns the error and when.
func waitClosed(t *testing.T, c net.Conn, within time.Duration) (error, time.Time) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(within))
	buf := make([]byte, 64<<10)
	for {
		_, err := c.Read(buf)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("client side still open after %v", within)
			}
			return err, time.Now()
		}
	}
}

func isCloseSignal(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)
}

// writeAsync writes n bytes in chunks until done or an error, in its own goroutine.
func writeAsync(c net.Conn, n, chunk int) <-chan int {
	done := make(chan int, 1)
	go func() {
		buf := make([]byte, chunk)
		sent := 0
		for sent < n {
			w, err := c.Write(buf)
			sent += w
			if err != nil {
				break
			}
		}
		done <- sent
	}()
	return done
}

// A peer that accepts and never reads, 4 KiB buffers: the first write the
// upstream kernel does not take within write_timeout closes the link,
// client side included, and excludes the endpoint: connects are refused
// until it is readmitted, and the next client gets a fresh upstream. The
// probe (http, to a closed port) fails, so the exclusion lasts until the
// test's enable, however late this goroutine runs.
func TestWriteTimeoutClosesStalledLink(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	_, closedPort, _ := net.SplitHostPort(lptestutil.ClosedAddr(t))
	httpPort, _ := strconv.Atoi(closedPort)
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(500 * time.Millisecond)
		s.TCPUserTimeout = 0
		s.Detector.Probe = policy.ProbeKindHTTP
		s.Detector.HTTP = policy.ProbeHTTP{Port: httpPort, Path: "/health"}
	})
	c := h.dial()
	begin := time.Now()
	sent := writeAsync(c, 4<<20, 64<<10)
	err, at := waitClosed(t, c, 5*time.Second)
	elapsed := at.Sub(begin)
	if !isCloseSignal(err) {
		t.Fatalf("client saw %v, want EOF or reset", err)
	}
	if elapsed < 500*time.Millisecond || elapsed > 1500*time.Millisecond {
		t.Fatalf("link closed after %v, want write_timeout (500ms) plus a small slack", elapsed)
	}
	s := h.linkEnd(5 * time.Second)
	if s.Reason != CloseWriteTimeout {
		t.Fatalf("reason %q, want %q (err %v)", s.Reason, CloseWriteTimeout, s.Err)
	}
	<-sent
	if got := testutil.ToFloat64(h.m.ForListener("test").WriteTimeouts); got != 1 {
		t.Fatalf("write_timeouts_total = %v, want 1", got)
	}
	t.Logf("4 MiB into a non-reading peer: client saw %v after %v", err, elapsed)

	// The write timeout excluded the endpoint: connects are refused.
	if ep := h.endpoint(); ep.State != "excluded" || ep.Reason != string(CloseWriteTimeout) {
		t.Fatalf("endpoint %s (%s), want excluded for write_timeout", ep.State, ep.Reason)
	}
	expectRefusedSoon(t, h.addr)
	peer.Set(faultpeer.Echo)
	if _, err := h.p.Enable(peer.Addr()); err != nil {
		t.Fatal(err)
	}
	c2 := h.dialWhenReadmitted(3 * time.Second)
	roundTrip(t, c2, []byte("after the stall"))
	// The stalled link and the fresh link; the probes went to the http port.
	if peer.Accepted() != 2 {
		t.Fatalf("peer accepted %d connections, want 2 (stalled link, fresh link)", peer.Accepted())
	}
}

func roundTrip(t *testing.T, c net.Conn, msg []byte) {
	t.Helper()
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Time{})
	if !bytes.Equal(got, msg) {
		t.Fatalf("echo %q, want %q", got, msg)
	}
}

// With a 64 KiB high watermark, reject and no write timeout, a stalled
// peer makes the link fail at once, and the queue never held more than the
// watermark.
func TestWatermarkRejectBoundsQueue(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	const high = 64 << 10
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.WriteTimeout = 0
		s.TCPUserTimeout = 0
		s.WriteBuffer = policy.WriteBuffer{HighWaterMark: high, LowWaterMark: 32 << 10, OnOverflow: policy.OverflowReject}
	})
	c := h.dial()
	begin := time.Now()
	// The kernel buffers of the client and of the proxy's upstream socket
	// absorb several hundred KiB before the proxy's own queue grows.
	sent := writeAsync(c, 16<<20, 16<<10)
	err, at := waitClosed(t, c, 5*time.Second)
	if !isCloseSignal(err) {
		t.Fatalf("client saw %v, want EOF or reset", err)
	}
	s := h.linkEnd(5 * time.Second)
	if s.Reason != CloseWatermark {
		t.Fatalf("reason %q, want %q", s.Reason, CloseWatermark)
	}
	if s.MaxQueued > high {
		t.Fatalf("queue reached %d bytes, above the %d high watermark", s.MaxQueued, high)
	}
	// The rejection itself shows the queue was in use: a read is at most
	// 64 KiB (the high watermark here), so it overflows only onto bytes
	// already queued. How many depends on how the client's writes were cut
	// into reads, which the test does not control.
	if s.MaxQueued == 0 {
		t.Fatalf("rejected with nothing queued: the stall never reached the queue, the test proves nothing")
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").WatermarkRejections); got != 1 {
		t.Fatalf("watermark_rejections_total = %v, want 1", got)
	}
	n := <-sent
	t.Logf("rejected %v after start; client wrote %d bytes; proxy read %d, queue peak %d", at.Sub(begin), n, s.BytesUp, s.MaxQueued)
	if at.Sub(begin) > time.Second {
		t.Fatalf("rejection took %v, want at once", at.Sub(begin))
	}
}

// backpressure stops reading the client above the high watermark and
// resumes below the low one; nothing is lost or reordered.
func TestBackpressureLosesNothing(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.HashOnEOF, faultpeer.Options{Buffer: 4096})
	peer.SetReadDelay(time.Second, 100*time.Microsecond)
	const high, low = 64 << 10, 32 << 10
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(5 * time.Second)
		s.WriteBuffer = policy.WriteBuffer{HighWaterMark: high, LowWaterMark: low, OnOverflow: policy.OverflowBackpressure}
	})
	c := h.dial()
	data := make([]byte, 12<<20)
	_, _ = rand.Read(data)
	want := sha256.Sum256(data)
	if _, err := c.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want[:]) {
		t.Fatalf("upstream hashed something else: bytes lost or reordered")
	}
	s := h.linkEnd(5 * time.Second)
	if s.Reason != CloseClientClosed && s.Reason != CloseUpstreamClosed {
		t.Fatalf("reason %q, want a clean close", s.Reason)
	}
	if s.MaxQueued > high {
		t.Fatalf("queue reached %d, above high watermark %d", s.MaxQueued, high)
	}
	if s.MaxQueued <= low {
		t.Fatalf("queue peaked at %d, never above the low watermark: backpressure was not exercised", s.MaxQueued)
	}
	if s.BytesUp != int64(len(data)) {
		t.Fatalf("proxied %d bytes up, want %d", s.BytesUp, len(data))
	}
}

// A request followed by CloseWrite still gets its full response.
func TestHalfCloseCarriesResponse(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.HashOnEOF, faultpeer.Options{})
	h := start(t, peer.Addr(), nil)
	c := h.dial()
	req := bytes.Repeat([]byte("request "), 10000)
	want := sha256.Sum256(req)
	if _, err := c.Write(req); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want[:]) {
		t.Fatalf("response %x, want %x", got, want)
	}
	if s := h.linkEnd(2 * time.Second); s.Reason != CloseClientClosed {
		t.Fatalf("reason %q, want %q", s.Reason, CloseClientClosed)
	}
}

// After a FIN, the other direction has half_close_timeout to finish.
func TestHalfCloseTimeout(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.HoldAfterEOF, faultpeer.Options{})
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.HalfCloseTimeout = policy.Duration(300 * time.Millisecond)
	})
	c := h.dial()
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	begin := time.Now()
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_, at := waitClosed(t, c, 3*time.Second)
	if d := at.Sub(begin); d < 250*time.Millisecond || d > 1500*time.Millisecond {
		t.Fatalf("closed after %v, want about the 300ms half_close_timeout", d)
	}
	if s := h.linkEnd(5 * time.Second); s.Reason != CloseHalfCloseTimeout {
		t.Fatalf("reason %q, want %q", s.Reason, CloseHalfCloseTimeout)
	}
}

// An upstream reset or FIN reaches the client promptly, with the right reason.
func TestUpstreamEndReachesClient(t *testing.T) {
	for _, tc := range []struct {
		b      faultpeer.Behavior
		reason string
	}{
		{faultpeer.Reset, string(CloseUpstreamError)},
		{faultpeer.CloseAtOnce, string(CloseUpstreamClosed)},
	} {
		t.Run(tc.reason, func(t *testing.T) {
			peer := faultpeer.New(t, tc.b, faultpeer.Options{})
			h := start(t, peer.Addr(), func(s *policy.Settings) { s.HalfCloseTimeout = policy.Duration(200 * time.Millisecond) })
			begin := time.Now()
			// The upstream's reset travels to the client: it can arrive
			// before the client's own connect completes.
			c, err := net.Dial("tcp", h.addr)
			at := time.Now()
			if err == nil {
				err, at = waitClosed(t, c, 3*time.Second)
				_ = c.Close()
			}
			if !isCloseSignal(err) {
				t.Fatalf("client saw %v", err)
			}
			if d := at.Sub(begin); d > 500*time.Millisecond {
				t.Fatalf("client saw the upstream end after %v", d)
			}
			s := h.linkEnd(2 * time.Second)
			// A reset at accept can reach the proxy before its connect
			// completes: then the dial itself failed with the reset.
			resetAtDial := tc.b == faultpeer.Reset && s.Reason == CloseDialError && errors.Is(s.Err, syscall.ECONNRESET)
			if string(s.Reason) != tc.reason && !resetAtDial {
				t.Fatalf("reason %q, want %q (err %v)", s.Reason, tc.reason, s.Err)
			}
		})
	}
}

// A refused dial resets the client and counts a dial error.
func TestDialErrorResetsClient(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	_ = ln.Close()
	h := start(t, dead, nil)
	// The reset may already be there when connect returns.
	c, err := net.Dial("tcp", h.addr)
	if err == nil {
		defer c.Close()
		err, _ = waitClosed(t, c, 3*time.Second)
	}
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("client saw %v, want a reset", err)
	}
	if s := h.linkEnd(5 * time.Second); s.Reason != CloseDialError {
		t.Fatalf("reason %q, want %q", s.Reason, CloseDialError)
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").DialErrors); got != 1 {
		t.Fatalf("dial_errors_total = %v, want 1", got)
	}
}

// blackholeListener returns a loopback address whose SYNs are dropped: a
// listening socket with backlog 0 whose one queue slot is taken.
func blackholeListener(t *testing.T) string {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Close(fd) })
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, _ := unix.Getsockname(fd)
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*unix.SockaddrInet4).Port))
	// Fill the accept queue; later SYNs are dropped.
	for range 2 {
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			t.Cleanup(func() { _ = c.Close() })
		}
	}
	return addr
}

// Dials happen in the link's goroutine: two clients of a black-holed
// upstream time out together after connect_timeout, not one after the other.
func TestBlackholedDialDoesNotStallAccept(t *testing.T) {
	addr := blackholeListener(t)
	h := start(t, addr, func(s *policy.Settings) {
		s.ConnectTimeout = policy.Duration(700 * time.Millisecond)
		s.ConnectAttempts = 1
	})
	begin := time.Now()
	c1, c2 := h.dial(), h.dial()
	_, at1 := waitClosed(t, c1, 3*time.Second)
	_, at2 := waitClosed(t, c2, 3*time.Second)
	for _, at := range []time.Time{at1, at2} {
		if d := at.Sub(begin); d < 600*time.Millisecond || d > 1300*time.Millisecond {
			t.Fatalf("client reset after %v, want about connect_timeout (700ms) for both", d)
		}
	}
	// The first dial error excludes the endpoint, which may evict the
	// other link still dialling.
	for range 2 {
		if s := h.linkEnd(5 * time.Second); s.Reason != CloseDialError && s.Reason != CloseEvicted {
			t.Fatalf("reason %q, want dial_error or evicted", s.Reason)
		}
	}
}

// Shutdown stops accepting, lets a link finish within the drain timeout,
// and cuts those still open when it runs out.
func TestShutdownDrainsThenCuts(t *testing.T) {
	_, h, c := startEcho(t, nil, "open")

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	begin := time.Now()
	done := make(chan error, 1)
	go func() { done <- h.p.Shutdown(ctx) }()

	// New connections are refused once shutdown has begun.
	deadline := time.Now().Add(2 * time.Second)
	for {
		nc, err := net.DialTimeout("tcp", h.addr, 200*time.Millisecond)
		if err != nil {
			break
		}
		_ = nc.Close()
		if time.Now().After(deadline) {
			t.Fatal("listener still accepting during shutdown")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The open link still works during the drain.
	roundTrip(t, c, []byte("draining"))
	if err := <-done; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown = %v, want deadline exceeded (a link was cut)", err)
	}
	if d := time.Since(begin); d < 250*time.Millisecond {
		t.Fatalf("shutdown returned after %v, before the drain timeout", d)
	}
	// A probe dial above may have been accepted just before the listener
	// closed; its link ends client_closed and is passed over.
	if s := h.linkEndOf(c, 5*time.Second); s.Reason != CloseShutdown {
		t.Fatalf("reason %q, want shutdown", s.Reason)
	}
}

// bytes_total counts live links at scrape time and keeps ended links' bytes.
func TestBytesTotal(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	h := start(t, peer.Addr(), nil)
	c := h.dial()
	msg := bytes.Repeat([]byte("b"), 1000)
	roundTrip(t, c, msg)
	want := "\nlivenessproxy_bytes_total{direction=\"request\",listener=\"test\"} 1000\n" +
		"livenessproxy_bytes_total{direction=\"response\",listener=\"test\"} 1000\n"
	if err := testutil.GatherAndCompare(h.m.Registry, strings.NewReader(
		"# HELP livenessproxy_bytes_total Bytes proxied, request (client→upstream) and response; computed at scrape time from live links, so the data path never touches a shared metric.\n"+
			"# TYPE livenessproxy_bytes_total counter"+want), "livenessproxy_bytes_total"); err != nil {
		t.Fatal(err)
	}
	_ = c.Close()
	h.linkEnd(2 * time.Second)
	if err := testutil.GatherAndCompare(h.m.Registry, strings.NewReader(
		"# HELP livenessproxy_bytes_total Bytes proxied, request (client→upstream) and response; computed at scrape time from live links, so the data path never touches a shared metric.\n"+
			"# TYPE livenessproxy_bytes_total counter"+want), "livenessproxy_bytes_total"); err != nil {
		t.Fatal(err)
	}
}

func startB(b *testing.B, upstream string) string {
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{{Name: "bench", Listen: "127.0.0.1:0", Upstream: upstream, Settings: cfg.Defaults}}
	p := New(cfg, Options{})
	if err := p.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = p.Close() })
	return p.Addr("bench").String()
}

// stateOf is the state the proxy reports for the endpoint addr
// ("unknown" when it has none).
func (h *harness) stateOf(addr string) string {
	for _, ep := range h.p.Endpoints() {
		if ep.Endpoint == addr {
			return ep.State
		}
	}
	return "unknown"
}

// waitReadmittedOf waits until the proxy reports addr readmitted by a
// probe: healthy, for probe_ok. A short exclusion (a probe that passes at
// once) can come and go between two looks at the state; this is the
// detector's own record that it did.
func (h *harness) waitReadmittedOf(addr string, within time.Duration) {
	h.t.Helper()
	waitFor(h.t, within, addr+" readmitted by its probe", func() bool {
		for _, ep := range h.p.Endpoints() {
			if ep.Endpoint == addr {
				return ep.State == "healthy" && ep.Reason == health.ReasonProbeOK
			}
		}
		return false
	})
}

// waitStateOf waits until the proxy reports addr in state, failing the
// test after within.
func (h *harness) waitStateOf(addr, state string, within time.Duration) {
	h.t.Helper()
	deadline := time.Now().Add(within)
	for h.stateOf(addr) != state {
		if time.Now().After(deadline) {
			h.t.Fatalf("%s is %s after %v, want %s", addr, h.stateOf(addr), within, state)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
