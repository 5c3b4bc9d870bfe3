package proxy

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/livenessproxy/livenessproxy/proxy/mesh"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// Detector reasons of the mesh.
const (
	reasonMeshDead     = CloseMeshDead    // the session to the peer sidecar missed its heartbeats
	reasonMeshNotReady = "mesh_not_ready" // the peer sidecar announced the port not ready
)

// meshCertsFor is the shared file set of t.
func (p *Proxy) meshCertsFor(t policy.MeshTLS) *mesh.Certs {
	key := t.CertFile + "\x00" + t.KeyFile + "\x00" + t.CAFile
	p.meshMu.Lock()
	defer p.meshMu.Unlock()
	if p.certs == nil {
		p.certs = make(map[string]*mesh.Certs)
	}
	mc := p.certs[key]
	if mc == nil {
		mc = &mesh.Certs{Files: t, Log: &p.log}
		p.certs[key] = mc
	}
	return mc
}

// noIngressFor is how long a peer whose mesh port refused is reached
// directly (mesh.fallback: direct) before the next link tries the mesh
// port again: a partial rollout does not pay a refused connect per link.
const noIngressFor = 10 * time.Second

// meshPeer is the ingress sidecar on one host, as the egress side sees it:
// the sessions to it and the status it announced.
type meshPeer struct {
	p    *Proxy
	host string
	addr string // host:mesh port

	dialMu sync.Mutex // one session dial at a time

	mu        sync.Mutex
	sessions  []*egressSession
	status    map[uint16]mesh.PortStatus // nil until a session's first message
	boot, gen uint64                     // of the status applied last
	statusCh  chan struct{}              // closed at every status change
	endpoints map[*endpoint]struct{}
	used      atomic.Int64 // mono: when a link or probe last asked for the peer

	noIngressUntil atomic.Int64 // mono; 0: try the mesh port
	fallbackLogged atomic.Bool
}

// egressSession is one session to a peer and the links on it.
type egressSession struct {
	*mesh.Session
	peer *meshPeer
	// key is the settings the session was dialled with: a link takes a
	// session of its own settings only.
	key sessionKey
	// maxStreams is what the ingress lets a session carry (its
	// handshake said).
	maxStreams int
	// mark is the SO_MARK the session's connection was dialled with (0:
	// none): its route lookup's (see excludePeer).
	mark int
	// ownNetwork is set, before the session is closed, when the heartbeat
	// declared it dead while the proxy's host had no route to the peer
	// sidecar: its links end local_error (see deathOf).
	ownNetwork atomic.Bool
	// statusOpen is 1 while the ingress's status stream is open here.
	statusOpen atomic.Int32
	// ready is closed once the status stream is open here, or the
	// session ended without one: dial gives links no session before.
	ready chan struct{}
	mu    sync.Mutex
	links map[*link]struct{}
}

// sessionKey is what a session is dialled with, printed (mesh.tls.peers
// is a slice): the mesh settings, and the options its connection's socket
// gets (flow.UpstreamControl, then MeshSessionUserTimeout): the mark,
// tcp_user_timeout, keepalive, the high-water mark TCP_NOTSENT_LOWAT
// follows. After a reload that changes any, new links go on sessions
// dialled with the new ones; the old ones keep theirs.
type sessionKey string

func newSessionKey(s *policy.Settings) sessionKey {
	return sessionKey(fmt.Sprintf("%+v|mark %d|ut %v|ka %+v|hwm %d|session ut %v", s.Mesh.OrDefaults(), s.UpstreamMark,
		s.TCPUserTimeout, s.Keepalive, s.WriteBuffer.HighWaterMark, s.MeshSessionUserTimeout()))
}

// noteMeshKeysLocked records the session keys of the settings p's
// listeners give new links now. A session of one of them is kept while
// idle: another listener's links, of other settings, do not retire it
// (they would, in turn, each dial a session for a link). One of settings
// that no listener has now (a reload changed them) is retired once idle.
// p.mu is held.
func (p *Proxy) noteMeshKeysLocked() {
	keys := make(map[sessionKey]bool, len(p.listeners))
	for _, l := range p.listeners {
		keys[newSessionKey(&l.spec().settings)] = true
	}
	p.meshKeys.Store(&keys)
}

// idle reports whether the session carries no link.
func (es *egressSession) idle() bool {
	es.mu.Lock()
	defer es.mu.Unlock()
	return len(es.links) == 0
}

// unused reports whether the session carries no link and no stream but
// the status stream: none attached, none still opening (a link's stream
// counts from OpenStream, before the ingress's ack and the attach), none
// that a link gave up. A retired session closes then (mesh.Hooks.Idle).
func (es *egressSession) unused() bool {
	return es.idle() && es.linkStreams() <= 0
}

// linkStreams is the streams the session carries for links: the ones
// this side opened. yamux's NumStreams counts the ingress's status stream
// too, from when its open arrives; a session is given to links only once
// its status stream is open here (dial waits for it), and statusOpen
// counts it until the session ends, so the count is exact whenever the
// status stream and the links' streams came. (Before that, the status
// stream is in NumStreams a moment before statusOpen is set: counted
// once more then, stricter, never laxer.)
func (es *egressSession) linkStreams() int { return es.Sess.NumStreams() - int(es.statusOpen.Load()) }

// full reports whether the session carries as many link streams as the
// ingress takes (its handshake said; the status stream besides).
func (es *egressSession) full() bool { return es.linkStreams() >= es.maxStreams }

// holdsSession reports whether a session to the peer lives (usable, full
// or not): its ingress is there and took this sidecar.
func (pr *meshPeer) holdsSession() bool {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	for _, es := range pr.sessions {
		if es.Usable() {
			return true
		}
	}
	return false
}

// meshPeer returns the peer at host:port, creating it on first use.
func (p *Proxy) meshPeer(host string, port int) *meshPeer {
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	p.meshMu.Lock()
	if p.peers == nil {
		p.peers = make(map[string]*meshPeer)
	}
	var sweep []*meshPeer
	now := flow.Mono()
	pr := p.peers[addr]
	if pr == nil {
		if now-p.peersSwept > int64(peerSweepEvery) {
			p.peersSwept = now
			sweep = slices.Collect(maps.Values(p.peers))
		}
		pr = &meshPeer{p: p, host: host, addr: addr, statusCh: make(chan struct{}), endpoints: make(map[*endpoint]struct{})}
		p.peers[addr] = pr
	}
	pr.used.Store(now)
	p.meshMu.Unlock()
	p.sweepPeers(now, sweep)
	return pr
}

// A peer with no live session that no link or probe asked for in
// peerIdleFor is forgotten (pod addresses churn); peers are swept when a
// new one comes, at most once a peerSweepEvery.
const (
	peerIdleFor    = 5 * time.Minute
	peerSweepEvery = 30 * time.Second
)

// sweepPeers forgets the idle ones of peers and, in the others, the
// endpoints that are no longer the proxy's. It takes each lock alone.
func (p *Proxy) sweepPeers(now int64, peers []*meshPeer) {
	for _, pr := range peers {
		if !pr.dialMu.TryLock() {
			continue // a session is being dialled
		}
		pr.mu.Lock()
		live := slices.ContainsFunc(pr.sessions, func(es *egressSession) bool { return !es.Closed() })
		eps := slices.Collect(maps.Keys(pr.endpoints))
		pr.mu.Unlock()
		pr.dialMu.Unlock()
		if !live && now-pr.used.Load() > int64(peerIdleFor) {
			p.meshMu.Lock()
			if p.peers[pr.addr] == pr {
				delete(p.peers, pr.addr)
			}
			p.meshMu.Unlock()
			continue
		}
		for _, ep := range eps {
			if p.lookupEndpoint(ep.addr) != ep {
				pr.mu.Lock()
				delete(pr.endpoints, ep) // retired
				pr.mu.Unlock()
			}
		}
	}
}

// closeMesh closes every egress session and waits for their goroutines;
// no session opens after it.
func (p *Proxy) closeMesh() {
	p.meshClosed.Store(true)
	p.meshMu.Lock()
	peers := slices.Collect(maps.Values(p.peers))
	p.meshMu.Unlock()
	for _, pr := range peers {
		pr.mu.Lock()
		ss := append([]*egressSession(nil), pr.sessions...)
		pr.sessions = nil
		pr.mu.Unlock()
		for _, es := range ss {
			es.Close()
		}
	}
}

// session returns a live session to the peer, dialled with the same
// settings s (sessionKey), with the fewest streams; it dials one, with
// dialer (whose Control sets s's socket options), when there is none, or
// when every one carries link streams (the status stream is not one) and
// fewer than mesh.sessions exist.
func (pr *meshPeer) session(ctx context.Context, s *policy.Settings, dialer *net.Dialer) (*egressSession, error) {
	key, m := newSessionKey(s), s.Mesh.OrDefaults()
	current := pr.p.meshKeys.Load()
	if current == nil {
		current = new(map[sessionKey]bool) // none known: every other key is retired
	}
	pick := func() (best *egressSession, grow bool) {
		pr.mu.Lock()
		defer pr.mu.Unlock()
		live := pr.sessions[:0]
		for _, es := range pr.sessions {
			if !es.Closed() {
				live = append(live, es) // a retired one stays until it closes: closeMesh owns it
			}
		}
		clear(pr.sessions[len(live):])
		pr.sessions = live
		usable := 0
		for _, es := range live {
			if es.key != key {
				if es.Usable() && es.idle() && !(*current)[es.key] {
					es.Retire("dialled with settings no listener has now, and idle") // a reload changed them
				}
				continue
			}
			if !es.Usable() {
				continue
			}
			usable++
			if !es.full() && (best == nil || es.linkStreams() < best.linkStreams()) {
				best = es
			}
		}
		return best, usable < m.Sessions && (best == nil || best.linkStreams() > 0)
	}
	best, grow := pick()
	if !grow {
		if best == nil {
			return nil, fmt.Errorf("%w: every session to it carries the most streams its ingress takes", mesh.ErrStream)
		}
		return best, nil
	}
	if best != nil && !pr.dialMu.TryLock() {
		return best, nil // another link is adding one already
	} else if best == nil {
		pr.dialMu.Lock()
	}
	defer pr.dialMu.Unlock()
	if best, grow = pick(); !grow {
		if best == nil {
			return nil, fmt.Errorf("%w: every session to it carries the most streams its ingress takes", mesh.ErrStream)
		}
		return best, nil
	}
	es, err := pr.dial(ctx, m, key, dialer, s.UpstreamMark, s.MeshSessionUserTimeout())
	if err != nil {
		if best != nil {
			return best, nil
		}
		return nil, err
	}
	return es, nil
}

// dial opens a session to the peer: the connection, the handshake, then
// yamux. ut, when not 0, is the TCP_USER_TIMEOUT the session gets after
// its connect (policy.Settings.MeshSessionUserTimeout); mark is the
// SO_MARK dialer's Control sets (0: none).
func (pr *meshPeer) dial(ctx context.Context, m policy.Mesh, key sessionKey, dialer *net.Dialer, mark int, ut time.Duration) (*egressSession, error) {
	c, tc, err := pr.connect(ctx, m, dialer, ut)
	if err != nil {
		return nil, err
	}
	c, streams, err := pr.handshake(ctx, m, c, tc, mark)
	if err != nil {
		return nil, err
	}
	es := &egressSession{peer: pr, key: key, maxStreams: streams, mark: mark, ready: make(chan struct{}), links: make(map[*link]struct{})}
	log := pr.p.log.With().Str("mesh_peer", pr.addr).Logger()
	// The ingress opens one stream, the status stream; any other it
	// opens is refused.
	opened := 0
	admit := func() bool { opened++; return opened == 1 }
	set := make(chan struct{})
	ms, err := mesh.NewSession(tc, c, true, metrics.MeshEgress, m, log, pr.p.metrics,
		es.sessionHooks(set), mesh.Admission{Admit: admit, Streams: 1})
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	es.Session = ms
	close(set)
	ms.Wg.Add(1)
	go es.readStatus()
	if err := es.awaitStatus(ctx); err != nil {
		ms.Close()
		return nil, err
	}
	pr.mu.Lock()
	if pr.p.meshClosed.Load() {
		// Shutdown closed the mesh while this one was dialled (a probe's).
		pr.mu.Unlock()
		ms.Close()
		return nil, errors.New("mesh: closed")
	}
	pr.sessions = append(pr.sessions, es)
	pr.mu.Unlock()
	log.Debug().Msg("mesh session opened")
	return es, nil
}

// sessionHooks are es's mesh.Hooks. They run on the session's own
// goroutines, which mesh.NewSession starts before dial sets es.Session,
// which they read: each waits for set, closed once it is set (the
// heartbeat's verdict may come while dial waits for the status stream).
func (es *egressSession) sessionHooks(set <-chan struct{}) mesh.Hooks {
	after := func(f func()) func() { return func() { <-set; f() } }
	return mesh.Hooks{BeforeClose: after(es.excludePeer), AfterClose: after(es.endLinks), Tick: after(es.shrinkStreams),
		Idle: func() bool { <-set; return es.unused() }}
}

// awaitStatus waits for the ingress's status stream to open on the new
// session: it opens it at once after its reply, but until it has arrived
// here NumStreams does not count it, and a link's stream could go on a
// session its ingress holds full (see linkStreams). The wait is the
// link's connect budget (ctx) plus a ping_timeout, as a stream's wait for
// its acknowledgement (awaitAck): a busy ingress that answers its pings
// is waited for, a dead one is found by the heartbeat, which closes the
// session (mesh_dead, its endpoints excluded). A session that closed
// otherwise, or no status stream in that time, is ErrStream: no evidence
// against the server, as a stream that could not open.
func (es *egressSession) awaitStatus(ctx context.Context) error {
	wait := es.Timeout
	if deadline, ok := ctx.Deadline(); ok {
		wait += time.Until(deadline)
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	stop := ctx.Done()
	for done := false; !done; {
		select {
		case <-es.ready:
			done = true
		case <-t.C:
			done = true
		case <-stop:
			if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return ctx.Err() // the proxy is shutting down
			}
			stop = nil // the budget is out: a ping_timeout is left
		}
	}
	switch {
	case es.statusOpen.Load() != 0:
		return nil
	case es.Dead.Load():
		return es.deathErr() // mesh_dead, or local_error (the proxy's own network)
	}
	return fmt.Errorf("%w: %s: the peer sidecar opened no status stream on the new session within the connect budget and a ping_timeout", mesh.ErrStream, es.peer.addr)
}

// handshake runs the session's handshake on c (over tc): TLS if set,
// then the preface and the ingress's reply. It returns the connection the
// session runs on and the streams the ingress lets it carry; on a failure
// tc is closed. The answer is judged as the heartbeat judges a session:
// nothing for ping_timeout of this process's running time (a
// mesh.HandshakeWatch) is a dead peer sidecar (see handshakeFailed).
func (pr *meshPeer) handshake(ctx context.Context, m policy.Mesh, c net.Conn, tc *net.TCPConn, mark int) (net.Conn, int, error) {
	began := flow.Mono()
	watch := mesh.WatchHandshake(tc, m.PingInterval.D(), m.PingTimeout.D())
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(pastDeadline) })
	var err error
	if m.TLS.Enabled() {
		t := mesh.TLSClient(c, pr.p.meshCertsFor(m.TLS).ClientConfig(m.TLS.Peers.List()))
		if err = t.Handshake(); err != nil {
			var ne net.Error
			if (!errors.As(err, &ne) || !ne.Timeout()) && !ownFailure(err) {
				// Not an ingress of this mesh (or one that refused this
				// sidecar's certificate): as a peer without one. Not this
				// sidecar's own files failing since the check above
				// (mesh.ErrOwnTLS, an ownFailure).
				err = fmt.Errorf("%w: TLS handshake: %v", mesh.ErrForeignPeer, err)
			}
		}
		c = t
	}
	streams := 0
	if err == nil {
		if _, err = c.Write(mesh.Preface()); err == nil {
			streams, err = mesh.ReadReply(c)
		}
	}
	stop()
	silent := watch.Stop()
	_ = c.SetDeadline(time.Time{})
	var ne net.Error
	if err != nil && !errors.Is(err, mesh.ErrNoIngress) && !errors.Is(err, mesh.ErrStream) && !(errors.As(err, &ne) && ne.Timeout()) && !ownFailure(err) {
		// The connection broke in the handshake (reset, closed, a TLS
		// alert: under TLS 1.3 the ingress judges this sidecar's
		// certificate after the client's handshake): whatever listens on
		// the mesh port is no ingress that takes this sidecar. Nothing
		// here involved the server. (A write that failed for this
		// process's own want, ENOBUFS say, is its own failure: the link
		// ends local_error, the peer keeps its standing.)
		err = fmt.Errorf("%w: %v", mesh.ErrForeignPeer, err)
	}
	if err != nil {
		_ = tc.Close()
		return nil, 0, pr.handshakeFailed(ctx, m, began, silent, err, tc, mark)
	}
	return c, streams, nil
}

// connect opens the connection a session to the peer runs on: c, over
// the TCP connection tc (c is tc but for testHookMeshHandshake), with
// TCP_USER_TIMEOUT ut where that is not 0.
func (pr *meshPeer) connect(ctx context.Context, m policy.Mesh, dialer *net.Dialer, ut time.Duration) (c net.Conn, tc *net.TCPConn, err error) {
	if m.TLS.Enabled() {
		// This sidecar's own certificate, key or CA not usable is its own
		// failure (mesh.ErrOwnTLS, an ownFailure): the link ends
		// local_error, the peer keeps its standing, and the peer's
		// ingress is not dialled only to see a handshake fail.
		if err := pr.p.meshCertsFor(m.TLS).Check(); err != nil {
			return nil, nil, fmt.Errorf("%s: %w", pr.addr, err)
		}
	}
	c, err = dialer.DialContext(ctx, "tcp", pr.addr)
	if err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) {
			return nil, nil, fmt.Errorf("%w: %s", mesh.ErrNoIngress, pr.addr)
		}
		return nil, nil, err
	}
	tc = c.(*net.TCPConn)
	if ut != 0 {
		// Keepalive's count holds on a session the heartbeat lets idle
		// (see policy.Settings.MeshSessionUserTimeout). A refusal is
		// this process's own failure, never the peer's.
		if err := setConnUserTimeout(tc, ut); err != nil {
			_ = tc.Close()
			return nil, nil, err
		}
	}
	if hook := testHookMeshHandshake.Load(); hook != nil {
		c = (*hook)(c)
	}
	return c, tc, nil
}

// testHookMeshHandshake, when set (by a test), wraps the connection a
// session's handshake (TLS, then the preface) and then its yamux run on:
// a test makes a write fail as for this process's own want (ENOBUFS),
// which nothing on a loopback socket can be made to return.
var testHookMeshHandshake atomic.Pointer[func(net.Conn) net.Conn]

// handshakeFailed is the error of a session handshake begun at mono time
// began that failed with err, tc its connection, dialled with mark.
// silent: its mesh.HandshakeWatch found no answer for ping_timeout, which,
// while the link's connect budget (ctx) lasts, is a dead peer sidecar:
// its endpoints are excluded. That silence is counted in this process's
// running time, as the heartbeat counts it: a stall of this process (CPU
// throttling, a frozen host) that spans the handshake's time is not held
// against the peer, whose answer may have come while this process could
// not read it; after it, the peer has a ping interval of the process's
// running time to be heard. Not a silence either while another session
// to the peer has read from it since the handshake began, nor while the
// proxy's host has no route to the peer sidecar (flow.RouteTo with the
// session's mark, as the heartbeat's verdict asks, see excludePeer): the
// link ends local_error (errOwnNetwork), nothing is excluded. Nor while
// another session to the peer, pinged then, answers within ping_timeout
// or a second, whichever is shorter (sessions of other settings may ping
// further apart than this handshake waits).
func (pr *meshPeer) handshakeFailed(ctx context.Context, m policy.Mesh, began int64, silent bool, err error, tc *net.TCPConn, mark int) error {
	var ne net.Error
	timedOut := errors.As(err, &ne) && ne.Timeout()
	if timedOut && !errors.Is(ctx.Err(), context.Canceled) && pr.heardSince(began) {
		// Another session to the peer sidecar has carried its bytes since
		// this handshake began: the sidecar runs, its ingress did not take
		// this connection in time (its handshakes queued, a TLS handshake
		// starved). No evidence against it or its servers, neither a dead
		// peer nor a connect that timed out: the link goes on that
		// session if it can take it (see session), else fails.
		return fmt.Errorf("%w: %s: no answer to the session handshake, while another session to the peer sidecar carries its bytes", mesh.ErrStream, pr.addr)
	}
	if ctx.Err() != nil || !timedOut || !silent {
		return fmt.Errorf("%s: %w", pr.addr, err)
	}
	dead := fmt.Errorf("%w (%s: no answer to the session handshake)", errMeshDead, pr.addr)
	if noRouteToPeer(tc, mark) {
		pr.p.log.Warn().Str("mesh_peer", pr.addr).Msg("mesh session handshake unanswered for ping_timeout, but the proxy's host has no route to the peer sidecar: its own network; no endpoint behind it is excluded")
		return errOwnNetwork{cause: dead}
	}
	if others := pr.liveSessions(); len(others) > 0 && mesh.AnyAnswers(others, min(m.PingTimeout.D(), time.Second)) {
		// Another session to the peer, quiet since the handshake began
		// (its pings further apart: a session of other settings), answers
		// now: the sidecar runs. As above.
		return fmt.Errorf("%w: %s: no answer to the session handshake, while another session to the peer sidecar answers its ping", mesh.ErrStream, pr.addr)
	}
	pr.p.metrics.MeshSessionDeaths(metrics.MeshEgress).Inc()
	pr.p.log.Warn().Str("mesh_peer", pr.addr).Msg("mesh session dead: the peer sidecar did not answer the session handshake for ping_timeout")
	pr.excludeEndpoints()
	return dead
}

// noRouteToPeer reports whether the proxy's host has no route now for the
// segments of c, a session's connection dialled with mark, to the peer
// sidecar (flow.RouteTo). A lookup that cannot be made says no.
func noRouteToPeer(c *net.TCPConn, mark int) bool {
	var dst netip.AddrPort
	if ra, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		dst = ra.AddrPort()
	}
	route, known := flow.RouteTo(dst, mark)
	return known && !route
}

// liveSessions are the sessions to the peer its heartbeat has not found
// dead, and still open.
func (pr *meshPeer) liveSessions() []*mesh.Session {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	var ss []*mesh.Session
	for _, es := range pr.sessions {
		if !es.Dead.Load() && !es.Closed() {
			ss = append(ss, es.Session)
		}
	}
	return ss
}

// heardSince reports whether a session to the peer has read from it since
// mono time t.
func (pr *meshPeer) heardSince(t int64) bool {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	for _, es := range pr.sessions {
		if es.HeardSince(t) {
			return true
		}
	}
	return false
}

// mesh.ReadStatus reads the status stream the ingress opens and applies each
// message. It ends when the session does.
func (es *egressSession) readStatus() {
	defer es.Wg.Done()
	st, err := es.Sess.AcceptStream()
	if err != nil {
		close(es.ready)
		return
	}
	es.statusOpen.Store(1)
	close(es.ready)
	defer st.Close()
	defer es.statusOpen.Store(0) // before the close: until it, not unused
	for {
		msg, err := mesh.ReadStatus(st)
		if err != nil {
			if errors.Is(err, mesh.ErrBadStatus) {
				es.Log.Warn().Err(err).Msg("mesh peer sent a malformed status: session closed")
				_ = es.Sess.Close()
			}
			return
		}
		es.peer.applyStatus(msg)
	}
}

// applyStatus takes a status message: a port announced ready again gets
// its probe at once (the probe still decides); a port announced not ready is
// excluded at once (new links are refused; the links it still serves are
// kept, see onHealthEvent); a port whose
// epoch changed had its server start afresh, so links opened under the
// old epoch are evicted.
//
// Sessions to one peer carry the same messages, each when its own stream
// delivers it: one that arrives after a newer generation is stale and
// ignored.
func (pr *meshPeer) applyStatus(msg mesh.StatusMsg) {
	pr.mu.Lock()
	if pr.status != nil && !msg.Newer(pr.boot, pr.gen) {
		pr.mu.Unlock()
		return
	}
	old := pr.status
	pr.status, pr.boot, pr.gen = msg.Ports, msg.Boot, msg.Gen
	close(pr.statusCh)
	pr.statusCh = make(chan struct{})
	pr.mu.Unlock()
	for port, ps := range msg.Ports {
		ep := pr.p.lookupEndpoint(net.JoinHostPort(pr.host, strconv.Itoa(int(port))))
		if ep == nil {
			continue
		}
		o, known := old[port]
		switch {
		case !ps.Ready && (!known || o.Ready):
			pr.p.report(ep, reasonMeshNotReady)
		case ps.Ready && known && o.Epoch != ps.Epoch:
			if n := ep.evictMeshEpoch(pr, o.Epoch); n > 0 {
				pr.p.log.Info().Str("endpoint", ep.addr).Int("links_closed", n).Msg("the server behind the peer sidecar started afresh (new epoch): links opened before are evicted")
			}
		}
		if ps.Ready && (!known || !o.Ready) {
			// Back (or announced for the first time): an excluded
			// endpoint is probed now, not when its backoff says.
			pr.p.det.ProbeSoon(ep.addr)
		}
	}
}

// liveSessionOf is a usable session to the peer dialled with settings
// key, full or not, nil if none: a probe opens no stream, and a full
// session's ping and the status it brought are the peer's as well, when
// no session with room can be had (its ingress refused another: under
// mesh.fallback refuse a failed probe, the server excluded for the
// proxy's own accounting). A probe otherwise takes a session as a link
// does (a new one reaches a replaced ingress).
func (pr *meshPeer) liveSessionOf(key sessionKey) *egressSession {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	for _, es := range pr.sessions {
		if es.key == key && es.Usable() {
			return es
		}
	}
	return nil
}

// epochOf is the epoch the peer announced for port, 0 if none yet.
func (pr *meshPeer) epochOf(port uint16) uint64 {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	return pr.status[port].Epoch
}

// probe proves an endpoint behind the peer: a session answers a ping and
// the peer announces the port ready.
func (pr *meshPeer) probe(ctx context.Context, port uint16, s *policy.Settings, dialer *net.Dialer) error {
	es, err := pr.session(ctx, s, dialer)
	if errors.Is(err, mesh.ErrNoIngress) || errors.Is(err, mesh.ErrStream) {
		// Every session full and none more taken (refused, or
		// mesh.sessions reached): a full one serves a probe.
		if full := pr.liveSessionOf(newSessionKey(s)); full != nil {
			es, err = full, nil
		}
	}
	if err != nil {
		return err
	}
	if _, err := es.Sess.Ping(); err != nil {
		return fmt.Errorf("mesh ping: %w", err)
	}
	for {
		pr.mu.Lock()
		ps, ok := pr.status[port]
		ch := pr.statusCh
		pr.mu.Unlock()
		if ok {
			if ps.Ready {
				return nil
			}
			return mesh.ErrPortNotReady
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("mesh: no status from the peer sidecar: %w", ctx.Err())
		}
	}
}

// excludePeer runs when the heartbeat declares the session dead, before
// it is closed: the status it brought is forgotten, and every endpoint
// reached through the peer is excluded; probes dial a new session. Not
// when the proxy's host has no route now for the session's segments to
// the peer sidecar (flow.RouteTo with the session's mark: its route
// removed, its interface down, an unreachable route of its own): the
// heartbeat heard nothing for the proxy's own failure. The links still
// end, they cannot go on, but local_error (ownNetwork), and no endpoint
// is excluded. A lookup that cannot be made leaves the verdict the
// peer's. One lookup per verdict, none per tick.
func (es *egressSession) excludePeer() {
	if noRouteToPeer(es.Conn, es.mark) {
		es.ownNetwork.Store(true)
		es.Log.Warn().Str("peer", es.Conn.RemoteAddr().String()).Msg("mesh session dead, but the proxy's host has no route to the peer sidecar: its own network; no endpoint behind it is excluded, its links end local_error")
		es.peer.forgetStatus()
		return
	}
	es.peer.excludeEndpoints()
}

// excludeEndpoints forgets the peer's status and excludes every endpoint
// reached through it.
func (pr *meshPeer) excludeEndpoints() {
	for _, ep := range pr.forgetStatus() {
		pr.p.report(ep, reasonMeshDead)
	}
}

// forgetStatus forgets the peer's status; it returns the endpoints
// reached through the peer.
func (pr *meshPeer) forgetStatus() []*endpoint {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	pr.status = nil
	return slices.Collect(maps.Keys(pr.endpoints))
}

// shrinkStreams drops the empty receive buffers of the session's streams
// (yamux keeps them otherwise): an idle link then holds no 64 KiB buffer
// in yamux. A busy stream's buffer is rarely empty, and this runs once a
// ping interval, so it does not churn.
//
// It runs on the session's ticker (mesh.Hooks.Tick) and holds no lock
// while it shrinks: Shrink may wait for a whole data frame to arrive.
func (es *egressSession) shrinkStreams() {
	es.mu.Lock()
	sts := make([]*yamux.Stream, 0, len(es.links))
	for lk := range es.links {
		lk.connMu.Lock()
		if e, ok := lk.up.(*meshEnd); ok {
			sts = append(sts, e.st)
		}
		lk.connMu.Unlock()
	}
	es.mu.Unlock()
	for _, st := range sts {
		st.Shrink()
	}
}

// endLinks ends the dead session's links, once it is closed (deathOf).
func (es *egressSession) endLinks() {
	es.mu.Lock()
	links := slices.Collect(maps.Keys(es.links))
	es.mu.Unlock()
	for _, lk := range links {
		lk.abort(es.deathOf(errMeshDead))
	}
}

var errMeshDead = errors.New("mesh: the session to the peer sidecar missed its heartbeats")

// deathOf is how a link on the dead session ends with err: mesh_dead, or
// local_error (errOwnNetwork: it does not unwrap to err) when the proxy's
// host had no route to the peer sidecar at the verdict (see excludePeer).
func (es *egressSession) deathOf(err error) (CloseReason, error) {
	if es.ownNetwork.Load() {
		return CloseLocalError, errOwnNetwork{cause: err}
	}
	return CloseMeshDead, err
}

func (es *egressSession) add(lk *link) bool {
	es.mu.Lock()
	defer es.mu.Unlock()
	if es.Dead.Load() || es.Closed() {
		return false
	}
	es.links[lk] = struct{}{}
	return true
}

func (es *egressSession) remove(lk *link) {
	es.mu.Lock()
	delete(es.links, lk)
	es.mu.Unlock()
}

// evictMeshEpoch evicts ep's links on peer pr opened under epoch (or
// before any epoch was known).
func (ep *endpoint) evictMeshEpoch(pr *meshPeer, epoch uint64) int {
	return ep.evictWhere(func(lk *link) bool {
		lk.connMu.Lock()
		e, _ := lk.up.(*meshEnd)
		lk.connMu.Unlock()
		return e != nil && e.sess.peer == pr && (e.epoch == epoch || e.epoch == 0)
	}, CloseEvicted, metrics.EvictReadmitted)
}

// meshProbe is the detector's probe override for ep: through the mesh
// when ep is reached through it, else not handled (the probe of its
// kind runs). A peer with no ingress sidecar, under fallback direct, is
// probed directly too.
func (ep *endpoint) meshProbe(ctx context.Context, _ string) (bool, error) {
	port := int(ep.meshPort.Load())
	if port == 0 {
		return false, nil
	}
	s := *ep.settings.Load()
	m := s.Mesh.OrDefaults()
	host, eport, err := net.SplitHostPort(ep.dial)
	if err != nil {
		return false, nil
	}
	n, _ := strconv.Atoi(eport)
	pr := ep.p.meshPeer(host, port)
	err = pr.probe(ctx, uint16(n), &s, &net.Dialer{KeepAlive: -1, Control: flow.UpstreamControl(s)})
	if errors.Is(err, mesh.ErrNoIngress) && m.Fallback == policy.MeshFallbackDirect {
		return false, nil
	}
	return true, err
}
