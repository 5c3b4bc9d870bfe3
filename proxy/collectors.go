package proxy

import (
	"maps"
	"slices"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/livenessproxy/livenessproxy/health"
)

// queuedCollector exports queued_bytes: the bytes waiting in links'
// queues toward their upstreams now, per listener, read at scrape time.
type queuedCollector struct{ p *Proxy }

var queuedDesc = prometheus.NewDesc("livenessproxy_queued_bytes",
	"Bytes waiting in the proxy's queues for the upstream now (the kernel's send buffers not included).",
	[]string{"listener"}, nil)

func (c *queuedCollector) Describe(ch chan<- *prometheus.Desc) { ch <- queuedDesc }

func (c *queuedCollector) Collect(ch chan<- prometheus.Metric) {
	ls, _ := c.p.scraped()
	queued := map[string]int64{}
	for _, l := range ls {
		n := queued[l.cfg.Name]
		for _, lk := range l.snapshotLinks() {
			n += lk.q.Bytes()
		}
		queued[l.cfg.Name] = n
	}
	for name, n := range queued {
		ch <- prometheus.MustNewConstMetric(queuedDesc, prometheus.GaugeValue, float64(n), name)
	}
}

// scraped returns the listeners the scrape-time series count, live and
// draining after a reload removed them (a listener moved under the same
// name is two of them then: their series are summed by name), and the
// bytes of retired listeners that their names carry.
func (p *Proxy) scraped() ([]*listener, map[string][2]int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append(slices.Clone(p.listeners), p.retiring...), maps.Clone(p.carried)
}

// bytesCollector exports bytes_total from live links' counters plus those
// of links that ended, so the pumps never touch a shared metric per read.
type bytesCollector struct{ p *Proxy }

var bytesDesc = prometheus.NewDesc("livenessproxy_bytes_total",
	"Bytes proxied, request (client→upstream) and response; computed at scrape time from live links, so the data path never touches a shared metric.",
	[]string{"listener", "direction"}, nil)

func (c *bytesCollector) Describe(ch chan<- *prometheus.Desc) { ch <- bytesDesc }

func (c *bytesCollector) Collect(ch chan<- prometheus.Metric) {
	ls, carried := c.p.scraped()
	bytes := map[string][2]int64{}
	for _, l := range ls {
		b := bytes[l.cfg.Name]
		carry := carried[l.cfg.Name]
		delete(carried, l.cfg.Name) // once per name
		l.mu.Lock()
		b[0] += l.closedUp + carry[0]
		b[1] += l.closedDn + carry[1]
		for lk := range l.links {
			b[0] += lk.bytesUp.Load()
			b[1] += lk.bytesDown.Load()
		}
		l.mu.Unlock()
		bytes[l.cfg.Name] = b
	}
	for name, b := range bytes {
		ch <- prometheus.MustNewConstMetric(bytesDesc, prometheus.CounterValue, float64(b[0]), name, "request")
		ch <- prometheus.MustNewConstMetric(bytesDesc, prometheus.CounterValue, float64(b[1]), name, "response")
	}
}

// stateCollector exports endpoint_state{listener,endpoint,state}: 1 for
// the endpoint's current state, 0 for the others. Endpoint labels are
// bounded by the configured upstreams.
type stateCollector struct{ p *Proxy }

var stateDesc = prometheus.NewDesc("livenessproxy_endpoint_state",
	"1 for the endpoint's current state (healthy, excluded, disabled), 0 for the others.",
	[]string{"listener", "endpoint", "state"}, nil)

var allStates = []health.State{health.Healthy, health.Excluded, health.Disabled}

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) { ch <- stateDesc }

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	for _, st := range c.p.Endpoints() {
		for _, l := range st.Listeners {
			for _, s := range allStates {
				v := 0.0
				if s.String() == st.State {
					v = 1
				}
				ch <- prometheus.MustNewConstMetric(stateDesc, prometheus.GaugeValue, v, l, st.Endpoint, s.String())
			}
		}
	}
}

// probesCollector exports probes_in_flight and probes_waiting: the
// detector's probes running now (health.DefaultMaxProbes at most) and
// those due that wait for one to end.
type probesCollector struct{ det *health.Detector }

var (
	probesInFlightDesc = prometheus.NewDesc("livenessproxy_probes_in_flight",
		"Probes of excluded endpoints running now, 256 at most (process-wide).", nil, nil)
	probesWaitingDesc = prometheus.NewDesc("livenessproxy_probes_waiting",
		"Probes due that wait for one of the 256 running to end, those of endpoints whose clients are turned away first (process-wide).", nil, nil)
)

func (c *probesCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- probesInFlightDesc
	ch <- probesWaitingDesc
}

func (c *probesCollector) Collect(ch chan<- prometheus.Metric) {
	inFlight, waiting := c.det.ProbeSlots()
	ch <- prometheus.MustNewConstMetric(probesInFlightDesc, prometheus.GaugeValue, float64(inFlight))
	ch <- prometheus.MustNewConstMetric(probesWaitingDesc, prometheus.GaugeValue, float64(waiting))
}
