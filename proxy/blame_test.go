//go:build linux

package proxy

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"
	"github.com/livenessproxy/livenessproxy/proxy/mesh"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	lptestutil "github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
)

// Real errors, sorted into the upstream's and the proxy's own.
func TestUpstreamFaultClassification(t *testing.T) {
	refused := func() error {
		_, err := net.Dial("tcp", lptestutil.ClosedAddr(t))
		return err
	}()
	timedOut := func() error {
		_, err := (&net.Dialer{Timeout: 50 * time.Millisecond}).Dial("tcp", blackholeListener(t))
		return err
	}()
	badOption := func() error {
		d := net.Dialer{Control: flow.UpstreamControl(policy.Settings{Keepalive: policy.Keepalive{
			Idle: policy.Duration(time.Second), Interval: policy.Duration(time.Second), Count: 1000}})}
		_, err := d.Dial("tcp", "127.0.0.1:1")
		return err
	}()
	_, unresolved := net.Dial("tcp", "no-such-host.invalid:80")
	for _, c := range []struct {
		name     string
		err      error
		upstream bool
		reason   CloseReason
	}{
		{"connection refused", refused, true, CloseUpstreamError},
		{"connect timeout", timedOut, true, CloseUpstreamError},
		{"ETIMEDOUT", &net.OpError{Op: "read", Err: os.NewSyscallError("read", syscall.ETIMEDOUT)}, true, CloseUpstreamTimeout},
		// The kernel's timeout reports the ICMP error it saw meanwhile
		// (TestUnreachableAtUserTimeoutIsUpstreamTimeout).
		{"EHOSTUNREACH on a connection", &net.OpError{Op: "read", Err: os.NewSyscallError("read", syscall.EHOSTUNREACH)}, true, CloseUpstreamTimeout},
		{"reset", &net.OpError{Op: "read", Err: os.NewSyscallError("read", syscall.ECONNRESET)}, true, CloseUpstreamError},
		{"EMFILE", &net.OpError{Op: "dial", Err: os.NewSyscallError("socket", syscall.EMFILE)}, false, CloseLocalError},
		{"ENOBUFS", &net.OpError{Op: "write", Err: os.NewSyscallError("write", syscall.ENOBUFS)}, false, CloseLocalError},
		{"a socket option the kernel refused", badOption, false, CloseLocalError},
		{"a name that does not resolve", unresolved, false, CloseLocalError},
	} {
		if c.err == nil {
			t.Fatalf("%s: no error to classify", c.name)
		}
		if got := upstreamFault(c.err); got != c.upstream {
			t.Errorf("%s (%v): upstream's = %v, want %v", c.name, c.err, got, c.upstream)
		}
		if got := closeReasonFor(c.err); got != c.reason {
			t.Errorf("%s (%v): close reason %s, want %s", c.name, c.err, got, c.reason)
		}
		// Only a connect that ran out of connect_timeout is a timeout a
		// lost SYN may explain (see dialFailed).
		if got, want := dialTimedOut(c.err), c.name == "connect timeout"; got != want {
			t.Errorf("%s (%v): dialTimedOut = %v, want %v", c.name, c.err, got, want)
		}
	}
}

// The proxy runs out of file descriptors (EMFILE) when it dials: that is
// its own failure. The client is reset, the link ends as local_error, the
// endpoint stays healthy and a link that was already open keeps working.
func TestOutOfDescriptorsIsALocalError(t *testing.T) {
	_, h, bystander := startEcho(t, nil, "before")

	// Leave exactly two free descriptor numbers: the test's own client
	// socket and the proxy's accept take them, the proxy's dial finds none.
	restore := lptestutil.FillDescriptors(t, 2)

	// The reset can reach the client before its own connect completes.
	c, rerr := net.Dial("tcp", h.addr)
	if rerr == nil {
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, rerr = c.Read(make([]byte, 1))
	}
	s := h.linkEnd(5 * time.Second)
	restore()

	if s.Reason != CloseLocalError || !errors.Is(s.Err, syscall.EMFILE) {
		t.Fatalf("link ended %q (%v), want local_error from EMFILE", s.Reason, s.Err)
	}
	if !errors.Is(rerr, syscall.ECONNRESET) {
		t.Fatalf("client saw %v, want a reset", rerr)
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").Closes(string(CloseLocalError))); got != 1 {
		t.Fatalf("link_closes_total{reason=local_error} = %v, want 1", got)
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").DialErrors); got != 0 {
		t.Fatalf("dial_errors_total = %v: the proxy's own failure was counted as the upstream's", got)
	}
	if ep := h.endpoint(); ep.State != "healthy" || ep.LiveLinks != 1 {
		t.Fatalf("endpoint %s with %d links, want healthy with the bystander", ep.State, ep.LiveLinks)
	}
	roundTrip(t, bystander, []byte("after"))
	roundTrip(t, h.dial(), []byte("a new link once descriptors are back"))
}

// The largest values check accepts are values the kernel takes: a config
// that passes check never fails a dial, nor panics, for its settings.
func TestSettingsAtTheLimitsOfCheckWork(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	s.Keepalive = policy.Keepalive{Idle: policy.Duration(32767 * time.Second), Interval: policy.Duration(32767 * time.Second), Count: 127}
	s.TCPUserTimeout = policy.Duration(math.MaxInt32 * time.Millisecond)
	s.Framing = policy.Framing{Type: policy.FramingLengthField, LengthFieldOffset: 64<<10 - 8, LengthFieldLength: 8,
		LengthAdjustment: math.MaxInt32, ByteOrder: policy.ByteOrderBig, MaxFrameLength: 1 << 30}
	s.Unanswered.Track = policy.TrackOn
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: s}}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("the limits do not pass check: %v", err)
	}
	p, c := startConfig(t, cfg, Options{})
	roundTrip(t, c, bytes.Repeat([]byte{7}, 100<<10)) // a header of 64 KiB and more
	if st := p.Endpoints()[0]; st.State != "healthy" {
		t.Fatalf("endpoint %s", st.State)
	}
}

// sockInt reads an integer socket option of c.
func sockInt(t *testing.T, c net.Conn, level, opt int) int {
	t.Helper()
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var v int
	var gerr error
	_ = raw.Control(func(fd uintptr) { v, gerr = unix.GetsockoptInt(int(fd), level, opt) })
	if gerr != nil {
		t.Fatal(gerr)
	}
	return v
}

// Probes dial with the same socket options as links, so that a probe
// cannot pass where a link would fail.
func TestProbesDialLikeLinks(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	s := policy.DefaultSettings()
	s.Keepalive = policy.Keepalive{Idle: policy.Duration(7 * time.Second), Interval: policy.Duration(3 * time.Second), Count: 4}
	s.TCPUserTimeout = policy.Duration(6 * time.Second)
	pc := probeConfig(s)
	if pc.Dialer == nil {
		t.Fatal("probe config has no dialer of its own")
	}
	c, err := pc.Dialer.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, o := range []struct {
		name       string
		level, opt int
		want       int
	}{
		{"TCP_KEEPIDLE", unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, 7},
		{"TCP_KEEPINTVL", unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, 3},
		{"TCP_KEEPCNT", unix.IPPROTO_TCP, unix.TCP_KEEPCNT, 4},
		{"TCP_USER_TIMEOUT", unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, 6000},
	} {
		if got := sockInt(t, c, o.level, o.opt); got != o.want {
			t.Errorf("probe socket %s = %d, want %d (as links)", o.name, got, o.want)
		}
	}
}

// A server that pauses (a GC, say) while a client uploads fast fills the
// 64 KiB queue: the uploading link is closed (reject), but a pause shorter
// than write_timeout is no evidence of death. The endpoint is not
// excluded and a bystander link to it is not cut.
func TestShortPauseUnderUploadExcludesNothing(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Buffer: 4096})
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(3 * time.Second)
		s.WriteBuffer = policy.WriteBuffer{HighWaterMark: 64 << 10, LowWaterMark: 32 << 10, OnOverflow: policy.OverflowReject}
	})
	bystander := h.dial()
	roundTrip(t, bystander, []byte("bystander"))
	peer.Set(faultpeer.HashOnEOF)
	peer.SetReadDelay(time.Second, 0) // pauses, then reads at full speed
	up := h.dial()
	sent := writeAsync(up, 16<<20, 64<<10)
	s := h.linkEnd(5 * time.Second)
	<-sent
	if s.Reason != CloseWatermark {
		t.Fatalf("uploading link ended %q (%v), want watermark", s.Reason, s.Err)
	}
	time.Sleep(100 * time.Millisecond) // a report would have excluded it by now
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s) after a short pause, want healthy", ep.State, ep.Reason)
	}
	roundTrip(t, bystander, []byte("still here"))
}

// The detection twin: a peer that takes some bytes and then never reads
// again leaves nothing acknowledged for write_timeout; the overflow that
// follows is evidence, and the endpoint is excluded.
func TestOverflowAfterNoProgressExcludes(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(300 * time.Millisecond)
		s.TCPUserTimeout = 0
		s.WriteBuffer = policy.WriteBuffer{HighWaterMark: 1 << 20, LowWaterMark: 512 << 10, OnOverflow: policy.OverflowReject}
		s.Detector.InitialDelay = policy.Duration(10 * time.Second)
	})
	c := h.dial()
	// A steady 1.6 MB/s: the peer's window closes at once, then the
	// proxy's upstream socket buffer fills (on loopback the kernel takes a
	// MiB or two), then, over more than write_timeout, its 1 MiB queue.
	go func() {
		buf := make([]byte, 16<<10)
		for range 400 {
			if _, err := c.Write(buf); err != nil {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	s := h.linkEnd(10 * time.Second)
	// Whichever comes first, the writer's own write_timeout or the
	// overflow after write_timeout without progress, is evidence.
	if s.Reason != CloseWriteTimeout && s.Reason != CloseWatermark {
		t.Fatalf("link ended %q (%v), want write_timeout or watermark", s.Reason, s.Err)
	}
	h.waitState("excluded", 2*time.Second)
}

// write_timeout is about acknowledged progress: a peer that reads 8 KiB
// every 20 ms (400 KB/s) never trips a 1 s write_timeout, although the
// kernel, which wakes a writer only once a good part of its send buffer is
// free, can keep a single write waiting longer than that.
func TestSteadySlowReaderNeverTimesOut(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.HashOnEOF, faultpeer.Options{})
	peer.SetReadDelay(0, 20*time.Millisecond) // reads 8 KiB at a time
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(time.Second)
		s.TCPUserTimeout = 0
	})
	c := h.dial()
	data := bytes.Repeat([]byte("steady"), (3<<20)/6) // 3 MiB: about 8 s to drain
	want := sha256.Sum256(data)
	go func() {
		if _, err := c.Write(data); err == nil {
			_ = c.CloseWrite()
		}
	}()
	_ = c.SetReadDeadline(time.Now().Add(60 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil || !bytes.Equal(got, want[:]) {
		t.Fatalf("steady slow reader got a cut stream: %x, %v", got, err)
	}
	if s := h.linkEnd(5 * time.Second); s.Reason != CloseClientClosed {
		t.Fatalf("reason %q (%v), want client_closed", s.Reason, s.Err)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s, want healthy", ep.State)
	}
}

// cutShort accepts one connection, reads the request, writes half a
// response and then resets (reset true) or closes cleanly.
func cutShort(t *testing.T, reset bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		buf := make([]byte, 64)
		if _, err := c.Read(buf); err != nil {
			c.Close()
			return
		}
		_, _ = c.Write([]byte("half a respo"))
		time.Sleep(50 * time.Millisecond)
		if reset {
			_ = c.(*net.TCPConn).SetLinger(0)
		}
		c.Close()
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	return ln.Addr().String()
}

// An upstream that resets a connection mid-response: the client sees a
// reset, not a clean end that would make the cut-short response look
// complete. The twin: an upstream FIN reaches the client as a FIN.
func TestResetsTravelFINsStayFINs(t *testing.T) {
	for _, reset := range []bool{true, false} {
		t.Run(fmt.Sprintf("reset=%v", reset), func(t *testing.T) {
			h := start(t, cutShort(t, reset), nil)
			c := h.dial()
			if _, err := c.Write([]byte("query")); err != nil {
				t.Fatal(err)
			}
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			got, err := io.ReadAll(c)
			if string(got) != "half a respo" {
				t.Fatalf("client read %q before the end, want the half response", got)
			}
			if reset && !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("client saw %v after the upstream's reset, want a reset", err)
			}
			if !reset && err != nil {
				t.Fatalf("client saw %v after the upstream's FIN, want a clean end", err)
			}
		})
	}
}

// Exact staleness: the acknowledged offset counts stream bytes only (the
// kernel's tcpi_bytes_acked also counts the SYN), so a request whose last
// byte is not yet acknowledged is not taken for acknowledged.
func TestBytesAckedCountsStreamBytesOnly(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.ReadNoAnswer, faultpeer.Options{})
	c, err := net.Dial("tcp", peer.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if n, ok := flow.BytesAcked(raw); !ok || n != 0 {
		t.Fatalf("before any byte: acked %d (%v), want 0", n, ok)
	}
	const request = 1000
	// The request is sent but its last byte is held back: the peer can
	// have acknowledged at most request-1 bytes of it.
	if _, err := c.Write(make([]byte, request-1)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		n, _ := flow.BytesAcked(raw)
		if n == request-1 {
			break
		}
		if n > request-1 || time.Now().After(deadline) {
			t.Fatalf("acked %d after %d bytes sent", n, request-1)
		}
		time.Sleep(time.Millisecond)
	}
	if n, _ := flow.BytesAcked(raw); n >= request {
		t.Fatalf("acked %d: a request ending at %d would pass as acknowledged without its last byte", n, request)
	}
}

// The healthy twin of the blackhole and idle-dead-peer detections: an idle
// link to a live upstream, with keepalive and TCP_USER_TIMEOUT far shorter
// than the idle time, is never closed: the peer's kernel answers every
// keepalive probe.
func TestIdleLinkToALiveUpstreamStaysOpen(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.Keepalive = policy.Keepalive{Idle: policy.Duration(time.Second), Interval: policy.Duration(time.Second), Count: 2}
		s.TCPUserTimeout = policy.Duration(time.Second)
		s.WriteTimeout = policy.Duration(time.Second)
	})
	c := h.dial()
	roundTrip(t, c, []byte("before"))
	time.Sleep(4 * time.Second) // idle + count x interval, twice over
	roundTrip(t, c, []byte("after four idle seconds"))
	if n := h.p.ActiveLinks(); n != 1 {
		t.Fatalf("%d links, want the idle one still open", n)
	}
}

// A probe's error is the proxy's own (no verdict on the endpoint) only
// when it is a name that did not resolve or a system call that failed for
// want of the proxy's resources or by its own settings; a refusal, a
// reset, an unreachable host, a timeout and an HTTP answer are the
// endpoint's.
func TestOwnFailureIsTheProxys(t *testing.T) {
	op := func(e syscall.Errno) error {
		return &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", e)}
	}
	for _, c := range []struct {
		err  error
		want bool
	}{
		{op(syscall.EMFILE), true},
		{op(syscall.ENOBUFS), true},
		{op(syscall.EPERM), true},
		{op(syscall.EADDRNOTAVAIL), true},
		{&net.DNSError{Err: "no such host", Name: "x"}, true},
		{fmt.Errorf("peer: mesh.tls: %w: %w", mesh.ErrOwnTLS, &os.PathError{Op: "stat", Path: "/tls/tls.crt", Err: syscall.ENOENT}), true}, // a probe's session dial
		{op(syscall.ECONNREFUSED), false},
		{op(syscall.ECONNRESET), false},
		{op(syscall.EHOSTUNREACH), false},
		{op(syscall.ETIMEDOUT), false},
		{op(syscall.EACCES), false}, // an ICMPv6 "administratively prohibited" from the upstream's side
		{context.DeadlineExceeded, false},
		{errors.New("unexpected status 503"), false},
	} {
		if got := ownFailure(c.err); got != c.want {
			t.Errorf("ownFailure(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
