package proxy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/mesh"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/hashicorp/yamux"

	"github.com/livenessproxy/livenessproxy/policy"
)

// meshDialer reaches an endpoint through the ingress sidecar on its host
// (a stream on a session to the peer's mesh port) when the link's
// listener or match entry has a mesh port, and through next otherwise,
// or when the peer has no ingress sidecar and mesh.fallback is direct.
type meshDialer struct{ next dialer }

func (d meshDialer) dial(lk *link, ep *endpoint) (upstreamEnd, error) {
	port := lk.meshPortFor(ep)
	if port == 0 {
		return d.next.dial(lk, ep)
	}
	began := flow.Mono()
	end, err := lk.openMesh(ep, port)
	if errors.Is(err, mesh.ErrNoIngress) && lk.settings.Mesh.OrDefaults().Fallback == policy.MeshFallbackDirect {
		lk.meshFallback(ep, port, err)
		return d.next.dial(lk, ep)
	}
	if err != nil {
		// A session dial that ran out of its time at least that time
		// late is no evidence, as a direct dial's (errFrozenDial).
		return nil, frozenDial(err, began, lk.meshDialTimeout())
	}
	return end, nil
}

// meshPortFor is the mesh port through which the link reaches ep, 0 for
// none: a transparent match entry's own, else the listener's mesh.port.
func (lk *link) meshPortFor(ep *endpoint) int {
	port := lk.host.meshPort(ep, lk.settings.Mesh.Port)
	ep.meshPort.Store(int32(port))
	return port
}

// meshDialTimeout is the time a link gives its stream through the mesh
// to open: connect_timeout, or the mesh's ping_timeout without one.
func (lk *link) meshDialTimeout() time.Duration {
	return cmp.Or(lk.settings.ConnectTimeout.D(), lk.settings.Mesh.OrDefaults().PingTimeout.D())
}

// openMesh opens a stream to ep through the peer sidecar at its mesh port.
func (lk *link) openMesh(ep *endpoint, port int) (*meshEnd, error) {
	host, eport, err := net.SplitHostPort(ep.dial)
	if err != nil {
		return nil, err
	}
	n, err := strconv.Atoi(eport)
	if err != nil {
		return nil, err
	}
	pr := lk.host.meshPeer(host, port)
	m := lk.settings.Mesh.OrDefaults()
	direct := m.Fallback == policy.MeshFallbackDirect
	if until := pr.noIngressUntil.Load(); direct && until != 0 && flow.Mono() < until {
		return nil, mesh.ErrNoIngress
	}
	ctx, cancel := context.WithTimeout(lk.host.dialContext(), lk.meshDialTimeout())
	defer cancel()
	pr.mu.Lock()
	pr.endpoints[ep] = struct{}{} // reached through the peer: excluded with it
	pr.mu.Unlock()
	for try := 0; ; try++ {
		es, err := pr.session(ctx, lk.settings, lk.dialer)
		if errors.Is(err, mesh.ErrNoIngress) {
			if direct && !pr.holdsSession() {
				// A session refused while another lives (full, say)
				// is this link's fallback only: the next takes the
				// live one.
				pr.noIngressUntil.Store(flow.Mono() + int64(noIngressFor))
			}
			return nil, err
		}
		if err != nil {
			return nil, err // the session dial: evidence as any dial's
		}
		pr.noIngressUntil.Store(0)
		queuing := flow.Mono()
		st, err := es.Sess.OpenStream()
		if err == nil {
			if st.StreamID() > mesh.RetireAfterStreams {
				es.Retire("stream ids running out")
			}
			if hook := testHookMeshStreamOpened.Load(); hook != nil {
				(*hook)(es, st)
			}
			if _, err = st.Write(mesh.Header(uint16(n))); err == nil {
				return es.awaitAck(ctx, lk, st, uint16(n), time.Duration(flow.Mono()-queuing))
			}
			es.ResetStream(st)
			if refused := es.refusedAtHeader(err); refused != nil {
				return nil, refused
			}
		}
		// A stream that cannot open on a live session is no evidence
		// against the server: the session is retired, another takes the
		// link.
		if !es.Dead.Load() {
			es.Retire("stream open failed: " + err.Error())
		}
		if try == 1 || ctx.Err() != nil {
			if es.Dead.Load() {
				// The session died while the stream waited in its send
				// queue: the link ends for that, as under awaitAck.
				return nil, es.deathErr()
			}
			return nil, fmt.Errorf("%w: %v", mesh.ErrStream, err)
		}
	}
}

// testHookMeshStreamOpened, when set (by a test), runs between a link's
// stream open and the write of its header: a test holds the write until
// the peer's reset of the stream has arrived (or its session died), an
// order nothing on a loopback socket can be made to take.
var testHookMeshStreamOpened atomic.Pointer[func(*egressSession, *yamux.Stream)]

// errMeshRefused: the peer sidecar could not connect the stream to its
// server (refused, not served, out of routing there). The peer sidecar
// judges its own server and announces it; the egress tries the next
// endpoint without reporting this one.
var errMeshRefused = errors.New("mesh: the peer sidecar could not reach the server")

// refusedAtHeader is errMeshRefused when err, the failed write of a
// stream's header, is the peer's reset of the stream while the session
// lives (the ingress refused the stream before its header arrived: at
// a limit, say), else nil. A reset is that stream's refusal by the peer
// sidecar, as one after the header is (awaitAck), not a session that
// cannot open streams: the link tries its next endpoint, the session,
// which its heartbeat judges, is kept. A session dead or closed is not
// the peer refusing: the write's failure is handled as any other's.
func (es *egressSession) refusedAtHeader(err error) error {
	if !errors.Is(err, yamux.ErrConnectionReset) || es.Dead.Load() || es.Closed() {
		return nil
	}
	return fmt.Errorf("%w (the stream was reset as its header was written: %v)", errMeshRefused, err)
}

// awaitAck waits for the ingress's acknowledgement that it reached the
// server (port, on the peer), within the link's connect budget (ctx) plus
// a ping_timeout for the way there and back, not counting the time the
// stream's open and header spent in this proxy's own send queue: queued,
// the wait in yamux's queue (the SYN and the header are frames behind
// the session's queued bytes; the guard's pings go ahead of them), and
// the wait in the socket's (see sendQueue.restart). That wait is the
// proxy's own on a live session, not the peer's: a peer that dies
// meanwhile is found by the heartbeat, which closes the session and ends
// the wait. The wait also goes on, within a bound, while the ack may
// wait in the peer's send queue (see peerQueue), and ends at once when
// the link's client resets (see clientWatch).
func (es *egressSession) awaitAck(ctx context.Context, lk *link, st *yamux.Stream, port uint16, queued time.Duration) (*meshEnd, error) {
	deadline, _ := ctx.Deadline()
	first := deadline.Add(queued + es.Timeout)
	_ = st.SetReadDeadline(first)
	wait := lk.meshDialTimeout() + es.Timeout
	sq, pq := es.sendQueue(), newPeerQueue(es.LinkBytesIn, time.Until(first)+maxPeerQueueWaits*wait)
	cw := lk.watchClient(st)
	var ack [1]byte
	_, err := io.ReadFull(st, ack[:])
	for deadlinePassed(err) && !cw.gone() {
		next, again := restartAck(sq, pq, wait)
		if !again {
			break
		}
		_ = st.SetReadDeadline(time.Now().Add(next))
		if cw.gone() { // its wake-up may have come before this deadline
			_ = st.SetReadDeadline(pastDeadline)
		}
		_, err = io.ReadFull(st, ack[:])
	}
	cw.stop()
	_ = st.SetReadDeadline(time.Time{})
	if err == nil && ack[0] == mesh.Ack {
		return &meshEnd{lk: lk, st: st, sess: es, port: port}, nil
	}
	// A reset, not a FIN: an ingress whose connect completes later would
	// pass a FIN on to the server as the client's half-close, and the
	// stream, which no link owns, would stay open on both sides.
	es.ResetStream(st)
	_ = st.SetDeadline(pastDeadline)
	if es.Dead.Load() {
		return nil, es.deathErr()
	}
	if es.Closed() {
		return nil, fmt.Errorf("%w: the session closed", mesh.ErrStream)
	}
	if cw.gone() {
		return nil, errClientLeft
	}
	if err == nil {
		err = fmt.Errorf("acknowledgement %d", ack[0])
	}
	return nil, fmt.Errorf("%w (%v)", errMeshRefused, err)
}

// errClientLeft ends a link whose client reset while its stream waited
// for the ack: client_error, nothing held against the endpoint.
var errClientLeft = errors.New("mesh: the client reset the connection while its stream waited for the peer sidecar's acknowledgement")

// clientWatch watches a link's client while its stream waits for the
// ack, which may take several waits on a congested session (restartAck):
// a client that resets meanwhile (its socket closed, flow.PeerReset; a
// FIN is a half-close, after which the link goes on) wakes the wait,
// which ends at once, the stream reset and the ingress's slot given back
// with it; so does the link's abort, which closes the client's socket
// (a shutdown without a drain). It reads nothing: the client's bytes and
// its reset's error stay for the link's reader.
type clientWatch struct {
	sock clientSocket
	left atomic.Bool
	done chan struct{} // the watch's goroutine ended
}

// watchClient starts the watch of lk's client for st's wait; nil (no
// watch) when the client is no socket of the proxy's (an ingress's
// stream).
func (lk *link) watchClient(st *yamux.Stream) *clientWatch {
	c, ok := lk.client.(*tcpClient)
	if !ok || c.raw() != nil {
		return nil
	}
	w := &clientWatch{sock: c.sock, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		// Woken by the socket's every edge (bytes, a FIN, a reset) until
		// stop's past deadline.
		err := c.rc.Read(func(fd uintptr) bool {
			if !flow.PeerReset(fd) {
				return false
			}
			w.wake(st)
			return true
		})
		if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			// Not stop's: the proxy closed the client's socket under
			// the watch, the link aborted (the proxy shutting down
			// without a drain, or its drain's time up): the wait ends
			// as for a reset (the abort's reason stays the link's).
			w.wake(st)
		}
	}()
	return w
}

// wake marks the client gone and wakes st's wait.
func (w *clientWatch) wake(st *yamux.Stream) {
	w.left.Store(true)
	_ = st.SetReadDeadline(pastDeadline)
}

func (w *clientWatch) gone() bool { return w != nil && w.left.Load() }

// stop ends the watch and waits for its goroutine: the link's own reader
// may read the client from then on.
func (w *clientWatch) stop() {
	if w == nil {
		return
	}
	_ = w.sock.SetReadDeadline(pastDeadline)
	<-w.done
	_ = w.sock.SetReadDeadline(time.Time{})
}

// sendQueue is where a stream's header stands in its session's socket:
// it was handed to the kernel when the stream's Write returned, and is
// out once the peer has acknowledged end bytes of the session's stream.
type sendQueue struct {
	raw        syscall.RawConn
	end, acked int64 // acked: at the last look
	known      bool  // the kernel says (Linux); else the header is out at once
	waited     bool  // a look found the header waiting behind bytes that moved
	out        bool  // a look found it out
}

func (es *egressSession) sendQueue() *sendQueue {
	sq := &sendQueue{}
	if raw, err := es.Conn.SyscallConn(); err == nil {
		if d, ok := flow.SampleDelivery(raw); ok {
			*sq = sendQueue{raw: raw, end: d.Acked + d.Queued, acked: d.Acked, known: true}
		}
	}
	return sq
}

// restart looks at the socket when the ack's wait has run out and
// reports whether it starts again: the header still waits behind bytes
// the peer has taken in since the last look (the queue is the proxy's,
// and it moves), or this is the first look to find it out after one
// found it waiting (the ingress has a whole wait from then). A queue
// that did not move for a whole wait is not excused (a peer that sends
// but takes nothing in): the link gives the stream up, as before; so
// does one whose header was out at the first look. A dead peer's
// session is closed by the heartbeat first.
func (sq *sendQueue) restart() bool {
	if !sq.known {
		return false
	}
	d, ok := flow.SampleDelivery(sq.raw)
	switch {
	case !ok:
		return false
	case d.Acked >= sq.end:
		first := sq.waited && !sq.out
		sq.out = true
		return first
	case d.Acked <= sq.acked:
		return false
	}
	sq.acked, sq.waited = d.Acked, true
	return true
}

// restartAck reports whether an ack's wait that ran out starts again,
// and for how long: a whole wait when the stream's frames wait in this
// proxy's send queue (sq), else, when the ack may wait in the peer's
// (pq), a whole wait at most, up to the end of pq's bound. Both look,
// each from its last look.
func restartAck(sq *sendQueue, pq *peerQueue, wait time.Duration) (time.Duration, bool) {
	own, peer := sq.restart(), pq.restart()
	if hook := testHookAckRenewed.Load(); hook != nil && (own || peer) {
		(*hook)(own, peer)
	}
	if !own && peer {
		wait = min(wait, time.Duration(pq.until-flow.Mono()))
	}
	return wait, own || peer
}

// testHookAckRenewed, when set (by a test), runs whenever a link's ack
// wait starts again: own when its frames wait in this proxy's send
// queue, peer when the peer's moves.
var testHookAckRenewed atomic.Pointer[func(own, peer bool)]

// peerQueue is what an ack's wait sees of the peer sidecar's send queue,
// in which the ack, one byte of stream data, waits behind the frames the
// peer queued before it (downloads toward this sidecar): not where the
// ack stands, only whether that queue moves, the links' data arriving
// (mesh.Session.LinkBytesIn: not the pings, whose answers go ahead of
// the queue, nor the status stream). A peer that
// sends no data has no queue the ack could wait in: its ack is judged
// by the old rule. The renewals for it end maxPeerQueueWaits whole
// waits (connect budget plus ping_timeout) after the first wait ran
// out: a peer whose data keeps arriving while its ingress never answers
// (a session busy with downloads, an ingress that cannot reach the
// server and does not say so) is not waited on for ever.
type peerQueue struct {
	in    func() int64
	seen  int64 // at the last look
	until int64 // mono: no renewal from then on
}

// maxPeerQueueWaits bounds the renewals of an ack's wait for the peer's
// send queue: the ack is given up at most this many whole waits after
// the first ran out (unless its own frames still wait in this proxy's
// queue, see sendQueue).
const maxPeerQueueWaits = 3

// newPeerQueue starts watching the peer's queue, whose moving in counts
// (a session's LinkBytesIn); no renewal for it from within on.
func newPeerQueue(in func() int64, within time.Duration) *peerQueue {
	return &peerQueue{in: in, seen: in(), until: flow.Mono() + int64(within)}
}

// restart looks at the session's inbound data when a wait for the peer
// (an ack, at the ingress a header) has run out and reports whether it
// starts again: data arrived since the last look (the peer's queue
// moves, what is awaited may be behind it), within the bound. A dead
// peer's session is closed by the heartbeat first.
func (pq *peerQueue) restart() bool {
	n := pq.in()
	moved := n > pq.seen
	pq.seen = n
	return moved && flow.Mono() < pq.until
}

// deathErr is the dial error of a link whose stream was opening when its
// session was declared dead: mesh_dead, or local_error when the proxy's
// host had no route to the peer sidecar (link.dialFailed).
func (es *egressSession) deathErr() error {
	_, err := es.deathOf(errMeshDead) // the dial's failure carries its reason (link.dialFailed)
	return err
}

// meshFallback counts a link of l that reaches ep directly because its
// host has no ingress sidecar (cause says what the mesh port did), and
// says so once per peer.
func (lk *link) meshFallback(ep *endpoint, port int, cause error) {
	lk.host.meshFallback()
	host, _, _ := net.SplitHostPort(ep.dial)
	if pr := lk.host.meshPeer(host, port); pr.fallbackLogged.CompareAndSwap(false, true) {
		lk.log.Warn().Str("mesh_peer", pr.addr).Str("endpoint", ep.addr).AnErr("cause", cause).
			Msg("no ingress sidecar on the peer that takes this one (mesh port refused, something else answered, TLS refused, or its ingress refused this sidecar's session): its links go directly, with the plain link enforcement (mesh.fallback: direct)")
	}
}

// meshEnd is a link's upstream through the mesh (egress side): a stream
// on sess, to the server at port on the peer's host, opened under the
// peer's epoch of that port. The stream's flow-control window bounds what
// is in flight, so the link needs no queue of its own; the peer sidecar
// enforces the plain link rules on its connection to the server.
type meshEnd struct {
	lk    *link
	st    *yamux.Stream
	sess  *egressSession
	port  uint16
	epoch uint64 // set by attach
}

func (e *meshEnd) attach(ep *endpoint) bool {
	lk := e.lk
	e.epoch = e.sess.peer.epochOf(e.port)
	lk.ep = ep
	open := lk.adopt(e)
	if lk.host.routing() != nil {
		ep.add(lk)
	}
	if !open {
		e.sess.ResetStream(e.st) // the link was aborted during its dial: see awaitAck
		_ = e.st.SetDeadline(pastDeadline)
		return false
	}
	if !e.sess.add(lk) {
		e.fail(errors.New("mesh: the session closed under the open"))
		return false
	}
	return true
}

func (e *meshEnd) run() {
	go e.responsesOwned()
	go e.requestsOwned()
}

// closeWrite half-closes the stream: yamux's Close sends FIN and keeps
// reading.
func (e *meshEnd) closeWrite() error { return e.st.Close() }

func (*meshEnd) finByClose() bool { return false }

// abortive resets the stream at once: the server behind the peer sidecar
// sees a reset too.
func (e *meshEnd) abortive() { e.sess.ResetStream(e.st) }

func (e *meshEnd) close() {
	_ = e.st.Close()                   // the half-close yamux has
	_ = e.st.SetDeadline(pastDeadline) // wakes the pumps' reads and writes
}

func (*meshEnd) acked() (int64, bool) { return 0, false }

func (*meshEnd) received() (n, at int64, ok bool) { return 0, 0, false }

func (*meshEnd) unread() int { return 0 }

func (*meshEnd) delivery() (flow.Delivery, bool) { return flow.Delivery{}, false }

func (*meshEnd) answersUnread() bool { return false }

func (e *meshEnd) release() { e.sess.remove(e.lk) }

func (e *meshEnd) requestsOwned() {
	defer e.lk.exit()
	e.requests()
}

func (e *meshEnd) responsesOwned() {
	defer e.lk.exit()
	e.responses()
}

// requests copies the client to the stream. The stream's flow-control
// window bounds what is in flight: a write waits while the peer's window
// is full, so the client is read no faster than the far side drains.
func (e *meshEnd) requests() {
	lk := e.lk
	for {
		bp, n, err := lk.client.read(flow.ChunkSize)
		if n > 0 {
			lk.budget.Reading(int64(cap(*bp)))
			lk.bytesUp.Add(int64(n))
			_, werr := e.st.Write((*bp)[:n])
			lk.budget.Reading(-int64(cap(*bp)))
			flow.PutChunk(bp)
			if werr != nil {
				e.fail(werr)
				return
			}
			continue
		}
		var fa finAck
		if errors.Is(err, io.EOF) {
			var reset bool
			if reset, fa = lk.clientReset(); reset {
				err = syscall.ECONNRESET // a write took the reset's error (see flow.ResetNotFin)
			}
		}
		if errors.Is(err, io.EOF) {
			lk.sawFin(CloseClientClosed)
			_ = e.closeWrite()
			lk.passedFin(fa)
		} else {
			lk.abort(CloseClientError, err)
		}
		return
	}
}

// responses copies the stream to the client. The end of the stream is
// the server's FIN, passed on as one, unless the session closed: yamux
// ends every stream of a closed session the same way, and a client told
// FIN would take a cut-short response for a whole one.
func (e *meshEnd) responses() {
	lk := e.lk
	var r streamReader
	for {
		bp, n, err := r.read(e.st, flow.ChunkSize)
		if n > 0 {
			lk.budget.Reading(int64(cap(*bp)))
			lk.bytesDown.Add(int64(n))
			_, werr := lk.client.Write((*bp)[:n])
			lk.budget.Reading(-int64(cap(*bp)))
			flow.PutChunk(bp)
			if werr != nil {
				lk.abort(CloseClientError, werr)
				return
			}
			continue
		}
		if errors.Is(err, io.EOF) && !e.sess.Closed() {
			lk.passFinToClient(finAck{})
			return
		}
		e.fail(err)
		return
	}
}

// fail ends a mesh link on a stream error: mesh_dead when its session
// was declared dead, else upstream_error (the stream was reset or its
// session closed).
func (e *meshEnd) fail(err error) {
	if err == nil || errors.Is(err, io.EOF) {
		err = errors.New("mesh: the session to the peer sidecar closed")
	}
	if e.sess.Dead.Load() {
		e.lk.abort(e.sess.deathOf(err))
		return
	}
	e.lk.abort(CloseUpstreamError, err)
}
