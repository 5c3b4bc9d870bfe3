package health

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strconv"
	"syscall"
	"time"
)

// Probe kinds.
const (
	ProbeConnect = "connect" // a TCP connect that completes within Timeout
	ProbeHTTP    = "http"    // GET http://<host>:<HTTPPort><HTTPPath> answered 2xx within Timeout
	ProbeKafka   = "kafka"   // a Kafka ApiVersions request answered within Timeout
)

// Defaults applied by Register to non-positive (or empty) ProbeConfig
// fields. They match the detector defaults in the README (Configuration
// reference).
const (
	DefaultProbeTimeout = 1 * time.Second
	DefaultInitialDelay = 1 * time.Second
	DefaultFactor       = 2.0
	DefaultMaxDelay     = 60 * time.Second
	// WaitingInterval is the longest time between the starts of two
	// probes of an excluded endpoint while ProbeConfig.Waiting reports
	// clients turned away (jittered downward only; back to back when a
	// probe takes longer): a dead endpoint gets about one probe a second
	// from each proxy, a recovered one is readmitted within about a
	// second plus the probe's own time.
	WaitingInterval = time.Second
	// MaxJitter bounds ProbeConfig.Jitter, so that a jittered delay is
	// never zero. policy validates jitter to [0, 1), so a validated
	// configuration is passed through unchanged.
	MaxJitter = 0.99
)

// ProbeConfig says how an excluded endpoint is probed. The proxy maps its
// configuration (defaults.detector) onto it. Register normalizes it: see the
// field comments for what zero and out-of-range values mean.
type ProbeConfig struct {
	// Kind is ProbeConnect (also when empty), ProbeHTTP or ProbeKafka. Any other value
	// makes every probe fail, so a typo keeps the endpoint out rather than
	// readmitting it unchecked; policy validation should reject it first.
	Kind string
	// Timeout bounds one probe: the connect, or the whole HTTP exchange.
	// Non-positive means DefaultProbeTimeout.
	Timeout time.Duration
	// InitialDelay is the wait between the exclusion and the first probe.
	// Non-positive means DefaultInitialDelay.
	InitialDelay time.Duration
	// Factor multiplies the delay after every failed probe. Non-positive
	// means DefaultFactor; a value in (0, 1) is raised to 1 (a constant
	// delay), so the schedule never speeds up.
	Factor float64
	// MaxDelay caps the delay before jitter. Non-positive means
	// DefaultMaxDelay; a value below InitialDelay is raised to it.
	MaxDelay time.Duration
	// Jitter spreads each delay uniformly over ±Jitter of it (0.2 = ±20%)
	// after the MaxDelay cap, so endpoints excluded together are not probed
	// in lockstep. 0 or negative means none; values above MaxJitter
	// (1 and more) are lowered to it.
	Jitter float64
	// HTTPPort is the port of the HTTP probe (ProbeHTTP only). 0 means the
	// endpoint's own port.
	HTTPPort int
	// HTTPPath is the request path of the HTTP probe (ProbeHTTP only), e.g.
	// "/health". Empty means "/"; a missing leading slash is added.
	HTTPPath string
	// Dialer, when set, opens this endpoint's probe connections instead of
	// Options.Dial. The data plane passes one with the socket options of
	// its own connections to the endpoint, so that a probe cannot pass
	// where a connection would fail.
	Dialer *net.Dialer
	// Connected, when set, runs on each connection Dialer opened, once it
	// is connected and before the probe writes: the data plane sets there
	// the socket options that must not bound the connect (a waiting
	// probe's TCP_USER_TIMEOUT raised to keepalive's, its SYN left to
	// tcp_user_timeout). Its error fails the probe; the connection is
	// closed.
	Connected func(net.Conn) error
	// Override, when set, runs first: if it reports handled, its error is
	// the probe's result and the probe of Kind does not run. The data
	// plane sets it for an endpoint reached through a mesh sidecar, whose
	// session and readiness announcement prove the server better than a
	// direct probe; it reports not handled where it falls back to a
	// direct connection (no sidecar there).
	Override func(ctx context.Context, endpoint string) (handled bool, err error)
	// OwnNetwork, when set, reports whether a failed probe's error is
	// the prober's own network's (its host has no route of its own to
	// where the probe dialed): such a probe reaches no verdict, as one
	// Options.OwnFailure finds the prober's own, and the next comes at
	// InitialDelay (see Options.OwnFailure). An Override's error is
	// asked too: the data plane's dials a mesh session to the peer
	// sidecar with the endpoint's own socket options.
	OwnNetwork func(error) bool
	// Waiting, when set, reports whether clients are being turned away
	// for want of this endpoint (its listener paused, links refused).
	// While it does, the endpoint is probed every WaitingInterval at
	// least, whatever the backoff has grown to, so that a recovered
	// endpoint is back within about a second while its clients wait;
	// otherwise the backoff spares a dead server. It is called without
	// the detector's lock held, at most every WaitingInterval/2.
	Waiting func() bool
}

// normalized returns pc with every default and bound applied.
func (pc ProbeConfig) normalized() ProbeConfig {
	if pc.Kind == "" {
		pc.Kind = ProbeConnect
	}
	if pc.Timeout <= 0 {
		pc.Timeout = DefaultProbeTimeout
	}
	if pc.InitialDelay <= 0 {
		pc.InitialDelay = DefaultInitialDelay
	}
	switch {
	case pc.Factor <= 0 || math.IsNaN(pc.Factor) || math.IsInf(pc.Factor, 0):
		pc.Factor = DefaultFactor
	case pc.Factor < 1:
		pc.Factor = 1
	}
	if pc.MaxDelay <= 0 {
		pc.MaxDelay = DefaultMaxDelay
	}
	if pc.MaxDelay < pc.InitialDelay {
		pc.MaxDelay = pc.InitialDelay
	}
	switch {
	case !(pc.Jitter > 0): // also NaN
		pc.Jitter = 0
	case pc.Jitter > MaxJitter:
		pc.Jitter = MaxJitter
	}
	if pc.HTTPPath == "" || pc.HTTPPath[0] != '/' {
		pc.HTTPPath = "/" + pc.HTTPPath
	}
	return pc
}

// baseDelay is the delay before the next probe after failed failed probes,
// before jitter: InitialDelay * Factor^failed, capped at MaxDelay. pc must be
// normalized.
func baseDelay(pc ProbeConfig, failed int) time.Duration {
	d := float64(pc.InitialDelay) * math.Pow(pc.Factor, float64(failed))
	if d >= float64(pc.MaxDelay) || math.IsInf(d, 0) || math.IsNaN(d) {
		return pc.MaxDelay
	}
	return time.Duration(d)
}

// jittered spreads d uniformly over [d*(1-j), d*(1+j)]; r is in [0, 1).
func jittered(d time.Duration, j, r float64) time.Duration {
	if j <= 0 {
		return d
	}
	return time.Duration(float64(d) * (1 + j*(2*r-1)))
}

// probeDelay is the jittered delay before the next probe.
func probeDelay(pc ProbeConfig, failed int) time.Duration {
	return jittered(baseDelay(pc, failed), pc.Jitter, rand.Float64())
}

// errUnknownKind fails every probe of a ProbeConfig with an unknown Kind.
var errUnknownKind = errors.New("unknown probe kind")

// probe runs one probe of endpoint over a fresh connection and returns nil
// only if it proves the endpoint healthy. ctx carries shutdown; the probe's
// own Timeout is applied here. overridden: pc.Override decided it.
func (d *Detector) probe(ctx context.Context, endpoint string, pc ProbeConfig) (overridden bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, pc.Timeout)
	defer cancel()
	if pc.Dialer != nil {
		ctx = context.WithValue(ctx, dialerKey{}, &pc)
	}
	if pc.Override != nil {
		if handled, err := pc.Override(ctx, endpoint); handled {
			return true, err
		}
	}
	switch pc.Kind {
	case ProbeConnect:
		return false, d.probeConnect(ctx, endpoint)
	case ProbeHTTP:
		return false, d.probeHTTP(ctx, endpoint, pc)
	case ProbeKafka:
		return false, d.probeKafka(ctx, endpoint)
	}
	return false, fmt.Errorf("%w %q", errUnknownKind, pc.Kind)
}

// noticedLate reports whether a probe that failed with err after took
// ran out of its own timeout and noticed it a timeout or more late. A probe's
// wait ends within a millisecond or two of its deadline while the
// process runs; so late, it could not run (CPU throttling, a host under
// contention) for about as long as the endpoint was given, and an answer
// may have come while it could not read it. That is no verdict: the
// probe neither counts as failed (the backoff does not grow, a flapped
// endpoint's hold-down does not start over) nor passes; the next probe
// asks again. Only for the detector's own probes, whose every wait ends
// at the deadline: an Override's may wait on the caller's locks (a mesh
// probe behind a link's session dial) and be late while the process ran.
func noticedLate(err error, took, timeout time.Duration) bool {
	var ne net.Error
	timedOut := errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
	// ETIMEDOUT is the kernel's verdict (its retransmissions ran out),
	// not the probe's deadline.
	return timedOut && !errors.Is(err, syscall.ETIMEDOUT) && took >= 2*timeout
}

// probeConnect succeeds when a new TCP connection to endpoint is established.
func (d *Detector) probeConnect(ctx context.Context, endpoint string) error {
	conn, err := d.dialContext(ctx, "tcp", endpoint)
	if err != nil {
		return err
	}
	return conn.Close()
}

// probeHTTP succeeds when GET http://host:port/path answers 2xx. The client
// never keeps a connection (DisableKeepAlives), so every probe dials afresh
// and no transport goroutine outlives the probe; redirects are not followed
// (a 3xx is a failure).
func (d *Detector) probeHTTP(ctx context.Context, endpoint string, pc ProbeConfig) error {
	host, port, err := net.SplitHostPort(endpoint)
	if err != nil {
		return err
	}
	if pc.HTTPPort > 0 {
		port = strconv.Itoa(pc.HTTPPort)
	}
	url := "http://" + net.JoinHostPort(host, port) + pc.HTTPPath
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := d.http.Do(req)
	if err != nil {
		return err
	}
	// Drain a little so the server sees a complete exchange; the connection
	// is closed either way.
	_, _ = io.CopyN(io.Discard, resp.Body, 4<<10)
	_ = resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("http probe %s: status %d", url, resp.StatusCode)
	}
	return nil
}

// kafkaProbeCorrelation is the correlation id of the probe's request;
// any value works, a distinctive one reads well in a capture.
const kafkaProbeCorrelation = 0x4c505052 // "LPPR"

// kafkaProbeRequest is a framed ApiVersions (api_key 18) version 0 request
// with client_id "livenessproxy-probe". Version 0 is the one every broker
// answers: a broker that does not support the version a client asks for
// still answers ApiVersions with a version 0 body, so that the client can
// learn what it supports (KIP-511).
var kafkaProbeRequest = func() []byte {
	const clientID = "livenessproxy-probe"
	b := binary.BigEndian.AppendUint32(nil, uint32(2+2+4+2+len(clientID)))
	b = binary.BigEndian.AppendUint16(b, 18) // api_key: ApiVersions
	b = binary.BigEndian.AppendUint16(b, 0)  // api_version
	b = binary.BigEndian.AppendUint32(b, kafkaProbeCorrelation)
	b = binary.BigEndian.AppendUint16(b, uint16(len(clientID)))
	return append(b, clientID...)
}()

// probeKafka succeeds when a broker answers an ApiVersions request over a
// fresh connection: a response frame that carries the request's
// correlation id, or a TLS alert (tlsAlert). A stopped broker's kernel still completes the handshake,
// but the process must read the request and write the answer. The
// response's error code is not checked: any answer proves the process.
func (d *Detector) probeKafka(ctx context.Context, endpoint string) error {
	conn, err := d.dialContext(ctx, "tcp", endpoint)
	if err != nil {
		return err
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if _, err := conn.Write(kafkaProbeRequest); err != nil {
		return fmt.Errorf("kafka probe: writing ApiVersions: %w", err)
	}
	var hdr [8]byte
	if n, err := io.ReadFull(conn, hdr[:]); err != nil {
		if n >= 2 && tlsAlert(hdr[:n]) {
			return nil
		}
		return fmt.Errorf("kafka probe: no ApiVersions response: %w", err)
	}
	if tlsAlert(hdr[:]) {
		return nil
	}
	if size := binary.BigEndian.Uint32(hdr[:4]); size < 4 || size > 1<<20 {
		return fmt.Errorf("kafka probe: response frame of %d bytes is not an ApiVersions response", size)
	}
	if corr := binary.BigEndian.Uint32(hdr[4:]); corr != kafkaProbeCorrelation {
		return fmt.Errorf("kafka probe: response correlation id %#x, want %#x", corr, kafkaProbeCorrelation)
	}
	return nil
}

// tlsAlert reports whether b starts a TLS alert record (content type 21,
// protocol major version 3): what a broker's TLS listener answers a
// plaintext request with before it closes. The broker's process wrote it
// (no kernel speaks TLS), so it is alive: a broker whose clients speak TLS
// is probed by its kafka probe before any client link has shown the proxy
// that it does (a restart, an endpoint excluded at its first dial), and
// would otherwise never be readmitted.
func tlsAlert(b []byte) bool { return len(b) >= 2 && b[0] == 0x15 && b[1] == 0x03 }

// dialerKey carries a probe's ProbeConfig (one with a Dialer) in its
// context, so that the HTTP probe's shared transport dials with it too.
type dialerKey struct{}

// dialContext opens a probe connection: with the probe's own Dialer when
// it has one (ProbeConfig.Dial), else with Options.Dial.
func (d *Detector) dialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	if pc, ok := ctx.Value(dialerKey{}).(*ProbeConfig); ok {
		return pc.Dial(ctx, network, addr)
	}
	return d.dial(ctx, network, addr)
}

// Dial opens a probe connection with pc.Dialer, then runs pc.Connected
// on it.
func (pc *ProbeConfig) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := pc.Dialer.DialContext(ctx, network, addr)
	if err != nil || pc.Connected == nil {
		return c, err
	}
	if err := pc.Connected(c); err != nil {
		_ = c.Close()
		return nil, err
	}
	return c, nil
}

// newHTTPClient returns the client of the HTTP probes: no keep-alives, no
// environment proxy, no redirects, dialing through dial.
// maxProbeHeaderBytes bounds an HTTP probe's answer headers: an answer
// with more fails the probe (its status line is not read on).
const maxProbeHeaderBytes = 16 << 10

func newHTTPClient(dial func(ctx context.Context, network, addr string) (net.Conn, error)) *http.Client {
	return &http.Client{
		Transport: &http.Transport{
			Proxy:              nil, // never HTTP_PROXY: the probe must reach the endpoint itself
			DialContext:        dial,
			DisableKeepAlives:  true,
			DisableCompression: true,
			// The probe reads a status line; net/http's default lets
			// an answer's headers take 10 MB, once per excluded endpoint
			// probed at once, outside the memory budget.
			MaxResponseHeaderBytes: maxProbeHeaderBytes,
		},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
}
