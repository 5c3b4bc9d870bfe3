//go:build linux

package proxy

import (
	"bytes"
	"crypto/sha256"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/twmb/franz-go/pkg/kmsg"
	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
)

// bigProduceReq is a Produce request (acks=all, timeout_ms timeout) whose
// records take size bytes: what a client that batches sends.
func bigProduceReq(size int, timeout time.Duration, corr int32) []byte {
	r := kmsg.NewPtrProduceRequest()
	r.Acks = -1
	r.TimeoutMillis = int32(timeout / time.Millisecond)
	r.Topics = []kmsg.ProduceRequestTopic{{Topic: "t", Partitions: []kmsg.ProduceRequestTopicPartition{{Records: make([]byte, size)}}}}
	return kafkaReq(r, 9, corr)
}

// smallRcvbufListener listens on loopback with a receive buffer of rcvbuf
// bytes on every accepted socket: Kafka's socket.receive.buffer.bytes is
// 100 KiB, so a client that pipelines fills it while the broker holds a
// request.
func smallRcvbufListener(t *testing.T, rcvbuf int) net.Listener {
	t.Helper()
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, rcvbuf) }); err != nil {
			return err
		}
		return serr
	}}
	ln, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

// userTimeout is TCP_USER_TIMEOUT (ms) on the upstream socket of h's one
// link now.
func userTimeout(h *harness) int {
	h.t.Helper()
	lk := h.onlyLink(5 * time.Second)
	lk.connMu.Lock()
	raw := lk.upRaw()
	lk.connMu.Unlock()
	ut := -1
	if err := raw.Control(func(fd uintptr) { ut, _ = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT) }); err != nil {
		h.t.Fatal(err)
	}
	return ut
}

// muteSettings: the kafka profile with tcp_user_timeout far below
// write_timeout (the default 10s) and below the broker's hold.
func muteSettings(ut time.Duration) func(*policy.Settings) {
	return func(s *policy.Settings) {
		kafkaProfile(3*time.Second, 1)(s)
		s.TCPUserTimeout = policy.Duration(ut)
	}
}

// Finding 1 of issue 20: a broker that stops reading a connection while it
// holds an acks=all Produce (waiting for its replicas, within the
// request's timeout_ms) while the client pipelines four 1 MiB batches:
// the broker's 100 KiB receive buffer fills, the window goes to zero, and
// the broker's kernel answers the zero-window probes. That is a broker
// not reading by its protocol's rules, not a dead path: nothing may end,
// nothing may be excluded, and every batch is answered once the hold ends.
// tcp_user_timeout is 2s here, the hold 6s (three times it).
func TestMutedBrokerHoldingARequestIsNotDead(t *testing.T) {
	const hold = 6 * time.Second
	broker := startKafkaBrokerOn(t, smallRcvbufListener(t, 100<<10), func(key int16, corr int32) (time.Duration, bool) {
		if corr == 1 {
			return hold, true // the first Produce waits for its replicas
		}
		return 0, true
	})
	h := start(t, broker.ln.Addr().String(), muteSettings(2*time.Second))
	c := h.dial()
	sent := time.Now()
	errc := make(chan error, 1)
	go func() {
		var err error
		for i := range 4 {
			if _, err = c.Write(bigProduceReq(1<<20, 10*time.Second, int32(i+1))); err != nil {
				break
			}
		}
		errc <- err
	}()
	time.Sleep(hold / 2)
	if ut := userTimeout(h); ut != 0 {
		t.Fatalf("TCP_USER_TIMEOUT %d ms while the broker holds, its window zero: want it lifted (0)", ut)
	}
	for i := range 4 {
		if id := readResponse(t, c, hold+20*time.Second); id != int32(i+1) {
			t.Fatalf("response %d, want %d", id, i+1)
		}
	}
	took := time.Since(sent)
	// The window opened: the bound is back, raised to keepalive's once
	// nothing is in flight (the link idles now).
	idle := int(h.p.listeners[0].current.Load().settings.IdleUserTimeout().Milliseconds())
	for deadline := time.Now().Add(10 * time.Second); userTimeout(h) != idle; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("TCP_USER_TIMEOUT %d ms 10s after the window opened, want %d (idle) again", userTimeout(h), idle)
		}
	}
	if err := <-errc; err != nil {
		t.Fatalf("writing the batches: %v", err)
	}
	t.Logf("4 x 1 MiB answered %v after the first was sent (hold %v)", took.Round(time.Millisecond), hold)
	if took < hold {
		t.Fatalf("answered after %v: the broker did not hold the first request for %v", took, hold)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s), want healthy", ep.State, ep.Reason)
	}
	select {
	case s := <-h.ended:
		t.Fatalf("a link ended (%s, %v) while its broker held a request", s.Reason, s.Err)
	default:
	}
	if n := h.p.ActiveLinks(); n != 1 {
		t.Fatalf("%d links open, want the one", n)
	}
}

// The dead twin: a broker that stops for good with its window full (it
// read the first request and then nothing, answers nothing) is still
// excluded once the held request's own deadline (timeout_ms 2s plus
// request_timeout 3s) has passed: by the unanswered rule, or by the
// write-progress rule (nothing acknowledged for write_timeout, 4s here,
// once no request is held), whichever judges first; never by
// TCP_USER_TIMEOUT while its kernel answers.
func TestStoppedBrokerWithFullWindowExcluded(t *testing.T) {
	broker := startKafkaBrokerOn(t, smallRcvbufListener(t, 100<<10), func(key int16, corr int32) (time.Duration, bool) {
		return time.Hour, true // stopped: reads nothing more, answers nothing
	})
	h := start(t, broker.ln.Addr().String(), func(s *policy.Settings) {
		muteSettings(2 * time.Second)(s)
		s.WriteTimeout = policy.Duration(4 * time.Second)
	})
	c := h.dial()
	sent := time.Now()
	go func() {
		for i := range 4 {
			if _, err := c.Write(bigProduceReq(1<<20, 2*time.Second, int32(i+1))); err != nil {
				return
			}
		}
	}()
	ep := h.waitState("excluded", 30*time.Second)
	took := ep.Since.Sub(sent)
	t.Logf("excluded for %s %v after the first request", ep.Reason, took.Round(time.Millisecond))
	if ep.Reason != string(CloseUnanswered) && ep.Reason != string(CloseWriteTimeout) {
		t.Fatalf("excluded for %s, want unanswered or write_timeout (not TCP_USER_TIMEOUT)", ep.Reason)
	}
	if took < 5*time.Second {
		t.Fatalf("excluded %v after the request, before its own deadline (2s + 3s)", took)
	}
}

// The dead twin in opaque mode: a peer that never reads at all, its
// window full and its kernel answering the probes, is caught by the
// write-progress rule (nothing acknowledged for write_timeout), not by
// TCP_USER_TIMEOUT, which only bounds unacknowledged data.
func TestNonReaderWithFullWindowIsAWriteTimeout(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.TCPUserTimeout = policy.Duration(time.Second)
		s.WriteTimeout = policy.Duration(3 * time.Second)
	})
	c := h.dial()
	go func() {
		buf := make([]byte, 64<<10)
		for range 64 {
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	}()
	ep := h.waitState("excluded", 20*time.Second)
	if ep.Reason != string(CloseWriteTimeout) {
		t.Fatalf("excluded for %s, want write_timeout", ep.Reason)
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").Closes(string(CloseUpstreamTimeout))); got != 0 {
		t.Fatalf("link_closes_total{upstream_timeout} = %v: TCP_USER_TIMEOUT cut a peer whose kernel answers", got)
	}
}

// The same for any protocol whose server reads a connection in turns: a
// peer that stops reading for three times tcp_user_timeout (but less than
// write_timeout) with its window full, and then reads everything, gets
// every byte through one link.
func TestPeerPausingLongerThanUserTimeoutKeepsLink(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.HashOnEOF, faultpeer.Options{Buffer: 4096})
	peer.SetReadDelay(3*time.Second, 0)
	h := start(t, peer.Addr(), func(s *policy.Settings) { s.TCPUserTimeout = policy.Duration(time.Second) })
	c := h.dial()
	data := make([]byte, 1<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	want := sha256.Sum256(data)
	if _, err := c.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("reading the peer's hash: %v", err)
	}
	if !bytes.Equal(got, want[:]) {
		t.Fatalf("the peer hashed %x, want %x: the link was cut", got, want)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s), want healthy", ep.State, ep.Reason)
	}
}
