// Package demo is `livenessproxy demo`: the seeds' path-stall incident
// replayed in-process on loopback, with and without the proxy, so the
// difference can be seen in about fifteen seconds and without root.
//
// A simulated Pinot server (package pinotsim) with a small receive buffer
// is queried at the same steady rate by two simulated brokers that behave
// like Pinot before the seeds' fixes: one connects directly, the other
// through a livenessproxy. After a few seconds the server stalls: it stops
// reading while its kernel keeps every socket open, which is what a wedged
// server or a stalled path looks like to the broker. Everything printed is
// measured during the run.
package demo

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// params shape a run. Run uses defaultParams; tests may shorten them.
type params struct {
	warmup, stall, recovery time.Duration // the three phases
	rate                    int           // queries per second per broker
	requestSize             int           // bytes per request payload
	queryTimeout            time.Duration
	serverRcvbuf            int // SO_RCVBUF of the server's sockets

	writeTimeout   time.Duration
	tcpUserTimeout time.Duration
	highWaterMark  policy.Size
	keepalive      policy.Keepalive
}

func defaultParams() params {
	return params{
		warmup:   3 * time.Second,
		stall:    6 * time.Second,
		recovery: 3 * time.Second,
		// 250 × 32 KiB ≈ 8 MiB/s per connection, about the incident's 9 MB/s.
		rate:         250,
		requestSize:  32 << 10,
		queryTimeout: time.Second,
		serverRcvbuf: 32 << 10,

		writeTimeout:   2 * time.Second,
		tcpUserTimeout: 2 * time.Second,
		highWaterMark:  4 * policy.MiB,
		keepalive:      policy.Keepalive{Idle: policy.Duration(time.Second), Interval: policy.Duration(time.Second), Count: 2},
	}
}

// Broker ids, which the server uses to tell the two paths apart.
const (
	directID  = "Broker_direct"
	proxiedID = "Broker_via_proxy"
	listener  = "pinot-server-0"
)

// pathResult is what was measured on one path.
type pathResult struct {
	Broker   pinotsim.BrokerStats
	Executed int64 // requests the server executed from this broker
	Stale    int64 // of those, the ones that arrived after their deadline

	// At the end of the stall, before Resume.
	ConnectedAtStallEnd bool
	TimedOutInStall     int64
	FailedFastInStall   int64
	QueueAtStallEnd     int64
}

// result is everything a run measured.
type result struct {
	Direct, Proxied pathResult
	// LinkEnds are the proxy's links that ended before shutdown, with At
	// relative to the start.
	LinkEnds []linkEnd
	// BrokerCloses are the connection closes the proxied broker saw.
	BrokerCloses []brokerClose
	StallAt      time.Duration // since the start
	ResumeAt     time.Duration
	HighWater    int64
}

type linkEnd struct {
	At    time.Duration
	Stats proxy.LinkStats
}

type brokerClose struct {
	At    time.Duration
	Close pinotsim.ConnClose
}

// Run replays the path stall with and without the proxy and writes a short
// timeline and a summary table to w. It takes about fifteen seconds; it
// returns early with ctx.Err() when ctx ends.
func Run(ctx context.Context, w io.Writer) error {
	_, err := run(ctx, w, defaultParams())
	return err
}

// events collects what the proxy and the proxied broker report from their
// own goroutines.
type events struct {
	start time.Time
	mu    sync.Mutex
	links []linkEnd
	conns []brokerClose
}

func (e *events) linkEnded(s proxy.LinkStats) {
	e.mu.Lock()
	e.links = append(e.links, linkEnd{At: time.Since(e.start), Stats: s})
	e.mu.Unlock()
}

func (e *events) connClosed(c pinotsim.ConnClose) {
	e.mu.Lock()
	e.conns = append(e.conns, brokerClose{At: c.At.Sub(e.start), Close: c})
	e.mu.Unlock()
}

func (e *events) snapshot() ([]linkEnd, []brokerClose) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]linkEnd(nil), e.links...), append([]brokerClose(nil), e.conns...)
}

func run(ctx context.Context, w io.Writer, p params) (res *result, err error) {
	ev := &events{start: time.Now()}
	out := &printer{w: w}

	srv, err := pinotsim.NewServer(pinotsim.ServerConfig{RecvBuffer: p.serverRcvbuf})
	if err != nil {
		return nil, fmt.Errorf("start server: %w", err)
	}
	defer srv.Close()

	cfg := policy.DefaultConfig()
	cfg.Admin.Listen = ""
	s := cfg.Defaults
	s.WriteTimeout = policy.Duration(p.writeTimeout)
	s.TCPUserTimeout = policy.Duration(p.tcpUserTimeout)
	s.Keepalive = p.keepalive
	s.WriteBuffer = policy.WriteBuffer{HighWaterMark: p.highWaterMark, LowWaterMark: p.highWaterMark / 2, OnOverflow: policy.OverflowReject}
	cfg.Defaults = s
	cfg.Listeners = []policy.Listener{{Name: listener, Listen: "127.0.0.1:0", Upstream: srv.Addr(), Settings: s}}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("demo proxy config: %w", err)
	}
	px := proxy.New(cfg, proxy.Options{OnLinkEnd: ev.linkEnded})
	if err := px.Start(); err != nil {
		return nil, fmt.Errorf("start proxy: %w", err)
	}
	proxyClosed := false
	defer func() {
		if !proxyClosed {
			_ = px.Close()
		}
	}()
	proxyAddr := px.Addr(listener).String()

	direct := pinotsim.NewBroker(pinotsim.BrokerConfig{ID: directID, Timeout: p.queryTimeout, RequestSize: p.requestSize})
	defer direct.Close()
	proxied := pinotsim.NewBroker(pinotsim.BrokerConfig{ID: proxiedID, Timeout: p.queryTimeout, RequestSize: p.requestSize,
		OnClose: ev.connClosed})
	defer proxied.Close()

	total := p.warmup + p.stall + p.recovery
	out.raw("livenessproxy demo: a broker→server path stall replayed on loopback, with and without the proxy (~%s)", total.Round(time.Second))
	out.raw("  load     %d queries/s per broker, %s requests (~%s/s), query timeout %s; server SO_RCVBUF %s",
		p.rate, mib(int64(p.requestSize)), mib(int64(p.rate*p.requestSize)), p.queryTimeout, mib(int64(p.serverRcvbuf)))
	out.raw("  direct   broker → server %s", srv.Addr())
	out.raw("  proxied  broker → proxy %s → server (write_timeout %s, tcp_user_timeout %s, high_water_mark %s reject)",
		proxyAddr, p.writeTimeout, p.tcpUserTimeout, p.highWaterMark)

	// Load: the same bounded rate on both paths, for the whole run.
	loadCtx, stopLoad := context.WithCancel(ctx)
	var loadWG sync.WaitGroup
	defer func() { stopLoad(); loadWG.Wait() }()
	maxQueries := p.rate * int(total/time.Second+1)
	for _, l := range []struct {
		b    *pinotsim.Broker
		addr string
	}{{direct, srv.Addr()}, {proxied, proxyAddr}} {
		loadWG.Add(1)
		go func() {
			defer loadWG.Done()
			driveLoad(loadCtx, l.b, l.addr, p.rate, maxQueries, total)
		}()
	}
	out.line(time.Since(ev.start), "load starts on both paths")

	if err := sleep(ctx, p.warmup); err != nil {
		return nil, err
	}
	d0, x0 := direct.Stats(), proxied.Stats()
	srv.Stall()
	res = &result{StallAt: time.Since(ev.start), HighWater: int64(p.highWaterMark)}
	out.line(res.StallAt, "server stalls: it stops reading, its kernel keeps every socket open")

	// During the stall, report the first link the proxy closed and the
	// first close the proxied broker saw, as they happen.
	stallEnd := time.Now().Add(p.stall)
	var sawLink, sawConn bool
	for time.Now().Before(stallEnd) {
		if err := sleep(ctx, min(50*time.Millisecond, time.Until(stallEnd))); err != nil {
			return nil, err
		}
		links, conns := ev.snapshot()
		if !sawLink && len(links) > 0 {
			sawLink = true
			l := links[0]
			out.line(l.At, "proxy closed the link: %s after %s queued toward the server (%.1fs into the stall)",
				l.Stats.Reason, mib(l.Stats.MaxQueued), (l.At - res.StallAt).Seconds())
		}
		if !sawConn && len(conns) > 0 {
			sawConn = true
			c := conns[0]
			when := ""
			if len(links) > 0 {
				if d := c.At - links[0].At; d >= time.Millisecond {
					when = fmt.Sprintf(" %dms after the proxy closed it", d.Milliseconds())
				} else {
					when = " at once"
				}
			}
			out.line(c.At, "proxied broker saw the close%s: %d in-flight queries failed fast", when, c.Close.FailedFast)
		}
	}
	d1, x1 := direct.Stats(), proxied.Stats()
	res.Direct.ConnectedAtStallEnd = direct.Connected(srv.Addr())
	res.Direct.TimedOutInStall = d1.TimedOut - d0.TimedOut
	res.Direct.FailedFastInStall = d1.FailedFast - d0.FailedFast
	res.Direct.QueueAtStallEnd = d1.QueueBytes
	res.Proxied.ConnectedAtStallEnd = proxied.Connected(proxyAddr)
	res.Proxied.TimedOutInStall = x1.TimedOut - x0.TimedOut
	res.Proxied.FailedFastInStall = x1.FailedFast - x0.FailedFast
	res.Proxied.QueueAtStallEnd = x1.QueueBytes
	now := time.Since(ev.start)
	links, _ := ev.snapshot()
	if len(links) == 0 {
		out.line(now, "proxy closed no link during the stall")
	} else {
		var maxQ int64
		for _, l := range links {
			maxQ = max(maxQ, l.Stats.MaxQueued)
		}
		out.line(now, "proxied: the proxy closed %d link(s) (%s; at most %s queued), the broker reconnected %d×: %d failed fast, %d timed out",
			len(links), reasons(links), mib(maxQ), x1.Connects-x0.Connects, res.Proxied.FailedFastInStall, res.Proxied.TimedOutInStall)
	}
	state := "still open"
	if !res.Direct.ConnectedAtStallEnd {
		state = "closed"
	}
	out.line(now, "direct: connection %s (%d closes), %d timed out, %d failed fast, outbound queue %s",
		state, d1.Closes, res.Direct.TimedOutInStall, res.Direct.FailedFastInStall, mib(d1.QueueBytes))

	srv.Resume()
	res.ResumeAt = time.Since(ev.start)
	out.line(res.ResumeAt, "server resumes: it reads what its kernel buffered meanwhile")
	drained := false
	recoveryEnd := time.Now().Add(p.recovery)
	for time.Now().Before(recoveryEnd) {
		if err := sleep(ctx, min(20*time.Millisecond, time.Until(recoveryEnd))); err != nil {
			return nil, err
		}
		if !drained && direct.Stats().QueueBytes == 0 {
			drained = true
			st := srv.Stats()
			out.line(time.Since(ev.start), "direct broker's queue drained into the server; stale requests executed so far: direct %d, proxied %d",
				st.ByBroker[directID].Stale, st.ByBroker[proxiedID].Stale)
		}
	}

	stopLoad()
	loadWG.Wait()
	out.line(time.Since(ev.start), "load stops")

	// Let the last answers and executions land, then take the numbers.
	_ = sleep(ctx, 200*time.Millisecond)
	st := srv.Stats()
	res.Direct.Broker, res.Proxied.Broker = direct.Stats(), proxied.Stats()
	res.Direct.Executed, res.Direct.Stale = st.ByBroker[directID].Executed, st.ByBroker[directID].Stale
	res.Proxied.Executed, res.Proxied.Stale = st.ByBroker[proxiedID].Executed, st.ByBroker[proxiedID].Stale
	res.LinkEnds, res.BrokerCloses = ev.snapshot()

	out.raw("")
	out.table([][]string{
		{"path", "sent", "ok", "failed fast", "timed out", "peak broker queue", "stale executed"},
		row("direct", res.Direct),
		row("via proxy", res.Proxied),
	})

	// Orderly teardown: brokers first, so the proxy's links end cleanly.
	_ = direct.Close()
	_ = proxied.Close()
	sctx, cancel := context.WithTimeout(context.Background(), time.Second)
	_ = px.Shutdown(sctx)
	cancel()
	proxyClosed = true
	return res, ctx.Err()
}

// driveLoad sends queries to addr at rate per second, each in its own
// goroutine, until ctx ends, max queries were sent or d elapsed, and
// returns once every query it started has finished (each is bounded by
// the broker's timeout).
func driveLoad(ctx context.Context, b *pinotsim.Broker, addr string, rate, max int, d time.Duration) {
	var wg sync.WaitGroup
	defer wg.Wait()
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	end := time.NewTimer(d)
	defer end.Stop()
	for range max {
		select {
		case <-ctx.Done():
			return
		case <-end.C:
			return
		case <-tick.C:
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			b.Query(ctx, addr)
		}()
	}
}

// sleep waits for d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func reasons(links []linkEnd) string {
	n := map[string]int{}
	for _, l := range links {
		n[l.Stats.Reason]++
	}
	keys := make([]string, 0, len(n))
	for k := range n {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s ×%d", k, n[k]))
	}
	return strings.Join(parts, ", ")
}

func row(name string, r pathResult) []string {
	b := r.Broker
	return []string{name, fmt.Sprint(b.Sent), fmt.Sprint(b.OK), fmt.Sprint(b.FailedFast), fmt.Sprint(b.TimedOut),
		mib(b.PeakQueueBytes), fmt.Sprint(r.Stale)}
}

func mib(n int64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.0f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// printer writes timeline lines stamped relative to the start.
type printer struct{ w io.Writer }

func (p *printer) line(at time.Duration, format string, args ...any) {
	fmt.Fprintf(p.w, "%8s  %s\n", fmt.Sprintf("+%.2fs", at.Seconds()), fmt.Sprintf(format, args...))
}

func (p *printer) raw(format string, args ...any) { fmt.Fprintf(p.w, format+"\n", args...) }

func (p *printer) table(rows [][]string) {
	widths := make([]int, len(rows[0]))
	for _, r := range rows {
		for i, c := range r {
			widths[i] = max(widths[i], len([]rune(c)))
		}
	}
	for _, r := range rows {
		var b strings.Builder
		for i, c := range r {
			if i == 0 {
				fmt.Fprintf(&b, "%-*s", widths[i], c)
			} else {
				fmt.Fprintf(&b, "  %*s", widths[i], c)
			}
		}
		fmt.Fprintln(p.w, b.String())
	}
}
