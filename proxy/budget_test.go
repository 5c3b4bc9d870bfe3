package proxy

import (
	"bufio"
	"crypto/rand"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// upload writes n bytes to c as fast as c takes them, then half-closes
// it and returns the count a Paced peer answers (-1 with the error if the
// link ended before).
func upload(c *net.TCPConn, n int) (int64, error) {
	buf := make([]byte, 64<<10)
	_, _ = rand.Read(buf)
	for sent := 0; sent < n; {
		w, err := c.Write(buf[:min(len(buf), n-sent)])
		sent += w
		if err != nil {
			return -1, fmt.Errorf("after %d bytes: %w", sent, err)
		}
	}
	if err := c.CloseWrite(); err != nil {
		return -1, err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return -1, fmt.Errorf("reading the count: %w", err)
	}
	return strconv.ParseInt(strings.TrimSpace(line), 10, 64)
}

// Issue 20, finding 3: with every default, a client uploading 40 MiB to
// an upstream that reads steadily at 20 MB/s (slower than the client
// writes) fills the 16 MiB watermark; the link is held back, never cut,
// and every byte arrives. Before, on_overflow: reject closed it
// (watermark) after 19-22 MiB.
func TestDefaultWatermarkKeepsAHealthyUpload(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Paced, faultpeer.Options{})
	peer.SetRate(20 << 20)
	h := start(t, peer.Addr(), nil) // the defaults
	if wb := policy.DefaultSettings().WriteBuffer; wb.OnOverflow != policy.OverflowBackpressure || wb.HighWaterMark != 16*policy.MiB {
		t.Fatalf("default write_buffer %+v, want backpressure at 16MiB", wb)
	}
	// The peer reads only once the queue is at the watermark (the
	// proxy's own count): on a loaded machine the client may write
	// slower than the peer reads.
	peer.HoldReads()
	c := h.dial()
	const n = 40 << 20
	type result struct {
		got int64
		err error
	}
	done := make(chan result, 1)
	go func() { got, err := upload(c, n); done <- result{got, err} }()
	lk := h.onlyLink(5 * time.Second)
	// Within write_timeout (10 s): the held peer acknowledges nothing new.
	waitFor(t, 8*time.Second, "the queue at the watermark", func() bool { return lk.q.Bytes() >= 16<<20-flow.ChunkSize })
	peer.ReleaseReads()
	if r := <-done; r.err != nil || r.got != n {
		t.Fatalf("upload: the peer read %d of %d bytes (%v)", r.got, n, r.err)
	}
	_ = c.Close()
	s := h.linkEnd(10 * time.Second)
	if s.Reason != CloseClientClosed && s.Reason != CloseUpstreamClosed {
		t.Fatalf("link ended %q (%v), want a clean end", s.Reason, s.Err)
	}
	// The situation of the finding: the queue reached the watermark.
	if high := int64(16 << 20); s.MaxQueued < high-flow.ChunkSize {
		t.Fatalf("the queue peaked at %d bytes: the upload never reached the %d watermark, so this proves nothing", s.MaxQueued, high)
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").WatermarkRejections); got != 0 {
		t.Fatalf("watermark_rejections_total = %v, want 0", got)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s), want healthy", ep.State, ep.Reason)
	}
}

// The dead twin: an upstream that stops reading altogether, with the
// default watermark policy, still ends the link on the write-progress
// evidence (write_timeout, 1 s here to keep the test short) and is
// excluded.
func TestDefaultWatermarkStoppedReaderStillTrips(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(time.Second)
		s.Detector.InitialDelay = policy.Duration(10 * time.Second)
	})
	c := h.dial()
	sent := writeAsync(c, 64<<20, 64<<10)
	s := h.linkEnd(10 * time.Second)
	<-sent
	if s.Reason != CloseWriteTimeout {
		t.Fatalf("link ended %q (%v), want write_timeout", s.Reason, s.Err)
	}
	if s.MaxQueued > 16<<20 {
		t.Fatalf("the queue held %d bytes, past the 16 MiB watermark", s.MaxQueued)
	}
	h.waitState("excluded", 2*time.Second)
}

// budgetRig is a proxy with a small memory budget, two listeners: "test"
// in front of upstream, "healthy" in front of an echo peer.
type budgetRig struct {
	t       *testing.T
	p       *Proxy
	m       *metrics.Metrics
	test    string // listener addresses
	healthy string
	ended   chan LinkStats
}

func startBudget(t *testing.T, upstream string, lim policy.Limits, tune func(*policy.Settings)) *budgetRig {
	t.Helper()
	return startBudgetPool(t, policy.Pool{Endpoints: []string{upstream}}, lim, tune)
}

// startBudgetPool is startBudget with a pool behind "test".
func startBudgetPool(t *testing.T, pool policy.Pool, lim policy.Limits, tune func(*policy.Settings)) *budgetRig {
	t.Helper()
	echo := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	cfg := policy.DefaultConfig()
	cfg.Limits = lim
	s := cfg.Defaults
	if tune != nil {
		tune(&s)
	}
	cfg.Listeners = []policy.Listener{
		{Name: "test", Listen: "127.0.0.1:0", Pool: pool, Settings: s},
		{Name: "healthy", Listen: "127.0.0.1:0", Upstream: echo.Addr(), Settings: s},
	}
	r := &budgetRig{t: t, m: metrics.New(), ended: make(chan LinkStats, 1024)}
	r.p = New(cfg, Options{metrics: r.m, Logger: testLogger(), OnLinkEnd: func(s LinkStats) { r.ended <- s }})
	if err := r.p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.p.Close() })
	r.test, r.healthy = r.p.Addr("test").String(), r.p.Addr("healthy").String()
	return r
}

func (r *budgetRig) dial(addr string) *net.TCPConn {
	r.t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { _ = c.Close() })
	return c.(*net.TCPConn)
}

// A budget of 4 MiB and eight links writing toward upstreams that never
// read (eight of them, so that one exclusion does not evict the other
// links): the budget fills and holds (the queues never pass it), links
// wait rather than being cut while their upstream could still be making
// progress, and once it has acknowledged nothing for write_timeout each
// is closed (budget, or its own writer's write_timeout, whichever sees it
// first). Meanwhile a healthy link through the same process keeps its
// round trips.
func TestBudgetHoldsAndStalledLinksGiveWay(t *testing.T) {
	const links = 8
	var pool policy.Pool
	for range links {
		pool.Endpoints = append(pool.Endpoints, faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096}).Addr())
	}
	const budget = 4 << 20
	r := startBudgetPool(t, pool, policy.Limits{MemoryBudget: budget}, func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(time.Second)
		s.Detector.InitialDelay = policy.Duration(30 * time.Second)
	})
	if got := r.p.Limits().Budget; got != budget {
		t.Fatalf("budget %d, want %d", got, budget)
	}
	hc := r.dial(r.healthy)
	roundTrip(t, hc, []byte("before"))

	var sent []<-chan int
	for range links {
		sent = append(sent, writeAsync(r.dial(r.test), 8<<20, 64<<10))
	}
	// The healthy link's round trips go on while the budget is full, and
	// the queues never hold more than the budget.
	var peakQueued int64
	trips := 0
	deadline := time.Now().Add(20 * time.Second)
	ends := map[string]int{}
	for len(ends) == 0 || sum(ends) < links {
		if time.Now().After(deadline) {
			t.Fatalf("after 20 s, %d of %d stalled links ended (%v)", sum(ends), links, ends)
		}
		roundTrip(t, hc, []byte("during "+strconv.Itoa(trips)))
		trips++
		peakQueued = max(peakQueued, r.p.budget.Queued.Load())
		for drained := false; !drained; {
			select {
			case s := <-r.ended:
				ends[string(s.Reason)]++
			default:
				drained = true
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, ch := range sent {
		<-ch
	}
	roundTrip(t, hc, []byte("after"))
	t.Logf("%d healthy round trips while the budget was full; stalled links ended %v; queues peaked at %d bytes", trips, ends, peakQueued)
	if peakQueued > budget {
		t.Fatalf("queues held %d bytes, past the %d budget", peakQueued, budget)
	}
	for reason, n := range ends {
		if reason != string(CloseBudget) && reason != string(CloseWriteTimeout) {
			t.Fatalf("%d stalled links ended %q, want budget or write_timeout", n, reason)
		}
	}

	if got := testutil.ToFloat64(r.m.BudgetWaits); got == 0 {
		t.Fatal("memory_budget_waits_total = 0: the budget never held a read back")
	}
	if got := r.p.budget.Queued.Load(); got != 0 {
		t.Fatalf("%d bytes of queue chunks still counted after every stalled link ended", got)
	}
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// The healthy twin: eight links uploading 4 MiB each toward an upstream
// that reads steadily (2 MB/s a connection), through a 1 MiB budget: the
// budget holds them back, and every link finishes with every byte
// delivered; none is closed.
func TestBudgetSlowSteadyUploadsAllFinish(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Paced, faultpeer.Options{})
	peer.SetRate(2 << 20)
	const budget = 1 << 20
	r := startBudget(t, peer.Addr(), policy.Limits{MemoryBudget: budget}, func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(time.Second)
	})
	const links, each = 8, 4 << 20
	var wg sync.WaitGroup
	errs := make(chan error, links)
	for range links {
		c := r.dial(r.test)
		wg.Add(1)
		go func() {
			defer wg.Done()
			got, err := upload(c, each)
			if err != nil || got != each {
				errs <- fmt.Errorf("the peer read %d of %d bytes (%v)", got, each, err)
			}
			_ = c.Close()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for range links {
		select {
		case s := <-r.ended:
			if s.Reason != CloseClientClosed && s.Reason != CloseUpstreamClosed {
				t.Errorf("a link ended %q (%v), want a clean end", s.Reason, s.Err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("not every link ended")
		}
	}
	if got := testutil.ToFloat64(r.m.BudgetWaits); got == 0 {
		t.Fatal("memory_budget_waits_total = 0: the budget never held a read back, so this proves nothing")
	}
}

// A link whose queue is empty and whose upstream has acknowledged all it
// was sent owes nothing: waiting for the budget (starved by others) for
// longer than write_timeout is no evidence against its upstream.
func TestBudgetStarvedLinkIsNotBlamed(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Paced, faultpeer.Options{})
	r := startBudget(t, peer.Addr(), policy.Limits{MemoryBudget: 1 << 20}, func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(300 * time.Millisecond)
	})
	c := r.dial(r.test)
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	lk := onlyLinkOf(t, r.p, "test")
	deadline := time.Now().Add(5 * time.Second)
	for a, ok := lk.ackedBytes(); !ok || a < 5; a, ok = lk.ackedBytes() {
		if time.Now().After(deadline) {
			t.Fatal("the upstream never acknowledged 5 bytes")
		}
		time.Sleep(10 * time.Millisecond)
	}
	lk.progressed()                    // the sample that sees the 5 bytes acknowledged
	time.Sleep(400 * time.Millisecond) // past write_timeout with nothing to acknowledge
	if !lk.stalled(300 * time.Millisecond) {
		t.Fatal("stalled() is false for a link idle past write_timeout: the precondition of this test is gone")
	}
	if lk.owesUpstream(0) {
		t.Fatal("a link that sent 5 bytes, all acknowledged, owes its upstream")
	}
}

func onlyLinkOf(t *testing.T, p *Proxy, name string) *link {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		p.mu.Lock()
		var l *listener
		for _, x := range p.listeners {
			if x.cfg.Name == name {
				l = x
			}
		}
		p.mu.Unlock()
		if ks := l.snapshotLinks(); len(ks) == 1 {
			return ks[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("listener %s has no single link", name)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A link that idled longer than write_timeout and then has to wait for
// the budget (another link fills it) is not closed on the old idle spell:
// its upstream is judged only on what it owed since the wait began. (On
// loopback the upstream acknowledges at once, so this guards the rule;
// the spell it protects against is a round trip long, on a real path.)
func TestBudgetWaitAfterIdleIsNotEvidence(t *testing.T) {
	stall := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	live := faultpeer.New(t, faultpeer.Paced, faultpeer.Options{})
	live.SetRate(1 << 20)
	p, m, dial := startHolder(t, stall.Addr(), live.Addr())
	c := dial("test")
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	lk := onlyLinkOf(t, p, "test")
	waitFor(t, 5*time.Second, "the upstream acknowledged 5 bytes", func() bool { a, ok := lk.ackedBytes(); return ok && a >= 5 })
	lk.progressed()
	time.Sleep(500 * time.Millisecond) // idle past write_timeout

	fillBudget(t, p, dial)
	waits := testutil.ToFloat64(m.BudgetWaits)
	writeAsync(c, 4<<20, 64<<10)
	deadline := time.Now().Add(10 * time.Second)
	for testutil.ToFloat64(m.BudgetWaits) == waits {
		if time.Now().After(deadline) {
			t.Fatal("the live link never waited for the budget")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Several write_timeouts of waiting behind the other link: its
	// upstream owes nothing it has not acknowledged, or keeps
	// acknowledging; either way it is no evidence.
	time.Sleep(time.Second)
	if r := lk.reason.Load(); r != nil {
		t.Fatalf("the live link was closed %q while it waited for the budget", *r)
	}
	if got := testutil.ToFloat64(m.ForListener("test").Closes(string(CloseBudget))); got != 0 {
		t.Fatalf("%v links closed for the budget", got)
	}
}

// startHolder starts a proxy with a 1 MiB budget and two listeners:
// "stall" in front of holder, with a write_timeout of a minute (its links
// hold the budget for the whole test), and "test" in front of upstream
// with a write_timeout of 300 ms. dial connects to a listener.
func startHolder(t *testing.T, holder, upstream string) (*Proxy, *metrics.Metrics, func(string) *net.TCPConn) {
	t.Helper()
	cfg := policy.DefaultConfig()
	cfg.Limits = policy.Limits{MemoryBudget: 1 << 20}
	slow, quick := cfg.Defaults, cfg.Defaults
	slow.WriteTimeout = policy.Duration(time.Minute)
	quick.WriteTimeout = policy.Duration(300 * time.Millisecond)
	quick.Detector.InitialDelay = policy.Duration(30 * time.Second)
	cfg.Listeners = []policy.Listener{
		{Name: "stall", Listen: "127.0.0.1:0", Upstream: holder, Settings: slow},
		{Name: "test", Listen: "127.0.0.1:0", Upstream: upstream, Settings: quick},
	}
	m := metrics.New()
	p := New(cfg, Options{metrics: m, Logger: testLogger()})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	dial := func(name string) *net.TCPConn {
		t.Helper()
		c, err := net.Dial("tcp", p.Addr(name).String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		return c.(*net.TCPConn)
	}
	return p, m, dial
}

// fillBudget writes toward the "stall" listener until its link holds the
// whole budget.
func fillBudget(t *testing.T, p *Proxy, dial func(string) *net.TCPConn) {
	t.Helper()
	writeAsync(dial("stall"), 4<<20, 64<<10)
	deadline := time.Now().Add(10 * time.Second)
	for p.budget.Queued.Load() < 1<<20-flow.ChunkSize {
		if time.Now().After(deadline) {
			t.Fatalf("the stalled link never filled the budget (%d bytes)", p.budget.Queued.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The detection twin: with the budget full (held by another link), a link
// whose own upstream stops reading has nothing queued (its chunks do not
// fit), so no writer of its own times out; its bytes sit unacknowledged
// in the kernel. Once it has waited write_timeout with nothing
// acknowledged it is closed (budget) and its endpoint excluded.
func TestBudgetClosesAWaiterWhoseUpstreamStopped(t *testing.T) {
	stall := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	dead := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	p, m, dial := startHolder(t, stall.Addr(), dead.Addr())
	fillBudget(t, p, dial)
	writeAsync(dial("test"), 16<<20, 64<<10)
	deadline := time.Now().Add(10 * time.Second)
	for testutil.ToFloat64(m.ForListener("test").Closes(string(CloseBudget))) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the link toward the stopped upstream was not closed for the budget within 10 s (waits %v)", testutil.ToFloat64(m.BudgetWaits))
		}
		time.Sleep(10 * time.Millisecond)
	}
	deadline = time.Now().Add(5 * time.Second)
	for {
		st, _ := p.det.State(dead.Addr())
		if st.String() == "excluded" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("endpoint %s is %s after a budget close on evidence, want excluded", dead.Addr(), st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The link that holds the budget is not the one that was closed: its
	// own upstream is judged by its own write_timeout (a minute).
	if got := testutil.ToFloat64(m.ForListener("stall").Closes(string(CloseBudget))); got != 0 {
		t.Fatalf("the holder was closed for the budget %v times within its minute", got)
	}
}
