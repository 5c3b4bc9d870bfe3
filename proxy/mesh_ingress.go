package proxy

import (
	"context"
	"errors"
	"io"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/mesh"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/hashicorp/yamux"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// ingress is the server side of the mesh on one listener: it accepts the
// sessions of egress sidecars, proxies each stream to a local server port
// as a link (with the listener's upstream enforcement), and announces to
// every session whether each local port accepts connections.
//
// Goroutines: the checker, the shrinker, and per session its heartbeat, its stream
// accept loop and its status writer, all owned by wg; a stream's
// handshake goroutine becomes its link's (counted by the listener).
type ingress struct {
	l    *listener
	host string

	kick      chan struct{} // check now
	shrink    chan struct{} // the checker's word to the shrinker
	checked   chan struct{} // closed after the first check: statuses wait for it
	stop      chan struct{}
	once      sync.Once
	startOnce sync.Once
	wg        sync.WaitGroup

	boot uint64       // this process's id in status messages (memo's)
	memo *ingressMemo // what every ingress on this local host shares

	handshakes atomic.Int64 // connections waiting for their handshake
	// refusing: streams refused at max_links that wait for their header
	// before their reset (takeSlot), at most maxRefusingStreams.
	refusing atomic.Int64
	streams  atomic.Int64 // streams served, over all sessions
	// refusals: sessions refused at the handshake, logged at warn at most
	// once a second (see refusedLog).
	refusals logGate

	mu       sync.Mutex
	ports    []uint16 // the local port first, then ingress.ports
	status   map[uint16]mesh.PortStatus
	gen      uint64                // the status's generation: one more at every change
	checks   map[uint16]*portCheck // what the checks saw since the port's last verdict
	sessions map[*ingressSession]struct{}
	perPeer  map[string]int            // sessions by peer address
	admitted int                       // sessions over all peers: the sum of perPeer
	pending  map[*net.TCPConn]struct{} // connections in their handshake
	closed   bool
	draining bool // the listener stopped accepting: every port is announced not ready
}

// portCheck is what the checks of one port saw.
type portCheck struct {
	failures int  // consecutive failed connects that were not refusals
	refused  bool // a connect was refused since the port was last ready: nothing listened
}

// checkFailuresForNotReady is how many consecutive connects that time out
// or fail otherwise (not refused) announce a port not ready: a server
// whose accept queue is full for a moment is slow, not gone. A refused
// connect (nothing listens) is announced at once.
const checkFailuresForNotReady = 3

type ingressSession struct {
	*mesh.Session
	changed chan struct{} // the status changed: send it
	host    string        // the peer's address
	// statusOpen is 1 once the status stream is open. Set under statusMu
	// with the open itself, which the admission of the peer's streams
	// takes too: they count the status stream exactly when yamux does.
	statusOpen atomic.Int32
	statusMu   sync.Mutex
}

func newIngress(l *listener, cfg policy.Listener) *ingress {
	host, port, _ := net.SplitHostPort(cfg.Ingress.Local)
	memo := l.p.ingressMemo(host)
	in := &ingress{l: l, host: host, kick: make(chan struct{}, 1), shrink: make(chan struct{}, 1), stop: make(chan struct{}), checked: make(chan struct{}),
		boot: memo.boot, memo: memo, status: make(map[uint16]mesh.PortStatus), checks: make(map[uint16]*portCheck),
		sessions: make(map[*ingressSession]struct{}), perPeer: make(map[string]int),
		pending: make(map[*net.TCPConn]struct{})}
	in.ports = ingressPorts(port, cfg.Ingress.Ports)
	// After the generations of the ingress it replaces: its messages are
	// no stale ones to the peers that heard that one.
	in.gen = memo.gen.Add(1)
	for _, p := range in.ports {
		// Not ready until the first check; the epoch an earlier ingress
		// on this host announced stays the port's unless the port
		// refuses connections in between (a reload that replaced the
		// ingress did not restart the server).
		in.status[p] = mesh.PortStatus{Epoch: memo.epoch(p)}
		in.checks[p] = &portCheck{}
	}
	return in
}

// ingressMemo is what the ingresses of one local host share across the
// reloads that replace one by another: one boot id, one generation count
// (messages of the old and the new, both on the peers' sessions for a
// while, stay ordered), each port's epoch and the refusals seen since it
// was drawn. One per local host, for the process's life. Its mu is taken
// under an ingress's mu, and nothing is taken under it.
type ingressMemo struct {
	boot    uint64
	gen     atomic.Uint64
	mu      sync.Mutex
	epochs  map[uint16]uint64
	refused map[uint16]bool // the port refused connections since its epoch was drawn
}

func (m *ingressMemo) epoch(port uint16) uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.epochs[port]
}

func (m *ingressMemo) setEpoch(port uint16, e uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.epochs[port] = e
}

// sawRefused records that port refused connections: the next ingress of
// the host to find it ready draws a new epoch, whichever saw the refusal.
func (m *ingressMemo) sawRefused(port uint16) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.refused[port] = true
}

// readyEpoch is the epoch of port, which an ingress of the host finds
// ready: the one announced before, or a new one when there was none or
// the port refused connections since (refused: this ingress saw it).
func (m *ingressMemo) readyEpoch(port uint16, refused bool) uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if refused || m.refused[port] || m.epochs[port] == 0 {
		// Nothing listened in between: the server started afresh, and
		// links opened before are to the process that went.
		m.epochs[port] = mesh.NewEpoch()
	}
	delete(m.refused, port)
	return m.epochs[port]
}

// ingressMemo returns the memo of the ingresses on local host, created
// on first use.
func (p *Proxy) ingressMemo(host string) *ingressMemo {
	p.memoMu.Lock()
	defer p.memoMu.Unlock()
	if p.ingressMemos == nil {
		p.ingressMemos = make(map[string]*ingressMemo)
	}
	m := p.ingressMemos[host]
	if m == nil {
		m = &ingressMemo{boot: mesh.NewEpoch(), epochs: make(map[uint16]uint64), refused: make(map[uint16]bool)}
		p.ingressMemos[host] = m
	}
	return m
}

// ingressPorts is local's port, then ports.
func ingressPorts(local string, ports []int) []uint16 {
	n, _ := strconv.Atoi(local)
	ps := []uint16{uint16(n)}
	for _, p := range ports {
		if !slices.Contains(ps, uint16(p)) {
			ps = append(ps, uint16(p))
		}
	}
	return ps
}

// portList is the ports the ingress serves.
func (in *ingress) portList() []uint16 {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.ports
}

// serves reports whether the ingress serves port.
func (in *ingress) serves(port uint16) bool { return slices.Contains(in.portList(), port) }

// retune takes a reload's configuration of the kept listener (the caller
// holds p.mu): the listener, its sessions and the ports' epochs stay; a
// port added is announced once checked, a port removed is no longer
// announced and takes no new stream (its links finish), and its endpoint
// is no longer the listener's: orphans are those no listener routes to
// any more, deleted from the proxy's endpoints, for the caller to forget
// once it has released p.mu (as detach does).
func (in *ingress) retuneLocked(lc policy.Listener) (orphans []*endpoint) {
	_, port, _ := net.SplitHostPort(lc.Ingress.Local)
	ports := ingressPorts(port, lc.Ingress.Ports)
	in.mu.Lock()
	changed := !slices.Equal(ports, in.ports)
	for _, p := range ports {
		if _, ok := in.status[p]; !ok {
			in.status[p] = mesh.PortStatus{}
			in.checks[p] = &portCheck{}
		}
	}
	var removed []uint16
	for p := range in.status {
		if !slices.Contains(ports, p) {
			delete(in.status, p)
			delete(in.checks, p)
			removed = append(removed, p)
		}
	}
	in.ports = ports
	var ss []*ingressSession
	if changed {
		in.gen = in.memo.gen.Add(1)
		ss = slices.Collect(maps.Keys(in.sessions))
	}
	in.mu.Unlock()
	in.endpointsLocked(lc.Settings)
	for _, port := range removed {
		if ep := in.l.p.endpoints[normalizeEndpoint(in.addr(port))]; ep != nil && in.l.p.detachFromLocked(in.l, ep) {
			orphans = append(orphans, ep)
		}
	}
	for _, is := range ss {
		is.notify()
	}
	in.kickCheck()
	return orphans
}

// endpoints registers the local ports as endpoints of l (the caller
// holds p.mu), so that their links are judged, and probed when excluded,
// like any upstream's.
func (in *ingress) endpointsLocked(s policy.Settings) {
	p := in.l.p
	for _, port := range in.portList() {
		ep, _ := p.endpointForLocked(in.addr(port), s, in.l)
		ep.mu.Lock()
		if !slices.Contains(ep.listeners, in.l) {
			ep.listeners = append(ep.listeners, in.l)
		}
		ep.mu.Unlock()
	}
}

// addr is the local host:port of port.
func (in *ingress) addr(port uint16) string {
	return net.JoinHostPort(in.host, strconv.Itoa(int(port)))
}

// localEndpoints are the endpoints of the local ports.
func (in *ingress) localEndpoints() []*endpoint {
	ports := in.portList()
	eps := make([]*endpoint, 0, len(ports))
	for _, port := range ports {
		if ep := in.l.p.lookupEndpoint(in.addr(port)); ep != nil {
			eps = append(eps, ep)
		}
	}
	return eps
}

// start runs the checker and the shrinker.
func (in *ingress) start() {
	in.wg.Add(2)
	go in.checker()
	go in.shrinker()
}

// close ends every session and the checker, and waits for them.
func (in *ingress) close() {
	in.once.Do(func() { close(in.stop) })
	in.mu.Lock()
	in.closed = true
	ss := slices.Collect(maps.Keys(in.sessions))
	for tc := range in.pending {
		_ = tc.Close() // its handshake ends
	}
	in.mu.Unlock()
	for _, is := range ss {
		_ = is.Sess.Close()
	}
	in.wg.Wait()
}

// kickCheck asks the checker to check the local ports now: a link to one
// of them failed.
func (in *ingress) kickCheck() {
	select {
	case in.kick <- struct{}{}:
	default:
	}
}

// checker checks every local port every check_interval, and at once when
// kicked. A port is ready when it accepts a connection and the detector
// does not hold it excluded or disabled; a port that turns ready gets a
// new epoch.
func (in *ingress) checker() {
	defer in.wg.Done()
	t := time.NewTimer(0)
	defer t.Stop()
	for first := true; ; first = false {
		// A reload may retune it.
		every := in.l.spec().cfg.Ingress.OrDefaults().CheckInterval.D()
		t.Reset(every)
		in.check(min(every, time.Second))
		select {
		case in.shrink <- struct{}{}:
		default: // the last one still runs
		}
		if first {
			close(in.checked)
		}
		select {
		case <-t.C:
		case <-in.kick:
		case <-in.stop:
			return
		}
	}
}

// check checks every local port once, within timeout each, and
// announces to every session the readiness that changed.
func (in *ingress) check(timeout time.Duration) {
	results, ok := in.probePorts(timeout)
	if !ok {
		return // shutting down: no verdict
	}
	in.mu.Lock()
	changed := false
	for port, r := range results {
		changed = in.judgeLocked(port, r) || changed
	}
	var ss []*ingressSession
	if changed {
		in.gen = in.memo.gen.Add(1)
		ss = slices.Collect(maps.Keys(in.sessions))
	}
	in.mu.Unlock()
	for _, is := range ss {
		is.notify()
	}
}

// checkResult is what one check of a local port found; the zero value:
// the detector holds the port's endpoint out.
type checkResult struct {
	ok, refused, local bool
	err                error
}

// probePorts connects to every local port whose endpoint the detector
// holds healthy. ok is false if the listener began shutting down
// meanwhile.
func (in *ingress) probePorts(timeout time.Duration) (results map[uint16]checkResult, ok bool) {
	p := in.l.p
	settings := in.l.spec().settings
	ports := in.portList()
	results = make(map[uint16]checkResult, len(ports))
	for _, port := range ports {
		addr := in.addr(port)
		if st, _ := p.det.State(normalizeEndpoint(addr)); st != health.Healthy {
			// Excluded on evidence (or disabled) by this proxy's own
			// detector: not ready, whatever a connect says.
			results[port] = checkResult{}
			continue
		}
		ctx, cancel := context.WithTimeout(in.l.ctx, timeout)
		began := flow.Mono()
		c, err := (&net.Dialer{KeepAlive: -1, Control: flow.UpstreamControl(settings)}).DialContext(ctx, "tcp", addr)
		cancel()
		err = frozenDial(err, began, timeout)
		switch {
		case err == nil:
			_ = c.Close()
			results[port] = checkResult{ok: true}
		case in.l.ctx.Err() != nil:
			return nil, false
		case errors.Is(err, syscall.ECONNREFUSED):
			results[port] = checkResult{refused: true, err: err}
		case errors.As(err, new(errFrozenDial)):
			// Timed out while this process could not run: no verdict,
			// as a link's dial or a probe noticed so late.
			results[port] = checkResult{local: true, err: err}
		case upstreamFault(err):
			results[port] = checkResult{err: err}
		default:
			// Out of descriptors and the like: the ingress's own failure
			// says nothing about the server. The port keeps its status.
			results[port] = checkResult{local: true, err: err}
			if ep := p.lookupEndpoint(addr); ep != nil {
				in.l.localError(ep, err)
			}
		}
	}
	return results, true
}

// judgeLocked turns a check of port into its readiness and reports
// whether that changed; a port that turns ready for the first time, or
// after nothing listened, gets a new epoch. in.mu is held.
func (in *ingress) judgeLocked(port uint16, r checkResult) (changed bool) {
	old, pc := in.status[port], in.checks[port]
	if pc == nil {
		return false // a reload removed it meanwhile
	}
	ready := old.Ready
	switch {
	case r.local || in.draining:
		return false
	case r.ok:
		pc.failures = 0
		ready = true
	case r.refused:
		pc.refused = true
		in.memo.sawRefused(port)
		ready = false
	case r.err != nil:
		pc.failures++
		ready = ready && pc.failures < checkFailuresForNotReady
	default: // the detector holds it out
		ready = false
	}
	if ready == old.Ready {
		return false
	}
	ns := mesh.PortStatus{Ready: ready, Epoch: old.Epoch}
	if ready {
		ns.Epoch = in.memo.readyEpoch(port, pc.refused)
		pc.refused = false
	}
	in.status[port] = ns
	in.l.log.Info().Str("local", in.addr(port)).Bool("ready", ready).
		AnErr("cause", r.err).Msg("mesh ingress: local port readiness changed; announced to the peers")
	return true
}

// shrinkStreams drops the empty receive buffers of the streams the
// ingress's links read (yamux keeps them otherwise).
func (in *ingress) shrinkStreams() {
	for _, lk := range in.l.snapshotLinks() {
		if sc, ok := lk.client.(*streamClient); ok {
			sc.s.Shrink()
		}
	}
}

// shrinker runs shrinkStreams whenever the checker asks, after each
// check, on a goroutine of its own: Shrink may wait for a whole data
// frame to arrive (yamux's receive loop holds the stream's lock for the
// frame's body, for good on a path dark mid-frame, until the session's
// heartbeat closes it), and the port checks must not wait for that. It
// runs at the checks' pace (check_interval), and one Shrink blocked so
// holds up the others' for up to ping_timeout: both only keep empty
// buffers a while longer.
func (in *ingress) shrinker() {
	defer in.wg.Done()
	for {
		select {
		case <-in.stop:
			return
		case <-in.shrink:
			in.shrinkStreams()
		}
	}
}

// drain announces every port not ready and tells every peer (GoAway) that
// no new stream is taken: the listener stopped accepting, and its links
// finish or are cut at the drain's end.
//
// It does not wait for the GoAways to be written: yamux refuses new
// streams from the call on, and the frame waits behind what the session
// queued before it, for as long as a congested path takes (or until the
// session closes: the heartbeat's verdict, or close at the drain's end).
// Each waits on a goroutine of the ingress's.
func (in *ingress) drain() {
	in.mu.Lock()
	if in.draining {
		in.mu.Unlock()
		return
	}
	in.draining = true
	for port, st := range in.status {
		in.status[port] = mesh.PortStatus{Epoch: st.Epoch}
	}
	in.gen = in.memo.gen.Add(1)
	var ss []*ingressSession
	if !in.closed { // close waits for in.wg: no Add after it
		ss = slices.Collect(maps.Keys(in.sessions))
		in.wg.Add(len(ss))
	}
	in.mu.Unlock()
	for _, is := range ss {
		is.notify()
		go func() {
			defer in.wg.Done()
			if hook := testHookGoAway.Load(); hook != nil {
				(*hook)()
			}
			_ = is.Sess.GoAway()
		}()
	}
}

// testHookGoAway, when set (by a test), runs on the goroutine that sends
// a drain's GoAway, before it: a test holds it there to open a stream in
// the moment the scheduler may leave between the drain and yamux's own
// refusal, which the GoAway call starts.
var testHookGoAway atomic.Pointer[func()]

func (is *ingressSession) notify() {
	select {
	case is.changed <- struct{}{}:
	default:
	}
}

func (in *ingress) snapshot() mesh.StatusMsg {
	in.mu.Lock()
	defer in.mu.Unlock()
	m := mesh.StatusMsg{Boot: in.boot, Gen: in.gen, Ports: make(map[uint16]mesh.PortStatus, len(in.status))}
	for k, v := range in.status {
		m.Ports[k] = v
	}
	return m
}

// maxHandshakes bounds the connections waiting for their handshake on
// one ingress: one more is reset at once.
const maxHandshakes = 128

// serveConn takes an accepted connection: its handshake and session run
// in a goroutine of the ingress.
func (in *ingress) serveConn(tc *net.TCPConn) {
	if in.handshakes.Add(1) > maxHandshakes {
		in.handshakes.Add(-1)
		in.l.p.metrics.MeshLimits(metrics.MeshIngress, mesh.LimitHandshakes).Inc()
		resetConn(tc)
		return
	}
	in.mu.Lock()
	if in.closed {
		in.mu.Unlock()
		in.handshakes.Add(-1)
		resetConn(tc)
		return
	}
	in.pending[tc] = struct{}{}
	in.wg.Add(1)
	in.mu.Unlock()
	go func() {
		defer in.wg.Done()
		in.handshake(tc)
	}()
}

// limits is the ingress's stream limits, defaults applied.
func (in *ingress) limits() (perSession, total int) {
	c := in.l.spec().cfg.Ingress.OrDefaults()
	return c.MaxStreamsPerSession, c.MaxStreams
}

// sessionLimits is the ingress's session limits, defaults applied.
func (in *ingress) sessionLimits() (perPeer, total int) {
	c := in.l.spec().cfg.Ingress.OrDefaults()
	return c.MaxSessionsPerPeer, c.MaxSessions
}

// allowed reports whether the peer at addr may hold sessions
// (ingress.allow).
func (in *ingress) allowed(addr net.Addr) bool {
	allow := in.l.spec().cfg.Ingress.Allow
	if len(allow) == 0 {
		return true
	}
	ap, err := netip.ParseAddrPort(addr.String())
	if err != nil {
		return false
	}
	for _, a := range allow {
		if p, err := policy.ParseAllow(a); err == nil && p.Contains(ap.Addr().Unmap()) {
			return true
		}
	}
	return false
}

// handshake reads the egress's preface, answers it, and turns the
// connection into a session: a peer that is not allowed, over its
// sessions, or of another version is answered so and closed.
func (in *ingress) handshake(tc *net.TCPConn) {
	h := &ingressHandshake{tc: tc, c: tc, log: in.l.log.With().Str("mesh_peer", tc.RemoteAddr().String()).Logger()}
	h.s = in.l.spec().settings
	h.m = h.s.Mesh.OrDefaults()
	preface, ok := in.readPreface(h)
	if !ok {
		return
	}
	host, perSession, ok := in.admitPeer(h, preface)
	if !ok {
		return
	}
	in.startSession(h, host, perSession)
}

// ingressHandshake is what the steps of one connection's handshake share.
type ingressHandshake struct {
	tc  *net.TCPConn
	c   net.Conn        // tc, or the TLS connection over it
	s   policy.Settings // the listener's, as the handshake began
	m   policy.Mesh     // s.Mesh, defaults applied
	log zerolog.Logger
}

// readPreface runs the TLS handshake (mesh.tls) and reads the egress's
// preface, within mesh.HeaderTimeout; the handshake then counts as ended
// (handshakeDone). A connection whose TLS handshake fails is closed, one
// without a livenessproxy preface is reset: ok is false then.
func (in *ingress) readPreface(h *ingressHandshake) (b [mesh.PrefaceLen]byte, ok bool) {
	tc := h.tc
	_ = tc.SetDeadline(time.Now().Add(mesh.HeaderTimeout))
	if h.m.TLS.Enabled() {
		t := mesh.TLSServer(tc, in.l.p.meshCertsFor(h.m.TLS).ServerConfig(h.m.TLS.Peers.List()))
		if err := t.Handshake(); err != nil {
			if errors.Is(err, mesh.ErrOwnTLS) {
				// This sidecar's own files are not usable (logged at
				// error, naming the file, by mesh.Certs): its own
				// failure, not counted against the peer. The egress read
				// an internal_error alert.
				h.log.Debug().Err(err).Msg("mesh TLS handshake failed for this sidecar's own files: connection closed")
			} else {
				in.l.p.metrics.MeshLimits(metrics.MeshIngress, mesh.LimitTLS).Inc()
				h.log.Debug().Err(err).Msg("mesh TLS handshake failed: connection closed") // at debug: a peer could flood the log
			}
			in.handshakeDone(tc)
			_ = tc.Close() // not reset: the egress reads the alert that says why
			return b, false
		}
		h.c = t
	}
	_, err := io.ReadFull(h.c, b[:])
	in.handshakeDone(tc)
	if err != nil || string(b[:len(mesh.PrefaceMagic)]) != mesh.PrefaceMagic {
		// At debug: a peer could flood the log.
		h.log.Debug().AnErr("cause", err).Msg("mesh connection without a livenessproxy preface (or a TLS handshake that failed): closed")
		resetConn(tc)
		return b, false
	}
	return b, true
}

// refusedLog is the log event for a session refused at its handshake: at
// warn at most once a second for the ingress (with the refusals since the
// line before), at debug otherwise. A peer can send the 8-byte preface in
// a loop; mesh_limits_total counts the refusals for a limit.
func (in *ingress) refusedLog(h *ingressHandshake) *zerolog.Event {
	if n, ok := in.refusals.pass(); ok {
		return h.log.Warn().Int64("refusals_since_last_line", n)
	}
	return h.log.Debug()
}

// admitPeer answers the preface: a peer that is not in ingress.allow,
// speaks another version or holds max_sessions_per_peer sessions, or one
// that comes while the ingress holds max_sessions, is refused; one that
// comes while the ingress closes is reset. Once
// admitted, the peer's session is counted (forgetPeer undoes it), the
// answer says how many streams the session may hold, and the handshake's
// deadline is cleared; ok is false if any of it failed.
func (in *ingress) admitPeer(h *ingressHandshake, preface [mesh.PrefaceLen]byte) (host string, perSession int, ok bool) {
	tc := h.tc
	perSession, _ = in.limits()
	if !in.allowed(tc.RemoteAddr()) {
		in.refusedLog(h).Msg("mesh session refused: the peer is not in ingress.allow")
		in.refuse(h, mesh.Refused, mesh.LimitPeerNotAllowed)
		return "", 0, false
	}
	if preface[len(mesh.PrefaceMagic)] != mesh.Version {
		in.refusedLog(h).Int("version", int(preface[len(mesh.PrefaceMagic)])).Msg("mesh session refused: the peer speaks another mesh protocol version")
		in.refuse(h, mesh.BadVersion, "")
		return "", 0, false
	}
	host = tc.RemoteAddr().(*net.TCPAddr).IP.String()
	if !in.countSession(h, host) {
		return "", 0, false
	}
	_, err := h.c.Write(mesh.Reply(mesh.OK, perSession))
	_ = tc.SetDeadline(time.Time{})
	if err != nil {
		in.forgetPeer(host)
		resetConn(tc)
		return "", 0, false
	}
	return host, perSession, true
}

// countSession counts a session of the peer at host, unless the peer
// holds max_sessions_per_peer or the ingress max_sessions (the session is
// refused) or the ingress closed (it is reset): false then. The peer is
// its IP address alone: a peer's source ports are its own to choose.
func (in *ingress) countSession(h *ingressHandshake, host string) bool {
	perPeer, total := in.sessionLimits()
	in.mu.Lock()
	if in.closed {
		in.mu.Unlock()
		resetConn(h.tc)
		return false
	}
	held, all := in.perPeer[host], in.admitted
	if held < perPeer && all < total {
		in.perPeer[host]++
		in.admitted++
		in.mu.Unlock()
		return true
	}
	in.mu.Unlock()
	if held >= perPeer {
		in.refusedLog(h).Int("max_sessions_per_peer", perPeer).Msg("mesh session refused: the peer holds as many sessions as it may")
		in.refuse(h, mesh.Refused, mesh.LimitSessionsPerPeer)
		return false
	}
	in.refusedLog(h).Int("max_sessions", total).Msg("mesh session refused: the ingress holds as many sessions as it may")
	in.refuse(h, mesh.Refused, mesh.LimitSessions)
	return false
}

// refuse answers the preface with code, counts limit (if not empty) and
// closes the connection.
func (in *ingress) refuse(h *ingressHandshake, code byte, limit string) {
	if limit != "" {
		in.l.p.metrics.MeshLimits(metrics.MeshIngress, limit).Inc()
	}
	_ = h.tc.SetWriteDeadline(time.Now().Add(time.Second))
	_, _ = h.c.Write(mesh.Reply(code, 0))
	_ = h.tc.Close()
}

// startSession makes the admitted peer's connection a yamux session that
// takes at most perSession streams, and starts its stream accept loop and
// its status writer; a session the ingress cannot keep (it failed to
// start, or the ingress closed meanwhile) is not counted for the peer.
func (in *ingress) startSession(h *ingressHandshake, host string, perSession int) {
	is := &ingressSession{changed: make(chan struct{}, 1), host: host}
	var sess atomic.Pointer[yamux.Session]
	admit := func() bool {
		// NumStreams counts the status stream too once it is open:
		// statusOpen is set with the open, under statusMu (writeStatus),
		// so the count of the peer's streams is exact whichever came
		// first. (The egress opens none before the status stream has
		// reached it; an egress that does finds them counted all the
		// same.)
		is.statusMu.Lock()
		defer is.statusMu.Unlock()
		if se := sess.Load(); se != nil && se.NumStreams()-int(is.statusOpen.Load()) >= perSession {
			in.l.p.metrics.MeshLimits(metrics.MeshIngress, mesh.LimitStreamsPerSession).Inc()
			return false
		}
		return true
	}
	// No yamux close timer here (hc 0): the session outlives reloads that
	// change the listener's half_close_timeout, which its links follow,
	// and a timer armed from the old one could end a stream first,
	// passing a clean end on. The links' own timers reset the streams.
	ms, err := mesh.NewSession(h.tc, h.c, false, metrics.MeshIngress, h.m, h.log, in.l.p.metrics, mesh.Hooks{},
		mesh.Admission{Admit: admit, Streams: perSession})
	if err != nil {
		in.forgetPeer(host)
		resetConn(h.tc)
		return
	}
	sess.Store(ms.Sess)
	is.Session = ms
	in.mu.Lock()
	if in.closed {
		in.mu.Unlock()
		in.forgetPeer(host)
		ms.Close()
		return
	}
	in.sessions[is] = struct{}{}
	in.mu.Unlock()
	in.wg.Add(2)
	go in.acceptStreams(is)
	go in.writeStatus(is)
}

// handshakeDone counts tc's handshake as ended.
func (in *ingress) handshakeDone(tc *net.TCPConn) {
	in.handshakes.Add(-1)
	in.mu.Lock()
	delete(in.pending, tc)
	in.mu.Unlock()
}

// forgetPeer counts one session of host less.
func (in *ingress) forgetPeer(host string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.admitted--
	if in.perPeer[host]--; in.perPeer[host] <= 0 {
		delete(in.perPeer, host)
	}
}

// mesh.WriteStatus opens the status stream and sends the status at once and
// on every change, until the session ends.
func (in *ingress) writeStatus(is *ingressSession) {
	defer in.wg.Done()
	if hook := testHookIngressStatus.Load(); hook != nil {
		(*hook)()
	}
	st, err := in.openStatus(is)
	if err != nil {
		return
	}
	defer st.Close()
	in.wg.Add(1)
	go in.guardStatus(is, st)
	select {
	case <-in.checked: // no status before the ports were checked once
	case <-is.Sess.CloseChan():
		return
	}
	for {
		if err := mesh.WriteStatus(st, in.snapshot()); err != nil {
			_ = is.Sess.Close() // a session that cannot carry its status is no use
			return
		}
		select {
		case <-is.changed:
		case <-is.Sess.CloseChan():
			return
		}
	}
}

// openStatus opens the session's status stream and counts it open
// (statusOpen), as one step for the admission of the peer's streams
// (startSession's admit waits for it): a stream of the peer's that
// arrives meanwhile is judged with the status stream counted or not, as
// yamux counts it. The open waits for its frame to be written: the
// session's send queue, empty this early (an egress opens no stream
// before the status stream has reached it); yamux's write timeout does
// not bound it (noWriteTimeout), the session's end does. The admission
// does not wait otherwise.
func (in *ingress) openStatus(is *ingressSession) (*yamux.Stream, error) {
	is.statusMu.Lock()
	defer is.statusMu.Unlock()
	st, err := is.Sess.OpenStream()
	if err == nil {
		is.statusOpen.Store(1)
	}
	return st, err
}

// testHookIngressStatus, when set (by a test), runs before the ingress
// opens a session's status stream: a test holds it back, as a busy
// ingress does, which nothing on a loopback socket can be made to do.
var testHookIngressStatus atomic.Pointer[func()]

// guardStatus reads the status stream the ingress opened, on which the
// egress sends nothing (it closes its side at the session's end). Unread,
// what a peer pushed into it anyway would sit in yamux's buffer, up to
// the stream's window and twice that in memory, for the session's life
// and outside every bound: a session that sends a byte on it does not
// speak this protocol and is closed.
func (in *ingress) guardStatus(is *ingressSession, st *yamux.Stream) {
	defer in.wg.Done()
	var b [1]byte
	if n, _ := st.Read(b[:]); n > 0 {
		in.l.log.Warn().Str("mesh_peer", is.Conn.RemoteAddr().String()).
			Msg("mesh peer sent bytes on the status stream, which carries none its way: session closed")
		_ = is.Sess.Close()
	}
}

// acceptStreams serves the session's streams until it ends, then forgets
// the session and waits for its heartbeat.
func (in *ingress) acceptStreams(is *ingressSession) {
	defer in.wg.Done()
	defer func() {
		in.mu.Lock()
		delete(in.sessions, is)
		in.mu.Unlock()
		in.forgetPeer(is.host)
		is.Close()
	}()
	for {
		st, err := is.Sess.AcceptStream()
		if err != nil {
			return
		}
		in.mu.Lock()
		draining := in.draining
		in.mu.Unlock()
		if draining {
			// Its GoAway may not be out yet (drain sends it on a
			// goroutine): no new stream all the same.
			is.RefuseStream(st)
			continue
		}
		in.wg.Add(1)
		go in.serveStream(is, st)
	}
}

// serveStream takes a max_links slot for a stream the peer opened, reads
// its header and proxies it to the local port it names, as a link of the
// listener. A port the ingress does not serve is refused: it is not an
// open relay.
//
// The stream counts against ingress.max_streams from its accept (this
// goroutine starts at it) until it ends. A stream refused (past a limit,
// a bad header, a port not served) is reset, which frees it in yamux at
// once: closed, it would stay half-open for half_close_timeout with what
// the peer pushed into its window.
//
// The slot (the process's and the listener's) is taken at the accept,
// before the header is read, and given back at once if the stream does
// not become a link, else when the link ends (linkEnded). yamux grants
// the peer the stream's whole window (mesh.stream_window) at the accept
// and buffers what arrives, up to twice the window (meshWindowGrowth),
// whether or not anything reads it; the derived max_links plans each
// slot for that (Limits.linkMemory). A stream waiting for its header
// holds less than the header (it comes first), but its goroutine and
// yamux's state for it (about 8 KiB) all the same: counted from the
// header on, streams that never send one were bounded only by
// ingress.max_streams (9,900 of them measured 75 MiB). One that never
// sends it holds its slot for mesh.HeaderTimeout at most (headerWaits
// of them while the links' data keeps arriving: headerReader), and
// while a listener waits for a slot of the process's new streams are
// refused (linkSlots.take). At the limit a stream is refused (takeSlot), not
// made to wait as a TCP listener's connection waits in the accept queue.
func (in *ingress) serveStream(is *ingressSession, st *yamux.Stream) {
	defer in.wg.Done()
	l := in.l
	l.m.LinksTotal.Inc()
	if _, total := in.limits(); in.streams.Add(1) > int64(total) {
		in.streams.Add(-1)
		l.p.metrics.MeshLimits(metrics.MeshIngress, mesh.LimitStreams).Inc()
		l.log.Debug().Int("max_streams", total).Str("mesh_peer", is.Conn.RemoteAddr().String()).
			Msg("mesh stream refused: the ingress carries as many streams as it may")
		is.RefuseStream(st)
		l.m.Closed(string(CloseCapacity))
		return
	}
	// release ends the stream's count: here if no link takes the stream,
	// else at its client's Close.
	release := func() { in.streams.Add(-1) }
	if !in.takeSlot(is, st) {
		release()
		return
	}
	ep := in.streamEndpoint(is, st)
	if ep == nil {
		l.p.slots.release(l)
		release()
		return
	}
	sc := &streamClient{s: st, ms: is.Session, remote: is.Conn.RemoteAddr(), done: release}
	lk := newLink(l, ep, sc)
	lk.slot = true // linkEnded gives it back
	if !l.track(lk) {
		_ = sc.Close()
		l.p.slots.release(l)
		return
	}
	l.serveLink(lk)
}

// streamEndpoint reads st's header (see headerReader) and returns the
// endpoint of the local port it names; a bad header, a port the ingress
// does not serve or one without an endpoint refuses st (a reset, counted
// in link_closes_total): nil then.
func (in *ingress) streamEndpoint(is *ingressSession, st *yamux.Stream) *endpoint {
	l := in.l
	port, err := mesh.ReadHeader(newHeaderReader(is, st))
	_ = st.SetReadDeadline(time.Time{})
	if err != nil || !in.serves(port) {
		// At debug: a peer could flood the log. link_closes_total counts it.
		l.log.Debug().AnErr("cause", err).Int("port", int(port)).Str("mesh_peer", is.Conn.RemoteAddr().String()).
			Msg("mesh stream refused: bad header or a port this ingress does not serve")
		is.RefuseStream(st)
		l.m.Closed(string(CloseNoMatch))
		return nil
	}
	ep := l.p.lookupEndpoint(in.addr(port))
	if ep == nil {
		is.RefuseStream(st)
		l.m.Closed(string(CloseRefused))
	}
	return ep
}

// headerReader reads a new stream's header within mesh.HeaderTimeout,
// a wait that starts again when it runs out while the links' data has
// kept arriving on the session since the last look (peerQueue): the
// stream's open (its SYN) and its header are two frames, each waiting
// its turn in the egress's send queue, and on a session congested by
// uploads the header comes a round of that queue after the open (which
// the egress's own wait does not count against the link, sendQueue).
// The renewals end headerWaits waits after the stream's accept: a peer
// that keeps sending data and never the header does not hold the
// stream's slot for ever.
type headerReader struct {
	st  *yamux.Stream
	pq  *peerQueue
	got int64 // the header's bytes read: the stream's own, no other link's
}

// headerWaits bounds an ingress's wait for a stream's header: at most
// this many mesh.HeaderTimeout in all.
const headerWaits = 5

func newHeaderReader(is *ingressSession, st *yamux.Stream) *headerReader {
	_ = st.SetReadDeadline(time.Now().Add(mesh.HeaderTimeout))
	r := &headerReader{st: st}
	// A part of the header is not the queue moving.
	r.pq = newPeerQueue(func() int64 { return is.LinkBytesIn() - r.got }, headerWaits*mesh.HeaderTimeout)
	return r
}

func (r *headerReader) Read(p []byte) (int, error) {
	for {
		n, err := r.st.Read(p)
		r.got += int64(n)
		if n > 0 || !deadlinePassed(err) || !r.pq.restart() {
			return n, err
		}
		_ = r.st.SetReadDeadline(time.Now().Add(min(mesh.HeaderTimeout, time.Duration(r.pq.until-flow.Mono()))))
	}
}

// maxRefusingStreams bounds the streams refused at max_links that wait
// for their header before their reset (takeSlot), on one ingress: one
// more is reset at once.
const maxRefusingStreams = 128

// takeSlot takes a max_links slot for st, or refuses st (a reset,
// counted as a capacity close and in mesh_limits_total{limit="links"})
// when the process or the listener is at its max_links, or another
// listener waits for a slot of the process's (linkSlots.take).
//
// A refused stream is reset once its header has arrived (within
// mesh.HeaderTimeout), as when the slot was taken after it: a reset that
// overtook the egress's write of the header would fail the write, which
// an egress before refusedAtHeader took for a session that cannot open
// streams and retired (seen in TestMeshIngressStreamsTakeMaxLinksSlots:
// a fifth attempt, on a new session); one since takes it for the
// refusal it is. What the stream holds meanwhile is less than its
// header; at most maxRefusingStreams wait so, one more is reset at once.
//
// Refused rather than waiting for a slot: the egress reads a reset
// before its acknowledgement as the peer sidecar not reaching its
// server (errMeshRefused), tries its next endpoint (this one again when
// it has no other) after its connect backoff and holds nothing against
// the server, as for a stream past max_streams; a sidecar full of links
// sends the link to a replica with room instead of queuing it behind
// this one. A waiting stream would hold a goroutine and its yamux stream
// for a time the ingress cannot tie to the egress's own connect budget
// (it cannot see the egress give up and reset the stream meanwhile, and
// would then dial the server for a link already gone).
func (in *ingress) takeSlot(is *ingressSession, st *yamux.Stream) bool {
	l := in.l
	if l.p.slots.take(l) {
		return true
	}
	l.p.metrics.MeshLimits(metrics.MeshIngress, mesh.LimitLinks).Inc()
	l.log.Debug().Int("listener_max_links", l.spec().cfg.MaxLinks).Str("mesh_peer", is.Conn.RemoteAddr().String()).
		Msg("mesh stream refused: the process or the listener holds max_links links, or another listener waits for a slot")
	if in.refusing.Add(1) <= maxRefusingStreams {
		_ = st.SetReadDeadline(time.Now().Add(mesh.HeaderTimeout))
		_, _ = mesh.ReadHeader(st)
	}
	in.refusing.Add(-1)
	l.m.Closed(string(CloseCapacity)) // counted first: whoever sees the reset finds it counted
	is.RefuseStream(st)
	return false
}
