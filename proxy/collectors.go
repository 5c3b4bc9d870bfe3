package proxy

import (
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
	c.p.mu.Lock()
	ls := append([]*listener(nil), c.p.listeners...)
	c.p.mu.Unlock()
	for _, l := range ls {
		var n int64
		for _, lk := range l.snapshotLinks() {
			n += lk.q.Bytes()
		}
		ch <- prometheus.MustNewConstMetric(queuedDesc, prometheus.GaugeValue, float64(n), l.cfg.Name)
	}
}

// bytesCollector exports bytes_total from live links' counters plus those
// of links that ended, so the pumps never touch a shared metric per read.
type bytesCollector struct{ p *Proxy }

var bytesDesc = prometheus.NewDesc("livenessproxy_bytes_total",
	"Bytes proxied, request (client→upstream) and response; computed at scrape time from live links, so the data path never touches a shared metric.",
	[]string{"listener", "direction"}, nil)

func (c *bytesCollector) Describe(ch chan<- *prometheus.Desc) { ch <- bytesDesc }

func (c *bytesCollector) Collect(ch chan<- prometheus.Metric) {
	c.p.mu.Lock()
	ls := append([]*listener(nil), c.p.listeners...)
	c.p.mu.Unlock()
	for _, l := range ls {
		l.mu.Lock()
		up, dn := l.closedUp, l.closedDn
		for lk := range l.links {
			up += lk.bytesUp.Load()
			dn += lk.bytesDown.Load()
		}
		l.mu.Unlock()
		ch <- prometheus.MustNewConstMetric(bytesDesc, prometheus.CounterValue, float64(up), l.cfg.Name, "request")
		ch <- prometheus.MustNewConstMetric(bytesDesc, prometheus.CounterValue, float64(dn), l.cfg.Name, "response")
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
