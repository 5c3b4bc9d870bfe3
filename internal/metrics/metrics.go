// Package metrics owns every Prometheus collector livenessproxy exports, on
// a private registry. Names and labels are part of the user-facing interface
// (DESIGN.md, "Metrics"): keep them stable.
package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

const namespace = "livenessproxy"

// Close reasons for link_closes_total{reason}. A small fixed set, like
// HAProxy's termination flags, so dashboards can rely on it.
const (
	ReasonClientClosed     = "client_closed"      // client sent FIN first, both directions finished
	ReasonUpstreamClosed   = "upstream_closed"    // upstream sent FIN first, both directions finished
	ReasonClientError      = "client_error"       // reset or error on the client socket
	ReasonUpstreamError    = "upstream_error"     // reset or error on the upstream socket
	ReasonUpstreamTimeout  = "upstream_timeout"   // ETIMEDOUT: TCP_USER_TIMEOUT or keepalive gave up
	ReasonWriteTimeout     = "write_timeout"      // upstream kernel did not accept a write in time
	ReasonWatermark        = "watermark"          // queue above the high watermark with on_overflow: reject
	ReasonHalfCloseTimeout = "half_close_timeout" // other direction still open half_close_timeout after a FIN
	ReasonDialError        = "dial_error"         // upstream dial failed (refused, unreachable, timeout)
	ReasonShutdown         = "shutdown"           // still open when the drain timeout ran out
)

// Reasons lists every close reason, for pre-creating series.
var Reasons = []string{
	ReasonClientClosed, ReasonUpstreamClosed, ReasonClientError, ReasonUpstreamError,
	ReasonUpstreamTimeout, ReasonWriteTimeout, ReasonWatermark, ReasonHalfCloseTimeout,
	ReasonDialError, ReasonShutdown,
}

// Metrics owns the registry and every collector.
type Metrics struct {
	Registry *prometheus.Registry

	linksActive         *prometheus.GaugeVec
	linksTotal          *prometheus.CounterVec
	linkCloses          *prometheus.CounterVec
	dialErrors          *prometheus.CounterVec
	dialDuration        *prometheus.HistogramVec
	writeTimeouts       *prometheus.CounterVec
	watermarkRejections *prometheus.CounterVec
}

// New builds the collectors and registers them, with the Go runtime and
// process collectors, on a fresh private registry.
func New() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		linksActive: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Name: "links_active",
			Help: "Links (client connection plus upstream connection) currently open.",
		}, []string{"listener"}),
		linksTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "links_total",
			Help: "Client connections accepted.",
		}, []string{"listener"}),
		linkCloses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "link_closes_total",
			Help: "Links ended, by the first reason that ended them.",
		}, []string{"listener", "reason"}),
		dialErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "dial_errors_total",
			Help: "Upstream dials that failed or timed out.",
		}, []string{"listener"}),
		dialDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "dial_duration_seconds",
			Help:    "Time to establish the upstream connection, successful dials only.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}, []string{"listener"}),
		writeTimeouts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "write_timeouts_total",
			Help: "Links closed because the upstream kernel did not accept a write within write_timeout.",
		}, []string{"listener"}),
		watermarkRejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "watermark_rejections_total",
			Help: "Links closed because their upstream queue would pass high_water_mark (on_overflow: reject).",
		}, []string{"listener"}),
	}
	m.Registry.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.linksActive, m.linksTotal, m.linkCloses, m.dialErrors, m.dialDuration,
		m.writeTimeouts, m.watermarkRejections,
	)
	return m
}

// Listener holds one listener's resolved children so that the data plane
// never looks a label up on its hot path.
type Listener struct {
	LinksActive         prometheus.Gauge
	LinksTotal          prometheus.Counter
	DialErrors          prometheus.Counter
	DialDuration        prometheus.Observer
	WriteTimeouts       prometheus.Counter
	WatermarkRejections prometheus.Counter
	closes              map[string]prometheus.Counter
}

// ForListener resolves (and so pre-creates at zero) every series of one listener.
func (m *Metrics) ForListener(name string) *Listener {
	l := &Listener{
		LinksActive:         m.linksActive.WithLabelValues(name),
		LinksTotal:          m.linksTotal.WithLabelValues(name),
		DialErrors:          m.dialErrors.WithLabelValues(name),
		DialDuration:        m.dialDuration.WithLabelValues(name),
		WriteTimeouts:       m.writeTimeouts.WithLabelValues(name),
		WatermarkRejections: m.watermarkRejections.WithLabelValues(name),
		closes:              make(map[string]prometheus.Counter, len(Reasons)),
	}
	for _, r := range Reasons {
		l.closes[r] = m.linkCloses.WithLabelValues(name, r)
	}
	return l
}

// Closed counts one link end with its reason.
func (l *Listener) Closed(reason string) {
	if c, ok := l.closes[reason]; ok {
		c.Inc()
	}
}

// Forget drops a removed listener's series.
func (m *Metrics) Forget(name string) {
	for _, v := range []interface{ DeletePartialMatch(prometheus.Labels) int }{
		m.linksActive, m.linksTotal, m.linkCloses, m.dialErrors, m.dialDuration,
		m.writeTimeouts, m.watermarkRejections,
	} {
		v.DeletePartialMatch(prometheus.Labels{"listener": name})
	}
}

// Register adds a collector the data plane owns (such as bytes_total,
// which is computed from live links at scrape time).
func (m *Metrics) Register(c prometheus.Collector) { m.Registry.MustRegister(c) }
