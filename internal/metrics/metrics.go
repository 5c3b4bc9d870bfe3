// Package metrics owns every Prometheus collector livenessproxy exports, on
// a private registry. Names and labels are part of the user-facing interface
// (README, Metrics reference): keep them stable.
package metrics

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

const namespace = "livenessproxy"

// Eviction reasons for evictions_total{reason}.
const (
	EvictExcluded   = "excluded"   // the endpoint was excluded by the detector
	EvictDisabled   = "disabled"   // an operator disabled the endpoint
	EvictReadmitted = "readmitted" // links opened before the endpoint was readmitted
	EvictOperator   = "operator"   // POST /v1/endpoints/{endpoint}/evict
	EvictRemoved    = "removed"    // the endpoint left its pool (DNS no longer lists it, or a reload removed it)
)

// Reasons a link stops being tracked, for untracked_links_total{reason}.
// The link is still proxied byte for byte; only its requests are no longer
// judged, and none of these is held against the upstream.
const (
	UntrackedTLS      = "tls"             // the connection starts with a TLS handshake
	UntrackedSASL     = "sasl"            // Kafka SaslHandshake v0: raw SASL tokens follow
	UntrackedProtocol = "not_protocol"    // a frame is not what the profile's protocol sends
	UntrackedDesync   = "desync"          // a response matches no outstanding request
	UntrackedVersion  = "unknown_version" // a request version whose layout is not known
	UntrackedLimit    = "limit"           // a frame over max_frame_length, or a request's head the memory budget had no room for
)

// UntrackedReasons lists every untracked reason, for pre-creating series.
var UntrackedReasons = []string{UntrackedTLS, UntrackedSASL, UntrackedProtocol, UntrackedDesync, UntrackedVersion, UntrackedLimit}

// EvictReasons lists every eviction reason, for pre-creating series.
var EvictReasons = []string{EvictExcluded, EvictDisabled, EvictReadmitted, EvictOperator, EvictRemoved}

// Metrics owns the data plane's collectors.
type Metrics struct {
	// Registry is the private registry of New; nil for NewOn.
	Registry *prometheus.Registry
	reg      prometheus.Registerer

	linksActive         *prometheus.GaugeVec
	linksTotal          *prometheus.CounterVec
	linkCloses          *prometheus.CounterVec
	dialErrors          *prometheus.CounterVec
	dialDuration        *prometheus.HistogramVec
	writeTimeouts       *prometheus.CounterVec
	watermarkRejections *prometheus.CounterVec
	unansweredTimeouts  *prometheus.CounterVec
	unansweredDeferred  *prometheus.CounterVec
	requestsUnjudged    *prometheus.CounterVec
	kafkaThrottles      *prometheus.CounterVec
	endpointSuspect     *prometheus.CounterVec
	evictions           *prometheus.CounterVec
	probes              *prometheus.CounterVec
	staleFramesDropped  *prometheus.CounterVec
	untrackedLinks      *prometheus.CounterVec
	failOpenLinks       *prometheus.CounterVec
	dnsErrors           *prometheus.CounterVec
	linkDuration        *prometheus.HistogramVec
	meshSessions        *prometheus.GaugeVec
	meshSessionDeaths   *prometheus.CounterVec
	meshFallbacks       *prometheus.CounterVec
	meshLimits          *prometheus.CounterVec
	acceptWaits         *prometheus.CounterVec
	acceptWaiting       *prometheus.GaugeVec
	// BudgetWaits counts reads held back by the memory budget (process-wide).
	BudgetWaits prometheus.Counter
	// ParkedPumps is how many pumps of idle links are parked now
	// (limits.park_idle_after; process-wide).
	ParkedPumps prometheus.Gauge
}

// Mesh session roles, the role label of the mesh series.
const (
	MeshEgress  = "egress"  // sessions this sidecar dialled to peers' ingress
	MeshIngress = "ingress" // sessions peers dialled to this sidecar's ingress
)

// MeshSessions is the gauge of live mesh sessions in role.
func (m *Metrics) MeshSessions(role string) prometheus.Gauge {
	return m.meshSessions.WithLabelValues(role)
}

// MeshSessionDeaths counts sessions in role declared dead by the heartbeat.
func (m *Metrics) MeshSessionDeaths(role string) prometheus.Counter {
	return m.meshSessionDeaths.WithLabelValues(role)
}

// MeshFallbacks counts links of listener that reached their endpoint
// directly because its host has no ingress sidecar (mesh.fallback: direct).
func (m *Metrics) MeshFallbacks(listener string) prometheus.Counter {
	return m.meshFallbacks.WithLabelValues(listener)
}

// MeshLimits counts what a mesh limit refused or cut, in role: limit is
// pings, refusals, streams_per_session, streams, links, sessions_per_peer,
// sessions, peer_not_allowed, handshakes or tls.
func (m *Metrics) MeshLimits(role, limit string) prometheus.Counter {
	return m.meshLimits.WithLabelValues(role, limit)
}

// Process owns the process's own collectors: build_info and the
// configuration reload series.
type Process struct {
	configReloads *prometheus.CounterVec
	lastReloadOK  prometheus.Gauge
	lastReloadAt  prometheus.Gauge
	buildInfo     *prometheus.GaugeVec
}

// New builds the data plane's and the process's collectors and registers
// them, with the Go runtime and process collectors, on a fresh private
// registry (tests, and callers that want one registry for everything).
func New() *Metrics {
	r := prometheus.NewRegistry()
	r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m := NewOn(r)
	m.Registry = r
	NewProcess(r)
	return m
}

// NewOn builds the data plane's collectors and registers them on reg.
//
// Long: a flat list, one collector a field with its name, help and labels,
// then their registration; it reads best as the one table of the data
// plane's series.
func NewOn(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		reg: reg,
		linksActive: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Name: "links_active",
			Help: "Links open now.",
		}, []string{"listener"}),
		linksTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "links_total",
			Help: "Client connections accepted.",
		}, []string{"listener"}),
		linkCloses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "link_closes_total",
			Help: "Links ended, by the first reason that ended them (reason: the close-reason table).",
		}, []string{"listener", "reason"}),
		dialErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "dial_errors_total",
			Help: "Upstream dials that failed or timed out.",
		}, []string{"listener"}),
		dialDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "dial_duration_seconds",
			Help:    "Time to connect upstream (successful dials).",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}, []string{"listener"}),
		writeTimeouts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "write_timeouts_total",
			Help: "Links closed by write_timeout; the same as link_closes_total{reason=\"write_timeout\"}, kept for existing dashboards.",
		}, []string{"listener"}),
		watermarkRejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "watermark_rejections_total",
			Help: "Links closed by the high watermark (reject); the same as link_closes_total{reason=\"watermark\"}, kept for existing dashboards.",
		}, []string{"listener"}),
		unansweredTimeouts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "unanswered_timeouts_total",
			Help: "Requests past their own deadline with no answer from the endpoint since they were sent.",
		}, []string{"listener"}),
		unansweredDeferred: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "unanswered_deferred_total",
			Help: "Verdicts put off because bytes of the endpoint's waited unread in the proxy (its client not reading them), or because the request had not all reached the endpoint (the proxy held it, or the endpoint was still taking it in).",
		}, []string{"listener"}),
		requestsUnjudged: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "requests_unjudged_total",
			Help: "Requests forwarded and never judged on a link that stays tracked: a Pinot request whose timeoutMs lies past the 64 KiB the proxy reads of it, or a frame that is no InstanceRequest (the server drops it without a reply).",
		}, []string{"listener"}),
		kafkaThrottles: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "kafka_throttles_total",
			Help: "Kafka responses carrying a quota throttle after which the broker reads nothing from the connection (KIP-219); requests it holds unread meanwhile are due from the throttle's end.",
		}, []string{"listener"}),
		endpointSuspect: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "endpoint_suspect_total",
			Help: "Times an endpoint reached the unanswered threshold.",
		}, []string{"listener"}),
		evictions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "evictions_total",
			Help: "Links closed by the registry: excluded, disabled, readmitted, operator, removed (left its pool, closed at the end of its drain).",
		}, []string{"listener", "reason"}),
		probes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "probes_total",
			Help: "Probes of excluded endpoints, ok or fail (once per endpoint).",
		}, []string{"listener", "result"}),
		staleFramesDropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "stale_frames_dropped_total",
			Help: "Request frames dropped because they were past request_timeout before the upstream acknowledged them.",
		}, []string{"listener"}),
		untrackedLinks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "untracked_links_total",
			Help: "Links no longer tracked, still proxied: tls, sasl, limit, desync, not_protocol, unknown_version.",
		}, []string{"listener", "reason"}),
		failOpenLinks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "fail_open_links_total",
			Help: "Links sent to an excluded endpoint: every enabled member of their pool (or transparent group) was excluded and it fails open (fail_open, group_fail_open), or the listener has on_excluded: allow.",
		}, []string{"listener"}),
		dnsErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "dns_errors_total",
			Help: "Failed lookups of upstream and pool names (the last good addresses are kept).",
		}, []string{"listener"}),
		linkDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "link_duration_seconds",
			Help:    "How long links lived.",
			Buckets: []float64{.001, .01, .1, 1, 10, 60, 600, 3600, 6 * 3600, 24 * 3600},
		}, []string{"listener"}),
		meshSessions: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Name: "mesh_sessions",
			Help: "Live mesh sessions: egress (dialled to peers) or ingress (accepted from them) (process-wide).",
		}, []string{"role"}),
		meshSessionDeaths: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "mesh_session_deaths_total",
			Help: "Sessions closed because nothing arrived from the peer for ping_timeout (process-wide).",
		}, []string{"role"}),
		meshFallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "mesh_fallbacks_total",
			Help: "Links that reached their endpoint directly because its host has no ingress sidecar (mesh.fallback: direct).",
		}, []string{"listener"}),
		meshLimits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "mesh_limits_total",
			Help: "What a mesh limit refused or cut: sessions (pings: a ping flood cut, refusals: a session cut whose refused streams' resets wait unwritten beyond the bound, sessions_per_peer, sessions: the ingress's max_sessions, peer_not_allowed, handshakes, tls: a failed TLS handshake) and streams (streams_per_session, streams, links: a stream whose link would pass max_links) (process-wide).",
		}, []string{"role", "limit"}),
		acceptWaits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "accept_waits_total",
			Help: "Times the listener stopped accepting at max_links (new connections waited in the kernel's accept queue).",
		}, []string{"listener"}),
		acceptWaiting: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Name: "accept_waiting",
			Help: "1 while the listener does not accept because it or the process holds max_links links.",
		}, []string{"listener"}),
		BudgetWaits: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Name: "memory_budget_waits_total",
			Help: "Reads whose bytes waited for room in the budget: backpressure toward a client (process-wide).",
		}),
		ParkedPumps: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "parked_pumps",
			Help: "Pumps of idle links parked now: their goroutines ended, an epoll set waits for their sockets (limits.park_idle_after; process-wide).",
		}),
	}
	for _, r := range []string{MeshEgress, MeshIngress} {
		m.meshSessions.WithLabelValues(r)
		m.meshSessionDeaths.WithLabelValues(r)
	}
	reg.MustRegister(
		m.linksActive, m.linksTotal, m.linkCloses, m.dialErrors, m.dialDuration,
		m.writeTimeouts, m.watermarkRejections, m.unansweredTimeouts, m.unansweredDeferred, m.requestsUnjudged, m.kafkaThrottles, m.endpointSuspect,
		m.evictions, m.probes, m.staleFramesDropped, m.untrackedLinks, m.failOpenLinks, m.dnsErrors,
		m.linkDuration, m.meshSessions, m.meshSessionDeaths, m.meshFallbacks, m.meshLimits,
		m.acceptWaits, m.acceptWaiting, m.BudgetWaits, m.ParkedPumps,
	)
	return m
}

// NewProcess builds the process's collectors (build_info and the
// configuration reload series) and registers them on reg.
func NewProcess(reg prometheus.Registerer) *Process {
	m := &Process{
		lastReloadOK: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "config_last_reload_successful",
			Help: "1 when the last load (the start, or a reload) succeeded, 0 while the file on disk is rejected or cannot be read (for three ticks in a row, or on a SIGHUP): alert on it (process-wide).",
		}),
		lastReloadAt: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "config_last_reload_success_timestamp_seconds",
			Help: "When the last successful load happened (process-wide).",
		}),
		buildInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Name: "build_info",
			Help: "1, with the binary's version, VCS revision and Go version (process-wide).",
		}, []string{"version", "revision", "goversion"}),
		configReloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "config_reloads_total",
			Help: "Config reloads, ok or error (process-wide: no listener label).",
		}, []string{"result"}),
	}
	m.configReloads.WithLabelValues("ok")
	m.configReloads.WithLabelValues("error")
	// The configuration a process starts with was loaded successfully.
	m.lastReloadOK.Set(1)
	m.lastReloadAt.SetToCurrentTime()
	reg.MustRegister(m.configReloads, m.lastReloadOK, m.lastReloadAt, m.buildInfo)
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
	UnansweredTimeouts  prometheus.Counter
	UnansweredDeferred  prometheus.Counter
	RequestsUnjudged    prometheus.Counter
	KafkaThrottles      prometheus.Counter
	EndpointSuspect     prometheus.Counter
	ProbesOK            prometheus.Counter
	ProbesFailed        prometheus.Counter
	StaleFramesDropped  prometheus.Counter
	FailOpenLinks       prometheus.Counter
	DNSErrors           prometheus.Counter
	LinkDuration        prometheus.Observer
	AcceptWaits         prometheus.Counter
	AcceptWaiting       prometheus.Gauge

	m         *Metrics
	name      string
	mu        sync.Mutex
	closes    map[string]prometheus.Counter
	evictions map[string]prometheus.Counter
	untracked map[string]prometheus.Counter
}

// Listener kinds for ForListenerKind: what series a listener can produce.
const (
	KindPool        = "pool"        // an explicit or pool listener
	KindTransparent = "transparent" // a transparent listener
	KindIngress     = "ingress"     // a mesh ingress listener
)

// ForListener resolves (and so pre-creates at zero) every series of one
// listener, of any kind.
func (m *Metrics) ForListener(name string) *Listener { return m.ForListenerKind(name, "") }

// ForListenerKind resolves, and so pre-creates at zero, the series a
// listener of kind can produce ("": every series): a transparent one has
// no dns errors. Close reasons are pre-created by PrecreateCloses. Others
// are created if they ever count.
func (m *Metrics) ForListenerKind(name, kind string) *Listener {
	l := &Listener{
		m:                   m,
		name:                name,
		LinkDuration:        m.linkDuration.WithLabelValues(name),
		LinksActive:         m.linksActive.WithLabelValues(name),
		LinksTotal:          m.linksTotal.WithLabelValues(name),
		DialErrors:          m.dialErrors.WithLabelValues(name),
		DialDuration:        m.dialDuration.WithLabelValues(name),
		WriteTimeouts:       m.writeTimeouts.WithLabelValues(name),
		WatermarkRejections: m.watermarkRejections.WithLabelValues(name),
		UnansweredTimeouts:  m.unansweredTimeouts.WithLabelValues(name),
		UnansweredDeferred:  m.unansweredDeferred.WithLabelValues(name),
		RequestsUnjudged:    m.requestsUnjudged.WithLabelValues(name),
		KafkaThrottles:      m.kafkaThrottles.WithLabelValues(name),
		EndpointSuspect:     m.endpointSuspect.WithLabelValues(name),
		ProbesOK:            m.probes.WithLabelValues(name, "ok"),
		ProbesFailed:        m.probes.WithLabelValues(name, "fail"),
		StaleFramesDropped:  m.staleFramesDropped.WithLabelValues(name),
		FailOpenLinks:       m.failOpenLinks.WithLabelValues(name),
		AcceptWaits:         m.acceptWaits.WithLabelValues(name),
		AcceptWaiting:       m.acceptWaiting.WithLabelValues(name),
		closes:              make(map[string]prometheus.Counter),
		evictions:           make(map[string]prometheus.Counter, len(EvictReasons)),
		untracked:           make(map[string]prometheus.Counter, len(UntrackedReasons)),
	}
	if kind != KindTransparent && kind != KindIngress { // neither resolves names
		l.DNSErrors = m.dnsErrors.WithLabelValues(name)
	} else {
		l.DNSErrors = lazyCounter{vec: m.dnsErrors, labels: []string{name}}
	}
	for _, r := range UntrackedReasons {
		l.untracked[r] = m.untrackedLinks.WithLabelValues(name, r)
	}
	for _, r := range EvictReasons {
		l.evictions[r] = m.evictions.WithLabelValues(name, r)
	}
	return l
}

// lazyCounter creates its series only when it first counts.
type lazyCounter struct {
	prometheus.Counter // nil: never used for reading
	vec                *prometheus.CounterVec
	labels             []string
}

func (c lazyCounter) Inc()          { c.vec.WithLabelValues(c.labels...).Inc() }
func (c lazyCounter) Add(v float64) { c.vec.WithLabelValues(c.labels...).Add(v) }

// series returns the counter of one reason from m, creating it in vec on
// first use (a reason the listener's kind was not expected to produce).
func (l *Listener) series(m map[string]prometheus.Counter, vec *prometheus.CounterVec, reason string) prometheus.Counter {
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := m[reason]
	if !ok {
		c = vec.WithLabelValues(l.name, reason)
		m[reason] = c
	}
	return c
}

// PrecreateCloses resolves, and so creates at zero, the link_closes_total
// series of reasons: the close reasons are the data plane's (proxy's
// CloseReason), and it says which a listener can produce.
func (l *Listener) PrecreateCloses(reasons []string) {
	for _, r := range reasons {
		l.Closes(r)
	}
}

// Closes returns the link_closes_total counter of one reason.
func (l *Listener) Closes(reason string) prometheus.Counter {
	return l.series(l.closes, l.m.linkCloses, reason)
}

// Evictions returns the evictions_total counter of one reason.
func (l *Listener) Evictions(reason string) prometheus.Counter {
	return l.series(l.evictions, l.m.evictions, reason)
}

// Evicted counts n links evicted for reason.
func (l *Listener) Evicted(reason string, n int) {
	if n > 0 {
		l.Evictions(reason).Add(float64(n))
	}
}

// Untracked returns the untracked_links_total counter of one reason.
func (l *Listener) Untracked(reason string) prometheus.Counter {
	return l.series(l.untracked, l.m.untrackedLinks, reason)
}

// Closed counts one link end with its reason.
func (l *Listener) Closed(reason string) { l.Closes(reason).Inc() }

// Forget drops a removed listener's series.
func (m *Metrics) Forget(name string) {
	for _, v := range []interface{ DeletePartialMatch(prometheus.Labels) int }{
		m.linksActive, m.linksTotal, m.linkCloses, m.dialErrors, m.dialDuration,
		m.writeTimeouts, m.watermarkRejections, m.unansweredTimeouts, m.unansweredDeferred, m.requestsUnjudged, m.kafkaThrottles, m.endpointSuspect,
		m.evictions, m.probes, m.staleFramesDropped, m.untrackedLinks, m.failOpenLinks, m.dnsErrors, m.linkDuration,
		m.meshFallbacks, m.acceptWaits, m.acceptWaiting,
	} {
		v.DeletePartialMatch(prometheus.Labels{"listener": name})
	}
}

// ConfigReload counts one reload with its result ("ok" or "error") and
// keeps config_last_reload_successful and its timestamp in step.
func (m *Process) ConfigReload(result string) {
	m.configReloads.WithLabelValues(result).Inc()
	if result == "ok" {
		m.lastReloadOK.Set(1)
		m.lastReloadAt.SetToCurrentTime()
	} else {
		m.lastReloadOK.Set(0)
	}
}

// SetBuildInfo sets build_info's labels: the version the binary reports,
// its VCS revision and the Go version it was built with.
func (m *Process) SetBuildInfo(version, revision, goversion string) {
	m.buildInfo.Reset()
	m.buildInfo.WithLabelValues(version, revision, goversion).Set(1)
}

// Register adds a collector the data plane owns (such as bytes_total,
// which is computed from live links at scrape time).
func (m *Metrics) Register(c prometheus.Collector) { m.reg.MustRegister(c) }
