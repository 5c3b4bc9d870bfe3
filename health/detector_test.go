package health

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/rs/zerolog"
	"go.uber.org/goleak"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// waitLimit bounds every wait on real time: a test that would hang fails.
const waitLimit = 5 * time.Second

// recorder collects events and probe verdicts and lets a test wait for a
// condition on them.
type recorder struct {
	mu      sync.Mutex
	events  []Event
	probes  []bool
	changed chan struct{}
}

func newRecorder() *recorder { return &recorder{changed: make(chan struct{}, 1)} }

func (r *recorder) onEvent(ev Event) {
	r.mu.Lock()
	r.events = append(r.events, ev)
	r.mu.Unlock()
	r.signal()
}

func (r *recorder) onProbe(_ string, ok bool) {
	r.mu.Lock()
	r.probes = append(r.probes, ok)
	r.mu.Unlock()
	r.signal()
}

func (r *recorder) signal() {
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

func (r *recorder) snapshot() ([]Event, []bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slicesClone(r.events), slicesClone(r.probes)
}

func slicesClone[T any](s []T) []T { return append([]T(nil), s...) }

// waitFor waits (in real time, at most waitLimit) until cond holds on the
// recorded events and probes.
func (r *recorder) waitFor(t *testing.T, what string, cond func(events []Event, probes []bool) bool) {
	t.Helper()
	deadline := time.NewTimer(waitLimit)
	defer deadline.Stop()
	for {
		if cond(r.snapshot()) {
			return
		}
		select {
		case <-r.changed:
		case <-deadline.C:
			ev, pr := r.snapshot()
			t.Fatalf("timed out waiting for %s; events %v, probes %v", what, ev, pr)
		}
	}
}

func failedProbes(probes []bool) int {
	n := 0
	for _, ok := range probes {
		if !ok {
			n++
		}
	}
	return n
}

func lastEventIs(to State, reason string) func([]Event, []bool) bool {
	return func(ev []Event, _ []bool) bool {
		return len(ev) > 0 && ev[len(ev)-1].To == to && ev[len(ev)-1].Reason == reason
	}
}

// transitions renders events as "from>to:reason" for compact comparison.
func transitions(evs []Event) []string {
	out := make([]string, len(evs))
	for i, ev := range evs {
		out[i] = ev.From.String() + ">" + ev.To.String() + ":" + ev.Reason
	}
	return out
}

// fastProbe is a real-time schedule for tests on loopback.
var fastProbe = ProbeConfig{Kind: ProbeConnect, Timeout: time.Second, InitialDelay: 10 * time.Millisecond, Factor: 2, MaxDelay: 40 * time.Millisecond}

// serveAndClose accepts on ln and closes every connection until ln is
// closed; it returns the number accepted so far and a stop function that
// closes ln and waits for the accept loop.
func serveAndClose(ln net.Listener) (accepted *atomic.Int32, stop func()) {
	accepted = new(atomic.Int32)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			c.Close()
		}
	}()
	return accepted, func() { ln.Close(); <-done }
}

func TestStateString(t *testing.T) {
	for s, want := range map[State]string{Healthy: "healthy", Excluded: "excluded", Disabled: "disabled", State(7): "State(7)"} {
		if got := s.String(); got != want {
			t.Errorf("State(%d).String() = %q, want %q", int(s), got, want)
		}
	}
}

// A connect probe against a refused port fails; once the listener is back,
// a probe over a fresh connection readmits the endpoint.
func TestConnectProbeRefusedThenReopened(t *testing.T) {
	addr := testutil.ClosedAddr(t)
	rec := newRecorder()
	d := New(Options{OnEvent: rec.onEvent, OnProbe: rec.onProbe})
	defer d.Close()
	d.Register(addr, fastProbe)

	if !d.Report(addr, "dial_error") {
		t.Fatal("Report on a healthy endpoint returned false")
	}
	rec.waitFor(t, "two refused probes", func(_ []Event, p []bool) bool { return failedProbes(p) >= 2 })
	st := d.Statuses()[0]
	if st.State != Excluded || st.FailedProbes < 2 || !strings.Contains(st.LastProbeError, "refused") {
		t.Fatalf("status after refused probes = %+v", st)
	}

	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("reopen %s: %v", addr, err)
	}
	accepted, stop := serveAndClose(ln)
	defer stop()

	rec.waitFor(t, "readmission", lastEventIs(Healthy, ReasonProbeOK))
	events, probes := rec.snapshot()
	want := []string{"healthy>excluded:dial_error", "excluded>healthy:probe_ok"}
	if got := transitions(events); !slices.Equal(got, want) {
		t.Fatalf("events = %v, want %v", got, want)
	}
	if !probes[len(probes)-1] {
		t.Fatalf("last probe verdict = false, want true (probes %v)", probes)
	}
	if s, _ := d.State(addr); s != Healthy {
		t.Fatalf("state = %v, want healthy", s)
	}
	// The probe's connect completed in the kernel, which queued the
	// connection for the listener: the accept loop takes it when it runs
	// (before the listener closes, or the queue goes with it).
	for deadline := time.Now().Add(waitLimit); accepted.Load() < 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("readmitted without the listener seeing a connection (none accepted %v on)", waitLimit)
		}
	}
	stop()
	// No more probing after readmission.
	n := len(probes)
	time.Sleep(5 * fastProbe.MaxDelay)
	if _, p := rec.snapshot(); len(p) != n {
		t.Fatalf("%d probes after readmission", len(p)-n)
	}
}

// An http probe fails on 503 and readmits on 200; every request arrives on
// a new connection.
func TestHTTPProbe503Then200(t *testing.T) {
	var healthy atomic.Bool
	var requests, conns atomic.Int32
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		if r.URL.Path != "/health" {
			http.NotFound(w, r)
			return
		}
		if !healthy.Load() {
			http.Error(w, "starting", http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ok"))
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()
	ep := srv.Listener.Addr().String() // 127.0.0.1:port; HTTPPort 0 = this port

	rec := newRecorder()
	d := New(Options{OnEvent: rec.onEvent, OnProbe: rec.onProbe})
	defer d.Close()
	pc := fastProbe
	pc.Kind, pc.HTTPPath = ProbeHTTP, "/health"
	d.Register(ep, pc)
	d.Report(ep, "unanswered")

	rec.waitFor(t, "two 503 probes", func(_ []Event, p []bool) bool { return failedProbes(p) >= 2 })
	if st := d.Statuses()[0]; !strings.Contains(st.LastProbeError, "503") {
		t.Fatalf("LastProbeError = %q, want it to name the 503", st.LastProbeError)
	}
	healthy.Store(true)
	rec.waitFor(t, "readmission", lastEventIs(Healthy, ReasonProbeOK))
	d.Close()
	srv.Close()
	if r, c := requests.Load(), conns.Load(); r < 3 || c != r {
		t.Fatalf("%d requests over %d connections, want every probe on a fresh connection", r, c)
	}
}

// HTTPPort sends the probe to another port of the endpoint's host.
func TestHTTPProbeUsesHTTPPort(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/ready" {
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	port := srv.Listener.Addr().(*net.TCPAddr).Port
	ep := testutil.ClosedAddr(t) // the data port itself refuses

	rec := newRecorder()
	d := New(Options{OnEvent: rec.onEvent, OnProbe: rec.onProbe})
	defer d.Close()
	pc := fastProbe
	pc.Kind, pc.HTTPPort, pc.HTTPPath = ProbeHTTP, port, "ready"
	d.Register(ep, pc)
	d.Report(ep, "dial_error")
	rec.waitFor(t, "readmission through the HTTP port", lastEventIs(Healthy, ReasonProbeOK))
}

// A probe that errors in any way is a failure: there is no "unknown means
// healthy" path. A redirect is not followed; an unknown kind never dials.
func TestProbeErrorsAreFailures(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			http.Redirect(w, r, "/elsewhere", http.StatusFound)
		}
	}))
	defer srv.Close()
	var unknownDials atomic.Int32
	rec := newRecorder()
	d := New(Options{OnEvent: rec.onEvent, OnProbe: rec.onProbe, Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
		if addr == "127.0.0.1:1" {
			unknownDials.Add(1)
		}
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}})
	defer d.Close()

	redirect := srv.Listener.Addr().String()
	pc := fastProbe
	pc.Kind, pc.HTTPPath = ProbeHTTP, "/health"
	d.Register(redirect, pc)
	pc.Kind = "grpc"
	d.Register("127.0.0.1:1", pc)
	d.Report(redirect, "unanswered")
	d.Report("127.0.0.1:1", "unanswered")

	// Each endpoint's probes run on their own schedule: the one that
	// fails at once (the unknown kind) may be ahead of the HTTP one.
	rec.waitFor(t, "three failed probes each", func([]Event, []bool) bool {
		for _, st := range d.Statuses() {
			if st.FailedProbes < 3 {
				return false
			}
		}
		return true
	})
	for _, st := range d.Statuses() {
		if st.State != Excluded || st.FailedProbes < 3 {
			t.Errorf("%s: status %+v, want excluded after failed probes", st.Endpoint, st)
		}
	}
	byEP := map[string]Status{}
	for _, st := range d.Statuses() {
		byEP[st.Endpoint] = st
	}
	if e := byEP[redirect].LastProbeError; !strings.Contains(e, "302") {
		t.Errorf("redirect probe error = %q, want status 302", e)
	}
	if e := byEP["127.0.0.1:1"].LastProbeError; !strings.Contains(e, "unknown probe kind") {
		t.Errorf("unknown kind probe error = %q", e)
	}
	if n := unknownDials.Load(); n != 0 {
		t.Errorf("unknown probe kind dialed %d times", n)
	}
	if ev, p := rec.snapshot(); len(ev) != 2 || failedProbes(p) != len(p) {
		t.Errorf("events %v probes %v: want only the two exclusions and only failures", transitions(ev), p)
	}
}

// fakeDialer records the (synctest) time of each dial relative to start and
// fails it, unless ok says otherwise.
type fakeDialer struct {
	start time.Time
	mu    sync.Mutex
	at    []time.Duration
	ok    bool
}

func (f *fakeDialer) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.at = append(f.at, time.Since(f.start))
	if f.ok {
		c1, c2 := net.Pipe()
		c2.Close()
		return c1, nil
	}
	return nil, &net.OpError{Op: "dial", Net: network, Err: syscall.ECONNREFUSED}
}

func (f *fakeDialer) times() []time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slicesClone(f.at)
}

func (f *fakeDialer) setOK(ok bool) {
	f.mu.Lock()
	f.ok = ok
	f.mu.Unlock()
}

// The probe schedule is InitialDelay, then ×Factor per failed probe, capped
// at MaxDelay, exactly (no jitter), in fake time.
func TestBackoffGrowsByFactorUpToMaxDelay(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &fakeDialer{start: time.Now()}
		d := New(Options{Dial: f.dial})
		defer d.Close()
		d.Register("10.0.0.1:8098", ProbeConfig{Timeout: time.Second, InitialDelay: time.Second, Factor: 2, MaxDelay: 10 * time.Second})
		d.Report("10.0.0.1:8098", "write_timeout")
		synctest.Wait()
		if st := d.Statuses()[0]; !st.NextProbe.Equal(f.start.Add(time.Second)) {
			t.Fatalf("NextProbe = %v, want start+1s", st.NextProbe.Sub(f.start))
		}

		time.Sleep(55 * time.Second)
		synctest.Wait()
		// Delays 1, 2, 4, 8, 10, 10, 10, 10: probes at 1, 3, 7, 15, 25, 35, 45, 55.
		want := []time.Duration{1, 3, 7, 15, 25, 35, 45, 55}
		got := f.times()
		if len(got) != len(want) {
			t.Fatalf("probes at %v, want %v s", got, want)
		}
		for i := range want {
			if got[i] != want[i]*time.Second {
				t.Fatalf("probe %d at %v, want %v (all: %v)", i, got[i], want[i]*time.Second, got)
			}
		}
		st := d.Statuses()[0]
		if st.FailedProbes != len(want) || !st.NextProbe.Equal(f.start.Add(65*time.Second)) {
			t.Fatalf("status %+v: want %d failed probes, next at start+65s", st, len(want))
		}
	})
}

// With jitter every delay stays within ±Jitter of its base, and jitter is
// actually applied.
func TestBackoffJitterWithinBounds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &fakeDialer{start: time.Now()}
		d := New(Options{Dial: f.dial})
		defer d.Close()
		pc := ProbeConfig{InitialDelay: time.Second, Factor: 2, MaxDelay: 8 * time.Second, Jitter: 0.2}
		d.Register("10.0.0.1:8098", pc)
		d.Report("10.0.0.1:8098", "watermark")
		time.Sleep(200 * time.Second)
		synctest.Wait()

		at := f.times()
		if len(at) < 20 {
			t.Fatalf("only %d probes in 200s", len(at))
		}
		pc = pc.normalized()
		prev, exact := time.Duration(0), 0
		for i, a := range at {
			got, base := a-prev, baseDelay(pc, i)
			lo, hi := time.Duration(float64(base)*0.8), time.Duration(float64(base)*1.2)
			if got < lo || got > hi {
				t.Errorf("delay %d = %v, want within [%v, %v]", i, got, lo, hi)
			}
			if got == base {
				exact++
			}
			prev = a
		}
		if exact == len(at) {
			t.Error("no delay was jittered")
		}
	})
	if got := jittered(10*time.Second, 0.2, 0); got != 8*time.Second {
		t.Errorf("jittered(r=0) = %v, want 8s", got)
	}
	if got := jittered(10*time.Second, 0.2, 0.5); got != 10*time.Second {
		t.Errorf("jittered(r=0.5) = %v, want 10s", got)
	}
	for range 1000 {
		if got := probeDelay(ProbeConfig{InitialDelay: time.Second, Factor: 1, MaxDelay: time.Second, Jitter: 0.5}, 3); got < 500*time.Millisecond || got > 1500*time.Millisecond {
			t.Fatalf("probeDelay with jitter 0.5 = %v", got)
		}
	}
}

func TestProbeConfigNormalized(t *testing.T) {
	got := ProbeConfig{Factor: 0.5, MaxDelay: time.Millisecond, Jitter: 3, HTTPPath: "health"}.normalized()
	want := ProbeConfig{Kind: ProbeConnect, Timeout: DefaultProbeTimeout, InitialDelay: DefaultInitialDelay,
		Factor: 1, MaxDelay: DefaultInitialDelay, Jitter: MaxJitter, HTTPPath: "/health"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("normalized = %+v, want %+v", got, want)
	}
	got = ProbeConfig{Factor: -1, Jitter: -1}.normalized()
	if got.Factor != DefaultFactor || got.MaxDelay != DefaultMaxDelay || got.Jitter != 0 || got.HTTPPath != "/" {
		t.Errorf("normalized defaults = %+v", got)
	}
	// A huge failure count saturates at MaxDelay instead of overflowing.
	if d := baseDelay(ProbeConfig{InitialDelay: time.Second, Factor: 2, MaxDelay: time.Minute}, 1<<20); d != time.Minute {
		t.Errorf("baseDelay after 2^20 failures = %v", d)
	}
}

// syncBuffer is a log sink safe for concurrent writes.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) count(s string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Count(b.buf.String(), s)
}

// Only real transitions emit an event and an Info line; repeated calls say
// nothing changed.
func TestEdgeTriggered(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		logs := &syncBuffer{}
		rec := newRecorder()
		f := &fakeDialer{start: time.Now()}
		d := New(Options{Logger: zerolog.New(logs).Level(zerolog.DebugLevel), OnEvent: rec.onEvent, Dial: f.dial})
		defer d.Close()
		ep := "10.0.0.1:8098"
		d.Register(ep, ProbeConfig{InitialDelay: time.Second})
		d.Register(ep, ProbeConfig{InitialDelay: time.Second}) // idempotent

		if !d.Report(ep, "unanswered") {
			t.Fatal("first Report returned false")
		}
		if d.Report(ep, "unanswered") || d.Report(ep, "write_timeout") {
			t.Fatal("Report on an excluded endpoint returned true")
		}
		time.Sleep(10 * time.Second) // probes fail meanwhile: no events, no transition lines
		if d.Report(ep, "unanswered") {
			t.Fatal("Report while probing returned true")
		}
		if !d.Disable(ep, "") || d.Disable(ep, "again") {
			t.Fatal("Disable: want true then false")
		}
		if d.Report(ep, "unanswered") {
			t.Fatal("Report on a disabled endpoint returned true")
		}
		if !d.Enable(ep, "") || d.Enable(ep, "again") {
			t.Fatal("Enable: want true then false")
		}
		if d.Report("10.9.9.9:1", "unanswered") || d.Disable("10.9.9.9:1", "") || d.Enable("10.9.9.9:1", "") {
			t.Fatal("calls on an unregistered endpoint returned true")
		}
		synctest.Wait()

		events, _ := rec.snapshot()
		want := []string{"healthy>excluded:unanswered", "excluded>disabled:operator_disable", "disabled>healthy:operator_enable"}
		if got := transitions(events); !slices.Equal(got, want) {
			t.Fatalf("events = %v, want %v", got, want)
		}
		if n := logs.count("endpoint state changed"); n != len(want) {
			t.Fatalf("%d transition log lines, want %d:\n%s", n, len(want), logs.buf.String())
		}
		if len(f.times()) == 0 {
			t.Fatal("no probe ran while excluded")
		}
	})
}

// Disable stops probing; a disabled endpoint is never probed and only Enable
// readmits it.
func TestDisableStopsProbingEnableReadmits(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := newRecorder()
		f := &fakeDialer{start: time.Now()}
		d := New(Options{OnEvent: rec.onEvent, OnProbe: rec.onProbe, Dial: f.dial})
		defer d.Close()
		ep := "10.0.0.1:8098"
		d.Register(ep, ProbeConfig{InitialDelay: time.Second, Factor: 2, MaxDelay: 4 * time.Second})
		d.Report(ep, "dial_error")
		time.Sleep(3500 * time.Millisecond) // probes at 1s and 3s
		synctest.Wait()
		if n := len(f.times()); n != 2 {
			t.Fatalf("%d probes before Disable, want 2", n)
		}

		f.setOK(true) // the server is back, but the operator disabled it
		if !d.Disable(ep, ReasonOperatorDisable) {
			t.Fatal("Disable of an excluded endpoint returned false")
		}
		time.Sleep(time.Hour)
		synctest.Wait()
		if n := len(f.times()); n != 2 {
			t.Fatalf("%d probes after Disable, want still 2", n)
		}
		if s, _ := d.State(ep); s != Disabled {
			t.Fatalf("state = %v, want disabled", s)
		}
		if st := d.Statuses()[0]; !st.NextProbe.IsZero() {
			t.Fatalf("disabled endpoint has NextProbe %v", st.NextProbe)
		}

		if !d.Enable(ep, ReasonOperatorEnable) {
			t.Fatal("Enable of a disabled endpoint returned false")
		}
		synctest.Wait()
		events, _ := rec.snapshot()
		want := []string{"healthy>excluded:dial_error", "excluded>disabled:operator_disable", "disabled>healthy:operator_enable"}
		if got := transitions(events); !slices.Equal(got, want) {
			t.Fatalf("events = %v, want %v", got, want)
		}
		time.Sleep(time.Hour)
		synctest.Wait()
		if n := len(f.times()); n != 2 {
			t.Fatalf("%d probes after Enable, want still 2 (healthy endpoints are not probed)", n)
		}

		// Disable from Healthy: never probed either.
		d.Disable(ep, "maintenance")
		time.Sleep(time.Hour)
		synctest.Wait()
		if n := len(f.times()); n != 2 {
			t.Fatalf("disabled-from-healthy endpoint probed (%d dials)", n)
		}
	})
}

// Enable on an excluded endpoint is an operator override: readmits at once
// and abandons the probe in flight without a verdict.
func TestEnableOverridesExclusion(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := newRecorder()
		var dials atomic.Int32
		d := New(Options{OnEvent: rec.onEvent, OnProbe: rec.onProbe, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
			dials.Add(1)
			<-ctx.Done() // black hole
			return nil, ctx.Err()
		}})
		defer d.Close()
		ep := "10.0.0.1:8098"
		d.Register(ep, ProbeConfig{InitialDelay: time.Second, Timeout: time.Minute})
		d.Report(ep, "unanswered")
		time.Sleep(2 * time.Second) // the first probe is in flight
		synctest.Wait()
		if !d.Enable(ep, "") {
			t.Fatal("Enable of an excluded endpoint returned false")
		}
		time.Sleep(time.Hour)
		synctest.Wait()
		events, probes := rec.snapshot()
		want := []string{"healthy>excluded:unanswered", "excluded>healthy:operator_enable"}
		if got := transitions(events); !slices.Equal(got, want) {
			t.Fatalf("events = %v, want %v", got, want)
		}
		if len(probes) != 0 || dials.Load() != 1 {
			t.Fatalf("probes %v, dials %d: want the in-flight probe abandoned, none after", probes, dials.Load())
		}
	})
}

// After readmission a later Report excludes again, with a fresh schedule
// once the endpoint stayed healthy for MaxDelay (unlike a computeIfAbsent
// that can flag a server only once).
func TestReportAfterReadmissionExcludesAgain(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := newRecorder()
		f := &fakeDialer{start: time.Now()}
		d := New(Options{OnEvent: rec.onEvent, Dial: f.dial})
		defer d.Close()
		ep := "10.0.0.1:8098"
		d.Register(ep, ProbeConfig{InitialDelay: time.Second, Factor: 2, MaxDelay: time.Minute})

		for round := range 3 {
			f.setOK(false)
			start := time.Now()
			if !d.Report(ep, "upstream_timeout") {
				t.Fatalf("round %d: Report returned false", round)
			}
			time.Sleep(3500 * time.Millisecond) // failed probes at +1s, +3s
			synctest.Wait()
			if st := d.Statuses()[0]; st.State != Excluded || st.FailedProbes != 2 || !st.NextProbe.Equal(start.Add(7*time.Second)) {
				t.Fatalf("round %d: status %+v, want excluded, 2 probes, next at +7s", round, st)
			}
			f.setOK(true)
			time.Sleep(4 * time.Second)
			synctest.Wait()
			if s, _ := d.State(ep); s != Healthy {
				t.Fatalf("round %d: state %v after a successful probe", round, s)
			}
			// Healthy for longer than MaxDelay: the next exclusion is not a
			// flap and starts the schedule over.
			time.Sleep(time.Minute)
		}
		events, _ := rec.snapshot()
		if len(events) != 6 {
			t.Fatalf("events = %v, want 3 exclusions and 3 readmissions", transitions(events))
		}
		for i, ev := range events {
			if (i%2 == 0) != (ev.To == Excluded) || (i%2 == 1 && ev.Reason != ReasonProbeOK) {
				t.Fatalf("event %d = %+v", i, ev)
			}
		}
	})
}

// Unregister stops probing and forgets the endpoint; Register starts afresh.
func TestUnregister(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := newRecorder()
		f := &fakeDialer{start: time.Now()}
		d := New(Options{OnEvent: rec.onEvent, Dial: f.dial})
		defer d.Close()
		ep := "10.0.0.1:8098"
		d.Register(ep, ProbeConfig{InitialDelay: time.Second})
		d.Report(ep, "dial_error")
		time.Sleep(1500 * time.Millisecond)
		d.Unregister(ep)
		time.Sleep(time.Hour)
		synctest.Wait()
		if n := len(f.times()); n != 1 {
			t.Fatalf("%d probes, want 1 (none after Unregister)", n)
		}
		if _, ok := d.State(ep); ok || len(d.Statuses()) != 0 {
			t.Fatal("endpoint still known after Unregister")
		}
		d.Register(ep, ProbeConfig{InitialDelay: time.Second})
		if s, _ := d.State(ep); s != Healthy {
			t.Fatalf("re-registered endpoint is %v", s)
		}
		if events, _ := rec.snapshot(); len(events) != 1 {
			t.Fatalf("events = %v, want only the exclusion", transitions(events))
		}
	})
}

// Re-registering changes the probe configuration from the next probe on,
// keeping the state and the failure count.
func TestReRegisterUpdatesProbeConfig(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &fakeDialer{start: time.Now()}
		d := New(Options{Dial: f.dial})
		defer d.Close()
		ep := "10.0.0.1:8098"
		d.Register(ep, ProbeConfig{InitialDelay: time.Second, Factor: 2, MaxDelay: time.Minute})
		d.Report(ep, "dial_error")
		time.Sleep(500 * time.Millisecond)
		d.Register(ep, ProbeConfig{InitialDelay: 3 * time.Second, Factor: 1, MaxDelay: time.Minute})
		time.Sleep(10 * time.Second)
		synctest.Wait()
		// The scheduled 1s stands; afterwards 3s, 3s, ...
		want := []time.Duration{1 * time.Second, 4 * time.Second, 7 * time.Second, 10 * time.Second}
		if got := f.times(); !slices.Equal(got, want) {
			t.Fatalf("probes at %v, want %v", got, want)
		}
		if s, _ := d.State(ep); s != Excluded {
			t.Fatalf("state %v, want still excluded", s)
		}
	})
}

// Never two probes of one endpoint at once, even when a stopped probe's dial
// ignores cancellation for a while and the endpoint is excluded again.
func TestOneProbeAtATime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		var mu sync.Mutex
		inFlight, maxInFlight := 0, 0
		var dialAt []time.Duration
		d := New(Options{Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
			mu.Lock()
			inFlight++
			maxInFlight = max(maxInFlight, inFlight)
			dialAt = append(dialAt, time.Since(start))
			mu.Unlock()
			time.Sleep(5 * time.Second) // a dialer slow to honour ctx
			mu.Lock()
			inFlight--
			mu.Unlock()
			return nil, errors.New("unreachable")
		}})
		defer d.Close()
		ep := "10.0.0.1:8098"
		d.Register(ep, ProbeConfig{InitialDelay: time.Second, Timeout: 10 * time.Second})
		d.Report(ep, "dial_error")
		time.Sleep(1500 * time.Millisecond) // probe 1 in flight until 6s
		d.Enable(ep, "")
		d.Report(ep, "dial_error") // new schedule waits for the old probe: next dial at 7s
		time.Sleep(10 * time.Second)
		synctest.Wait()
		mu.Lock()
		defer mu.Unlock()
		if maxInFlight != 1 || len(dialAt) < 2 || dialAt[1] != 7*time.Second {
			t.Fatalf("max %d probes in flight, dials at %v: want 1, second at 7s", maxInFlight, dialAt)
		}
	})
}

// OnEvent runs without the lock held: it may call back into the Detector,
// and its own transitions are delivered after the current one, in order.
func TestOnEventReentrant(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var d *Detector
		var mu sync.Mutex
		var got []string
		d = New(Options{OnEvent: func(ev Event) {
			mu.Lock()
			got = append(got, ev.Endpoint+" "+ev.To.String())
			mu.Unlock()
			_ = d.Statuses()
			if ev.Endpoint == "a:1" && ev.To == Excluded {
				d.Report("b:1", "peer_excluded") // cascades: delivered after this one
				d.Disable("a:1", "")
			}
		}, Dial: (&fakeDialer{}).dial})
		defer d.Close()
		d.Register("a:1", ProbeConfig{})
		d.Register("b:1", ProbeConfig{})
		d.Report("a:1", "unanswered")
		synctest.Wait()
		mu.Lock()
		defer mu.Unlock()
		want := []string{"a:1 excluded", "b:1 excluded", "a:1 disabled"}
		if !slices.Equal(got, want) {
			t.Fatalf("events %v, want %v", got, want)
		}
	})
}

// Concurrent callers: every endpoint's events form one unbroken chain
// (each From is the previous To) ending in its current state.
func TestEventsInOrderUnderConcurrency(t *testing.T) {
	var mu sync.Mutex
	chains := map[string][]Event{}
	d := New(Options{OnEvent: func(ev Event) {
		mu.Lock()
		chains[ev.Endpoint] = append(chains[ev.Endpoint], ev)
		mu.Unlock()
	}, Dial: func(context.Context, string, string) (net.Conn, error) { return nil, errors.New("down") }})
	defer d.Close()
	eps := []string{"10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"}
	for _, ep := range eps {
		d.Register(ep, ProbeConfig{InitialDelay: time.Millisecond, MaxDelay: 2 * time.Millisecond})
	}
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 1))
			for range 300 {
				ep := eps[r.IntN(len(eps))]
				switch r.IntN(3) {
				case 0:
					d.Report(ep, "unanswered")
				case 1:
					d.Disable(ep, "")
				case 2:
					d.Enable(ep, "")
				}
			}
		})
	}
	wg.Wait()
	d.Close()
	mu.Lock()
	defer mu.Unlock()
	for _, ep := range eps {
		from := Healthy
		for i, ev := range chains[ep] {
			if ev.From != from || ev.From == ev.To {
				t.Fatalf("%s event %d: %v>%v after state %v", ep, i, ev.From, ev.To, from)
			}
			from = ev.To
		}
		if s, _ := d.State(ep); s != from {
			t.Fatalf("%s: state %v, last event to %v", ep, s, from)
		}
	}
}

// Close with probes in flight (black-holed dials, a hanging HTTP server)
// returns promptly, emits nothing, reports no probe verdict, and leaks no
// goroutine (goleak checks at the end of the package).
func TestCloseWithProbesInFlight(t *testing.T) {
	release := make(chan struct{})
	hung := make(chan struct{}, 8)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hung <- struct{}{}
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	defer srv.Close()
	defer close(release)

	var dialing sync.WaitGroup
	dialing.Add(3)
	rec := newRecorder()
	d := New(Options{OnEvent: rec.onEvent, OnProbe: rec.onProbe, Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
		if strings.HasPrefix(addr, "10.") {
			dialing.Done()
			<-ctx.Done() // black hole until the probe is abandoned
			return nil, ctx.Err()
		}
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}})
	slow := ProbeConfig{Kind: ProbeConnect, Timeout: time.Minute, InitialDelay: time.Millisecond}
	for _, ep := range []string{"10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"} {
		d.Register(ep, slow)
		d.Report(ep, "dial_error")
	}
	httpEP := srv.Listener.Addr().String()
	slow.Kind = ProbeHTTP
	d.Register(httpEP, slow)
	d.Report(httpEP, "unanswered")
	d.Register("10.0.0.9:1", ProbeConfig{InitialDelay: time.Hour}) // excluded, waiting on its timer
	d.Report("10.0.0.9:1", "dial_error")

	waitOrFail(t, "dials in flight", func() { dialing.Wait() })
	waitOrFail(t, "http probe in flight", func() { <-hung })

	start := time.Now()
	waitOrFail(t, "Close", d.Close)
	// The probes in flight would end at their minute's timeout: Close
	// abandons them instead. Half of it is far beyond any scheduling delay.
	if el := time.Since(start); el > slow.Timeout/2 {
		t.Errorf("Close took %v: it waited for the probes in flight (timeout %v)", el, slow.Timeout)
	}
	waitOrFail(t, "second Close", d.Close)
	events, probes := rec.snapshot()
	if len(events) != 5 || len(probes) != 0 {
		t.Fatalf("events %v probes %v: want only the 5 exclusions, no verdicts", transitions(events), probes)
	}
	for _, st := range d.Statuses() {
		if st.State != Excluded || st.FailedProbes != 0 || !st.NextProbe.IsZero() {
			t.Errorf("after Close: %+v", st)
		}
	}
	if d.Report(httpEP, "x") || d.Enable(httpEP, "") || d.Disable(httpEP, "") {
		t.Error("mutating call after Close returned true")
	}
}

// waitOrFail runs f and fails the test if it has not returned within
// waitLimit (a hang detector).
func waitOrFail(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(waitLimit):
		t.Fatalf("%s did not return within %v", what, waitLimit)
	}
}

// Statuses are sorted; NextProbe is set only while excluded; JSON renders
// states by name.
func TestStatuses(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := New(Options{Dial: (&fakeDialer{}).dial})
		defer d.Close()
		for _, ep := range []string{"10.0.0.3:1", "10.0.0.1:1", "10.0.0.2:1"} {
			d.Register(ep, ProbeConfig{InitialDelay: time.Second})
		}
		d.Report("10.0.0.2:1", "watermark")
		d.Disable("10.0.0.3:1", "")
		synctest.Wait()
		sts := d.Statuses()
		if len(sts) != 3 || sts[0].Endpoint != "10.0.0.1:1" || sts[1].Endpoint != "10.0.0.2:1" || sts[2].Endpoint != "10.0.0.3:1" {
			t.Fatalf("statuses not sorted: %+v", sts)
		}
		if sts[0].State != Healthy || sts[0].Reason != ReasonRegistered || !sts[0].NextProbe.IsZero() {
			t.Errorf("healthy status %+v", sts[0])
		}
		if sts[1].State != Excluded || sts[1].Reason != "watermark" || !sts[1].NextProbe.Equal(time.Now().Add(time.Second)) {
			t.Errorf("excluded status %+v", sts[1])
		}
		if sts[2].State != Disabled || sts[2].Reason != ReasonOperatorDisable || !sts[2].NextProbe.IsZero() {
			t.Errorf("disabled status %+v", sts[2])
		}
	})
}

// A panicking subscriber is logged, not fatal, and does not wedge delivery.
func TestOnEventPanicContained(t *testing.T) {
	var calls atomic.Int32
	logs := &syncBuffer{}
	d := New(Options{Logger: zerolog.New(logs), OnEvent: func(Event) {
		calls.Add(1)
		panic("subscriber bug")
	}, Dial: (&fakeDialer{}).dial})
	defer d.Close()
	d.Register("a:1", ProbeConfig{InitialDelay: time.Hour})
	d.Report("a:1", "x")
	d.Disable("a:1", "")
	if calls.Load() != 2 || logs.count("OnEvent panicked") != 2 {
		t.Fatalf("calls %d, logs:\n%s", calls.Load(), logs.buf.String())
	}
}

// A probe that passes while the server cannot serve (a stopped process
// whose kernel still completes handshakes) readmits it; each re-exclusion
// soon after starts the backoff one step further instead of over.
func TestFlappingEndpointBacksOff(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ep := ln.Addr().String()
	readmitted := make(chan time.Time, 8)
	d := New(Options{OnEvent: func(ev Event) {
		if ev.To == Healthy {
			readmitted <- ev.At
		}
	}})
	defer d.Close()
	d.Register(ep, ProbeConfig{Kind: ProbeConnect, Timeout: time.Second, InitialDelay: 50 * time.Millisecond,
		Factor: 2, MaxDelay: 5 * time.Second})
	var waits []time.Duration
	for range 3 {
		excluded := time.Now()
		if !d.Report(ep, "unanswered") {
			t.Fatal("report did not exclude")
		}
		select {
		case at := <-readmitted:
			waits = append(waits, at.Sub(excluded))
		case <-time.After(3 * time.Second):
			t.Fatal("not readmitted")
		}
	}
	t.Logf("exclusion lengths: %v", waits)
	// 50ms, then 100ms, then 200ms: each at least the doubled delay.
	for i, want := range []time.Duration{50, 100, 200} {
		if waits[i] < want*time.Millisecond {
			t.Fatalf("exclusion %d lasted %v, want at least %v", i, waits[i], want*time.Millisecond)
		}
	}
	// The operator's enable resets the history: the next exclusion lasts
	// the initial delay (50ms), not the fourth flap's 800ms. (The bound
	// leaves the probe's timer and dial a loaded machine's slack.)
	d.Disable(ep, "")
	d.Enable(ep, "")
	<-readmitted
	excluded := time.Now()
	d.Report(ep, "unanswered")
	if w := (<-readmitted).Sub(excluded); w > 400*time.Millisecond {
		t.Fatalf("after an operator enable the first exclusion lasted %v, want the initial delay", w)
	}
}

// Override decides the probe when it handles it, and leaves it to Kind
// when it does not: an endpoint whose own port refuses is readmitted on
// the override's word alone, and one whose override declines is probed
// directly.
func TestProbeOverride(t *testing.T) {
	refusing := testutil.ClosedAddr(t)
	var calls atomic.Int32
	var pass atomic.Bool
	rec := newRecorder()
	d := New(Options{OnEvent: rec.onEvent, OnProbe: rec.onProbe})
	defer d.Close()
	pc := fastProbe
	pc.Override = func(ctx context.Context, endpoint string) (bool, error) {
		calls.Add(1)
		if endpoint != refusing {
			return false, nil
		}
		if pass.Load() {
			return true, nil
		}
		return true, errors.New("sidecar says not ready")
	}
	d.Register(refusing, pc)
	d.Report(refusing, "unanswered")
	rec.waitFor(t, "a failed override probe", func(_ []Event, p []bool) bool { return failedProbes(p) >= 1 })
	if st := d.Statuses()[0]; st.LastProbeError != "sidecar says not ready" {
		t.Fatalf("LastProbeError = %q, want the override's error", st.LastProbeError)
	}
	pass.Store(true)
	rec.waitFor(t, "readmission on the override's word", lastEventIs(Healthy, ReasonProbeOK))

	// Declined: the connect probe of the refusing port decides. (The
	// failures counted so far are however many override probes failed
	// before pass was set: one or more.)
	d.Unregister(refusing)
	pc.Override = func(context.Context, string) (bool, error) { calls.Add(1); return false, nil }
	d.Register(refusing, pc)
	_, p := rec.snapshot()
	failedBefore, before := failedProbes(p), calls.Load()
	d.Report(refusing, "unanswered")
	rec.waitFor(t, "a failed direct probe", func(_ []Event, p []bool) bool { return failedProbes(p) > failedBefore })
	if calls.Load() == before {
		t.Fatal("the override was not asked")
	}
	if st, _ := d.State(refusing); st != Excluded {
		t.Fatalf("state %v, want Excluded: the direct probe of a refusing port failed", st)
	}
}

// ProbeSoon probes an excluded endpoint now instead of at its scheduled
// time (an hour away here); the probe still decides. It does nothing to
// an endpoint that is not excluded.
func TestProbeSoon(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, stop := serveAndClose(ln)
	defer stop()
	addr := ln.Addr().String()
	rec := newRecorder()
	d := New(Options{OnEvent: rec.onEvent, OnProbe: rec.onProbe})
	defer d.Close()
	pc := fastProbe
	pc.InitialDelay, pc.MaxDelay = time.Hour, time.Hour
	d.Register(addr, pc)
	if d.ProbeSoon(addr) {
		t.Fatal("ProbeSoon on a healthy endpoint reported a probe")
	}
	d.Report(addr, "unanswered")
	for deadline := time.Now().Add(5 * time.Second); d.Statuses()[0].NextProbe.IsZero(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no probe scheduled")
		}
	}
	if st := d.Statuses()[0]; time.Until(st.NextProbe) < 30*time.Minute {
		t.Fatalf("next probe at %v, want about an hour away", st.NextProbe)
	}
	if !d.ProbeSoon(addr) {
		t.Fatal("ProbeSoon on an excluded endpoint reported none")
	}
	rec.waitFor(t, "readmission by the early probe", lastEventIs(Healthy, ReasonProbeOK))
	if d.ProbeSoon("127.0.0.1:1") {
		t.Fatal("ProbeSoon on an unregistered endpoint reported a probe")
	}
}

// A probe that ran out of its timeout and noticed it a timeout or more
// late (the process could not run: CPU throttling, a host under
// contention) is no verdict: it counts no failure, so the backoff does
// not grow. The twin: a probe that times out at its deadline is a failed
// probe. Then a probe that passes readmits the endpoint. The probe's dial
// stands in for the late wake-up; an Override's lateness is a failure as
// any (it may wait on the proxy's own locks while the process runs).
func TestProbeNoticedLateIsNoVerdict(t *testing.T) {
	const timeout = time.Second
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, stop := serveAndClose(ln)
	defer stop()
	ep := ln.Addr().String()
	var calls atomic.Int32
	var d *Detector
	failedBefore := make(chan int, 3) // FailedProbes as each probe after the first begins
	rec := newRecorder()
	d = New(Options{OnEvent: rec.onEvent, OnProbe: rec.onProbe, Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
		n := calls.Add(1)
		if n > 1 {
			failedBefore <- d.Statuses()[0].FailedProbes
		}
		switch n {
		case 1: // noticed late: the deadline passed a timeout before the probe saw it
			<-ctx.Done()
			time.Sleep(timeout + 100*time.Millisecond)
			return nil, ctx.Err()
		case 2: // at its deadline
			<-ctx.Done()
			return nil, ctx.Err()
		}
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}})
	defer d.Close()
	pc := fastProbe
	pc.Timeout = timeout
	d.Register(ep, pc)
	d.Report(ep, "unanswered")
	rec.waitFor(t, "readmission", lastEventIs(Healthy, ReasonProbeOK))
	if got := [2]int{<-failedBefore, <-failedBefore}; got != [2]int{0, 1} {
		t.Fatalf("failed probes before the second and third probe %v, want [0 1]: the late timeout is no failure, the one at its deadline is", got)
	}
	if _, p := rec.snapshot(); failedProbes(p) != 1 {
		t.Fatalf("OnProbe saw %d failures (%v), want 1", failedProbes(p), p)
	}
}

// The same lateness in an Override (a mesh probe waiting on a link's
// session dial while the process runs) is a failed probe.
func TestOverrideProbeLateIsAFailure(t *testing.T) {
	rec := newRecorder()
	d := New(Options{OnEvent: rec.onEvent, OnProbe: rec.onProbe})
	defer d.Close()
	pc := fastProbe
	pc.Timeout = 200 * time.Millisecond
	pc.Override = func(ctx context.Context, _ string) (bool, error) {
		<-ctx.Done()
		time.Sleep(300 * time.Millisecond)
		return true, ctx.Err()
	}
	ep := testutil.ClosedAddr(t)
	d.Register(ep, pc)
	d.Report(ep, "unanswered")
	rec.waitFor(t, "a failed override probe", func(_ []Event, p []bool) bool { return failedProbes(p) >= 1 })
	if st := d.Statuses()[0]; st.FailedProbes < 1 {
		t.Fatalf("FailedProbes %d after a late override probe, want at least 1", st.FailedProbes)
	}
}
