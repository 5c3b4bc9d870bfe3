// Package policy owns livenessproxy's configuration: the ConfigMap schema,
// its defaults, strict decoding with key-path errors, and validation; and
// the routing rule that picks a pool's endpoint for each new link (Select).
//
// Every key has a default and a ConfigMap may set any subset. Durations are
// written as Go durations (10s, 500ms), sizes with binary units (16MiB).
// A duration or size of 0 disables the mechanism it controls; a negative
// one is an error (keys that must be positive say so).
//
// policy imports no project package: the probe kinds that detector.probe
// names are its own (ProbeKind*), and the proxy translates them into the
// health package's.
package policy

import (
	"cmp"
	"math"
	"strings"
	"time"
)

// Config is the whole configuration file.
type Config struct {
	// Admin is where the admin HTTP servers listen: the read-only one
	// (/metrics, /healthz, /readyz, GET /v1/...) and the control one (the
	// operator's actions).
	Admin Admin `yaml:"admin"`
	// Log controls the structured logger.
	Log Log `yaml:"log"`
	// DrainTimeout is how long SIGTERM waits for open links to finish
	// after the listeners stop accepting; links still open then are closed.
	// 0 closes them at once; negative is invalid.
	DrainTimeout Duration `yaml:"drain_timeout"`
	// ShutdownGrace is how long, after SIGTERM, the proxy keeps accepting
	// and serving before it stops accepting and drains: a client in the
	// same pod gets SIGTERM at the same moment and may still be finishing
	// requests and opening connections. The grace ends early once no link
	// has been open for ShutdownIdle (the client has closed its
	// connections). 0 stops accepting at once: right for a native sidecar,
	// which Kubernetes stops only after the app has exited.
	ShutdownGrace Duration `yaml:"shutdown_grace"`
	// ShutdownIdle ends ShutdownGrace early once no link has been open for
	// this long; 0 waits out the whole grace.
	ShutdownIdle Duration `yaml:"shutdown_idle"`
	// Defaults are the link settings every listener starts from; a listener
	// may override any of them.
	Defaults Settings `yaml:"defaults"`
	// Listeners are the listeners: explicit (one upstream), transparent
	// (original destinations) or pool (a set of equivalent endpoints).
	Listeners []Listener `yaml:"listeners"`
	// Interception configures how the proxy cooperates with the nftables
	// rules `livenessproxy redirect` installs.
	Interception Interception `yaml:"interception"`
	// Endpoints holds operator decisions about individual upstream endpoints.
	Endpoints Endpoints `yaml:"endpoints"`
	// Limits bounds the whole process: its memory and its links.
	Limits Limits `yaml:"limits"`
}

// Limits bounds the whole process, whatever each link's own settings say.
// A key's 0 means "derived" (see proxy.PlanLimits): from the container's
// memory limit and the descriptor limit, and for Procs by the Go runtime;
// except ParkIdleAfter, whose 0 means never.
type Limits struct {
	// Memory is the memory the process plans for: GOMEMLIMIT (unless the
	// environment sets it) is 90% of it and the memory budget half of it.
	// 0: the container's memory limit (cgroup v2 memory.max, or v1
	// memory.limit_in_bytes), else the host's memory; negative is invalid.
	Memory Size `yaml:"memory"`
	// MemoryBudget is the most bytes all links together hold in their
	// queues and read buffers. Past it, a link toward an upstream that
	// acknowledged nothing for write_timeout is closed; any other waits
	// (backpressure). 0: half of Memory; negative is invalid.
	MemoryBudget Size `yaml:"memory_budget"`
	// MaxLinks is the most links the process holds at once; past it, new
	// connections wait in the kernel's accept queue, and a mesh ingress's
	// new streams are reset. 0: derived from the memory left beside the
	// budget and from the descriptor limit; negative is invalid.
	MaxLinks int `yaml:"max_links"`
	// Procs is how many threads run Go code at once (GOMAXPROCS), unless
	// the environment sets GOMAXPROCS, which then wins. 1 by default (see
	// DefaultConfig): a sidecar shares its pod's cores with the process
	// it serves, as HAProxy with one thread does. 0: the Go runtime's own
	// default (the CPUs, the affinity mask, the cgroup's CPU limit);
	// negative is invalid. Applied by the binary only (proxy.ApplyRuntime).
	Procs int `yaml:"procs"`
	// ParkIdleAfter parks the pumps of a TCP link that moved no byte
	// either way for this long: their goroutines end, and one epoll set
	// for the process waits for the sockets; bytes, a FIN or an error on
	// a socket start that socket's pump again, the link's close both. An
	// idle link then costs no goroutine stack. 2s by default (see
	// DefaultConfig); 0: never (unlike the other keys, 0 is not
	// "derived"); negative is invalid.
	ParkIdleAfter Duration `yaml:"park_idle_after"`
}

// Interception configures the proxy's side of transparent interception.
type Interception struct {
	// ExcludedSet makes the proxy add each excluded or disabled transparent
	// destination to the nftables sets that `redirect --excluded-set`
	// created, so that a client's connect to it is reset by the kernel
	// before any proxy accepts it (needs NET_ADMIN). Off, or when the sets
	// cannot be opened: the accepted connection is reset at once instead.
	ExcludedSet bool `yaml:"excluded_set"`
}

// Endpoints holds operator decisions about individual upstream endpoints,
// whichever listener reaches them.
type Endpoints struct {
	// Disabled lists host:port endpoints the operator has taken out of
	// service: no link is ever routed to one, not even by fail-open when
	// every other endpoint is excluded. Each entry is a host:port with a
	// numeric, non-zero port; an entry may appear once. Empty disables none.
	// The admin API can disable and enable endpoints at run time as well.
	Disabled []string `yaml:"disabled"`
}

// Admin configures the admin HTTP servers.
type Admin struct {
	// Listen is the host:port the read-only admin server binds (/metrics,
	// /healthz, /readyz and the GET /v1/ listings; never an action). Empty
	// disables it. Loopback by default; the Helm chart binds the pod
	// address, for kubelet probes and Prometheus.
	Listen string `yaml:"listen"`
	// ControlListen is where the operator's actions (POST
	// /v1/endpoints/{endpoint}/disable, enable, evict, drain) are served: a
	// host:port, or unix:/absolute/path for a Unix socket (made 0600).
	// Empty disables the actions. A host:port whose host is not a loopback
	// address (127.0.0.0/8, ::1, localhost) needs TokenFile: nobody from
	// the network changes routing without the token.
	ControlListen string `yaml:"control_listen"`
	// TokenFile is the path of a file holding the bearer token every
	// request to ControlListen must carry (Authorization: Bearer <token>);
	// the file is read at each request, so a rotated token applies at once.
	// Empty: no token. Required when ControlListen is a host:port off
	// loopback. Its existence is not checked when the configuration is
	// loaded: it is typically a mounted Secret, which may appear later
	// (until it does, every action is refused).
	TokenFile string `yaml:"token_file"`
}

// Log configures logging.
type Log struct {
	// Level is one of debug, info, warn, error.
	Level string `yaml:"level"`
	// Format is json (one object per line) or console (human-readable;
	// coloured only when stderr is a terminal).
	Format string `yaml:"format"`
	// Access logs one line at info for every finished link (its listener,
	// client, upstream, who ended it and why, request and response bytes,
	// connect time and attempts, duration). Off: that line is at debug.
	Access bool `yaml:"access"`
}

// Listener is one listener: explicit (Upstream), transparent (Transparent)
// or pool (Pool); exactly one of the three is set.
type Listener struct {
	// Name labels the listener's metrics and logs; unique, [a-zA-Z0-9_.-].
	Name string `yaml:"name"`
	// Listen is the host:port the listener binds.
	Listen string `yaml:"listen"`
	// Upstream is the host:port every link of this listener dials.
	// Exclusive with Transparent and Pool.
	Upstream string `yaml:"upstream"`
	// Transparent makes this a transparent listener: it proxies each
	// connection an nftables REDIRECT sent to it to the connection's
	// original destination (SO_ORIGINAL_DST), but only destinations its
	// match list covers. Exclusive with Upstream and Pool. Parse starts it
	// from DefaultTransparent.
	Transparent Transparent `yaml:"transparent"`
	// Pool makes this a pool listener: each new link goes to one of a set
	// of equivalent endpoints, chosen by Select from the detector's view.
	// Exclusive with Upstream and Transparent. Parse starts it from
	// DefaultPool.
	Pool Pool `yaml:"pool"`
	// Ingress makes this the server side of the mesh: it accepts the
	// sessions of egress sidecars (on Listen) and proxies their streams to
	// the local server. Exclusive with Upstream, Transparent and Pool.
	Ingress Ingress `yaml:"ingress"`
	// MaxLinks is the most links this listener holds at once; past it,
	// its new connections wait in the kernel's accept queue (a mesh
	// ingress's new streams are reset). 0: only the process's
	// limits.max_links; negative is invalid.
	MaxLinks int `yaml:"max_links"`
	// Settings override the defaults for this listener's links.
	Settings `yaml:",inline"`
}

// IsIngress reports whether the listener is a mesh ingress.
func (l Listener) IsIngress() bool { return l.Ingress.Local != "" }

// ReachesThroughMesh reports whether the listener's links may reach
// their endpoints through the mesh: a mesh.port on the listener or on one
// of its transparent match entries.
func (l Listener) ReachesThroughMesh() bool {
	if l.Settings.Mesh.Port != 0 {
		return true
	}
	for _, m := range l.Transparent.Match {
		if m.Mesh.Port != 0 {
			return true
		}
	}
	return false
}

// IsTransparent reports whether the listener proxies original destinations.
func (l Listener) IsTransparent() bool { return len(l.Transparent.Match) > 0 }

// IsPool reports whether the listener routes to a pool: it has pool
// endpoints or a pool dns name.
func (l Listener) IsPool() bool { return len(l.Pool.Endpoints) > 0 || l.Pool.DNS != "" }

// Transparent configures a transparent listener.
type Transparent struct {
	// Match lists the destinations that may be proxied; anything else is
	// refused (never an open relay).
	Match []Match `yaml:"match"`
	// GroupFailOpen makes the destinations of each match entry a group
	// that fails open like a pool with fail_open: when no destination of
	// the group that the listener tracks is routable, a connection to an
	// excluded one is proxied instead of reset. All-or-nothing: while one
	// destination of the group is healthy, an excluded one is refused. A
	// disabled destination is always refused. Off (the default): an
	// excluded destination is always refused.
	GroupFailOpen bool `yaml:"group_fail_open"`
	// MaxDestinations is the hard cap on the destinations this listener
	// tracks (each with its detector state); past it, a connection to a
	// destination it does not track yet is refused, and counted. At least
	// 1; 0 in a Config built in code means the default, 4096.
	MaxDestinations int `yaml:"max_destinations"`
	// ForgetExcludedAfter is how long an excluded destination's probes
	// may keep failing before the listener forgets it (its detector state
	// and series), so that destinations gone for good do not stay tracked
	// forever; a later connection to it starts afresh. Must be positive;
	// 0 in a Config built in code means the default, 10m.
	ForgetExcludedAfter Duration `yaml:"forget_excluded_after"`
}

// Balance policies for Pool.Balance.
const (
	// BalanceRoundRobin sends each new link to the next eligible endpoint
	// in turn.
	BalanceRoundRobin = "round_robin"
	// BalanceLeastLinks sends each new link to the eligible endpoint with
	// the fewest live links, ties in turn.
	BalanceLeastLinks = "least_links"
)

// Pool is a set of equivalent endpoints behind one listener: the replicas
// behind a Kubernetes headless Service, a Kafka bootstrap list, a
// ZooKeeper ensemble. Each new link goes to one of them, chosen by Select;
// each endpoint is an endpoint of its own for the detector. Exactly one of
// Endpoints and DNS is set.
type Pool struct {
	// Endpoints are the pool's entries, each a host:port with a numeric,
	// non-zero port. A host may be a name: it is resolved again every
	// Refresh and each of its addresses is an endpoint. Entries are unique
	// after normalisation (a:080 is a:80). Exclusive with DNS.
	Endpoints []string `yaml:"endpoints"`
	// DNS is a host:port (numeric, non-zero port) whose every A and AAAA
	// record is an endpoint, resolved again every Refresh: a Kubernetes
	// headless Service, say. Exclusive with Endpoints.
	DNS string `yaml:"dns"`
	// Refresh is how often the pool's names are resolved again: an
	// address that appears becomes an endpoint, one that disappears leaves
	// the pool. Must be positive; 0 in a Config built in code means the
	// default, 5s.
	Refresh Duration `yaml:"refresh"`
	// Balance is how a new link picks among the eligible endpoints:
	// round_robin (in turn) or least_links (the fewest live links, ties in
	// turn). Empty in a Config built in code means the default,
	// round_robin.
	Balance string `yaml:"balance"`
	// FailOpen: when every endpoint the operator has not disabled is
	// excluded by the detector, new links go to the excluded ones (round
	// robin) instead of being refused. All-or-nothing: while any endpoint
	// is routable only routable ones are chosen, and a disabled endpoint
	// never gets a link, not even when nothing else is left (the link is
	// refused then).
	FailOpen bool `yaml:"fail_open"`
}

// DefaultPool returns the pool settings a pool listener starts from: no
// entries, refresh 5s, round_robin, fail_open off. Parse starts every pool
// section from it; a Config built in code may leave the zero values, which
// mean the same.
func DefaultPool() Pool {
	return Pool{Refresh: Duration(5 * time.Second), Balance: BalanceRoundRobin}
}

// DefaultTransparent returns the settings a transparent listener starts
// from: no match entries, group_fail_open off, max_destinations 4096,
// forget_excluded_after 10m. Parse starts every transparent section from
// it; a Config built in code may leave the zero values, which mean the
// same.
func DefaultTransparent() Transparent {
	return Transparent{MaxDestinations: 4096, ForgetExcludedAfter: Duration(10 * time.Minute)}
}

// Match is one destination range of a transparent listener.
type Match struct {
	// CIDR is the destination address range, IPv4 or IPv6.
	CIDR string `yaml:"cidr"`
	// Ports are the destination ports; empty means any port.
	Ports []int `yaml:"ports"`
	// Mesh, when its port is set, reaches this entry's destinations
	// through the sidecar beside each of them, with the listener's other
	// mesh settings; it overrides the listener's mesh.port.
	Mesh MatchMesh `yaml:"mesh"`
}

// MatchMesh is a transparent match entry's mesh port.
type MatchMesh struct {
	// Port is the peer sidecar's ingress port; 0: the listener's mesh.port.
	Port int `yaml:"port"`
}

// Settings are the per-link liveness settings, set under defaults and
// overridable per listener.
type Settings struct {
	// ConnectTimeout bounds the upstream dial. 0: the kernel's own SYN
	// retry limit (minutes); negative is invalid. The default, 2s, lets
	// the SYN Linux sends again 1s after the first complete: one lost SYN
	// costs a second, not a failed connect.
	ConnectTimeout Duration `yaml:"connect_timeout"`
	// ConnectAttempts is how many upstream connects a new link makes before
	// its client is reset. Each retry, after a short backoff, goes to the
	// next endpoint in the balance order, never to the one that just failed
	// while another eligible endpoint exists (Select's avoid). 1: no retry;
	// at least 1. A transparent link's destination is fixed, so it has one
	// endpoint to try.
	ConnectAttempts int `yaml:"connect_attempts"`
	// WriteTimeout closes the link when the upstream kernel has not accepted
	// a queued write for this long. 0 disables; negative is invalid.
	WriteTimeout Duration `yaml:"write_timeout"`
	// TCPUserTimeout is TCP_USER_TIMEOUT on the upstream socket: data left
	// unacknowledged this long makes the kernel fail the socket. The proxy
	// lifts it while the peer's window is zero and its kernel answers the
	// probes (a peer not reading: write_timeout judges it), and raises it
	// to IdleUserTimeout while nothing is unacknowledged (keepalive's
	// count holds; on a mesh session, see MeshSessionUserTimeout). 0
	// leaves the kernel default (tcp_retries2, ~15 min);
	// negative is invalid.
	TCPUserTimeout Duration `yaml:"tcp_user_timeout"`
	// Keepalive sets TCP keepalive on the upstream socket.
	Keepalive Keepalive `yaml:"keepalive"`
	// WriteBuffer bounds the bytes queued toward the upstream per link.
	WriteBuffer WriteBuffer `yaml:"write_buffer"`
	// HalfCloseTimeout bounds how long, after one side sent FIN, the other
	// direction may move no byte (an inactivity bound: it is kept while
	// bytes move). 0: unbounded; negative is invalid.
	HalfCloseTimeout Duration `yaml:"half_close_timeout"`
	// UpstreamMark sets SO_MARK on upstream sockets so that interception
	// rules can exempt the proxy's own traffic (needs NET_ADMIN). 0: no
	// mark (exempt the proxy by its uid instead).
	UpstreamMark int `yaml:"upstream_mark"`
	// Framing tells where one message ends and the next begins, so that
	// requests and responses can be counted.
	Framing Framing `yaml:"framing"`
	// Unanswered tracks request frames that see no response from the
	// upstream, and reports the endpoint when too many go unanswered.
	Unanswered Unanswered `yaml:"unanswered"`
	// Detector probes an excluded endpoint until it may be readmitted.
	Detector Detector `yaml:"detector"`
	// OnExcluded is what happens to a new link whose endpoint is excluded:
	// refuse (the client's connection is refused or reset before any byte
	// is read, so the client's own failure detector sees the endpoint down)
	// or allow (the link is dialled as usual).
	OnExcluded string `yaml:"on_excluded"`
	// Mesh reaches each endpoint through the livenessproxy sidecar beside
	// it (its ingress listener, on the endpoint's host at Mesh.Port)
	// instead of directly. Off while Mesh.Port is 0.
	Mesh Mesh `yaml:"mesh"`
}

// Mesh fallback policies for Mesh.Fallback.
const (
	// MeshFallbackDirect reaches a peer that has no ingress sidecar (its
	// mesh port refuses connections) directly, with the plain link
	// enforcement: a partial rollout works.
	MeshFallbackDirect = "direct"
	// MeshFallbackRefuse resets the client instead.
	MeshFallbackRefuse = "refuse"
)

// Mesh is how links reach their endpoints through the peer's sidecar: one
// or a few multiplexed sessions per peer, each link a stream on one of
// them, with heartbeats that the peer sidecar answers whether or not
// queries flow.
type Mesh struct {
	// Port is the peer sidecar's ingress port, on each endpoint's own
	// address. 0: links reach their endpoints directly.
	Port int `yaml:"port"`
	// Fallback is what a link does when the peer has no ingress sidecar
	// (a connect to Port is refused): direct or refuse.
	Fallback string `yaml:"fallback"`
	// Sessions is how many sessions a peer gets at most; new streams go
	// to the one with the fewest. At least 1.
	Sessions int `yaml:"sessions"`
	// PingInterval is how often each session is pinged. Must be positive.
	PingInterval Duration `yaml:"ping_interval"`
	// PingTimeout: a session from which nothing at all (no answer to a
	// ping, no data) has arrived for this long is dead; its streams are
	// closed and the peer's endpoints excluded. Must be above
	// PingInterval.
	PingTimeout Duration `yaml:"ping_timeout"`
	// WriteTimeout bounds one write of the session's frames to its
	// connection (yamux's ConnectionWriteTimeout). Must be positive and
	// below PingTimeout, so a stuck write cannot outlive the heartbeat
	// that judges the session.
	WriteTimeout Duration `yaml:"write_timeout"`
	// StreamWindow is each stream's flow-control window (at least
	// 256KiB): the most bytes one direction of a mesh link can have in
	// flight, in the role of the write buffer's watermark.
	StreamWindow Size `yaml:"stream_window"`
	// TLS runs the sessions over mutual TLS when its files are set: on
	// an egress listener for the sessions it dials, on an ingress for
	// those it accepts.
	TLS MeshTLS `yaml:"tls"`
}

// MeshTLS is mutual TLS for mesh sessions. The files are read again when
// they change (a rotated Secret): new sessions take the new certificate,
// open ones keep theirs.
type MeshTLS struct {
	// CertFile and KeyFile are this sidecar's certificate (PEM, with its
	// chain) and key; CAFile the CA bundle a peer's certificate must chain
	// to. All three or none.
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
	CAFile   string `yaml:"ca_file"`
	// Peers are the identities a peer's certificate may carry: a URI
	// (spiffe://...) matches a URI SAN, anything else a DNS SAN, exactly.
	// Empty: any certificate the CA signed.
	Peers Identities `yaml:"peers"`
}

// Identities is a list of identities, kept as one string (one a line) so
// that the settings stay comparable; in YAML, a list of strings.
type Identities string

// NewIdentities makes an Identities of ids.
func NewIdentities(ids ...string) Identities { return Identities(strings.Join(ids, "\n")) }

// MarshalYAML writes the identities as the list they are read from.
func (l Identities) MarshalYAML() (any, error) { return l.List(), nil }

// List is the identities, in order.
func (l Identities) List() []string {
	if l == "" {
		return nil
	}
	return strings.Split(string(l), "\n")
}

// Enabled reports whether sessions run over TLS.
func (t MeshTLS) Enabled() bool { return t.CertFile != "" }

// Enabled reports whether links reach their endpoints through the mesh.
func (m Mesh) Enabled() bool { return m.Port != 0 }

// OrDefaults returns m with DefaultMesh's value for every key at its zero
// value (a Config built in code).
func (m Mesh) OrDefaults() Mesh {
	d := DefaultMesh()
	m.Fallback = cmp.Or(m.Fallback, d.Fallback)
	m.Sessions = cmp.Or(m.Sessions, d.Sessions)
	m.PingInterval = cmp.Or(m.PingInterval, d.PingInterval)
	m.PingTimeout = cmp.Or(m.PingTimeout, d.PingTimeout)
	m.WriteTimeout = cmp.Or(m.WriteTimeout, d.WriteTimeout)
	m.StreamWindow = cmp.Or(m.StreamWindow, d.StreamWindow)
	return m
}

// DefaultMesh is the mesh settings' defaults; Port 0 leaves it off.
func DefaultMesh() Mesh {
	return Mesh{Fallback: MeshFallbackDirect, Sessions: 2, PingInterval: Duration(time.Second),
		PingTimeout: Duration(3 * time.Second), WriteTimeout: Duration(2 * time.Second), StreamWindow: 256 * KiB}
}

// Ingress makes a listener the server side of the mesh: it accepts the
// sessions of egress sidecars and proxies each stream to a local server
// port, with the listener's upstream enforcement.
type Ingress struct {
	// Local is the local server's host:port. A stream names the port it
	// is for; it may name Local's port or one of Ports, on Local's host.
	Local string `yaml:"local"`
	// Ports are further local ports on Local's host that streams may
	// name, at most 1023. Any other port is refused: the ingress is not an
	// open relay.
	Ports []int `yaml:"ports"`
	// CheckInterval is how often the ingress checks that each local port
	// accepts connections, for the readiness it announces to its peers; a
	// link whose local server failed checks at once. 0 means the default,
	// 1s; negative is invalid.
	CheckInterval Duration `yaml:"check_interval"`
	// Allow lists the peers (IP addresses or CIDRs) whose sessions the
	// ingress takes; any other is refused at its handshake. Empty: any
	// peer that reaches the port.
	Allow []string `yaml:"allow"`
	// MaxSessionsPerPeer is how many sessions one peer address may hold
	// at once; 0 means the default, 16.
	MaxSessionsPerPeer int `yaml:"max_sessions_per_peer"`
	// MaxSessions is how many sessions the ingress holds at once over all
	// its peers; 0 means the default, 1024.
	MaxSessions int `yaml:"max_sessions"`
	// MaxStreamsPerSession is how many streams (links) one session may
	// carry at once; 0 means the default, 1000. The egress learns it at
	// the handshake and opens no more.
	MaxStreamsPerSession int `yaml:"max_streams_per_session"`
	// MaxStreams is how many streams the ingress carries at once over all
	// its sessions; 0 means the default, 10000.
	MaxStreams int `yaml:"max_streams"`
}

// Ingress defaults.
const (
	DefaultMaxSessionsPerPeer   = 16
	DefaultMaxSessions          = 1024
	DefaultMaxStreamsPerSession = 1000
	DefaultMaxStreams           = 10000
	DefaultCheckInterval        = Duration(time.Second)
)

// OrDefaults is in with each 0 (the default) replaced by its value.
func (in Ingress) OrDefaults() Ingress {
	in.CheckInterval = cmp.Or(in.CheckInterval, DefaultCheckInterval)
	in.MaxSessionsPerPeer = cmp.Or(in.MaxSessionsPerPeer, DefaultMaxSessionsPerPeer)
	in.MaxSessions = cmp.Or(in.MaxSessions, DefaultMaxSessions)
	in.MaxStreamsPerSession = cmp.Or(in.MaxStreamsPerSession, DefaultMaxStreamsPerSession)
	in.MaxStreams = cmp.Or(in.MaxStreams, DefaultMaxStreams)
	return in
}

// Keepalive is TCP keepalive on upstream sockets.
type Keepalive struct {
	// Idle is the idle time before the first probe (TCP_KEEPIDLE).
	// 0 leaves keepalive off (the kernel default); negative is invalid.
	Idle Duration `yaml:"idle"`
	// Interval is the time between probes (TCP_KEEPINTVL). It must be
	// positive when Idle is; never negative.
	Interval Duration `yaml:"interval"`
	// Count is the number of unanswered probes before the socket fails
	// (TCP_KEEPCNT): DeadAfter after the last segment received, or
	// TCPUserTimeout where that is longer (see Settings.IdleUserTimeout).
	Count int `yaml:"count"`
}

// DeadAfter is how long after the last segment received from a silent
// peer keepalive fails the socket: idle + interval x count, idle and
// interval in the kernel's whole seconds (rounded up, as they are set);
// 0 when keepalive is off.
func (k Keepalive) DeadAfter() time.Duration {
	if k.Idle <= 0 {
		return 0
	}
	sec := func(d Duration) time.Duration {
		return max(time.Second, (d.D() + time.Second - 1).Truncate(time.Second))
	}
	return sec(k.Idle) + sec(k.Interval)*time.Duration(max(k.Count, 0))
}

// IdleUserTimeout is the TCP_USER_TIMEOUT the proxy keeps on an upstream
// socket with nothing unacknowledged: max(tcp_user_timeout, keepalive's
// DeadAfter), at most the kernel's limit; tcp_user_timeout itself when
// either is off. Linux's keepalive timer, with TCP_USER_TIMEOUT set,
// fails the socket at its first run with a probe unanswered once that
// much has passed since the last segment received, not after count
// unanswered probes (tcp_keepalive_timer): with tcp_user_timeout below
// DeadAfter, one lost probe would end a healthy link. Raised to DeadAfter,
// the count holds, and a dead peer is cut at DeadAfter. Where
// tcp_user_timeout is the longer, the kernel probes on past count and
// cuts a dead peer at the first probe timer tcp_user_timeout after the
// last segment received: IdleUserTimeout, rounded up to a probe.
func (s *Settings) IdleUserTimeout() time.Duration {
	ut := s.TCPUserTimeout.D()
	if ut <= 0 {
		return ut
	}
	return min(max(ut, s.Keepalive.DeadAfter()), maxUserTimeout)
}

// MeshSessionUserTimeout is the TCP_USER_TIMEOUT of the connection an
// egress mesh session runs on where it is not tcp_user_timeout, and 0
// where it is. Keepalive probes a session only between the heartbeat's
// pings (a ping in flight holds it off, an answer or its ACK restarts its
// idle time), and with TCP_USER_TIMEOUT set the kernel cuts the
// connection after one lost probe at its first probe timer
// max(tcp_user_timeout, idle + interval) after the last segment received
// (see IdleUserTimeout). Where ping_timeout is at most half that, the
// heartbeat has declared such a silence dead first, and the bound stays
// tcp_user_timeout. Where it is not (a heartbeat slower than keepalive),
// one lost probe would end a live session and every link on it: the
// bound is IdleUserTimeout then, keepalive's count holds, and data left
// unacknowledged on the session is cut at that bound, or by the
// heartbeat at ping_timeout.
func (s *Settings) MeshSessionUserTimeout() time.Duration {
	return s.heldUserTimeout(2 * s.Mesh.OrDefaults().PingTimeout.D())
}

// ProbeUserTimeout is the TCP_USER_TIMEOUT of the connection of a probe
// that waits for an answer (http, kafka; a connect probe closes its
// connection at once), set once it is connected (its SYN keeps
// tcp_user_timeout), where it is not tcp_user_timeout, and 0 where it
// is: IdleUserTimeout where detector.probe_timeout lets a probe wait for
// its answer longer than the kernel's cut after one lost keepalive probe
// (see MeshSessionUserTimeout), so that a lost probe does not fail a
// probe whose server answers within probe_timeout.
func (s *Settings) ProbeUserTimeout() time.Duration {
	return s.heldUserTimeout(s.Detector.ProbeTimeout.D())
}

// heldUserTimeout is IdleUserTimeout for a connection that may stay
// silent for up to held, where the kernel would otherwise cut it after
// one lost keepalive probe within that time; 0 where tcp_user_timeout is
// the bound (held within that cut, or nothing to raise).
func (s *Settings) heldUserTimeout(held time.Duration) time.Duration {
	ut, raised := s.TCPUserTimeout.D(), s.IdleUserTimeout()
	if raised == ut {
		return 0
	}
	k := s.Keepalive
	if held <= max(ut, Keepalive{Idle: k.Idle, Interval: k.Interval, Count: 1}.DeadAfter()) {
		return 0
	}
	return raised
}

// maxUserTimeout is the most TCP_USER_TIMEOUT the kernel takes (an int of
// milliseconds).
const maxUserTimeout = time.Duration(math.MaxInt32) * time.Millisecond

// Overflow policies for WriteBuffer.OnOverflow.
const (
	OverflowReject       = "reject"
	OverflowBackpressure = "backpressure"
)

// WriteBuffer is the per-link queue toward the upstream.
type WriteBuffer struct {
	// HighWaterMark is the most bytes queued toward the upstream per link.
	// 0: unbounded (not recommended); negative is invalid.
	HighWaterMark Size `yaml:"high_water_mark"`
	// LowWaterMark is where backpressure resumes reading the client; it
	// must be below HighWaterMark. 0: resume when empty; negative is
	// invalid.
	LowWaterMark Size `yaml:"low_water_mark"`
	// OnOverflow is backpressure (stop reading the client until the queue
	// is below LowWaterMark; an upstream that acknowledges nothing for
	// write_timeout still ends the link, as write_timeout) or reject (close
	// the link at the high watermark, whatever the upstream does: the
	// client fails fast, and a fast upload to a live but slower server is
	// cut too).
	OnOverflow string `yaml:"on_overflow"`
}

// Framing types for Framing.Type.
const (
	FramingNone        = "none"
	FramingLengthField = "length_field"
	// FramingKafka is Kafka's wire protocol: 4-byte big-endian length
	// frames whose request headers the proxy reads to match responses by
	// correlation id, to skip requests that get no response by protocol
	// (Produce with acks=0) and to give each request the time it asks the
	// broker to hold it (Fetch max_wait_ms, JoinGroup rebalance timeout,
	// Produce timeout_ms).
	FramingKafka = "kafka"
	// FramingPinot is the Pinot broker-to-server query transport: 4-byte
	// big-endian length frames carrying Thrift InstanceRequests and
	// DataTable responses; each request's deadline is its own timeoutMs
	// query option.
	FramingPinot = "pinot"
)

// IsProfile reports whether t is a protocol profile (kafka, pinot): a
// fixed 4-byte big-endian length framing plus what the protocol says about
// answers.
func IsProfile(t string) bool { return t == FramingKafka || t == FramingPinot }

// Byte orders for Framing.ByteOrder.
const (
	ByteOrderBig    = "big"
	ByteOrderLittle = "little"
)

// Framing describes the wire format of the proxied protocol. The length_field
// parameters are those of Netty's LengthFieldBasedFrameDecoder; the defaults
// are Pinot's and Kafka's transport: a 4-byte big-endian length prefix that
// counts the bytes after it.
type Framing struct {
	// Type is none (opaque bytes: there are no frames, so no requests to
	// count), length_field (each frame carries its length in a header; the
	// proxy cannot tell which frames get an answer or how long one may take),
	// or a protocol profile: kafka or pinot. The profiles use a 4-byte
	// big-endian length that counts the bytes after it (the length_field
	// keys below do not apply to them, max_frame_length does) and read just
	// enough of each request and response to know which requests expect an
	// answer, by when, and which answer is whose.
	Type string `yaml:"type"`
	// LengthFieldOffset is the number of bytes from the start of a frame to
	// its length field. Negative is invalid.
	LengthFieldOffset int `yaml:"length_field_offset"`
	// LengthFieldLength is the size of the length field in bytes: 1, 2, 3,
	// 4 or 8. Zero and negative are invalid.
	LengthFieldLength int `yaml:"length_field_length"`
	// LengthAdjustment is added to the length field's value to give the
	// number of bytes that follow the length field. Zero when the field
	// counts exactly those bytes; negative when it also counts the header
	// (-4 for a 4-byte length that includes itself).
	LengthAdjustment int `yaml:"length_adjustment"`
	// InitialBytesToStrip is the number of bytes Netty's decoder drops from
	// the start of each frame before handing it on. Zero keeps the whole
	// frame; negative is invalid.
	InitialBytesToStrip int `yaml:"initial_bytes_to_strip"`
	// ByteOrder is the length field's byte order: big (network order) or
	// little.
	ByteOrder string `yaml:"byte_order"`
	// MaxFrameLength is the largest frame the proxy follows, header
	// included. A longer one means the stream is not what the framing
	// says (a TLS handshake read as a length, say): the link is still
	// forwarded, untouched, but no longer tracked. It must be positive when
	// Type is not none (and is unused otherwise, but never negative).
	MaxFrameLength Size `yaml:"max_frame_length"`
}

// Values of Unanswered.Track.
const (
	TrackAuto = "auto"
	TrackOn   = "on"
	TrackOff  = "off"
)

// Unanswered configures tracking of requests that see no response. A
// request counts only once its own deadline has passed and only if the
// endpoint answered nothing at all, on any link, since it was sent: a slow
// upstream that still answers never trips it; a dead one answers nothing.
type Unanswered struct {
	// Track turns tracking on or off: auto (on for the kafka and pinot
	// profiles, whose requests say whether and by when they are answered;
	// off for none and length_field, where a long poll, a subscription or a
	// request with no response by design looks the same as a dead server),
	// on, or off.
	Track string `yaml:"track"`
	// RequestTimeout is how long a request may wait for a response beyond
	// the time it asks the server to hold it (a Kafka Fetch's max_wait_ms,
	// say) before it counts as unanswered. With the pinot profile a request
	// that carries its own timeoutMs uses that (plus one second) instead.
	// 0 disables tracking; negative is invalid.
	RequestTimeout Duration `yaml:"request_timeout"`
	// ConsecutiveTimeoutsThreshold is how many unanswered requests in a row
	// (across all links to the endpoint, with no answer in between) mark the
	// endpoint suspect; a request counts against the threshold of the
	// listener that sent it. Non-positive: this listener's requests are
	// never counted (in framed mode they are still never delivered stale).
	ConsecutiveTimeoutsThreshold int `yaml:"consecutive_timeouts_threshold"`
}

// Enabled reports whether requests are tracked for framing type framing:
// Track allows it (auto: only for the protocol profiles), the timeout is
// positive, and tracking has a use: in framed mode a request past its
// deadline is never delivered stale, whatever the threshold; in opaque
// mode tracking only counts, so it needs a positive threshold.
func (u Unanswered) Enabled(framing string) bool {
	switch u.Track {
	case TrackOff:
		return false
	case TrackAuto, "":
		if !IsProfile(framing) {
			return false
		}
	}
	return u.RequestTimeout > 0 && (framing != FramingNone || u.ConsecutiveTimeoutsThreshold > 0)
}

// The values of Detector.Probe. ProbeKindAuto is the default: it picks the
// probe that proves the process for the framing: ProbeKindKafka for the
// kafka profile, ProbeKindHTTP for the pinot profile (Pinot servers answer
// /health on their admin port), ProbeKindConnect otherwise. The other three
// name the health detector's probes; the proxy translates them into the
// health package's kinds.
const (
	ProbeKindAuto    = "auto"
	ProbeKindConnect = "connect" // a fresh TCP connection is established
	ProbeKindHTTP    = "http"    // an HTTP GET of HTTP.Path answers 2xx
	ProbeKindKafka   = "kafka"   // a Kafka ApiVersions request is answered
)

// PinotAdminPort is the Pinot server's admin port (pinot.server.adminapi.port),
// where GET /health answers: the http probe's port under the pinot profile
// when detector.http.port is 0.
const PinotAdminPort = 8097

// Probe returns the probe kind and HTTP port that settings s use, with
// auto resolved for s.Framing.Type.
func (s Settings) Probe() (kind string, httpPort int) {
	kind, httpPort = s.Detector.Probe, s.Detector.HTTP.Port
	if kind == ProbeKindAuto || kind == "" {
		switch s.Framing.Type {
		case FramingKafka:
			kind = ProbeKindKafka
		case FramingPinot:
			kind = ProbeKindHTTP
		default:
			kind = ProbeKindConnect
		}
	}
	if kind == ProbeKindHTTP && httpPort == 0 && s.Framing.Type == FramingPinot {
		httpPort = PinotAdminPort
	}
	return kind, httpPort
}

// Detector configures how an excluded endpoint is probed. A probe always
// uses a fresh connection, never a cached one; an endpoint is readmitted
// only after a successful probe. After a failed probe the delay before the
// next is multiplied by BackoffFactor, up to MaxDelay.
type Detector struct {
	// Probe is auto (the default: kafka under the kafka profile, http
	// under the pinot profile, connect otherwise), connect (a fresh TCP
	// connection to the endpoint is established: proves the host's kernel,
	// not the process), http (an HTTP GET of HTTP.Path over a fresh
	// connection answers with a 2xx status) or kafka (a Kafka ApiVersions
	// request over a fresh connection is answered).
	Probe string `yaml:"probe"`
	// ProbeTimeout bounds one probe, connection included. Must be positive.
	ProbeTimeout Duration `yaml:"probe_timeout"`
	// InitialDelay is the wait between an endpoint's exclusion and its
	// first probe, and the first backoff step. Must be positive.
	InitialDelay Duration `yaml:"initial_delay"`
	// BackoffFactor multiplies the delay after each failed probe. 1 probes
	// at a fixed interval of InitialDelay; below 1 is invalid.
	BackoffFactor float64 `yaml:"backoff_factor"`
	// MaxDelay caps the delay between probes. It must be at least
	// InitialDelay (so it must be positive).
	MaxDelay Duration `yaml:"max_delay"`
	// Jitter spreads each delay uniformly over ±Jitter of itself (0.2: from
	// 80% to 120%), so that endpoints excluded together are not probed in
	// lockstep. Zero disables jitter; it must be at least 0 and below 1.
	Jitter float64 `yaml:"jitter"`
	// HTTP configures the http probe; unused by the connect probe.
	HTTP ProbeHTTP `yaml:"http"`
}

// ProbeHTTP configures the http probe.
type ProbeHTTP struct {
	// Port is the port the probe connects to, on the endpoint's host. Zero
	// uses the endpoint's own port, or under the pinot profile the Pinot
	// server's admin port, 8097; it must be from 0 to 65535.
	Port int `yaml:"port"`
	// Path is the request path; it must start with "/" when the probe is
	// http.
	Path string `yaml:"path"`
}

// OnExcluded policies for Settings.OnExcluded.
const (
	OnExcludedRefuse = "refuse"
	OnExcludedAllow  = "allow"
)

// DefaultSettings returns the link settings used where a config says nothing.
// The numbers come from the production incidents the proxy was built for
// (docs/incidents.md): each bounds how long a dead upstream can hold a link.
func DefaultSettings() Settings {
	return Settings{
		ConnectTimeout:   Duration(2 * time.Second),
		ConnectAttempts:  3,
		WriteTimeout:     Duration(10 * time.Second),
		TCPUserTimeout:   Duration(10 * time.Second),
		Keepalive:        Keepalive{Idle: Duration(10 * time.Second), Interval: Duration(5 * time.Second), Count: 3},
		WriteBuffer:      WriteBuffer{HighWaterMark: 16 * MiB, LowWaterMark: 8 * MiB, OnOverflow: OverflowBackpressure},
		HalfCloseTimeout: Duration(30 * time.Second),
		Framing: Framing{
			Type:              FramingNone,
			LengthFieldLength: 4,
			ByteOrder:         ByteOrderBig,
			MaxFrameLength:    256 * MiB,
		},
		Unanswered: Unanswered{Track: TrackAuto, RequestTimeout: Duration(3 * time.Second), ConsecutiveTimeoutsThreshold: 1},
		Detector: Detector{
			Probe:         ProbeKindAuto,
			ProbeTimeout:  Duration(time.Second),
			InitialDelay:  Duration(time.Second),
			BackoffFactor: 2,
			MaxDelay:      Duration(60 * time.Second),
			Jitter:        0.2,
			HTTP:          ProbeHTTP{Port: 0, Path: "/health"},
		},
		OnExcluded: OnExcludedRefuse,
		Mesh:       DefaultMesh(),
	}
}

// DefaultConfig returns a configuration with every default and no listeners.
func DefaultConfig() Config {
	return Config{
		Admin:         Admin{Listen: "127.0.0.1:9901", ControlListen: "127.0.0.1:9902"},
		Log:           Log{Level: "info", Format: "json"},
		DrainTimeout:  Duration(15 * time.Second),
		ShutdownGrace: Duration(10 * time.Second),
		ShutdownIdle:  Duration(2 * time.Second),
		Defaults:      DefaultSettings(),
		Limits:        Limits{Procs: DefaultProcs, ParkIdleAfter: DefaultParkIdleAfter},
	}
}

// DefaultParkIdleAfter is limits.park_idle_after when a config says
// nothing: long enough that a link with a request a second never parks,
// short enough that a broker's idle connections give their stacks back
// within seconds (docs/performance.md, "Parking idle links").
const DefaultParkIdleAfter = Duration(2 * time.Second)

// DefaultProcs is limits.procs when a config says nothing: one thread
// runs Go code at a time (docs/performance.md, "Real clients").
const DefaultProcs = 1
