package proxy

import (
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/prometheus/client_golang/prometheus"
)

// waitForBudget is send's path when the queue's next chunk does not fit
// the budget: it waits until it fits, and returns push's result then. A
// link that has waited write_timeout while its upstream owed bytes and
// acknowledged none of them gets flow.PushStalled instead: the evidence a
// close needs.
func (lk *link) waitForBudget(p []byte, high int64) flow.PushResult {
	b := lk.budget
	b.HeldBack.Add(1)
	if b.Waits != nil {
		b.Waits.Inc()
	}
	wt := lk.settings.WriteTimeout.D()
	t := time.NewTimer(flow.BudgetRecheck)
	defer t.Stop()
	// Evidence is measured from the wait on: the last progress sample may
	// be from an idle spell long before these bytes were owed.
	began := flow.Mono()
	lk.progressed()
	for {
		if wt > 0 && flow.Mono()-began >= int64(wt) && lk.owesUpstream(len(p)) && lk.stalled(wt) {
			return flow.PushStalled
		}
		ch := b.Wait()
		r := lk.q.Push(p, high)
		if r != flow.PushBudget {
			b.Unwait(ch)
			return r
		}
		t.Reset(flow.BudgetRecheck)
		select {
		case <-ch:
		case <-t.C:
		case <-lk.q.Done:
		}
		b.Unwait(ch)
	}
}

// owesUpstream reports whether bytes handed toward the upstream wait for
// it: in the queue, or sent to the kernel and not acknowledged (inHand is
// what the pump read and has not handed on). Without that, an upstream
// that acknowledged nothing lately simply had nothing to acknowledge.
func (lk *link) owesUpstream(inHand int) bool {
	if lk.q.Bytes() > 0 {
		return true
	}
	acked, ok := lk.ackedBytes()
	return ok && lk.bytesUp.Load()-int64(inHand) > acked
}

// reap runs while the proxy does: every flow.BudgetRecheck, while links wait
// for the budget, it closes the links that hold queue chunks toward an
// upstream that acknowledged nothing for write_timeout, and it logs what
// the budget did at most once a second.
func (p *Proxy) reap() {
	defer p.bg.Done()
	t := time.NewTicker(flow.BudgetRecheck)
	defer t.Stop()
	var logged time.Time
	for {
		select {
		case <-t.C:
		case <-p.ctx.Done():
			return
		}
		b := &p.budget
		if b.Nwait.Load() > 0 {
			p.mu.Lock()
			ls := append([]*listener(nil), p.listeners...)
			p.mu.Unlock()
			for _, l := range ls {
				for _, lk := range l.snapshotLinks() {
					if lk.holdsForNothing(flow.Mono()) {
						lk.budgetClose()
					}
				}
			}
		}
		if time.Since(logged) < time.Second {
			continue
		}
		held, closed := b.HeldBack.Swap(0), b.Closed.Swap(0)
		if held == 0 && closed == 0 {
			continue
		}
		logged = time.Now()
		p.log.Warn().Int64("budget_bytes", b.Limit.Load()).Int64("used_bytes", b.Queued.Load()+b.Windows.Load()).Int64("read_buffer_bytes", b.Reads.Load()).Int64("reads_held_back", held).
			Int64("links_closed", closed).Int32("links_waiting", b.Nwait.Load()).
			Msg("memory budget full: links toward live upstreams wait, links toward upstreams without progress for write_timeout are closed")
	}
}

// holdsForNothing reports whether the link holds queue chunks toward an
// upstream that acknowledged nothing for write_timeout while they waited:
// bytes queued for at least write_timeout (so an idle spell before them
// is not counted), and no progress for that long: nothing acknowledged,
// nor sent (stalled).
func (lk *link) holdsForNothing(now int64) bool {
	wt := lk.settings.WriteTimeout.D()
	since, held := lk.q.HeldSince()
	return wt > 0 && held && now-since >= int64(wt) && lk.stalled(wt)
}

// budgetClose ends a link for the budget: its upstream has bytes waiting
// and acknowledged nothing for write_timeout (the caller checked), so it
// is blamed, as a write_timeout would blame it, unless its client stalled
// it.
func (lk *link) budgetClose() {
	// Blamed, unless the upstream's own bytes wait unread in the proxy:
	// then the link is the proxy's cut, for memory, of a link its client
	// stalled (answersWaiting).
	lk.overflowStalled.Store(!lk.answersWaiting())
	if lk.abort(CloseBudget, nil) {
		lk.budget.Closed.Add(1)
	}
}

// budgetCollector exports memory_budget_bytes and memory_budget_used_bytes.
type budgetCollector struct{ b *flow.Budget }

var (
	budgetDesc = prometheus.NewDesc("livenessproxy_memory_budget_bytes",
		"The memory budget in force (process-wide).", nil, nil)
	budgetUsedDesc = prometheus.NewDesc("livenessproxy_memory_budget_used_bytes",
		"Bytes of the budget in use: queues (chunks of bytes waiting for upstreams), reads (read buffers in hand) and windows (the head of a frame a protocol profile waits on, held across reads beyond its first 4 KiB) (process-wide).",
		[]string{"use"}, nil)
)

func (c *budgetCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- budgetDesc
	ch <- budgetUsedDesc
}

func (c *budgetCollector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(budgetDesc, prometheus.GaugeValue, float64(c.b.Limit.Load()))
	ch <- prometheus.MustNewConstMetric(budgetUsedDesc, prometheus.GaugeValue, float64(c.b.Queued.Load()), "queues")
	ch <- prometheus.MustNewConstMetric(budgetUsedDesc, prometheus.GaugeValue, float64(c.b.Reads.Load()), "reads")
	ch <- prometheus.MustNewConstMetric(budgetUsedDesc, prometheus.GaugeValue, float64(c.b.Windows.Load()), "windows")
}
