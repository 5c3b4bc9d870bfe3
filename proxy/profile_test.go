package proxy

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/prometheus/client_golang/prometheus/testutil"

	lptestutil "github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/kafkawire"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/internal/pinotwire"
	"github.com/livenessproxy/livenessproxy/policy"
)

// kafkaReq encodes a framed Kafka request the way a client does: size,
// header v1 or v2 (client id "test"), body.
func kafkaReq(r kmsg.Request, version int16, corr int32) []byte {
	r.SetVersion(version)
	b := binary.BigEndian.AppendUint32(nil, 0)
	b = binary.BigEndian.AppendUint16(b, uint16(r.Key()))
	b = binary.BigEndian.AppendUint16(b, uint16(version))
	b = binary.BigEndian.AppendUint32(b, uint32(corr))
	b = binary.BigEndian.AppendUint16(b, 4)
	b = append(b, "test"...)
	if r.IsFlexible() {
		b = append(b, 0) // no tagged fields
	}
	b = r.AppendTo(b)
	binary.BigEndian.PutUint32(b, uint32(len(b)-4))
	return b
}

func fetchReq(maxWait time.Duration, corr int32) []byte {
	r := kmsg.NewPtrFetchRequest()
	r.MaxWaitMillis = int32(maxWait / time.Millisecond)
	r.MinBytes = 1
	return kafkaReq(r, 12, corr)
}

func produceReq(acks int16, corr int32) []byte {
	r := kmsg.NewPtrProduceRequest()
	r.Acks = acks
	r.TimeoutMillis = 1000
	return kafkaReq(r, 9, corr)
}

func metadataReq(corr int32) []byte { return kafkaReq(kmsg.NewPtrMetadataRequest(), 9, corr) }

// kafkaBroker is a loopback peer that reads Kafka request frames and
// answers each with a response frame carrying its correlation id, after
// the delay policy gives (or never). Answers on a connection go out in
// request order, as a broker's do.
type kafkaBroker struct {
	ln     net.Listener
	policy func(key int16, corr int32) (time.Duration, bool)
	// serveConn, if set, serves each connection instead (a broker of
	// another behaviour on the same plumbing); done ends it.
	serveConn func(c net.Conn, done <-chan struct{})
	wg        sync.WaitGroup
	done      chan struct{}
	mu        sync.Mutex
	conns     []net.Conn
	seen      int // requests read
}

func startKafkaBroker(t *testing.T, policy func(key int16, corr int32) (time.Duration, bool)) *kafkaBroker {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return startKafkaBrokerOn(t, ln, policy)
}

// startKafkaBrokerOn is startKafkaBroker on a listener of the test's own
// (small receive buffers, say).
func startKafkaBrokerOn(t *testing.T, ln net.Listener, policy func(key int16, corr int32) (time.Duration, bool)) *kafkaBroker {
	t.Helper()
	return runKafkaBroker(t, &kafkaBroker{ln: ln, policy: policy})
}

// runKafkaBroker starts b on its listener; the test's cleanup stops it.
func runKafkaBroker(t *testing.T, b *kafkaBroker) *kafkaBroker {
	t.Helper()
	ln := b.ln
	b.done = make(chan struct{})
	b.wg.Add(1)
	go b.accept()
	t.Cleanup(func() {
		close(b.done)
		_ = ln.Close()
		b.mu.Lock()
		for _, c := range b.conns {
			_ = c.Close()
		}
		b.mu.Unlock()
		b.wg.Wait()
	})
	return b
}

func (b *kafkaBroker) accept() {
	defer b.wg.Done()
	for {
		c, err := b.ln.Accept()
		if err != nil {
			return
		}
		b.mu.Lock()
		b.conns = append(b.conns, c)
		b.mu.Unlock()
		b.wg.Add(1)
		if b.serveConn != nil {
			go func() {
				defer b.wg.Done()
				b.serveConn(c, b.done)
			}()
			continue
		}
		go b.serve(c)
	}
}

// readKafkaRequest reads one request frame's payload from c; ok false at
// the connection's end or for a payload too short for a header.
func readKafkaRequest(c net.Conn) (p []byte, ok bool) {
	var hdr [4]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return nil, false
	}
	p = make([]byte, binary.BigEndian.Uint32(hdr[:]))
	if _, err := io.ReadFull(c, p); err != nil || len(p) < 8 {
		return nil, false
	}
	return p, true
}

func (b *kafkaBroker) serve(c net.Conn) {
	defer b.wg.Done()
	for {
		p, ok := readKafkaRequest(c)
		if !ok {
			return
		}
		b.mu.Lock()
		b.seen++
		b.mu.Unlock()
		key, corr := int16(binary.BigEndian.Uint16(p)), int32(binary.BigEndian.Uint32(p[4:]))
		delay, answer := b.policy(key, corr)
		if !answer {
			continue
		}
		select {
		case <-time.After(delay):
		case <-b.done:
			return
		}
		resp := binary.BigEndian.AppendUint32(nil, 8)
		resp = binary.BigEndian.AppendUint32(resp, uint32(corr))
		resp = append(resp, 0, 0, 0, 0)
		if _, err := c.Write(resp); err != nil {
			return
		}
	}
}

func (b *kafkaBroker) requests() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.seen
}

// kafkaProfile is the kafka profile with defaults but a short
// request_timeout and a quiet detector.
func kafkaProfile(rt time.Duration, thr int) func(*policy.Settings) {
	return func(s *policy.Settings) {
		s.Framing.Type = policy.FramingKafka
		s.Unanswered.RequestTimeout = policy.Duration(rt)
		s.Unanswered.ConsecutiveTimeoutsThreshold = thr
		s.Detector.InitialDelay = policy.Duration(10 * time.Second)
		s.Detector.MaxDelay = policy.Duration(10 * time.Second)
	}
}

func readResponse(t *testing.T, c net.Conn, within time.Duration) int32 {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(within))
	defer func() { _ = c.SetReadDeadline(time.Time{}) }()
	var hdr [8]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		t.Fatalf("reading a response: %v", err)
	}
	rest := make([]byte, binary.BigEndian.Uint32(hdr[:])-4)
	if _, err := io.ReadFull(c, rest); err != nil {
		t.Fatalf("reading a response: %v", err)
	}
	return int32(binary.BigEndian.Uint32(hdr[4:]))
}

// The healthy twin: long polls held by the broker for their max_wait
// (1.5s, five times request_timeout) and produce requests with acks=0
// (never answered) are never counted, on a link with nothing else going on.
func TestKafkaLongPollAndAcksZeroNotCounted(t *testing.T) {
	broker := startKafkaBroker(t, func(key int16, _ int32) (time.Duration, bool) {
		switch key {
		case 0:
			return 0, false // acks=0: no response by protocol
		case 1:
			return 1400 * time.Millisecond, true // an empty topic: held for max_wait
		}
		return 0, true
	})
	h := start(t, broker.ln.Addr().String(), kafkaProfile(300*time.Millisecond, 2))
	c := h.dial()
	for i := range 3 {
		if _, err := c.Write(produceReq(0, int32(100+i))); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		if _, err := c.Write(fetchReq(1500*time.Millisecond, int32(i))); err != nil {
			t.Fatal(err)
		}
		if id := readResponse(t, c, 5*time.Second); id != int32(i) {
			t.Fatalf("response %d, want %d", id, i)
		}
	}
	time.Sleep(2 * time.Second) // past every deadline a 300ms rule would have used
	m := h.m.ForListener("test")
	if got := testutil.ToFloat64(m.UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
	if ep := h.endpoint(); ep.State != "healthy" || h.p.ActiveLinks() != 1 {
		t.Fatalf("endpoint %s (%s), %d links; want healthy with the link open", ep.State, ep.Reason, h.p.ActiveLinks())
	}
	for _, r := range metrics.UntrackedReasons {
		if got := testutil.ToFloat64(m.Untracked(r)); got != 0 {
			t.Fatalf("untracked{%s} = %v: the link should still be tracked", r, got)
		}
	}
}

// The detection twin: a broker that stops answering is caught by the
// requests' own deadlines, the long poll's included.
func TestKafkaSilentBrokerExcludedAfterOwnDeadlines(t *testing.T) {
	broker := startKafkaBroker(t, func(int16, int32) (time.Duration, bool) { return 0, false })
	h := start(t, broker.ln.Addr().String(), kafkaProfile(300*time.Millisecond, 2))
	sent := time.Now() // before the dial: no deadline can start earlier
	c := h.dial()
	if _, err := c.Write(fetchReq(time.Second, 1)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(metadataReq(2)); err != nil {
		t.Fatal(err)
	}
	ep := h.waitState("excluded", 10*time.Second)
	// The Fetch is due at max_wait + request_timeout; the Metadata behind it
	// cannot be answered first (the broker answers in order), so it is due
	// with it, not request_timeout after it: the deadlines do not add up.
	if d := ep.Since.Sub(sent); d < 1300*time.Millisecond {
		t.Fatalf("excluded %v after the requests, before the Fetch's own deadline (1.3s)", d)
	}
	if ep.Reason != string(CloseUnanswered) {
		t.Fatalf("excluded for %s, want unanswered", ep.Reason)
	}
}

// A response that matches no outstanding request means the proxy lost
// the thread: it stops tracking that link and keeps forwarding.
func TestKafkaDesyncStopsTrackingNotTheLink(t *testing.T) {
	broker := startKafkaBroker(t, func(int16, int32) (time.Duration, bool) { return 0, true })
	h := start(t, broker.ln.Addr().String(), kafkaProfile(300*time.Millisecond, 1))
	c := h.dial()
	if _, err := c.Write(metadataReq(7)); err != nil {
		t.Fatal(err)
	}
	readResponse(t, c, 2*time.Second)
	// A response nobody asked for: the peer answers a Produce with acks=0,
	// which by protocol gets no response, so the proxy expects none.
	if _, err := c.Write(produceReq(0, 8)); err != nil {
		t.Fatal(err)
	}
	if id := readResponse(t, c, 2*time.Second); id != 8 {
		t.Fatalf("response %d, want 8", id)
	}
	m := h.m.ForListener("test")
	deadline := time.Now().Add(2 * time.Second)
	for testutil.ToFloat64(m.Untracked(metrics.UntrackedDesync)) != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("untracked{desync} = %v, want 1", testutil.ToFloat64(m.Untracked(metrics.UntrackedDesync)))
		}
		time.Sleep(5 * time.Millisecond)
	}
	// Untracked, still proxied, and nothing is held against the broker.
	if _, err := c.Write(metadataReq(9)); err != nil {
		t.Fatal(err)
	}
	if id := readResponse(t, c, 2*time.Second); id != 9 {
		t.Fatalf("response %d, want 9", id)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s after a desync, want healthy", ep.State)
	}
}

// A TLS client and a SASL v0 handshake are forwarded untouched and not
// tracked: nothing the proxy cannot read is held against the broker.
func TestKafkaUnreadableStreamsUntracked(t *testing.T) {
	for _, tc := range []struct {
		name, reason string
		first        []byte
	}{
		{"tls", metrics.UntrackedTLS, []byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03}},
		{"sasl v0", metrics.UntrackedSASL, kafkaReq(&kmsg.SASLHandshakeRequest{Mechanism: "PLAIN"}, 0, 1)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			broker := startKafkaBroker(t, func(int16, int32) (time.Duration, bool) { return 0, false })
			h := start(t, broker.ln.Addr().String(), kafkaProfile(100*time.Millisecond, 1))
			c := h.dial()
			if _, err := c.Write(tc.first); err != nil {
				t.Fatal(err)
			}
			// Raw tokens or records that read as nothing sensible follow,
			// each in a read of its own: none of them may be recorded.
			for range 5 {
				time.Sleep(20 * time.Millisecond)
				if _, err := c.Write([]byte{0, 0, 0, 4, 'r', 'a', 'w', '!'}); err != nil {
					t.Fatal(err)
				}
			}
			m := h.m.ForListener("test")
			deadline := time.Now().Add(2 * time.Second)
			for testutil.ToFloat64(m.Untracked(tc.reason)) != 1 {
				if time.Now().After(deadline) {
					t.Fatalf("untracked{%s} = %v, want 1", tc.reason, testutil.ToFloat64(m.Untracked(tc.reason)))
				}
				time.Sleep(5 * time.Millisecond)
			}
			time.Sleep(400 * time.Millisecond) // past any deadline
			if ep := h.endpoint(); ep.State != "healthy" || h.p.ActiveLinks() != 1 {
				t.Fatalf("endpoint %s (%s), %d links; want healthy with the link open", ep.State, ep.Reason, h.p.ActiveLinks())
			}
			if got := testutil.ToFloat64(m.UnansweredTimeouts); got != 0 {
				t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
			}
		})
	}
}

// A listener that turned tracking off keeps it off for its own links,
// whatever another listener to the same endpoint says (the last listener
// configured used to win for all).
func TestThresholdIsPerListener(t *testing.T) {
	broker := startKafkaBroker(t, func(int16, int32) (time.Duration, bool) { return 0, false })
	cfg := policy.DefaultConfig()
	quiet, strict := cfg.Defaults, cfg.Defaults
	kafkaProfile(100*time.Millisecond, 0)(&quiet)
	kafkaProfile(100*time.Millisecond, 3)(&strict)
	up := broker.ln.Addr().String()
	cfg.Listeners = []policy.Listener{
		{Name: "quiet", Listen: "127.0.0.1:0", Upstream: up, Settings: quiet},
		{Name: "strict", Listen: "127.0.0.1:0", Upstream: up, Settings: strict},
	}
	m := metrics.New()
	p := New(cfg, Options{metrics: m})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c, err := net.Dial("tcp", p.Addr("quiet").String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := range 10 {
		if _, err := c.Write(metadataReq(int32(i))); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for broker.requests() < 10 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // every deadline passed
	if st := p.Endpoints()[0]; st.State != "healthy" || st.ConsecutiveUnanswered != 0 {
		t.Fatalf("endpoint %s with %d consecutive after the quiet listener's requests; want healthy, 0", st.State, st.ConsecutiveUnanswered)
	}
	// The strict listener's own requests still count.
	s, err := net.Dial("tcp", p.Addr("strict").String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i := range 3 {
		if _, err := s.Write(metadataReq(int32(i))); err != nil {
			t.Fatal(err)
		}
	}
	deadline = time.Now().Add(5 * time.Second)
	for p.Endpoints()[0].State != "excluded" {
		if time.Now().After(deadline) {
			t.Fatalf("endpoint %s after 3 unanswered on the strict listener, want excluded", p.Endpoints()[0].State)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Listeners with different thresholds share the endpoint's count, and a
// request counts against its own listener's: behind "a" (threshold 2) and
// "b" (threshold 1), a silent server's first request on a is no verdict,
// and b's that follows is (the shared count, 2, is past b's 1). Before,
// only a crossing of the threshold tripped: b's count went from 1 to 2,
// past 1 but not across it, and nothing tripped again. The twin: with b's
// threshold 3 the same two requests are below it and the endpoint stays
// healthy.
func TestMixedThresholdsTripOnTheSendersThreshold(t *testing.T) {
	for _, tc := range []struct {
		name    string
		bThr    int
		exclude bool
	}{{"b threshold 1", 1, true}, {"b threshold 3", 3, false}} {
		t.Run(tc.name, func(t *testing.T) {
			peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
			peer.SetAnswer(func(int64) (time.Duration, bool) { return 0, false })
			cfg := policy.DefaultConfig()
			sa, sb := cfg.Defaults, cfg.Defaults
			framed(200*time.Millisecond, 2, nil)(&sa)
			framed(200*time.Millisecond, tc.bThr, nil)(&sb)
			cfg.Listeners = []policy.Listener{
				{Name: "a", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: sa},
				{Name: "b", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: sb},
			}
			m := metrics.New()
			p := startProxy(t, cfg, Options{metrics: m})
			counted := func(name string, n float64) {
				t.Helper()
				waitFor(t, 5*time.Second, name+"'s request counted", func() bool {
					return testutil.ToFloat64(m.ForListener(name).UnansweredTimeouts) >= n
				})
			}
			ha := &harness{t: t, p: p, addr: p.Addr("a").String()}
			hb := &harness{t: t, p: p, addr: p.Addr("b").String()}
			sendFrame(t, ha.dial(), "a1")
			counted("a", 1)
			if st := p.Endpoints()[0]; st.State != "healthy" {
				t.Fatalf("endpoint %s after one request on a (threshold 2), want healthy", st.State)
			}
			sendFrame(t, hb.dial(), "b1")
			counted("b", 1)
			if tc.exclude {
				ha.waitState("excluded", 5*time.Second)
				return
			}
			// Both in the shared count (the metric counts first): below
			// b's threshold, no verdict.
			waitFor(t, 5*time.Second, "two in the endpoint's count", func() bool { return p.Endpoints()[0].ConsecutiveUnanswered == 2 })
			if st := p.Endpoints()[0]; st.State != "healthy" {
				t.Fatalf("endpoint %s (%s), want healthy: two requests, below b's threshold of 3", st.State, st.Reason)
			}
		})
	}
}

// Pinot: queries answered within their own timeoutMs never count, even
// when that is far beyond request_timeout; the same queries to a server
// that answers nothing are counted at timeoutMs plus the slack.
func TestPinotQueryTimeoutIsTheDeadline(t *testing.T) {
	for _, tc := range []struct {
		name    string
		silent  bool
		wantEnd string
	}{
		{"answered within timeoutMs", false, "healthy"},
		{"never answered", true, "excluded"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, err := pinotsim.NewServer(pinotsim.ServerConfig{Delay: 1200 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			defer srv.Close()
			srv.SetSilent(tc.silent)
			h := start(t, srv.Addr(), func(s *policy.Settings) {
				s.Framing.Type = policy.FramingPinot
				s.Unanswered.RequestTimeout = policy.Duration(200 * time.Millisecond)
				s.Unanswered.ConsecutiveTimeoutsThreshold = 3
				s.Detector.Probe = policy.ProbeKindConnect
				s.Detector.InitialDelay = policy.Duration(10 * time.Second)
			})
			c := h.dial()
			sent := time.Now()
			for i := range 5 {
				payload := pinotsim.AppendRequest(nil, &pinotsim.Request{ID: int64(1000 + i), Table: "t_OFFLINE", TimeoutMs: 1500})
				if _, err := c.Write(lptestutil.LengthPrefixed(payload)); err != nil {
					t.Fatal(err)
				}
			}
			if !tc.silent {
				for range 5 {
					readFrame(t, c, 5*time.Second)
				}
				time.Sleep(1500 * time.Millisecond) // past timeoutMs + slack
				if got := testutil.ToFloat64(h.m.ForListener("test").UnansweredTimeouts); got != 0 {
					t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
				}
				if ep := h.endpoint(); ep.State != tc.wantEnd {
					t.Fatalf("endpoint %s, want %s", ep.State, tc.wantEnd)
				}
				return
			}
			ep := h.waitState("excluded", 10*time.Second)
			if d := ep.Since.Sub(sent); d < 2500*time.Millisecond {
				t.Fatalf("excluded %v after the queries, before timeoutMs (1.5s) plus the 1s slack", d)
			}
		})
	}
}

// A Pinot request that asks for a timeoutMs beyond any deadline is never
// judged: its deadline saturates, it does not wrap to the past.
func TestPinotHugeTimeoutNeverJudged(t *testing.T) {
	srv, err := pinotsim.NewServer(pinotsim.ServerConfig{Delay: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	h := start(t, srv.Addr(), func(s *policy.Settings) {
		s.Framing.Type = policy.FramingPinot
		s.Unanswered.RequestTimeout = policy.Duration(50 * time.Millisecond)
		s.Unanswered.ConsecutiveTimeoutsThreshold = 1
		s.Detector.Probe = policy.ProbeKindConnect
	})
	c := h.dial()
	for i := range 3 {
		payload := pinotsim.AppendRequest(nil, &pinotsim.Request{ID: int64(i + 1), Table: "t_OFFLINE", TimeoutMs: math.MaxInt64})
		if _, err := c.Write(lptestutil.LengthPrefixed(payload)); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(200 * time.Millisecond) // within the server's 300 ms, past rt and slack
	if got := testutil.ToFloat64(h.m.ForListener("test").UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
	for range 3 {
		readFrame(t, c, 5*time.Second)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s", ep.State)
	}
}

// Clients that close while their long polls are parked abandon them: the
// requests can no longer be answered, and a live broker is not blamed
// (an application shutting down its consumers, say).
func TestKafkaAbandonedLongPollsNotCounted(t *testing.T) {
	broker := startKafkaBroker(t, func(key int16, _ int32) (time.Duration, bool) {
		return 500 * time.Millisecond, true // an empty topic: held for max_wait
	})
	h := start(t, broker.ln.Addr().String(), kafkaProfile(100*time.Millisecond, 1))
	for i := range 5 {
		c := h.dial()
		if _, err := c.Write(fetchReq(500*time.Millisecond, int32(i))); err != nil {
			t.Fatal(err)
		}
		// The Fetch is at the broker (so the proxy tracks it): a fixed
		// 20ms could end before, and the test then judge nothing.
		waitFor(t, 5*time.Second, "the Fetch at the broker", func() bool { return broker.requests() >= i+1 })
		_ = c.SetLinger(0)
		c.Close() // the client goes away with its Fetch parked
		h.linkEnd(2 * time.Second)
	}
	time.Sleep(900 * time.Millisecond) // past every Fetch's own deadline
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s) after clients abandoned their long polls, want healthy", ep.State, ep.Reason)
	}
}

// A Kafka endpoint whose clients speak TLS is probed with a TCP connect
// under probe: auto: a plaintext ApiVersions could never readmit it.
func TestKafkaTLSEndpointProbedByConnect(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{}) // not a Kafka broker: only a connect probe passes
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		kafkaProfile(time.Second, 5)(s)
		s.Detector.InitialDelay = policy.Duration(50 * time.Millisecond)
		s.Detector.MaxDelay = policy.Duration(50 * time.Millisecond)
		s.Detector.Jitter = 0
	})
	c := h.dial()
	roundTrip(t, c, []byte{0x16, 0x03, 0x01, 0x00, 0x05, 1, 2, 3, 4, 5}) // a TLS record
	h.p.det.Report(h.endpoint().Endpoint, string(CloseDialError))
	h.waitState("healthy", 3*time.Second)
}

// While a Kafka broker may be holding a connection's oldest request
// within its own deadline, no acknowledged progress is no evidence of a
// stall; past that deadline (or with nothing outstanding) it is.
func TestKafkaHoldingExcusesNoProgress(t *testing.T) {
	c := &conv{kafka: true}
	now := flow.Mono()
	if c.holding(now) {
		t.Fatal("holding with nothing outstanding")
	}
	c.queue = []outstanding{{id: 1, due: now + int64(time.Second)}, {id: 2, due: flow.Never}}
	if !c.holding(now) {
		t.Fatal("not holding a request within its deadline")
	}
	if c.holding(now + int64(2*time.Second)) {
		t.Fatal("holding past the oldest request's deadline")
	}
	c.head = 1 // the first was answered; the second's hold is unknown
	if !c.holding(now + int64(time.Hour)) {
		t.Fatal("not holding a request whose hold is unknown")
	}
	c.kafka = false
	if c.holding(now) {
		t.Fatal("holding for a protocol that reads while it works")
	}
}

// A large answer that takes far longer than request_timeout to arrive is
// life from its first byte: a request sent behind it, queued on the same
// connection, is covered by the bytes still arriving after it was sent,
// before the whole response is in. (Its healthy-but-slow twin of the clock
// rule: nothing is counted, the link stays, every byte is delivered.)
func TestKafkaLargeSlowAnswerIsLife(t *testing.T) {
	const (
		respLen = 1 << 20
		chunk   = 16 << 10
		every   = 40 * time.Millisecond // 1 MiB in about 2.6 s
	)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	served := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			served <- err
			return
		}
		defer c.Close()
		readReq := func() (int32, error) {
			var hdr [4]byte
			if _, err := io.ReadFull(c, hdr[:]); err != nil {
				return 0, err
			}
			p := make([]byte, binary.BigEndian.Uint32(hdr[:]))
			if _, err := io.ReadFull(c, p); err != nil {
				return 0, err
			}
			return int32(binary.BigEndian.Uint32(p[4:])), nil
		}
		corr, err := readReq()
		if err != nil {
			served <- err
			return
		}
		resp := binary.BigEndian.AppendUint32(nil, uint32(respLen-4))
		resp = binary.BigEndian.AppendUint32(resp, uint32(corr))
		resp = append(resp, make([]byte, respLen-len(resp))...)
		for off := 0; off < len(resp); off += chunk {
			if _, err := c.Write(resp[off:min(off+chunk, len(resp))]); err != nil {
				served <- err
				return
			}
			time.Sleep(every)
		}
		corr, err = readReq() // the Metadata request, sent while the answer trickled
		if err == nil {
			_, err = c.Write(binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint32(nil, 8), uint32(corr)))
			if err == nil {
				_, err = c.Write([]byte{0, 0, 0, 0})
			}
		}
		served <- err
	}()
	h := start(t, ln.Addr().String(), kafkaProfile(300*time.Millisecond, 1))
	c := h.dial()
	if _, err := c.Write(fetchReq(100*time.Millisecond, 1)); err != nil {
		t.Fatal(err)
	}
	got := make(chan int, 1)
	go func() {
		n, _ := io.CopyN(io.Discard, c, respLen+12)
		got <- int(n)
	}()
	time.Sleep(time.Second) // the answer is arriving, slowly
	if _, err := c.Write(metadataReq(2)); err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-got:
		if n != respLen+12 {
			t.Fatalf("the client received %d bytes, want %d", n, respLen+12)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the answers did not arrive within 30s")
	}
	if err := <-served; err != nil {
		t.Fatalf("server: %v", err)
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0: bytes arriving are life", got)
	}
	if ep := h.endpoint(); ep.State != "healthy" || h.p.ActiveLinks() != 1 {
		t.Fatalf("endpoint %s (%s), %d links; want healthy with the link open", ep.State, ep.Reason, h.p.ActiveLinks())
	}
}

// Requests queued on one Kafka connection are each due no earlier than
// the one ahead of them (the broker answers in order) and no later than the
// later of their own deadline and that one's: their deadlines do not add
// up, so the fifth of five queued requests is judged with the first. Only
// a hold begins when the broker starts on its request.
func TestKafkaQueuedDeadlinesDoNotAddUp(t *testing.T) {
	var answer atomic.Int64
	answer.Store(flow.NoAnswer)
	lk := &link{}
	lk.trk = flow.NewTracker(time.Millisecond, false, &answer, func([]flow.PendingRequest, int) {})
	defer lk.trk.Stop()
	rt := 3 * time.Second
	c := &conv{lk: lk, kafka: true, profile: true, rt: int64(rt), thr: 1}
	t0 := flow.Mono()
	reqs := []struct {
		after time.Duration
		key   int16
		hold  time.Duration
		want  time.Duration // due, from t0
	}{
		{0, 0, 10 * time.Second, 13 * time.Second},                             // an acks=all Produce held up to 10s
		{10 * time.Millisecond, 0, 10 * time.Second, 13010 * time.Millisecond}, // a second one behind it: its own
		{20 * time.Millisecond, 3, 0, 13010 * time.Millisecond},                // Metadata: behind them, due with them
		{30 * time.Millisecond, 1, 30 * time.Second, 33030 * time.Millisecond}, // a 30s Fetch: its own, later
		{40 * time.Millisecond, 12, 5 * time.Second, 33030 * time.Millisecond}, // a heartbeat behind it
	}
	for i, r := range reqs {
		c.sendAt = t0 + int64(r.after)
		c.kafkaRequest(&kafkawire.Request{APIKey: r.key, CorrelationID: int32(i), Hold: r.hold}, int64(100*(i+1)))
	}
	for i, r := range reqs {
		if got := time.Duration(c.queue[i].due - t0); got != r.want {
			t.Fatalf("request %d due at +%v, want +%v (all: %+v)", i, got, r.want, c.queue)
		}
	}

	// The broker starts on a request once the one ahead is answered: one
	// it may hold is due its hold and request_timeout from then, when that
	// is later, and those behind it with it.
	for _, a := range []struct {
		at   time.Duration // the answer, from t0
		want []time.Duration
	}{
		// The first Produce held its whole 10s: the second starts now.
		{10 * time.Second, []time.Duration{23 * time.Second, 23 * time.Second, 33030 * time.Millisecond, 33030 * time.Millisecond}},
		// The second answered at once: the Metadata holds nothing (the
		// answer covers it), nothing moves.
		{10001 * time.Millisecond, []time.Duration{23 * time.Second, 33030 * time.Millisecond, 33030 * time.Millisecond}},
		// The Metadata answered 5s later: the Fetch starts then.
		{15001 * time.Millisecond, []time.Duration{48001 * time.Millisecond, 48001 * time.Millisecond}},
	} {
		c.kafkaResponse(c.queue[c.head].id)
		c.kafkaAnswered(t0+int64(a.at), 0) // the response read to its end
		for i, want := range a.want {
			if got := time.Duration(c.queue[c.head+i].due - t0); got != want {
				t.Fatalf("answered at +%v: request %d due at +%v, want +%v", a.at, c.queue[c.head+i].id, got, want)
			}
		}
	}
}

func TestAddDueSaturates(t *testing.T) {
	if got := addDue(10, 5, 5); got != 20 {
		t.Fatalf("addDue(10, 5, 5) = %d", got)
	}
	for _, ds := range [][]int64{{math.MaxInt64}, {math.MaxInt64 - 5, 10}, {-1}, {flow.Never}} {
		if got := addDue(10, ds...); got != flow.Never {
			t.Fatalf("addDue(10, %v) = %d, want never", ds, got)
		}
	}
}

// A link the proxy cut for a reason that is no evidence against the
// server leaves nothing for the endpoint to judge: its requests' answers
// could no longer be seen, and a quiet client's silence would be taken
// for the server's. Here a Kafka client ends its stream inside a frame
// (bad_frame) with a Metadata request in flight to a live broker; the
// twin (a client that closes while its request is in flight to a
// silent server, TestUnansweredCountsAfterClientCloses) still hands its
// requests on.
func TestProxyCutLinkLeavesNoOrphans(t *testing.T) {
	broker := startKafkaBroker(t, func(int16, int32) (time.Duration, bool) {
		return 150 * time.Millisecond, true // live, a little slow
	})
	h := start(t, broker.ln.Addr().String(), kafkaProfile(300*time.Millisecond, 1))
	c := h.dial()
	if _, err := c.Write(append(metadataReq(1), metadataReq(2)[:6]...)); err != nil { // one request, then half of one
		t.Fatal(err)
	}
	_ = c.CloseWrite()
	if st := h.linkEnd(2 * time.Second); st.Reason != CloseBadFrame {
		t.Fatalf("link ended %s, want bad_frame", st.Reason)
	}
	// The link's requests are handed on (or not) before its end is reported.
	ep := h.p.lookupEndpoint(broker.ln.Addr().String())
	if n := ep.orphans.Pending(); n != 0 {
		t.Fatalf("the endpoint holds %d request(s) of a link the proxy cut for a client's bad frame, want 0", n)
	}
	time.Sleep(600 * time.Millisecond) // past the request's deadline (300ms) and the slack
	if st := h.endpoint(); st.State != "healthy" {
		t.Fatalf("live broker is %s (%s) after a client's bad frame: %s", st.State, st.Reason, st.Evidence)
	}
}

// An operator's evict of a live Pinot server's link, a query in flight,
// and no other query for a while: the server is not judged by the query
// the evict took away.
func TestEvictedLinkLeavesNoOrphans(t *testing.T) {
	srv, err := pinotsim.NewServer(pinotsim.ServerConfig{Delay: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	h := start(t, srv.Addr(), func(s *policy.Settings) {
		s.Framing.Type = policy.FramingPinot
		s.Detector.Probe = policy.ProbeKindConnect
		s.Detector.InitialDelay = policy.Duration(10 * time.Second)
	})
	c := h.dial()
	payload := pinotsim.AppendRequest(nil, &pinotsim.Request{ID: 1, Table: "t_OFFLINE", TimeoutMs: 500})
	if _, err := c.Write(lptestutil.LengthPrefixed(payload)); err != nil {
		t.Fatal(err)
	}
	lk := h.onlyLink(5 * time.Second)
	for deadline := time.Now().Add(5 * time.Second); lk.trk.Pending() < 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the link did not record the query within 5s")
		}
	}
	if n, err := h.p.Evict(h.endpoint().Endpoint); err != nil || n != 1 {
		t.Fatalf("evict: %d, %v", n, err)
	}
	if st := h.linkEnd(2 * time.Second); st.Reason != CloseEvicted {
		t.Fatalf("link ended %s, want evicted", st.Reason)
	}
	if n := h.p.lookupEndpoint(srv.Addr()).orphans.Pending(); n != 0 {
		t.Fatalf("the endpoint holds %d request(s) of a link an operator evicted, want 0", n)
	}
	time.Sleep(2 * time.Second) // past timeoutMs + 1s and the slack
	if st := h.endpoint(); st.State != "healthy" {
		t.Fatalf("live Pinot server is %s (%s) after an operator evict: %s", st.State, st.Reason, st.Evidence)
	}
}

// produceAllReq is an acks=all Produce asking the broker to wait up to
// timeout for its replicas.
func produceAllReq(timeout time.Duration, corr int32) []byte {
	r := kmsg.NewPtrProduceRequest()
	r.Acks = -1
	r.TimeoutMillis = int32(timeout / time.Millisecond)
	return kafkaReq(r, 9, corr)
}

// Two held requests pipelined on one connection, the broker holding each
// for its whole wait: it starts on the second only once it has answered
// the first, so the second may be held for its own wait after that
// (KAFKA.md: a request's legitimate wait includes the holds of every
// request ahead of it). The broker is healthy: it must not be judged.
// Before, the second was due request_timeout after the first's hold, and
// a healthy broker was excluded. The twin is
// TestQueuedHeldRequestOfADeadBrokerIsJudged.
func TestPipelinedHeldRequestsAreNotJudgedEarly(t *testing.T) {
	// The hold longer than request_timeout: the second's answer comes
	// after the deadline it had before (its own send, hold and timeout).
	const hold, rt = 2 * time.Second, 700 * time.Millisecond
	for _, tc := range []struct {
		name string
		key  int16
		req  func(corr int32) []byte
	}{
		{"fetch long polls", 1, func(corr int32) []byte { return fetchReq(hold, corr) }},
		{"acks=all produces", 0, func(corr int32) []byte { return produceAllReq(hold, corr) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			broker := startKafkaBroker(t, func(key int16, _ int32) (time.Duration, bool) {
				if key == tc.key {
					return hold, true // held for its whole wait, as the protocol allows
				}
				return 0, true
			})
			h := start(t, broker.ln.Addr().String(), kafkaProfile(rt, 1))
			c := h.dial()
			if _, err := c.Write(tc.req(1)); err != nil {
				t.Fatal(err)
			}
			time.Sleep(150 * time.Millisecond) // past the judging slack (70ms): two records
			if _, err := c.Write(tc.req(2)); err != nil {
				t.Fatal(err)
			}
			for want := int32(1); want <= 2; want++ {
				if got := readResponse(t, c, 10*time.Second); got != want {
					t.Fatalf("response %d, want %d", got, want)
				}
			}
			h.nothingCounted()
		})
	}
}

// The twin: a broker that answers the first of two queued long polls
// after its hold and then stops is judged by the second's own deadline,
// counted from the first's answer: its hold and request_timeout, and a
// second at most (the judging slack and the time to close its links).
func TestQueuedHeldRequestOfADeadBrokerIsJudged(t *testing.T) {
	const hold, rt = 500 * time.Millisecond, 300 * time.Millisecond
	broker := startKafkaBroker(t, func(_ int16, corr int32) (time.Duration, bool) {
		return hold, corr == 1 // the first held and answered; then nothing
	})
	h := start(t, broker.ln.Addr().String(), kafkaProfile(rt, 1))
	c := h.dial()
	if _, err := c.Write(append(fetchReq(hold, 1), fetchReq(hold, 2)...)); err != nil {
		t.Fatal(err)
	}
	if got := readResponse(t, c, 5*time.Second); got != 1 {
		t.Fatalf("response %d, want 1", got)
	}
	answered := time.Now()
	ep := h.waitState("excluded", hold+rt+3*time.Second)
	if ep.Reason != string(CloseUnanswered) {
		t.Fatalf("excluded for %q, want unanswered", ep.Reason)
	}
	// Not before the second's own deadline, counted from the first answer.
	if took := time.Since(answered); took < hold+rt-50*time.Millisecond {
		t.Fatalf("excluded %v after the first answer, before the second request's hold (%v) and request_timeout (%v) had passed", took, hold, rt)
	}
}

// A stopped broker (its kernel still takes the bytes) with more requests
// pipelined on one connection than a link keeps entries for is still
// judged by the oldest request's deadline. Before, past 1,024 the link
// stopped tracking, and the dead broker was never judged.
func TestThousandsQueuedToADeadBrokerAreJudged(t *testing.T) {
	broker := startKafkaBroker(t, func(int16, int32) (time.Duration, bool) { return 0, false })
	h := start(t, broker.ln.Addr().String(), kafkaProfile(300*time.Millisecond, 1))
	c := h.dial()
	var batch []byte
	for i := range maxOutstanding + 100 { // bounded: about 50 KB, within any socket buffer
		batch = append(batch, metadataReq(int32(i))...)
	}
	if _, err := c.Write(batch); err != nil {
		t.Fatal(err)
	}
	ep := h.waitState("excluded", 300*time.Millisecond+3*time.Second)
	if ep.Reason != string(CloseUnanswered) {
		t.Fatalf("excluded for %q, want unanswered", ep.Reason)
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").Untracked(metrics.UntrackedLimit)); got != 0 {
		t.Fatalf("untracked{reason=limit} = %v, want 0", got)
	}
}

// The twin: as many requests to a broker that answers every one are
// matched to the end (the link stays tracked, in step), and nothing is
// judged.
func TestThousandsQueuedToALiveBrokerStayMatched(t *testing.T) {
	broker := startKafkaBroker(t, func(int16, int32) (time.Duration, bool) { return 0, true })
	h := start(t, broker.ln.Addr().String(), kafkaProfile(2*time.Second, 1))
	c := h.dial()
	const n = maxOutstanding + 100
	var batch []byte
	for i := range n {
		batch = append(batch, metadataReq(int32(i))...)
	}
	go func() { _, _ = c.Write(batch) }() // read below as it is answered
	for i := range n {
		if got := readResponse(t, c, 10*time.Second); got != int32(i) {
			t.Fatalf("response %d, want %d", got, i)
		}
	}
	// One more, after the queue emptied: still matched, still tracked.
	if _, err := c.Write(metadataReq(n)); err != nil {
		t.Fatal(err)
	}
	if got := readResponse(t, c, 10*time.Second); got != n {
		t.Fatalf("response %d, want %d", got, n)
	}
	m := h.m.ForListener("test")
	for _, reason := range []string{metrics.UntrackedLimit, metrics.UntrackedDesync} {
		if got := testutil.ToFloat64(m.Untracked(reason)); got != 0 {
			t.Fatalf("untracked{reason=%s} = %v, want 0", reason, got)
		}
	}
	if got := testutil.ToFloat64(m.UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
	if lk := h.onlyLink(time.Second); lk.conv.off.Load() {
		t.Fatal("the link is no longer tracked")
	}
}

// A Pinot request is due by its own timeoutMs plus a second; one that
// carries no timeoutMs runs under the server's default (15s, PINOT.md),
// and is due then plus a second, or at request_timeout plus a second where
// that is longer. Before, it was due at request_timeout (3s by default).
func TestPinotRequestDeadlines(t *testing.T) {
	for _, tc := range []struct {
		name string
		rt   time.Duration
		req  pinotwire.Request
		want time.Duration
	}{
		{"own timeoutMs", 3 * time.Second, pinotwire.Request{Timeout: 500 * time.Millisecond, HasTimeout: true}, 1500 * time.Millisecond},
		{"no timeoutMs: the server's default", 3 * time.Second, pinotwire.Request{}, 16 * time.Second},
		{"no timeoutMs, a longer request_timeout", 20 * time.Second, pinotwire.Request{}, 21 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var answer atomic.Int64
			answer.Store(flow.NoAnswer)
			lk := &link{}
			lk.trk = flow.NewTracker(time.Millisecond, false, &answer, func([]flow.PendingRequest, int) {})
			defer lk.trk.Stop()
			c := &conv{lk: lk, profile: true, rt: int64(tc.rt), thr: 1}
			c.sendAt = flow.Mono()
			c.pinotRequest(&tc.req, 100)
			if got := time.Duration(lk.trk.NextDue() - c.sendAt); got != tc.want {
				t.Fatalf("due %v after it was sent, want %v", got, tc.want)
			}
		})
	}
}

// A live Pinot server answers a query that carries no timeoutMs in 4s,
// within the server's own default (15s) but past request_timeout (3s):
// it is not judged.
func TestPinotQueryWithoutTimeoutIsNotJudgedAtRequestTimeout(t *testing.T) {
	srv, err := pinotsim.NewServer(pinotsim.ServerConfig{Delay: 4 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	h := start(t, srv.Addr(), func(s *policy.Settings) {
		s.Framing.Type = policy.FramingPinot // request_timeout: the default, 3s
		s.Detector.Probe = policy.ProbeKindConnect
		s.Detector.InitialDelay = policy.Duration(10 * time.Second)
	})
	c := h.dial()
	payload := pinotsim.AppendRequest(nil, &pinotsim.Request{ID: 1, Table: "t_OFFLINE"}) // no timeoutMs
	if _, err := c.Write(lptestutil.LengthPrefixed(payload)); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var hdr [4]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		t.Fatalf("no answer: %v", err)
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("live Pinot server is %s (%s): %s", ep.State, ep.Reason, ep.Evidence)
	}
}

// Past 1,024 outstanding, two long polls held their whole wait join one
// entry: the second's hold starts when the first is answered, as a
// request's of its own would.
func TestMergedHeldRequestsStartInTurn(t *testing.T) {
	const hold, rt = 2 * time.Second, 700 * time.Millisecond
	broker := startKafkaBroker(t, func(key int16, corr int32) (time.Duration, bool) {
		if key == 1 {
			return hold, true
		}
		if corr == 0 {
			return 300 * time.Millisecond, true
		}
		return 0, true
	})
	h := start(t, broker.ln.Addr().String(), kafkaProfile(rt, 1))
	c := h.dial()
	var batch []byte
	for i := range maxOutstanding - 1 {
		batch = append(batch, metadataReq(int32(i))...)
	}
	batch = append(batch, fetchReq(hold, 5000)...)
	batch = append(batch, fetchReq(hold, 5001)...)
	if _, err := c.Write(batch); err != nil {
		t.Fatal(err)
	}
	for i := range maxOutstanding - 1 {
		if got := readResponse(t, c, 10*time.Second); got != int32(i) {
			t.Fatalf("response %d, want %d", got, i)
		}
	}
	for want := int32(5000); want <= 5001; want++ {
		if got := readResponse(t, c, 10*time.Second); got != want {
			t.Fatalf("response %d, want %d", got, want)
		}
	}
	h.nothingCounted()
}

// A broker writes a response whole before it reads the connection's next
// request: a request held behind a large answer that streams for 1.2s
// (more than request_timeout) starts its hold when that answer ends, not
// when its first bytes came.
func TestHoldStartsWhenTheAnswerAheadEnds(t *testing.T) {
	const hold, rt = 2 * time.Second, 700 * time.Millisecond
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done, served := make(chan struct{}), make(chan struct{})
	defer func() { close(done); <-served }()
	go func() {
		defer close(served)
		s, err := ln.Accept()
		if err != nil {
			return
		}
		defer s.Close()
		read := func() int32 {
			var hdr [4]byte
			if _, err := io.ReadFull(s, hdr[:]); err != nil {
				return -1
			}
			p := make([]byte, binary.BigEndian.Uint32(hdr[:]))
			if _, err := io.ReadFull(s, p); err != nil {
				return -1
			}
			return int32(binary.BigEndian.Uint32(p[4:]))
		}
		corr := read()
		const chunks, size = 12, 1024
		resp := binary.BigEndian.AppendUint32(nil, 4+chunks*size)
		resp = binary.BigEndian.AppendUint32(resp, uint32(corr))
		_, _ = s.Write(resp)
		for range chunks {
			time.Sleep(100 * time.Millisecond)
			_, _ = s.Write(make([]byte, size))
		}
		corr = read()
		time.Sleep(hold)
		resp = binary.BigEndian.AppendUint32(nil, 8)
		resp = binary.BigEndian.AppendUint32(resp, uint32(corr))
		_, _ = s.Write(append(resp, 0, 0, 0, 0))
		<-done
	}()
	h := start(t, ln.Addr().String(), kafkaProfile(rt, 1))
	c := h.dial()
	if _, err := c.Write(append(fetchReq(hold, 1), fetchReq(hold, 2)...)); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.CopyN(io.Discard, c, 8+12*1024+12); err != nil {
		t.Fatalf("reading both answers: %v", err)
	}
	h.nothingCounted()
}

// nothingCounted fails the test if the listener counted a request
// unanswered or its endpoint is not healthy.
func (h *harness) nothingCounted() {
	h.t.Helper()
	if got := testutil.ToFloat64(h.m.ForListener("test").UnansweredTimeouts); got != 0 {
		h.t.Errorf("unanswered_timeouts_total = %v, want 0", got)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		h.t.Errorf("healthy upstream is %s (%s): %s", ep.State, ep.Reason, ep.Evidence)
	}
}

func listOffsetsReq(corr int32) []byte {
	return kafkaReq(kmsg.NewPtrListOffsetsRequest(), 10, corr) // v10: a timeout_ms the proxy does not read
}

// A Fetch queued behind a request whose hold the proxy does not read (a
// ListOffsets v10, never judged) is judged once that one is answered:
// its own hold and request_timeout from then. The broker answers the
// ListOffsets and then nothing more; the Fetch is the evidence.
func TestHeldRequestBehindAnUnknownHoldIsJudged(t *testing.T) {
	const rt, wait = 300 * time.Millisecond, 500 * time.Millisecond
	broker := startKafkaBroker(t, func(key int16, _ int32) (time.Duration, bool) {
		return 200 * time.Millisecond, key == 2 // ListOffsets answered, the Fetch never
	})
	h := start(t, broker.ln.Addr().String(), kafkaProfile(rt, 1))
	c := h.dial()
	sent := time.Now()
	if _, err := c.Write(append(listOffsetsReq(1), fetchReq(wait, 2)...)); err != nil {
		t.Fatal(err)
	}
	if id := readResponse(t, c, 5*time.Second); id != 1 {
		t.Fatalf("response %d, want 1", id)
	}
	ep := h.waitState("excluded", 10*time.Second)
	if d := ep.Since.Sub(sent); d < 200*time.Millisecond+wait+rt {
		t.Fatalf("excluded %v after the requests, before the Fetch's own deadline from the answer ahead", d)
	}
	if ep.Reason != string(CloseUnanswered) {
		t.Fatalf("excluded for %s, want unanswered", ep.Reason)
	}
}

// Its healthy twin: the broker holds the Fetch for its whole max_wait
// after answering the ListOffsets ahead of it (and the ListOffsets
// itself for longer than request_timeout); nothing is counted.
func TestHeldRequestBehindAnUnknownHoldHeldInFull(t *testing.T) {
	const rt, wait = time.Second, 800 * time.Millisecond
	broker := startKafkaBroker(t, func(key int16, _ int32) (time.Duration, bool) {
		if key == 2 {
			return 2 * rt, true
		}
		return wait, true
	})
	h := start(t, broker.ln.Addr().String(), kafkaProfile(rt, 1))
	c := h.dial()
	if _, err := c.Write(append(listOffsetsReq(1), fetchReq(wait, 2)...)); err != nil {
		t.Fatal(err)
	}
	for want := int32(1); want <= 2; want++ {
		if id := readResponse(t, c, 5*time.Second); id != want {
			t.Fatalf("response %d, want %d", id, want)
		}
	}
	h.nothingCounted()
	if h.p.ActiveLinks() != 1 {
		t.Fatal("the link was cut")
	}
}

// A broker closes the connection instead of answering a request it will
// not serve (an oversize Produce, an acks=0 Produce that failed, an
// unparseable header: KAFKA.md, "close all outstanding entries at EOF").
// Here it answers a Metadata request, then closes on the Produce behind
// it: the Produce is no evidence, and the broker, otherwise quiet, stays
// healthy past the Produce's deadline. Before, the link's requests were
// handed to the endpoint and a live broker was excluded for a client's
// bad request. The twin is TestBrokerThatClosesUnansweredIsJudged.
func TestBrokerThatClosesAfterAnsweringOwesNothing(t *testing.T) {
	for _, reset := range []bool{false, true} {
		name := "FIN, the client slow to close"
		if reset {
			name = "reset"
		}
		t.Run(name, func(t *testing.T) { brokerClosesAfterAnswering(t, reset) })
	}
}

func brokerClosesAfterAnswering(t *testing.T, reset bool) {
	b := &kafkaBroker{ln: listenLoopback(t), serveConn: func(c net.Conn, _ <-chan struct{}) {
		for n := 0; ; n++ {
			p, ok := readKafkaRequest(c)
			if !ok || n > 0 {
				if reset {
					_ = c.(*net.TCPConn).SetLinger(0)
				}
				_ = c.Close() // the Produce: refused by closing
				return
			}
			resp := binary.BigEndian.AppendUint32(nil, 8)
			resp = append(resp, p[4:8]...) // the correlation id
			resp = append(resp, 0, 0, 0, 0)
			if _, err := c.Write(resp); err != nil {
				return
			}
		}
	}}
	runKafkaBroker(t, b)
	h := start(t, b.ln.Addr().String(), kafkaProfile(300*time.Millisecond, 1))
	c := h.dial()
	if _, err := c.Write(metadataReq(1)); err != nil {
		t.Fatal(err)
	}
	if id := readResponse(t, c, 5*time.Second); id != 1 {
		t.Fatalf("response %d, want 1", id)
	}
	if _, err := c.Write(produceReq(1, 2)); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, _ = io.Copy(io.Discard, c) // to the broker's FIN, or its reset
	if !reset {
		// The link is half-closed past the Produce's deadline (timeout_ms
		// 1s + 300ms) and the slack: nothing is judged meanwhile.
		time.Sleep(1500 * time.Millisecond)
	}
	_ = c.Close()
	if st := h.linkEnd(5 * time.Second); st.Reason != CloseUpstreamClosed && st.Reason != CloseUpstreamError {
		t.Fatalf("link ended %s, want the upstream's close", st.Reason)
	}
	if n := h.p.lookupEndpoint(b.ln.Addr().String()).orphans.Pending(); n != 0 {
		t.Fatalf("the endpoint holds %d request(s) of a link its broker closed after answering on it, want 0", n)
	}
	if reset {
		time.Sleep(1500 * time.Millisecond) // past the Produce's deadline and the slack
	}
	if st := h.endpoint(); st.State != "healthy" {
		t.Fatalf("live broker is %s (%s) after closing on a request it would not serve: %s", st.State, st.Reason, st.Evidence)
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
}

// The twin: a broker that accepts, reads the request and closes without
// a byte, every time, is not taken at its word: the request is handed to
// the endpoint and judged by its deadline.
func TestBrokerThatClosesUnansweredIsJudged(t *testing.T) {
	b := &kafkaBroker{ln: listenLoopback(t), serveConn: func(c net.Conn, _ <-chan struct{}) {
		readKafkaRequest(c)
		_ = c.Close()
	}}
	runKafkaBroker(t, b)
	h := start(t, b.ln.Addr().String(), kafkaProfile(300*time.Millisecond, 1))
	c := h.dial()
	sent := time.Now()
	if _, err := c.Write(metadataReq(1)); err != nil {
		t.Fatal(err)
	}
	closeOnEOF(t, c)
	if st := h.linkEnd(5 * time.Second); st.Reason != CloseUpstreamClosed && st.Reason != CloseUpstreamError {
		t.Fatalf("link ended %s, want the upstream's close", st.Reason)
	}
	h.excludedUnanswered(sent, 300*time.Millisecond, 300*time.Millisecond+2*time.Second)
}

// closeOnEOF reads c to its end, as a client does whose server closed
// the connection, then closes it.
func closeOnEOF(t *testing.T, c net.Conn) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("reading to the server's close: %v", err)
	}
	_ = c.Close()
}

// sentALongQuery starts a proxy (pinot, threshold 1, request_timeout rt
// unless 0) in front of addr, and sends it a query (timeoutMs 60s) whose
// timeoutMs lies past the proxy's parser's prefix limit (a filter with a
// long IN list before it); it returns once the answer came and checks
// that the query was left unjudged.
func sentALongQuery(t *testing.T, addr string, rt time.Duration) (*harness, net.Conn, *metrics.Listener) {
	t.Helper()
	h := start(t, addr, func(s *policy.Settings) {
		s.Framing.Type = policy.FramingPinot
		if rt > 0 {
			s.Unanswered.RequestTimeout = policy.Duration(rt)
		}
		s.Unanswered.ConsecutiveTimeoutsThreshold = 1
		s.Detector.Probe = policy.ProbeKindConnect
		s.Detector.InitialDelay = policy.Duration(10 * time.Second)
	})
	c := h.dial()
	q := pinotsim.AppendRequest(nil, &pinotsim.Request{ID: 1, Table: "t_OFFLINE", TimeoutMs: 60_000, Filter: pinotwire.MaxRequestPrefix + 1024})
	if _, err := c.Write(lptestutil.LengthPrefixed(q)); err != nil {
		t.Fatal(err)
	}
	readFrame(t, c, 10*time.Second)
	m := h.m.ForListener("test")
	if got := testutil.ToFloat64(m.RequestsUnjudged); got != 1 {
		t.Fatalf("requests_unjudged_total = %v, want 1", got)
	}
	return h, c, m
}

// A query too long for the proxy to read its timeoutMs is forwarded and
// left unjudged, and only it: the link stays tracked, so a server that
// hangs later on the broker's one connection to it is still excluded by
// the next query's own deadline. Before, one long query untracked the
// link for good. The twin is TestPinotLongQueryIsNotJudged.
func TestPinotLongQueryLeavesTheLinkTracked(t *testing.T) {
	srv, err := pinotsim.NewServer(pinotsim.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	h, c, m := sentALongQuery(t, srv.Addr(), 0)
	stillTracked(t, m, "a long query")
	srv.SetSilent(true) // hangs
	excludedByItsDeadline(t, h, c)
}

// The twin: a long query whose timeoutMs the proxy cannot read, answered
// late (2s, ten times request_timeout, within its own 60s), on a link with
// nothing else going on, is not judged: its deadline is unknown, and no
// guess (request_timeout, the server's default) is the query's own.
func TestPinotLongQueryIsNotJudged(t *testing.T) {
	srv, err := pinotsim.NewServer(pinotsim.ServerConfig{Delay: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	h, _, m := sentALongQuery(t, srv.Addr(), 200*time.Millisecond)
	if got := testutil.ToFloat64(m.UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s), want healthy", ep.State, ep.Reason)
	}
}

// A Pinot response longer than max_frame_length (Pinot's have no
// practical cap) ends only the check for responses cut short: the link's
// queries stay judged, and a server that hangs after it is excluded by
// the next query's deadline. Before, the link was untracked for good.
func TestPinotLongResponseLeavesTheLinkTracked(t *testing.T) {
	const long = 2 << 20
	addr := serveConns(t, listenLoopback(t), func(c net.Conn, _ <-chan struct{}) {
		for n := 0; ; n++ {
			var hdr [4]byte
			if _, err := io.ReadFull(c, hdr[:]); err != nil {
				return
			}
			if _, err := io.CopyN(io.Discard, c, int64(binary.BigEndian.Uint32(hdr[:]))); err != nil || n > 0 {
				continue // the second query: hangs
			}
			resp := binary.BigEndian.AppendUint32(nil, long)
			if _, err := c.Write(append(resp, make([]byte, long)...)); err != nil {
				return
			}
		}
	})
	h := start(t, addr, func(s *policy.Settings) {
		s.Framing.Type = policy.FramingPinot
		s.Framing.MaxFrameLength = 1 << 20
		s.Unanswered.ConsecutiveTimeoutsThreshold = 1
		s.Detector.Probe = policy.ProbeKindConnect
		s.Detector.InitialDelay = policy.Duration(10 * time.Second)
	})
	c := h.dial()
	t.Cleanup(func() { _ = c.Close() })
	payload := pinotsim.AppendRequest(nil, &pinotsim.Request{ID: 1, Table: "t_OFFLINE", TimeoutMs: 5000})
	if _, err := c.Write(lptestutil.LengthPrefixed(payload)); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.CopyN(io.Discard, c, 4+long); err != nil {
		t.Fatalf("reading the long response: %v", err)
	}
	m := h.m.ForListener("test")
	stillTracked(t, m, "a long response")
	excludedByItsDeadline(t, h, c)
}

// stillTracked fails the test if the listener untracked a link.
func stillTracked(t *testing.T, m *metrics.Listener, after string) {
	t.Helper()
	for _, r := range metrics.UntrackedReasons {
		if got := testutil.ToFloat64(m.Untracked(r)); got != 0 {
			t.Fatalf("untracked{%s} = %v after %s: the link should still be tracked", r, got, after)
		}
	}
}

// excludedByItsDeadline sends a Pinot query (timeoutMs 300) on c to a
// server that answers nothing more, and checks that the endpoint is
// excluded for it, not before its deadline (timeoutMs plus 1s).
func excludedByItsDeadline(t *testing.T, h *harness, c net.Conn) {
	t.Helper()
	sent := time.Now()
	payload := pinotsim.AppendRequest(nil, &pinotsim.Request{ID: 2, Table: "t_OFFLINE", TimeoutMs: 300})
	if _, err := c.Write(lptestutil.LengthPrefixed(payload)); err != nil {
		t.Fatal(err)
	}
	h.excludedUnanswered(sent, 1300*time.Millisecond, 10*time.Second) // timeoutMs plus the 1s slack
}

// A frame that is no InstanceRequest gets no reply from a Pinot server,
// by design (it fails to deserialize; PINOT.md): it is forwarded and left
// unjudged, and the link stays tracked, so a server that hangs later is
// excluded by the next query's deadline. Before, one such frame untracked
// the broker's one connection to the server for good. The twin,
// TestPinotGarbageFrameIsNotJudged, waits past any deadline a guess would
// give the frame.
func TestPinotGarbageFrameLeavesTheLinkTracked(t *testing.T) {
	srv, err := pinotsim.NewServer(pinotsim.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	h, c, m := sentAGarbageFrame(t, srv)
	stillTracked(t, m, "a frame that is no request")
	srv.SetSilent(true)
	excludedByItsDeadline(t, h, c)
}

func TestPinotGarbageFrameIsNotJudged(t *testing.T) {
	srv, err := pinotsim.NewServer(pinotsim.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	h, _, m := sentAGarbageFrame(t, srv)
	time.Sleep(200*time.Millisecond + pinotTimeoutSlack + 300*time.Millisecond) // past request_timeout and the slack
	if got := testutil.ToFloat64(m.UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s), want healthy", ep.State, ep.Reason)
	}
}

// sentAGarbageFrame starts a proxy (pinot, request_timeout 200ms,
// threshold 1) in front of srv and sends it a frame that is no
// InstanceRequest; it returns once the server has dropped it and checks
// that the frame was left unjudged.
func sentAGarbageFrame(t *testing.T, srv *pinotsim.Server) (*harness, net.Conn, *metrics.Listener) {
	t.Helper()
	h := start(t, srv.Addr(), func(s *policy.Settings) {
		s.Framing.Type = policy.FramingPinot
		s.Unanswered.RequestTimeout = policy.Duration(200 * time.Millisecond)
		s.Unanswered.ConsecutiveTimeoutsThreshold = 1
		s.Detector.Probe = policy.ProbeKindConnect
		s.Detector.InitialDelay = policy.Duration(10 * time.Second)
	})
	c := h.dial()
	if _, err := c.Write(lptestutil.LengthPrefixed([]byte{0x18, 1, 2, 3})); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); srv.Stats().BadFrames < 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the server did not drop the frame within 5s")
		}
	}
	m := h.m.ForListener("test")
	if got := testutil.ToFloat64(m.RequestsUnjudged); got != 1 {
		t.Fatalf("requests_unjudged_total = %v, want 1", got)
	}
	return h, c, m
}

// initProducerIDReq is a transactional producer's InitProducerId asking
// for a transaction timeout (v1: header v1; v2+: flexible, header v2).
func initProducerIDReq(version int16, txn string, timeout time.Duration, corr int32) []byte {
	r := kmsg.NewPtrInitProducerIDRequest()
	r.TransactionalID = kmsg.StringPtr(txn)
	r.TransactionTimeoutMillis = int32(timeout / time.Millisecond)
	r.ProducerID, r.ProducerEpoch = -1, -1
	return kafkaReq(r, version, corr)
}

// endTxnReq commits transactional id txn's transaction (v3, flexible).
func endTxnReq(txn string, corr int32) []byte {
	r := kmsg.NewPtrEndTxnRequest()
	r.TransactionalID, r.ProducerID, r.ProducerEpoch, r.Commit = txn, 7, 0, true
	return kafkaReq(r, 3, corr)
}

// addPartitionsToTxnReq adds a partition to txn's transaction (v1, header
// v1).
func addPartitionsToTxnReq(txn string, corr int32) []byte {
	r := kmsg.NewPtrAddPartitionsToTxnRequest()
	r.TransactionalID, r.ProducerID, r.ProducerEpoch = txn, 7, 0
	topic := kmsg.NewAddPartitionsToTxnRequestTopic()
	topic.Topic, topic.Partitions = "events", []int32{0}
	r.Topics = append(r.Topics, topic)
	return kafkaReq(r, 1, corr)
}

// The transaction coordinator writes to the transaction log with acks=all
// and the transaction's own timeout (transaction.timeout.ms, which the
// producer's InitProducerId sets; 60 s by default, up to the broker's
// transaction.max.timeout.ms, 15 min): a healthy broker whose
// __transaction_state replicas lag holds EndTxn and the like that long.
// Here it holds each for 6.5 s, past the 5 s + request_timeout they were
// due at before (a false exclusion then); nothing may be counted:
//   - after an InitProducerId of the same transactional id on the link,
//     asking for 9 s: bound by those 9 s;
//   - with no InitProducerId of that id on the link (the client
//     reconnected since, or it named another id): bound by 15 min;
//   - the InitProducerId itself: the coordinator first aborts the id's
//     open transaction with that transaction's timeout, set by an earlier
//     InitProducerId, so its own 1 s does not bound it.
//
// The twin is TestTxnOfADeadBrokerJudgedAtItsTransactionTimeout.
func TestTxnHeldWithinItsTransactionTimeoutNotCounted(t *testing.T) {
	const rt, held, timeout = 300 * time.Millisecond, 6500 * time.Millisecond, 9 * time.Second
	for _, tc := range []struct {
		name string
		reqs [][]byte // sent in turn, each once the one before is answered
		held int16    // the api key the broker holds
	}{
		{"EndTxn after InitProducerId", [][]byte{initProducerIDReq(4, "app-tx", timeout, 1), endTxnReq("app-tx", 2)}, 26},
		{"AddPartitionsToTxn v1 after InitProducerId v1", [][]byte{initProducerIDReq(1, "app-tx", timeout, 1), addPartitionsToTxnReq("app-tx", 2)}, 24},
		{"EndTxn without InitProducerId", [][]byte{endTxnReq("app-tx", 1)}, 26},
		{"EndTxn of another transactional id", [][]byte{initProducerIDReq(4, "other-tx", time.Second, 1), endTxnReq("app-tx", 2)}, 26},
		{"InitProducerId aborting an open transaction", [][]byte{initProducerIDReq(4, "app-tx", time.Second, 1)}, 22},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			broker := startKafkaBroker(t, func(key int16, _ int32) (time.Duration, bool) {
				if key == tc.held {
					return held, true
				}
				return 0, true
			})
			h := start(t, broker.ln.Addr().String(), kafkaProfile(rt, 1))
			c := h.dial()
			for i, req := range tc.reqs {
				if _, err := c.Write(req); err != nil {
					t.Fatal(err)
				}
				if got := readResponse(t, c, held+10*time.Second); got != int32(i+1) {
					t.Fatalf("response %d, want %d", got, i+1)
				}
			}
			h.nothingCounted()
			if h.p.ActiveLinks() != 1 {
				t.Fatal("the link was cut")
			}
		})
	}
}

// The twin: a broker that answers the InitProducerId (transaction timeout
// 7 s) and then never the EndTxn is excluded once that timeout and
// request_timeout have passed since the EndTxn was sent, not before (at
// the 5 s + request_timeout it was due at before).
func TestTxnOfADeadBrokerJudgedAtItsTransactionTimeout(t *testing.T) {
	const rt, timeout = 300 * time.Millisecond, 7 * time.Second
	broker := startKafkaBroker(t, func(key int16, _ int32) (time.Duration, bool) {
		return 0, key == 22
	})
	h := start(t, broker.ln.Addr().String(), kafkaProfile(rt, 1))
	c := h.dial()
	if _, err := c.Write(initProducerIDReq(4, "app-tx", timeout, 1)); err != nil {
		t.Fatal(err)
	}
	if got := readResponse(t, c, 5*time.Second); got != 1 {
		t.Fatalf("response %d, want 1", got)
	}
	sent := time.Now() // before the write: its deadline cannot start earlier
	if _, err := c.Write(endTxnReq("app-tx", 2)); err != nil {
		t.Fatal(err)
	}
	h.excludedUnanswered(sent, timeout+rt, timeout+rt+10*time.Second) // its transaction timeout and request_timeout
}

// A link remembers, per transactional id, the longest transaction timeout
// its InitProducerIds asked for, and at most maxTxnIDs ids: a request of
// an id past those keeps kafkawire's bound.
func TestTxnTimeoutsPerLink(t *testing.T) {
	c := &conv{kafka: true}
	c.txnTimeout(1, 9*time.Second)
	c.txnTimeout(1, time.Second) // a later, shorter one: the transaction may keep the longer
	if got := c.txnTimeouts[1]; got != 9*time.Second {
		t.Fatalf("id 1: %v, want the longest asked, 9s", got)
	}
	for id := uint64(2); id <= maxTxnIDs+1; id++ {
		c.txnTimeout(id, time.Second)
	}
	if _, ok := c.txnTimeouts[maxTxnIDs+1]; ok || len(c.txnTimeouts) != maxTxnIDs {
		t.Fatalf("%d ids remembered, want at most %d", len(c.txnTimeouts), maxTxnIDs)
	}
	c.txnTimeout(1, 20*time.Second) // a known id is still updated when full
	if got := c.txnTimeouts[1]; got != 20*time.Second {
		t.Fatalf("id 1: %v, want 20s", got)
	}
}

// Only the upstream's own close excuses its link's requests: its FIN or
// its reset, after it answered on the link. An error that says the path
// is gone (a host unreachable once the retransmissions ran out) does not.
func TestOnlyTheUpstreamsCloseExcusesItsRequests(t *testing.T) {
	for _, tc := range []struct {
		reason  CloseReason
		err     error
		excused bool
	}{
		{CloseUpstreamClosed, nil, true},
		{CloseUpstreamError, syscall.ECONNRESET, true},
		{CloseUpstreamError, syscall.EPIPE, true},
		{CloseUpstreamError, syscall.EHOSTUNREACH, false},
		{CloseUpstreamError, syscall.ENETUNREACH, false},
		{CloseUpstreamTimeout, syscall.ETIMEDOUT, false},
	} {
		lk := &link{}
		lk.bytesDown.Store(10)
		lk.setReason(tc.reason, tc.err)
		if got := lk.upstreamEndedAfterAnswers(); got != tc.excused {
			t.Errorf("%s (%v) after answers: excused %v, want %v", tc.reason, tc.err, got, tc.excused)
		}
		lk.bytesDown.Store(0)
		if lk.upstreamEndedAfterAnswers() {
			t.Errorf("%s (%v) before any answer: excused", tc.reason, tc.err)
		}
	}
}

// A transaction's hold (here 60 s) outlasts a client's own wait: one that
// gives up and closes (at 1 s here; 30 s in Java) abandons an EndTxn to a
// coordinator that never answers. Abandoned, it is judged by the bound it
// had before the transaction's timeout was read (5 s and request_timeout
// from its send), so a stopped coordinator seen only by transactional
// clients is still excluded. Before, it was never judged: the client's
// close took its requests away. The twin is
// TestTxnAbandonedToALiveBrokerIsNotCounted.
func TestTxnAbandonedByItsClientIsJudged(t *testing.T) {
	const rt = 300 * time.Millisecond
	broker := startKafkaBroker(t, func(key int16, _ int32) (time.Duration, bool) { return 0, key == 22 })
	h := start(t, broker.ln.Addr().String(), kafkaProfile(rt, 1))
	sent := abandonAnEndTxn(t, h)
	h.excludedUnanswered(sent, kafkaTxnAbandonedHold+rt, kafkaTxnAbandonedHold+rt+5*time.Second) // its abandoned bound
}

// The twin: the same abandoned EndTxn to a coordinator that answers
// another client's requests meanwhile is not counted: the coordinator is
// alive.
func TestTxnAbandonedToALiveBrokerIsNotCounted(t *testing.T) {
	broker := startKafkaBroker(t, func(key int16, _ int32) (time.Duration, bool) { return 0, key != 26 })
	h := start(t, broker.ln.Addr().String(), kafkaProfile(300*time.Millisecond, 1))
	sent := abandonAnEndTxn(t, h)
	other := h.dial()
	for i := int32(1); time.Since(sent) < kafkaTxnAbandonedHold+2*time.Second; i++ {
		if _, err := other.Write(metadataReq(i)); err != nil {
			t.Fatal(err)
		}
		readResponse(t, other, 5*time.Second)
		time.Sleep(200 * time.Millisecond)
	}
	h.nothingCounted()
}

// abandonAnEndTxn sends, on a new link to h, an InitProducerId
// (transaction timeout 60 s) and, once answered, an EndTxn, then resets
// the link a second later as a client that gives up may; it returns when
// the EndTxn was sent.
func abandonAnEndTxn(t *testing.T, h *harness) time.Time {
	t.Helper()
	c := h.dial()
	if _, err := c.Write(initProducerIDReq(4, "app-tx", time.Minute, 1)); err != nil {
		t.Fatal(err)
	}
	readResponse(t, c, 5*time.Second)
	sent := time.Now()
	if _, err := c.Write(endTxnReq("app-tx", 2)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	_ = c.SetLinger(0) // gives up: a reset, so the link ends at once
	_ = c.Close()
	if st := h.linkEnd(5 * time.Second); st.Reason != CloseClientError {
		t.Fatalf("link ended %s, want client_error", st.Reason)
	}
	return sent
}

// A Kafka client that stops in the middle of a request's header (here, a
// 30,000-byte client id of which 1,000 bytes came) holds the window the
// profile's parser waits on: it is counted in the memory budget while the
// link lives, and given back when the link ends.
func TestKafkaHeaderWindowCountedInTheBudget(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	h := start(t, peer.Addr(), kafkaProfile(time.Second, 1))
	c := h.dial()
	const idLen = 30000
	head := binary.BigEndian.AppendUint32(nil, uint32(2+2+4+2+idLen+12)) // the frame's length
	head = binary.BigEndian.AppendUint16(head, 1)                        // Fetch: its max_wait_ms lies past the client id
	head = binary.BigEndian.AppendUint16(head, 4)                        // v4
	head = binary.BigEndian.AppendUint32(head, 1)                        // correlation id
	head = binary.BigEndian.AppendUint16(head, idLen)                    // client id length
	if _, err := c.Write(append(head, bytes.Repeat([]byte("c"), 1000)...)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the header's window counted in the budget", func() bool {
		return h.p.budget.Used() >= idLen-4<<10
	})
	_ = c.Close()
	h.linkEnd(5 * time.Second)
	if got := h.p.budget.Used(); got != 0 {
		t.Fatalf("budget used %d after the link ended, want 0", got)
	}
}

// With no room in the memory budget for a request's head that straddles
// reads, the frame is read no further and the link goes untracked
// (untracked_links_total{reason="limit"}), its bytes relayed as before;
// nothing is held. Its twin, with room: the same head is read and the link
// stays tracked, and the room is given back at the frame's end. The head
// here is a Fetch's with a 30,000-byte client id, its first part read by
// the server before the rest is sent, so that it straddles the proxy's
// reads.
func TestKafkaHeaderWithoutRoomInTheBudgetUntracks(t *testing.T) {
	for _, tc := range []struct {
		budget    int64
		untracked float64 // untracked_links_total{reason="limit"}
	}{{16 << 10, 1}, {1 << 20, 0}} {
		t.Run(fmt.Sprintf("budget %d KiB", tc.budget>>10), func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			var read atomic.Int64 // what the server read: it answers nothing
			srv := serveConns(t, ln, func(c net.Conn, _ <-chan struct{}) {
				buf := make([]byte, 64<<10)
				for {
					n, err := c.Read(buf)
					read.Add(int64(n))
					if err != nil {
						return
					}
				}
			})
			h := start(t, srv, kafkaProfile(time.Minute, 1))
			h.p.budget.SetLimit(tc.budget)
			c := h.dial()
			const idLen = 30000
			frame := binary.BigEndian.AppendUint32(nil, uint32(2+2+4+2+idLen+12))
			frame = binary.BigEndian.AppendUint16(frame, 1) // Fetch
			frame = binary.BigEndian.AppendUint16(frame, 4) // v4
			frame = binary.BigEndian.AppendUint32(frame, 1) // correlation id
			frame = binary.BigEndian.AppendUint16(frame, idLen)
			frame = append(frame, bytes.Repeat([]byte("c"), idLen)...)
			frame = append(frame, make([]byte, 12)...) // replica id, max_wait_ms, min_bytes
			for _, end := range []int{1014, len(frame)} {
				if _, err := c.Write(frame[read.Load():end]); err != nil {
					t.Fatal(err)
				}
				waitFor(t, 5*time.Second, "the server read what was sent", func() bool { return read.Load() == int64(end) })
			}
			for _, r := range metrics.UntrackedReasons {
				want := 0.0
				if r == metrics.UntrackedLimit {
					want = tc.untracked
				}
				if got := testutil.ToFloat64(h.m.ForListener("test").Untracked(r)); got != want {
					t.Fatalf("untracked_links_total{reason=%s} = %v, want %v", r, got, want)
				}
			}
			if got := h.p.budget.Windows.Load(); got != 0 {
				t.Fatalf("%d bytes of windows held after the frame, want none", got)
			}
		})
	}
}
