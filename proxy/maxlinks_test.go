package proxy

import (
	"io"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	lptestutil "github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
)

// limitRig is a proxy with one listener "test" in front of an echo peer,
// logging at debug into log.
type limitRig struct {
	t   *testing.T
	p   *Proxy
	m   *metrics.Metrics
	cfg policy.Config
	log *lptestutil.SyncBuffer
}

func startLimited(t *testing.T, lim policy.Limits, listenerMax int) *limitRig {
	t.Helper()
	echo := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	cfg := policy.DefaultConfig()
	cfg.Limits = lim
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Upstream: echo.Addr(), MaxLinks: listenerMax, Settings: cfg.Defaults}}
	r := &limitRig{t: t, m: metrics.New(), cfg: cfg, log: &lptestutil.SyncBuffer{}}
	log := zerolog.New(r.log).Level(zerolog.DebugLevel)
	r.p = New(cfg, Options{metrics: r.m, Logger: &log})
	if err := r.p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.p.Close() })
	// The listener binds 127.0.0.1:0: later configs name the bound port.
	r.cfg.Listeners[0].Listen = r.p.Addr("test").String()
	return r
}

// echoer is one client connection that makes a round trip when told to.
type echoer struct {
	c    net.Conn
	done chan error
}

// openEchoers dials n connections (the kernel completes each handshake,
// accepted or not) and starts a round trip on each.
func (r *limitRig) openEchoers(n int) []*echoer {
	r.t.Helper()
	var es []*echoer
	for i := range n {
		c, err := net.Dial("tcp", r.p.Addr("test").String())
		if err != nil {
			r.t.Fatal(err)
		}
		r.t.Cleanup(func() { _ = c.Close() })
		e := &echoer{c: c, done: make(chan error, 1)}
		go func() {
			msg := []byte("hello " + strconv.Itoa(i))
			if _, err := c.Write(msg); err != nil {
				e.done <- err
				return
			}
			buf := make([]byte, len(msg))
			_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
			_, err := io.ReadFull(c, buf)
			e.done <- err
		}()
		es = append(es, e)
	}
	return es
}

// served waits for k more of es to finish their round trip and returns
// them (removed from pending).
func served(t *testing.T, pending map[*echoer]bool, k int, within time.Duration) []*echoer {
	t.Helper()
	var out []*echoer
	deadline := time.Now().Add(within)
	for len(out) < k {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d round trips served within %v", len(out), k, within)
		}
		for e := range pending {
			select {
			case err := <-e.done:
				if err != nil {
					t.Fatalf("round trip: %v", err)
				}
				delete(pending, e)
				out = append(out, e)
			default:
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	return out
}

func (r *limitRig) waitGauge(want float64, within time.Duration) {
	r.t.Helper()
	deadline := time.Now().Add(within)
	for testutil.ToFloat64(r.m.ForListener("test").AcceptWaiting) != want {
		if time.Now().After(deadline) {
			r.t.Fatalf("accept_waiting never became %v", want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A client opening 2 × max_links connections: the proxy never holds more
// than max_links links; the others wait in the kernel's accept queue (their
// connects succeed, nothing is reset) and are served as links end. No
// descriptor error is logged. For the process's limit and a listener's.
func TestMaxLinksHoldsTheRestInTheKernelQueue(t *testing.T) {
	for _, tc := range []struct {
		name        string
		lim         policy.Limits
		listenerMax int
	}{
		{"process", policy.Limits{MaxLinks: 4}, 0},
		{"listener", policy.Limits{}, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := startLimited(t, tc.lim, tc.listenerMax)
			const max = 4
			es := r.openEchoers(2 * max)
			pending := map[*echoer]bool{}
			for _, e := range es {
				pending[e] = true
			}
			first := served(t, pending, max, 10*time.Second)
			r.waitGauge(1, 5*time.Second)
			if n := r.p.ActiveLinks(); n > max {
				t.Fatalf("%d links held, max_links %d", n, max)
			}
			// As links end, the waiting connections are accepted and served.
			for _, e := range first {
				_ = e.c.Close()
			}
			served(t, pending, max, 10*time.Second)
			r.p.slots.mu.Lock()
			peak := r.p.slots.peak
			r.p.slots.mu.Unlock()
			if peak > max {
				t.Fatalf("the proxy held %d links at once, max_links %d", peak, max)
			}
			if got := testutil.ToFloat64(r.m.ForListener("test").AcceptWaits); got < 1 {
				t.Fatalf("accept_waits_total = %v, want at least 1", got)
			}
			if got := testutil.ToFloat64(r.m.ForListener("test").LinksTotal); got != 2*max {
				t.Fatalf("links_total = %v, want %d: every connection accepted once", got, 2*max)
			}
			for _, bad := range []string{"accept failed", "too many open files", "local_error"} {
				if strings.Contains(r.log.String(), bad) {
					t.Fatalf("the log says %q:\n%s", bad, r.log.String())
				}
			}
		})
	}
}

// Reload lowers limits.max_links below the links open and the memory
// budget below what their traffic uses: nothing is cut. The open links
// keep their round trips (and an upload through a 64 KiB budget
// completes); a new connection waits until enough links ended.
func TestReloadLowersLimitsCutsNothing(t *testing.T) {
	r := startLimited(t, policy.Limits{}, 0)
	const open = 6
	var cs []net.Conn
	for i := range open {
		c, err := net.Dial("tcp", r.p.Addr("test").String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		roundTrip(t, c, []byte("before "+strconv.Itoa(i)))
		cs = append(cs, c)
	}
	lowered := r.cfg
	lowered.Limits = policy.Limits{MaxLinks: 2, MemoryBudget: 64 << 10}
	if err := r.p.Reload(lowered); err != nil {
		t.Fatal(err)
	}
	if l := r.p.Limits(); l.MaxLinks != 2 || l.Budget != 64<<10 {
		t.Fatalf("limits after the reload: max_links %d, budget %d", l.MaxLinks, l.Budget)
	}
	for i, c := range cs {
		roundTrip(t, c, []byte("after "+strconv.Itoa(i)))
	}
	// An upload larger than the budget on an open link: held back, not cut.
	big := make([]byte, 512<<10)
	for i := range big {
		big[i] = byte(i)
	}
	roundTrip(t, cs[0], big)

	late := r.openEchoers(1)
	r.waitGauge(1, 5*time.Second)
	for _, c := range cs[1:] {
		_ = c.Close()
	}
	pending := map[*echoer]bool{late[0]: true}
	served(t, pending, 1, 10*time.Second)
	if got := testutil.ToFloat64(r.m.ForListener("test").LinksActive); got > 2 {
		t.Fatalf("links_active %v after the waiting connection was served, max_links 2", got)
	}
	for _, reason := range []string{string(CloseBudget), string(CloseWatermark), string(CloseShutdown)} {
		if got := testutil.ToFloat64(r.m.ForListener("test").Closes(reason)); got != 0 {
			t.Fatalf("%v links closed %s after the reload", got, reason)
		}
	}
}

// A slot given back while a listener waits for one of the process's is
// that listener's, not a mesh stream's: a listener takes the slot for its
// next connection before it accepts, and its connections wait in the
// kernel's accept queue with nowhere else to go, where a refused stream
// goes to another replica. Here the limit is raised without waking the
// waiting listener, so a slot is free while it waits: a stream's take is
// refused. Before, take saw only the free slot, and streams arriving
// faster than the listener woke could keep it from every slot given back.
// The twin: once the listener holds its slot, take gets a free one.
func TestWaitingListenerGoesBeforeAMeshStream(t *testing.T) {
	r := startLimited(t, policy.Limits{MaxLinks: 1}, 0)
	l := r.p.listeners[0]
	first := r.openEchoers(1)
	served(t, map[*echoer]bool{first[0]: true}, 1, 10*time.Second)
	r.waitGauge(1, 10*time.Second) // the listener waits for the process's slot
	s := &r.p.slots
	s.mu.Lock()
	s.max = 2 // a slot free, the listener not woken
	waiting := s.procWaiting
	s.mu.Unlock()
	if waiting != 1 {
		t.Fatalf("%d listeners counted waiting for a slot of the process's, want 1", waiting)
	}
	if s.take(l) {
		s.release(l)
		t.Fatal("a mesh stream took the slot a waiting listener was owed")
	}
	s.retuned()
	deadline := time.Now().Add(10 * time.Second)
	for {
		s.mu.Lock()
		total, waiting := s.total, s.procWaiting
		if total == 2 && waiting == 0 {
			s.max = 3 // a slot free, nobody waiting for it
			s.mu.Unlock()
			break
		}
		s.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatalf("%d slots taken, %d listeners waiting 10s after the wake, want 2 (the listener's for its next connection) and none", total, waiting)
		}
		time.Sleep(time.Millisecond)
	}
	if !s.take(l) {
		t.Fatal("a mesh stream was refused a free slot nobody waits for")
	}
	s.release(l)
	second := r.openEchoers(1)
	served(t, map[*echoer]bool{second[0]: true}, 1, 10*time.Second)
}

// A reload that changes max_links or the budget says so in the log, and
// says the warnings its limits have that the old ones had not: the start
// log says them once, and before a reload left them unsaid (a reload
// that adds a mesh listener lowers a derived max_links to a third).
func TestReloadLogsChangedLimitsAndNewWarnings(t *testing.T) {
	r := startLimited(t, policy.Limits{}, 0)
	was := r.p.Limits().MaxLinks
	retuned := r.cfg
	retuned.Limits = policy.Limits{MaxLinks: 2, Memory: 64 << 20, MemoryBudget: 64 << 20}
	if err := r.p.Reload(retuned); err != nil {
		t.Fatal(err)
	}
	log := r.log.String()
	if !strings.Contains(log, `"message":"limits changed"`) || !strings.Contains(log, `"max_links":2,"max_links_was":`+strconv.Itoa(was)) {
		t.Fatalf("no limits change logged for max_links %d -> 2:\n%s", was, log)
	}
	if !strings.Contains(log, `"level":"warn","message":"memory budget`) {
		t.Fatalf("the new limits' warning (budget not below the memory) not logged at the reload:\n%s", log)
	}
	// The twin: a reload that changes neither logs neither.
	before := strings.Count(r.log.String(), `"limits changed"`)
	if err := r.p.Reload(retuned); err != nil {
		t.Fatal(err)
	}
	if after := strings.Count(r.log.String(), `"limits changed"`); after != before {
		t.Fatalf("a reload with the same limits logged a change")
	}
}
