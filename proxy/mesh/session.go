package mesh

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/hashicorp/yamux"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// The mesh runs yamux sessions between an egress sidecar (beside the
// client) and an ingress sidecar (beside the server). On top of yamux:
//
//   - A data stream, opened by the egress for one client link, starts with
//     a header: the 4 bytes of meshMagic, then the local port it is for
//     (2 bytes, big-endian). The ingress answers with one byte, Ack,
//     once its link to that port is connected; it ends the stream
//     without it when the port is not served, refused, or out of routing
//     (a stream it does not take, for its header or a limit, is reset).
//   - A status stream, opened by the ingress as soon as the session starts,
//     carries status messages: a 2-byte length, the ingress's boot id and
//     the message's generation (8 bytes each), then for each local port it
//     serves, the port (2 bytes), ready (1 byte) and the port's epoch (8
//     bytes). A message is sent at the start and whenever a port's
//     readiness or epoch changes. Generations grow with every change, so
//     that a message that arrives late on a busy session, after a newer
//     one on another, is known stale.
//
// Before yamux, a session starts with a handshake: the egress sends the
// preface, PrefaceMagic then the protocol version (1 byte); the
// ingress answers with the same magic, its own version, a code (OK,
// Refused: the peer is not allowed or over a limit, BadVersion)
// and the most streams a session may carry (4 bytes, big-endian). A peer
// on the mesh port whose first bytes are not the magic is not an ingress
// (another mesh's port, another server): the egress knows at once and
// falls back as for a refused port.
//
// A port's epoch is random, drawn again whenever the port turns ready
// after being not ready: a new epoch tells the egress that the server
// behind it started afresh, so links opened under the old one are stale.
const (
	meshMagic     = "LPM\x01"
	meshHeaderLen = len(meshMagic) + 2
	Ack           = 1
	// statusEntryLen is one port's entry in a status message, after the
	// boot id and generation (statusHeadLen).
	statusEntryLen = 2 + 1 + 8
	statusHeadLen  = 8 + 8
	// maxStatusPorts bounds a status message (a peer's message is read
	// into memory).
	maxStatusPorts = 1024
	// HeaderTimeout bounds each wait of an ingress for a new stream's
	// header (the ingress starts it again, a bounded number of times,
	// while the links' data keeps arriving on the session).
	HeaderTimeout = 5 * time.Second
)

// The session handshake.
const (
	PrefaceMagic = "LPMESH\x00"
	Version      = 1
	PrefaceLen   = len(PrefaceMagic) + 1
	ReplyLen     = PrefaceLen + 1 + 4
	OK           = 0
	Refused      = 1
	BadVersion   = 2
)

func Preface() []byte { return append([]byte(PrefaceMagic), Version) }

func Reply(code byte, streams int) []byte {
	b := append(Preface(), code)
	return binary.BigEndian.AppendUint32(b, uint32(streams))
}

// ErrForeignPeer: something that is not an ingress answered on the mesh
// port; fallback treats it as ErrNoIngress.
var ErrForeignPeer = fmt.Errorf("%w, or something else answers on it", ErrNoIngress)

// ErrStream: no stream could be opened on a session to the peer. Not
// held against the endpoint: the link ends upstream_error, unreported.
var ErrStream = errors.New("mesh: no stream could be opened to the peer sidecar")

// errSessionRefused: the ingress refused the session (this peer is not
// in its ingress.allow, or one of its session limits is reached). For
// this sidecar that is as good as no ingress (ErrNoIngress): the server
// is not judged by it, and mesh.fallback decides (direct: the links go
// to the server directly for a while, as to a peer without a sidecar;
// refuse: they are refused). A session refused while another to the
// peer lives is not seen here: the link takes the live one.
var errSessionRefused = fmt.Errorf("%w: the peer sidecar refused the session (ingress.allow, or its session limits)", ErrNoIngress)

// ReadReply reads the ingress's answer to the preface from c, byte by
// byte as it arrives, so that a foreign peer is known at its first wrong
// byte. It returns the streams a session may carry.
func ReadReply(c net.Conn) (int, error) {
	var b [ReplyLen]byte
	for n := 0; n < len(b); {
		k, err := c.Read(b[n:])
		for i := n; i < n+k && i < len(PrefaceMagic); i++ {
			if b[i] != PrefaceMagic[i] {
				return 0, fmt.Errorf("%w: its first bytes are %q", ErrForeignPeer, b[:n+k])
			}
		}
		n += k
		if err != nil && n < len(b) {
			if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
				return 0, fmt.Errorf("%w: it closed the connection after %d bytes of an answer (%v)", ErrForeignPeer, n, err)
			}
			return 0, fmt.Errorf("mesh: no answer to the session handshake: %w", err)
		}
	}
	switch ver, code := b[len(PrefaceMagic)], b[PrefaceLen]; {
	case ver != Version || code == BadVersion:
		return 0, fmt.Errorf("%w: it speaks mesh protocol version %d, this sidecar %d", ErrForeignPeer, ver, Version)
	case code == Refused:
		return 0, errSessionRefused
	case code != OK:
		return 0, fmt.Errorf("%w: handshake code %d", errSessionRefused, code)
	}
	return int(binary.BigEndian.Uint32(b[PrefaceLen+1:])), nil
}

var (
	ErrNoIngress    = errors.New("mesh: the peer has no ingress sidecar (connection refused on the mesh port)")
	ErrPortNotReady = errors.New("mesh: the peer sidecar announces the port not ready")
	ErrBadStatus    = errors.New("mesh: malformed status message")
)

// PortStatus is what an ingress announces for one local port.
type PortStatus struct {
	Ready bool
	Epoch uint64
}

// StatusMsg is one status message: the ingress process's boot id, the
// message's generation and the ports.
type StatusMsg struct {
	Boot, Gen uint64
	Ports     map[uint16]PortStatus
}

// Newer reports whether m comes after the message of boot and gen: a
// later generation of the same process, or another process.
func (m StatusMsg) Newer(boot, gen uint64) bool { return m.Boot != boot || m.Gen > gen }

func NewEpoch() uint64 {
	for {
		if e := rand.Uint64(); e != 0 { // 0 stands for "none known"
			return e
		}
	}
}

func Header(port uint16) []byte {
	h := make([]byte, meshHeaderLen)
	copy(h, meshMagic)
	binary.BigEndian.PutUint16(h[len(meshMagic):], port)
	return h
}

// ReadHeader reads a data stream's header and returns its port.
func ReadHeader(r io.Reader) (uint16, error) {
	var h [meshHeaderLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, err
	}
	if string(h[:len(meshMagic)]) != meshMagic {
		return 0, fmt.Errorf("mesh: stream header %q is not a livenessproxy mesh header", h[:len(meshMagic)])
	}
	return binary.BigEndian.Uint16(h[len(meshMagic):]), nil
}

func WriteStatus(w io.Writer, m StatusMsg) error {
	b := make([]byte, 2, 2+statusHeadLen+len(m.Ports)*statusEntryLen)
	binary.BigEndian.PutUint16(b, uint16(statusHeadLen+len(m.Ports)*statusEntryLen))
	b = binary.BigEndian.AppendUint64(b, m.Boot)
	b = binary.BigEndian.AppendUint64(b, m.Gen)
	for port, ps := range m.Ports {
		b = binary.BigEndian.AppendUint16(b, port)
		ready := byte(0)
		if ps.Ready {
			ready = 1
		}
		b = append(b, ready)
		b = binary.BigEndian.AppendUint64(b, ps.Epoch)
	}
	_, err := w.Write(b)
	return err
}

func ReadStatus(r io.Reader) (StatusMsg, error) {
	var lb [2]byte
	if _, err := io.ReadFull(r, lb[:]); err != nil {
		return StatusMsg{}, err
	}
	n := int(binary.BigEndian.Uint16(lb[:]))
	if n < statusHeadLen || (n-statusHeadLen)%statusEntryLen != 0 || (n-statusHeadLen)/statusEntryLen > maxStatusPorts {
		return StatusMsg{}, fmt.Errorf("%w: length %d", ErrBadStatus, n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return StatusMsg{}, err
	}
	m := StatusMsg{Boot: binary.BigEndian.Uint64(b), Gen: binary.BigEndian.Uint64(b[8:]),
		Ports: make(map[uint16]PortStatus, (n-statusHeadLen)/statusEntryLen)}
	for b = b[statusHeadLen:]; len(b) > 0; b = b[statusEntryLen:] {
		m.Ports[binary.BigEndian.Uint16(b)] = PortStatus{Ready: b[2] == 1, Epoch: binary.BigEndian.Uint64(b[3:])}
	}
	return m, nil
}

// yamuxConfig is the session configuration for mesh settings m (with
// defaults applied). yamux's own keepalive is off: the session's
// heartbeat judges it (see Session).
func yamuxConfig(m policy.Mesh, log zerolog.Logger) *yamux.Config {
	c := yamux.DefaultConfig()
	c.EnableKeepAlive = false
	c.KeepAliveInterval = m.PingInterval.D() // unused with keepalive off; must be positive
	// A frame waits in the send queue for as long as the path takes to
	// carry what is ahead of it: on a congested path where bytes keep
	// moving that is no fault, and a write that gave up would lose its
	// frame (a window update, a FIN). The heartbeat judges the session;
	// when it closes it, every waiting write ends.
	c.ConnectionWriteTimeout = noWriteTimeout
	c.MaxStreamWindowSize = uint32(m.StreamWindow)
	// The link's own half-close timer ends a stream one side closed and
	// the other did not, with a reset both ways (Session.ResetStream),
	// never a clean end, once the direction still open has moved no byte
	// for half_close_timeout. yamux's timer is off: it is fixed from
	// the close, and would end a stream whose other direction still
	// streams (an answer that goes on after the client's FIN), closing it
	// as if the peer had ended it.
	c.StreamCloseTimeout = 0
	// The heartbeat alone judges the session: yamux would close it when a
	// stream's open is not acknowledged in time, which a busy peer may be
	// slow to do while it answers every ping.
	c.StreamOpenTimeout = 0
	c.LogOutput = nil
	c.Logger = yamuxLogger{log}
	return c
}

// noWriteTimeout stands for no bound on a frame's time in yamux's send
// queue (yamux needs a duration).
const noWriteTimeout = 100 * 365 * 24 * time.Hour

// yamuxLogger passes yamux's log lines on at debug level: the session's
// owner logs what matters (a dead session, a refused stream) itself.
type yamuxLogger struct{ log zerolog.Logger }

func (l yamuxLogger) Print(v ...any)                 { l.log.Debug().Msg(fmt.Sprint(v...)) }
func (l yamuxLogger) Printf(format string, v ...any) { l.log.Debug().Msgf(format, v...) }
func (l yamuxLogger) Println(v ...any)               { l.log.Debug().Msg(fmt.Sprint(v...)) }

// Session is one yamux session and its heartbeat, on either side.
//
// The heartbeat pings the peer every ping_interval, whether or not the
// last ping was answered, and declares the session dead when nothing at
// all has arrived from the peer for ping_timeout. Data counts as much as
// a ping or its answer. Pings and answers go out ahead of yamux's send
// queue (see meshGuard), and each side pings on its own: on a path
// congested one way, the other way carries the pings that prove the
// peer alive, while the congested way carries data that does. Two guards keep the proxy's own stalls from
// being blamed on the peer: bytes waiting unread in the socket are life,
// and after a stall of this process the peer has a ping interval of its
// running time to be heard (see silence).
type Session struct {
	Sess     *yamux.Session
	Conn     *net.TCPConn
	role     string
	Interval time.Duration
	Timeout  time.Duration
	Log      zerolog.Logger
	m        *metrics.Metrics
	lastRead *atomic.Int64 // mono: when the peer's bytes last arrived (arrivalClock)
	Dead     atomic.Bool
	hooks    Hooks
	// retired: no new stream goes on the session (a stream open failed on
	// it, or its stream IDs are running out); the heartbeat closes it once
	// its last stream has ended.
	retired atomic.Bool

	Guard *meshGuard
	Wg    sync.WaitGroup // the heartbeat, the guard's flusher and the ticker
	tick  chan struct{}  // the heartbeat's word to the ticker (Hooks.Tick)
}

// Hooks are a session owner's parts of the heartbeat; each may be nil.
type Hooks struct {
	// BeforeClose runs once when the heartbeat declares the session dead,
	// before it is closed. It must not block: the exclusions, so that a
	// client whose link ends next finds the endpoint out already.
	BeforeClose func()
	// AfterClose runs once after that (the links on it end).
	AfterClose func()
	// Tick runs once a ping interval, on a goroutine of its own: the
	// owner drops its streams' empty receive buffers. It may block
	// (yamux's Stream.Shrink waits for the stream's receive lock, which
	// yamux's receive loop holds for a whole data frame's body, for ever
	// on a path dark mid-frame): the heartbeat never waits for it, and a
	// closed session unblocks it.
	Tick func()
	// Idle reports whether the session carries no link of the owner's
	// (the status stream does not count): a retired session then closes.
	// nil: when it carries no stream at all.
	Idle func() bool
}

// Admission is how a session takes the streams the peer opens.
type Admission struct {
	// Admit reports whether a stream the peer opens may be taken (see
	// meshGuard); nil takes every one. It runs on yamux's receive loop,
	// and may find the session not yet set.
	Admit func() bool
	// Streams is the most streams the peer may hold on the session (an
	// ingress's handshake tells it): the refusals waiting to be written
	// are bounded by it (see meshGuard).
	Streams int
}

// NewSession wraps conn in a yamux session (client: the egress side)
// and starts its heartbeat. rw is what the session reads and writes:
// conn, or TLS over it (made by TLSClient or TLSServer, so that the
// heartbeat counts the peer's bytes as they arrive). adm says which streams the peer opens are taken.
func NewSession(conn *net.TCPConn, rw net.Conn, client bool, role string, m policy.Mesh, log zerolog.Logger, mt *metrics.Metrics, hooks Hooks, adm Admission) (*Session, error) {
	ms := &Session{Conn: conn, role: role, Interval: m.PingInterval.D(), Timeout: m.PingTimeout.D(), Log: log, m: mt, hooks: hooks,
		lastRead: arrivalClock(rw)}
	ms.lastRead.Store(flow.Mono())
	ms.Guard = newMeshGuard(rw, conn, ms.lastRead, adm, func(limit string) { mt.MeshLimits(role, limit).Inc() })
	cfg := yamuxConfig(m, log)
	var err error
	if client {
		ms.Sess, err = yamux.Client(ms.Guard, cfg)
	} else {
		ms.Sess, err = yamux.Server(ms.Guard, cfg)
	}
	if err != nil {
		return nil, err
	}
	mt.MeshSessions(role).Inc()
	if hooks.Tick != nil {
		ms.tick = make(chan struct{}, 1)
		ms.Wg.Add(1)
		go ms.ticker()
	}
	ms.Wg.Add(2)
	go ms.heartbeat()
	go func() {
		defer ms.Wg.Done()
		ms.Guard.flusher(ms.Sess.CloseChan())
	}()
	return ms, nil
}

// ticker runs Hooks.Tick whenever the heartbeat asks, until the session
// closes.
func (ms *Session) ticker() {
	defer ms.Wg.Done()
	for {
		select {
		case <-ms.Sess.CloseChan():
			return
		case <-ms.tick:
			ms.hooks.Tick()
		}
	}
}

// ResetStream ends st as reset on both sides (see meshGuard): the peer's
// end reads a reset, not the end of the stream.
func (ms *Session) ResetStream(st *yamux.Stream) { ms.Guard.reset(st.StreamID()) }

// RefuseStream ends st, a stream the peer opened that the owner does not
// serve, as ResetStream does; but a peer with as many refusals waiting to
// be written as the bound (see meshGuard) has its session closed instead:
// it opens streams and does not read. On a closed session it does
// nothing: the streams its end failed are no refusals.
func (ms *Session) RefuseStream(st *yamux.Stream) {
	if ms.Sess.IsClosed() {
		return
	}
	if !ms.Guard.refuse(st.StreamID(), true) {
		_ = ms.Sess.Close()
	}
}

// LinkBytesIn is the count of data bytes that have arrived from the peer
// on the links' streams (not on the status stream, nor the heartbeat's
// pings and their answers, which go ahead of the send queue): it grows
// while the peer's send queue, in which a stream's first bytes (the
// egress's header, the ingress's ack) may wait behind other links' data,
// moves.
func (ms *Session) LinkBytesIn() int64 { return ms.Guard.linkIn.Load() }

// LastHeard is the mono time the peer's bytes last arrived: the
// heartbeat's silence counts from it (a fault on the path takes effect
// here once the bytes already on their way have arrived).
func (ms *Session) LastHeard() int64 { return ms.lastRead.Load() }

// Closed reports whether the session has ended.
func (ms *Session) Closed() bool { return ms.Sess.IsClosed() }

// Close ends the session and waits for its heartbeat.
func (ms *Session) Close() {
	_ = ms.Sess.Close()
	ms.Wg.Wait()
}

func (ms *Session) heartbeat() {
	defer ms.Wg.Done()
	defer ms.m.MeshSessions(ms.role).Dec()
	step := heartbeatStep(ms.Interval, ms.Timeout)
	t := time.NewTicker(step)
	defer t.Stop()
	nextPing, nextTick := int64(0), int64(0)
	sil := silence{grace: int64(ms.Interval)}
	clk := stallClock{step: int64(step), prev: flow.Mono()}
	for {
		select {
		case <-ms.Sess.CloseChan():
			return
		case <-t.C:
		}
		now := flow.Mono()
		if silent := sil.update(now, ms.lastRead.Load(), clk.tick(now)); silent > int64(ms.Timeout) && flow.UnreadBytes(ms.Conn) == 0 {
			ms.DeclareDead(time.Duration(silent))
			return
		}
		if ms.retired.Load() && (ms.Sess.NumStreams() == 0 || ms.hooks.Idle != nil && ms.hooks.Idle()) {
			_ = ms.Sess.Close()
			return
		}
		if ms.tick != nil && now >= nextTick {
			nextTick = now + int64(ms.Interval)
			select {
			case ms.tick <- struct{}{}:
			default: // the last one still runs
			}
		}
		if now >= nextPing {
			nextPing = now + int64(ms.Interval)
			ms.Guard.ping()
		}
	}
}

// heartbeatStep is the heartbeat's tick: a quarter of the ping interval
// (an eighth of ping_timeout if shorter). A dead session is found within
// ping_timeout plus this step (250 ms at the defaults), or, when this
// process could not run meanwhile, a ping interval after it ran again
// (see silence).
func heartbeatStep(interval, timeout time.Duration) time.Duration {
	return min(interval/4, timeout/8)
}

// stallClock tells, tick by tick of a ticker of step, the time this
// process could not run: a tick more than a step late comes after a
// stall (of this process, or of the ticking goroutine) of the time past
// the step. A tick late by less is scheduling noise on a busy machine,
// not counted: it would put off a dead peer's verdict, tick by tick.
type stallClock struct{ step, prev int64 } // mono

// tick takes a tick at now and returns the stall before it.
func (c *stallClock) tick(now int64) (stalled int64) {
	if gap := now - c.prev; gap > 2*c.step {
		stalled = gap - c.step
	}
	c.prev = now
	return stalled
}

// HandshakeWatch judges a session handshake's silence as the heartbeat
// judges a session's (see silence): the peer, of which nothing counts
// until its answer is whole, is silent once timeout of this process's
// running time has passed since the watch began, or, after a stall of
// this process, once it has run for interval since (a peer stalled with
// it gets that long to answer) and the whole time since the watch began
// is past timeout; and no byte of the peer's waits unread in the socket.
// Then the watch sets a past deadline on the connection, which ends the
// handshake's read or write with a timeout. A wall-clock deadline would
// end it at once after a stall that spans it, before the handshake could
// read the answer that came meanwhile (the runtime runs expired timers
// before it polls the network).
type HandshakeWatch struct {
	silent     atomic.Bool
	quit, done chan struct{}
}

// WatchHandshake starts watching the handshake on tc from now. The caller
// must Stop it.
func WatchHandshake(tc *net.TCPConn, interval, timeout time.Duration) *HandshakeWatch {
	w := &HandshakeWatch{quit: make(chan struct{}), done: make(chan struct{})}
	go w.run(tc, interval, timeout)
	return w
}

func (w *HandshakeWatch) run(tc *net.TCPConn, interval, timeout time.Duration) {
	defer close(w.done)
	step := heartbeatStep(interval, timeout)
	t := time.NewTicker(step)
	defer t.Stop()
	began := flow.Mono()
	sil := silence{grace: int64(interval)}
	clk := stallClock{step: int64(step), prev: began}
	for {
		select {
		case <-w.quit:
			return
		case <-t.C:
		}
		now := flow.Mono()
		if sil.update(now, began, clk.tick(now)) > int64(timeout) && flow.UnreadBytes(tc) == 0 {
			w.silent.Store(true)
			_ = tc.SetDeadline(time.Unix(1, 0))
			return
		}
	}
}

// Stop ends the watch and reports whether it found the peer silent (and
// set the past deadline).
func (w *HandshakeWatch) Stop() (silent bool) {
	close(w.quit)
	<-w.done
	return w.silent.Load()
}

// silence is the heartbeat's measure of the peer's silence. Time this
// process could not run (its heartbeat's ticks came late: a CPU throttled
// or starved, a host or VM stalled) is not held against the peer at once:
// a peer stalled with it (sidecars on one host) had no chance to speak,
// and its bytes may wait for this process's reader, which has not run yet
// either (and under TLS, TLS's buffer). After such a stall the silence
// counts only the time this process ran, until it has run for grace (a
// ping interval: a peer that runs is heard within one, its own ping or
// its answer to this side's); from then on the time since the peer was
// last heard counts again. So a peer stalled with this process gets a
// ping interval once both run again, and a dead one is judged no later
// than that after the stall, not a whole ping_timeout of running time
// later; one that stays silent for ping_timeout of this process's running
// time is dead however often it stalls.
type silence struct {
	grace   int64 // mono duration
	heard   int64 // the peer's last arrival seen (mono)
	stalled int64 // time since heard this process could not run
	ran     int64 // when this process ran again after its last stall (mono)
}

// update takes a tick at now: the peer's last arrival and how late the
// tick came, and returns the silence.
func (s *silence) update(now, heard, stalled int64) int64 {
	if heard != s.heard {
		s.heard, s.stalled = heard, 0
	}
	if stalled > 0 {
		s.ran = now
	}
	s.stalled += max(min(stalled, now-heard), 0) // only what came after the peer was heard
	if now-s.ran >= s.grace {
		return now - heard
	}
	return now - heard - s.stalled
}

// DeclareDead has the owner exclude what the session served, closes the
// session (its streams' Close is then a no op, never a wait on a send
// queue stuck behind a dead path), then lets the owner end the links on
// it: every pump that sees the close finds dead set and ends its link
// mesh_dead.
func (ms *Session) DeclareDead(silent time.Duration) {
	ms.Dead.Store(true)
	if ms.hooks.BeforeClose != nil {
		ms.hooks.BeforeClose()
	}
	_ = ms.Sess.Close()
	ms.m.MeshSessionDeaths(ms.role).Inc()
	ms.Log.Warn().Str("peer", ms.Conn.RemoteAddr().String()).Dur("silent_ms", silent).
		Msg("mesh session dead: nothing from the peer sidecar for ping_timeout; its streams are closed")
	if ms.hooks.AfterClose != nil {
		ms.hooks.AfterClose()
	}
}

// Retire takes the session out of use: the peer is told (GoAway) that no
// new stream comes, and the heartbeat closes it when it carries none.
func (ms *Session) Retire(why string) {
	if ms.retired.CompareAndSwap(false, true) {
		_ = ms.Sess.GoAway()
		ms.Log.Info().Str("peer", ms.Conn.RemoteAddr().String()).Str("why", why).Msg("mesh session retired: a new one takes its new links")
	}
}

// HeardSince reports whether the session, still open, has read anything
// from the peer since mono time t: the peer sidecar was running then.
func (ms *Session) HeardSince(t int64) bool {
	return !ms.Dead.Load() && !ms.Sess.IsClosed() && ms.lastRead.Load() >= t
}

// AnyAnswers pings the peer on each of ss (ahead of its send queue, as
// the heartbeat does) and reports whether any of them hears from it
// within d: its answer, or anything else, arriving, or waiting unread in
// the socket. Time this process could not run meanwhile is added to d
// (see answerWait): the answer may wait for it.
func AnyAnswers(ss []*Session, d time.Duration) bool {
	asked := flow.Mono()
	for _, ms := range ss {
		ms.Guard.ping()
	}
	t := time.NewTicker(answerPoll)
	defer t.Stop()
	w := newAnswerWait(asked, d)
	for {
		for _, ms := range ss {
			if ms.HeardSince(asked) || !ms.Dead.Load() && !ms.Sess.IsClosed() && flow.UnreadBytes(ms.Conn) > 0 {
				return true
			}
		}
		if w.over(flow.Mono()) {
			return false
		}
		<-t.C
	}
}

// answerPoll is how often AnyAnswers looks for an answer.
const answerPoll = 5 * time.Millisecond

// answerWait is AnyAnswers' clock: d of this process's running time from
// when it asked. A poll late by less than a quarter of d is scheduling
// noise on a busy machine (a 5 ms poll is often 10 to 30 ms late there),
// not counted as a stall: counted, it would put off a dead peer's verdict
// poll by poll (as stallClock says of the heartbeat's ticks).
type answerWait struct {
	deadline int64 // mono
	clk      stallClock
}

func newAnswerWait(asked int64, d time.Duration) answerWait {
	return answerWait{deadline: asked + int64(d), clk: stallClock{step: int64(max(d/8, answerPoll)), prev: asked}}
}

// over takes a poll at now and reports whether the wait is over.
func (w *answerWait) over(now int64) bool {
	w.deadline += w.clk.tick(now)
	return now >= w.deadline
}

// Usable reports whether new streams may go on the session.
func (ms *Session) Usable() bool {
	return !ms.Dead.Load() && !ms.retired.Load() && !ms.Sess.IsClosed()
}

// RetireAfterStreams retires a session whose stream IDs (31 bits, odd or
// even per side) pass this: yamux cannot open more after 2^31.
const RetireAfterStreams = 1 << 30
