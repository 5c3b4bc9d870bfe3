package proxy

import (
	"encoding/json"
	"net"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// syncBuffer is a log sink safe for the proxy's goroutines.
type syncBuffer struct{ testutil.SyncBuffer }

// lines returns the JSON log lines with the given message.
func (s *syncBuffer) lines(t *testing.T, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(s.String(), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if m["message"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// family returns the gathered metric family name (prefix added).
func family(t *testing.T, m *metrics.Metrics, name string) *dto.MetricFamily {
	t.Helper()
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "livenessproxy_"+name {
			return mf
		}
	}
	return nil
}

// hasLabel reports whether the family has a series with label=value.
// labels are a series' labels by name.
func labels(m *dto.Metric) map[string]string {
	out := map[string]string{}
	for _, lp := range m.GetLabel() {
		out[lp.GetName()] = lp.GetValue()
	}
	return out
}

func hasLabel(mf *dto.MetricFamily, label, value string) bool {
	if mf == nil {
		return false
	}
	for _, m := range mf.GetMetric() {
		for _, lp := range m.GetLabel() {
			if lp.GetName() == label && lp.GetValue() == value {
				return true
			}
		}
	}
	return false
}

// With log.access every finished link is one info line with what an
// HAProxy user expects; an exclusion is one line, with the links it
// closed, the one whose end was the evidence included.
func TestAccessLogAndOneLinePerStateChange(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	var sink syncBuffer
	log := zerolog.New(&sink).Level(zerolog.InfoLevel)
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: cfg.Defaults}}
	p, c := startConfig(t, cfg, Options{Logger: &log, AccessLog: true})
	roundTrip(t, c, []byte("hello"))
	c.Close()
	deadline := time.Now().Add(5 * time.Second)
	for len(sink.lines(t, "link closed")) == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	lines := sink.lines(t, "link closed")
	if len(lines) != 1 {
		t.Fatalf("%d access log lines, want 1", len(lines))
	}
	l := lines[0]
	for _, k := range []string{"listener", "client", "upstream", "request_bytes", "response_bytes", "connect_ms", "connect_attempts", "opened", "duration_ms", "ended_by", "reason", "max_queued"} {
		if _, ok := l[k]; !ok {
			t.Errorf("access log line lacks %q: %v", k, l)
		}
	}
	if l["level"] != "info" || l["request_bytes"] != 5.0 || l["response_bytes"] != 5.0 || l["upstream"] != peer.Addr() ||
		l["reason"] != "client_closed" || l["ended_by"] != "client" || l["connect_attempts"] != 1.0 {
		t.Errorf("access log line %v", l)
	}
	if ms, _ := l["connect_ms"].(float64); ms <= 0 {
		t.Errorf("connect_ms %v: want the connect's time", l["connect_ms"])
	}

	// One line per state change (the detector's own is at debug).
	p.det.Report(p.Endpoints()[0].Endpoint, string(CloseWriteTimeout))
	deadline = time.Now().Add(5 * time.Second)
	for len(sink.lines(t, "endpoint excluded")) == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := len(sink.lines(t, "endpoint excluded")) + len(sink.lines(t, "endpoint state changed")); n != 1 {
		t.Fatalf("%d lines for one exclusion, want 1", n)
	}
	if got := sink.lines(t, "endpoint excluded")[0]["links_closed"]; got != 1.0 {
		t.Errorf("links_closed %v for an exclusion by a link's write timeout, want 1 (that link)", got)
	}
}

// Endpoint-level counters count once per endpoint whatever the number of
// listeners routing to it, so a sum() does not overcount; a listener kind
// has no series it can never produce; queued bytes and link durations are
// exported.
func TestEndpointCountersOncePerEndpoint(t *testing.T) {
	dead := testutil.ClosedAddr(t)
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	s.Detector.InitialDelay = policy.Duration(20 * time.Millisecond)
	s.Detector.MaxDelay = policy.Duration(20 * time.Millisecond)
	s.Detector.Jitter = 0
	cfg.Listeners = []policy.Listener{
		{Name: "a", Listen: "127.0.0.1:0", Upstream: dead, Settings: s},
		{Name: "b", Listen: "127.0.0.1:0", Upstream: dead, Settings: s},
		{Name: "t", Listen: "127.0.0.1:0", Settings: s, Transparent: policy.Transparent{Match: []policy.Match{{CIDR: "10.9.0.0/16"}}}},
	}
	m := metrics.New()
	p := New(cfg, Options{metrics: m})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	p.det.Report(p.Endpoints()[0].Endpoint, string(CloseDialError))
	deadline := time.Now().Add(5 * time.Second)
	for p.Endpoints()[0].FailedProbes < 3 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	p.det.Disable(p.Endpoints()[0].Endpoint, "test") // stops the probes
	failed := p.Endpoints()[0].FailedProbes
	var sum float64
	for _, mm := range family(t, m, "probes_total").GetMetric() {
		for _, lp := range mm.GetLabel() {
			if lp.GetName() == "result" && lp.GetValue() == "fail" {
				sum += mm.GetCounter().GetValue()
			}
		}
	}
	if sum != float64(failed) {
		t.Fatalf("sum(probes_total{result=fail}) = %v over two listeners, want %d (once per probe)", sum, failed)
	}
	closes := family(t, m, "link_closes_total")
	if !hasLabel(closes, "reason", "no_match") || !hasLabel(closes, "reason", "capacity") {
		t.Fatal("the transparent listener's no_match and capacity series are missing")
	}
	for _, mm := range closes.GetMetric() {
		lb := labels(mm)
		listener, reason := lb["listener"], lb["reason"]
		if listener != "t" && (reason == "no_match" || reason == "loop" || reason == "capacity") {
			t.Errorf("pool listener %s has a %s series it can never produce", listener, reason)
		}
	}
	if hasLabel(family(t, m, "dns_errors_total"), "listener", "t") {
		t.Error("the transparent listener has a dns_errors_total series it can never produce")
	}
	if !hasLabel(family(t, m, "queued_bytes"), "listener", "a") {
		t.Error("no queued_bytes series")
	}
	if family(t, m, "link_duration_seconds") == nil {
		t.Error("no link_duration_seconds")
	}
}

// queued_bytes shows what waits in the proxy's queues for a stalled
// upstream.
func TestQueuedBytesGauge(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.WriteTimeout, s.TCPUserTimeout = 0, 0
		s.WriteBuffer = policy.WriteBuffer{HighWaterMark: 4 << 20, LowWaterMark: 1 << 20, OnOverflow: policy.OverflowBackpressure}
	})
	c := h.dial()
	writeAsync(c, 16<<20, 64<<10)
	deadline := time.Now().Add(5 * time.Second)
	for {
		var v float64
		if mf := family(t, h.m, "queued_bytes"); mf != nil {
			v = mf.GetMetric()[0].GetGauge().GetValue()
		}
		if v > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("queued_bytes stayed 0 with a stalled upstream")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// An unanswered exclusion says what it rests on: the status carries when
// the silence began and, in words, how many requests were overdue; the
// suspect line gives the silence and the count as fields; the exclusion's
// line carries the evidence.
func TestUnansweredExclusionShowsItsEvidence(t *testing.T) {
	broker := startKafkaBroker(t, func(int16, int32) (time.Duration, bool) { return 0, false })
	var sink syncBuffer
	log := zerolog.New(&sink).Level(zerolog.InfoLevel)
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	kafkaProfile(300*time.Millisecond, 1)(&s)
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Upstream: broker.ln.Addr().String(), Settings: s}}
	sent := time.Now()
	p, c := startConfig(t, cfg, Options{Logger: &log})
	if _, err := c.Write(metadataReq(1)); err != nil {
		t.Fatal(err)
	}
	var ep EndpointStatus
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if eps := p.Endpoints(); len(eps) == 1 && eps[0].State == "excluded" {
			ep = eps[0]
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not excluded within 10s: %+v", p.Endpoints())
		}
	}
	if ep.EvidenceSince.Before(sent) || !ep.EvidenceSince.Before(ep.Since) ||
		!strings.Contains(ep.Evidence, "1 request(s) past their own deadline") {
		t.Fatalf("status %+v: want evidence since the request was sent (after %v), before the exclusion, naming one overdue request", ep, sent)
	}
	if silence := ep.Since.Sub(ep.EvidenceSince); silence < 300*time.Millisecond {
		t.Fatalf("evidence since %v before the exclusion, want at least the request's deadline (300ms)", silence)
	}
	for deadline := time.Now().Add(5 * time.Second); len(sink.lines(t, "endpoint excluded")) == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no exclusion line logged")
		}
	}
	sus := sink.lines(t, "endpoint suspect: requests past their deadline with the endpoint silent")
	if len(sus) != 1 || sus[0]["overdue_requests"] != float64(1) || sus[0]["silent_ms"].(float64) < 300 {
		t.Fatalf("suspect lines %v: want one with overdue_requests 1 and silent_ms >= 300", sus)
	}
	ex := sink.lines(t, "endpoint excluded")
	if len(ex) != 1 || ex[0]["evidence"] != ep.Evidence || ex[0]["evidence_ms"].(float64) < 300 {
		t.Fatalf("exclusion lines %v: want one carrying the evidence %q", ex, ep.Evidence)
	}
}

// Any client can send frames the proxy cannot follow as fast as it
// likes: each closes its link (bad_frame), every one is logged at debug,
// and at warn at most one line per second per listener, which counts the
// links closed since the line before. Before, every link wrote a warn
// line.
func TestBadFramesWarnOncePerSecond(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	var sink syncBuffer
	log := zerolog.New(&sink).Level(zerolog.DebugLevel)
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	framed(time.Second, 3, nil)(&s)
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Upstream: peer.Addr(), Settings: s}}
	p, first := startConfig(t, cfg, Options{Logger: &log})
	const links = 30
	began := time.Now()
	for i := range links {
		c := first
		if i > 0 {
			nc, err := net.Dial("tcp", p.Addr("test").String())
			if err != nil {
				t.Fatal(err)
			}
			c = nc.(*net.TCPConn)
		}
		// A frame that says 100 bytes, cut after 4: the stream ends inside it.
		if _, err := c.Write([]byte{0, 0, 0, 100, 'p', 'a', 'r', 't'}); err != nil {
			t.Fatal(err)
		}
		_ = c.CloseWrite()
		if err, _ := waitClosed(t, c, 5*time.Second); !isCloseSignal(err) {
			t.Fatalf("link %d saw %v, want it closed", i, err)
		}
		_ = c.Close()
	}
	var lines []map[string]any
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if lines = sink.lines(t, "bad frame: link closed"); len(lines) >= links || time.Now().After(deadline) {
			break
		}
	}
	took := time.Since(began)
	if len(lines) != links {
		t.Fatalf("%d bad-frame lines for %d links, want one each (at debug or warn)", len(lines), links)
	}
	warns, counted := 0, 0.0
	for _, l := range lines {
		if l["level"] == "warn" {
			warns++
			n, _ := l["bad_frames_since_last_line"].(float64)
			counted += n
		}
	}
	// One per second that the links took, and the first at once.
	if most := 1 + int(took/logEvery); warns < 1 || warns > most {
		t.Fatalf("%d warn lines for %d bad frames in %v, want 1 to %d", warns, links, took, most)
	}
	if counted < float64(warns) || counted > links {
		t.Fatalf("the warn lines count %v bad frames, want %d to %d", counted, warns, links)
	}
}

// A logGate lets the first event's line through, holds back the others
// within logEvery, and the next line it lets through counts them.
func TestLogGateCountsWhatItHeldBack(t *testing.T) {
	var g logGate
	if n, ok := g.pass(); !ok || n != 1 {
		t.Fatalf("first event: pass() = %d, %v; want 1, true", n, ok)
	}
	for i := range 99 {
		if _, ok := g.pass(); ok {
			t.Fatalf("event %d within logEvery of the first was let through", i+2)
		}
	}
	g.logged.Store(flow.Mono() - int64(logEvery)) // logEvery later
	if n, ok := g.pass(); !ok || n != 100 {
		t.Fatalf("the next line: pass() = %d, %v; want 100 (99 held back and this one), true", n, ok)
	}
}

// The suspect verdict's line is written once a second at most per
// endpoint, with the verdicts since the last line: under fail-open toward
// a silent endpoint, every link let through comes back to a verdict, as
// often as its clients reconnect (found by a helper's audit). The first
// is always written.
func TestSuspectLineIsRateLimited(t *testing.T) {
	var sink syncBuffer
	log := zerolog.New(&sink).Level(zerolog.InfoLevel)
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Upstream: testutil.ClosedAddr(t), Settings: cfg.Defaults}}
	p := startProxy(t, cfg, Options{Logger: &log})
	ep := p.lookupEndpoint(cfg.Listeners[0].Upstream)
	if ep == nil {
		t.Fatal("no endpoint")
	}
	for range 50 {
		p.suspect(ep, 1, 1)
	}
	const msg = "endpoint suspect: requests past their deadline with the endpoint silent"
	if n := len(sink.lines(t, msg)); n != 1 {
		t.Fatalf("%d suspect lines for 50 verdicts within a second, want 1", n)
	}
	time.Sleep(logEvery + 50*time.Millisecond)
	p.suspect(ep, 1, 1)
	sus := sink.lines(t, msg)
	if len(sus) != 2 || sus[1]["verdicts_since_last_line"] != float64(50) {
		t.Fatalf("suspect lines %v: want a second one a second later, counting the 49 held back and itself", sus)
	}
}
