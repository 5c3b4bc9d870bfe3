package proxy

import (
	"cmp"
	"errors"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/yamux"
	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/kafkawire"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// LinkStats describes a link that ended. It is what the debug log line
// carries and what Options.OnLinkEnd receives.
type LinkStats struct {
	Listener  string
	Client    string
	Upstream  string
	Reason    CloseReason
	Err       error // the error that ended the link, if any
	BytesUp   int64 // client to upstream
	BytesDown int64 // upstream to client
	MaxQueued int64 // the most bytes ever queued toward the upstream
	Opened    time.Time
	Duration  time.Duration
	// ConnectAttempts is how many upstream connects the link made (a
	// pool's failover retries included); ConnectTime how long the one that
	// succeeded took (0: none did).
	ConnectAttempts int
	ConnectTime     time.Duration
}

// link is one client connection paired with one upstream connection.
//
// Goroutines: start (the caller's) dials and starts pumpRequests and
// pumpResponses; pumpRequests starts writeUpstream when bytes must queue.
// Every goroutine ends once both connections are closed, which abort
// guarantees, and the last one to end finishes the link.
type link struct {
	l        *listener
	ep       *endpoint       // set at accept (transparent) or when the dial succeeds (pool)
	settings policy.Settings // the listener's settings when the link opened
	frames   *frameSpec      // the listener's framing when the link opened; nil: opaque
	failOpen bool            // the listener's pool.fail_open or group_fail_open when the link opened
	slot     bool            // holds a max_links slot of l (given back when it ends)
	dialer   *net.Dialer
	client   clientSide
	upstream *net.TCPConn
	upRaw    syscall.RawConn
	// stream replaces upstream for a link through the mesh (egress side):
	// a stream on meshSess, opened under the peer's meshEpoch.
	stream    *yamux.Stream
	meshSess  *egressSession
	meshEpoch uint64
	// fromUpstream reads the upstream only when it is readable (the
	// response pump owns it; a TCP client has its own).
	fromUpstream sockReader
	// win keeps TCP_USER_TIMEOUT off a zero window whose peer answers
	// (see windowGuard); nil without tcp_user_timeout.
	win    *windowGuard
	opened time.Time
	dialed dialRecord // what the dial did (accesslog.go)

	// connMu orders the dial's assignment of upstream against closeBoth
	// called from another goroutine (eviction, shutdown) during the dial.
	connMu sync.Mutex
	closed bool

	q queue
	// batch and toWrite are the writer's views of queued bytes, kept here
	// so that a batch costs no allocation.
	batch, toWrite net.Buffers
	// live counts the link's goroutines: the two pumps and, once started,
	// writeUpstream. The writer starts on the first byte the kernel does
	// not take at once: most request/response links never need it. The
	// last to end finishes the link.
	live atomic.Int32

	// rawP, rawN, rawErr and rawWriteFn carry tryWrite's arguments so the
	// per-write callback is allocated once per link, not once per write.
	rawP       []byte
	rawN       int
	rawErr     error
	rawWriteFn func(fd uintptr) bool

	// What requests.handle leaves for pumpRequests to do outside the read
	// (see sockReader.readEach): a chunk it began to send, of which the
	// kernel took reqSent bytes (with reqBegun).
	reqSent  int32
	reqBegun bool
	readAny  bool // the request pump has read bytes before

	bytesUp   atomic.Int64
	bytesDown atomic.Int64

	// acked is the stream offset the upstream had acknowledged at the last
	// sample, and ackedAt (mono) when a sample last saw it move: progress
	// is what the upstream acknowledged, not what the kernel took.
	acked   atomic.Int64
	ackedAt atomic.Int64
	// overflowStalled: the link overflowed its high watermark while the
	// upstream acknowledged nothing for write_timeout.
	overflowStalled atomic.Bool

	// Framed mode with tracking: frame boundaries in each direction (each
	// pump owns its own; it drops it when the link stops being tracked).
	// nil: opaque, or not tracked.
	reqScan, respScan *frameScanner
	// trk follows requests and judges them; nil when tracking is off.
	trk *tracker
	// conv is what the pumps share about the protocol; nil unless reqScan
	// was set.
	conv *conv

	reason    atomic.Pointer[CloseReason] // first reason that ended the link
	endErr    atomic.Pointer[error]
	closeOnce sync.Once

	finMu     sync.Mutex
	fins      int         // directions whose FIN has been passed on
	firstFin  CloseReason // reason if the link ends cleanly
	halfTimer *time.Timer
}

// newLink returns a link for a client connection. ep is the endpoint of a
// transparent listener's link; a pool listener's link picks one when it
// dials (nil here).
func newLink(l *listener, ep *endpoint, client clientSide) *link {
	t := l.spec()
	lk := &link{l: l, ep: ep, settings: t.settings, frames: t.frames, failOpen: t.failOpen || t.groupFailOpen, dialer: t.dialer,
		client: client, opened: time.Now()}
	lk.q.init(&l.p.budget)
	lk.rawWriteFn = func(fd uintptr) bool {
		lk.rawN, lk.rawErr = syscall.Write(int(fd), lk.rawP)
		return true
	}
	return lk
}

// requests and responses are a link as the chunkSink of its request and
// response pumps (a pointer conversion: nothing is allocated).
type (
	requests  link
	responses link
)

func (s *requests) limit() int { return (*link)(s).requestLimit() }

func (*responses) limit() int { return chunkSize }

// start dials the upstream and starts the link's pumps; it reports false
// when the link ended at its dial. The goroutine that dialled returns
// then: the dial's deep call chain grew its stack, and a link that idles
// for hours should not keep that stack. The last of the link's goroutines
// to end accounts for the link (see exit).
func (lk *link) start() bool {
	if !lk.dial() {
		return false
	}
	if err := lk.client.upstreamConnected(); err != nil {
		lk.abort(CloseClientError, err)
		return false
	}
	lk.live.Store(2)
	if lk.stream != nil {
		go lk.meshResponsesOwned()
		go lk.meshRequestsOwned()
		return true
	}
	go lk.pumpResponsesOwned()
	go lk.pumpRequestsOwned()
	return true
}

// exit ends one of the link's goroutines; the last one finishes the link.
func (lk *link) exit() {
	if lk.live.Add(-1) == 0 {
		lk.l.linkEnded(lk, lk.finish())
	}
}

// finish releases what the link holds once its goroutines have ended.
func (lk *link) finish() LinkStats {
	lk.closeBoth()
	if lk.l.p.transparent.Load() && lk.upstream != nil {
		lk.l.p.ownUp.Delete(lk.upstream.LocalAddr().String())
	}
	if lk.meshSess != nil {
		lk.meshSess.remove(lk)
	}
	lk.win.stop()
	if lk.trk != nil {
		orphans := lk.trk.stop()
		if lk.conv != nil && lk.conv.profile && lk.clientEnded() {
			// Under a protocol profile every request carries its own
			// deadline and clients wait at least that long: one that closes
			// first abandons its requests, which can no longer be answered.
			orphans = nil
		}
		if len(orphans) > 0 {
			since := lk.ep.readmitted.Load()
			orphans = slices.DeleteFunc(orphans, func(r pendingRequest) bool { return r.at <= since })
			lk.ep.orphans.adopt(orphans)
		}
	}
	lk.q.release()
	lk.finMu.Lock()
	if lk.halfTimer != nil {
		lk.halfTimer.Stop()
	}
	lk.finMu.Unlock()
	return lk.stats()
}

// attach makes ep the link's endpoint once its dial succeeded: its
// requests are tracked against ep's answers, and ep's registry holds it
// for eviction (a transparent link is registered at accept).
func (lk *link) attach(ep *endpoint) {
	lk.ep = ep
	if u := lk.settings.Unanswered; u.Enabled(lk.settings.Framing.Type) {
		if lk.frames != nil {
			lk.reqScan, lk.respScan = newFrameScanner(lk.frames), newFrameScanner(lk.frames)
		}
		lk.trk = newTracker(judgingSlack(u.RequestTimeout.D()), lk.reqScan == nil, &ep.lastAnswer, lk.judge)
		if lk.reqScan != nil {
			lk.conv = newConv(lk)
		}
	}
	if lk.l.pool != nil {
		ep.add(lk)
	}
}

// connectBackoff is the pause before the n-th retry of a link's connect:
// short, since each retry goes to another endpoint.
func connectBackoff(n int) time.Duration {
	return min(25*time.Millisecond<<(n-1), 200*time.Millisecond)
}

// dial connects the link's upstream. A pool listener's link makes up to
// connect_attempts attempts, each to the next endpoint in the balance
// order and never to the one that just failed while another can serve;
// every refusal or timeout is reported to the detector at once. A
// transparent link's destination is fixed: one attempt.
func (lk *link) dial() bool {
	attempts := max(lk.settings.ConnectAttempts, 1)
	if lk.l.pool == nil {
		attempts = 1
	}
	var avoid string
	var lastErr error
	for i := range attempts {
		if i > 0 {
			select {
			case <-time.After(connectBackoff(i)):
			case <-lk.l.ctx.Done():
			}
		}
		ep, failOpen := lk.ep, false
		if lk.l.pool == nil {
			// A transparent destination let through while excluded: its
			// group is failing open (group_fail_open).
			st, _ := lk.l.p.det.State(ep.addr)
			failOpen = st == health.Excluded
		} else {
			if ep, failOpen = lk.l.pool.pick(avoid); ep == nil {
				break // nothing eligible is left
			}
		}
		lk.dialed.try(ep)
		start, began := time.Now(), mono()
		var c net.Conn
		var err error
		direct := true
		if mport := lk.meshPortFor(ep); mport != 0 {
			var st *yamux.Stream
			var es *egressSession
			st, es, err = lk.openMesh(ep, mport)
			switch {
			case err == nil:
				lk.countDial(start, failOpen)
				return lk.meshConnected(ep, st, es)
			case errors.Is(err, errNoIngress) && lk.settings.Mesh.OrDefaults().Fallback == policy.MeshFallbackDirect:
				lk.meshFallback(ep, mport, err)
			case errors.Is(err, errNoIngress):
				lk.setReason(CloseRefused, err)
				lk.resetClient()
				return false
			case errors.Is(err, errMeshRefused):
				// The peer sidecar judges its server and says so in its
				// status; this endpoint is not reported, the next is tried.
				lk.l.m.DialErrors.Inc()
				avoid, lastErr = ep.addr, err
				continue
			case errors.Is(err, errMeshDead):
				lk.setReason(CloseMeshDead, err)
				lk.resetClient()
				return false
			case errors.Is(err, errMeshStream):
				lk.setReason(CloseUpstreamError, err)
				lk.resetClient()
				return false
			default:
				direct = false
			}
		}
		if direct {
			c, err = lk.dialer.DialContext(lk.l.ctx, "tcp", ep.dial)
		}
		if err != nil && lk.l.ctx.Err() != nil {
			// The proxy is shutting down: not the upstream's fault.
			lk.setReason(CloseShutdown, err)
			lk.resetClient()
			return false
		}
		if err != nil && !upstreamFault(err) {
			// Out of descriptors, a socket option refused: the proxy's own
			// failure, never the upstream's; another endpoint would not help.
			lk.setReason(CloseLocalError, err)
			lk.l.localError(ep, err)
			lk.resetClient()
			return false
		}
		if err != nil {
			lk.l.m.DialErrors.Inc()
			if ep.dialFailed(began, cmp.Or(lk.settings.ConnectTimeout.D(), time.Second), err) {
				lk.l.p.report(ep, CloseDialError)
			} else {
				lk.l.log.Debug().Err(err).Str("endpoint", ep.addr).
					Msg("connect failed; not held against the endpoint (it answers on other links, or one timeout a lost SYN explains)")
			}
			avoid, lastErr = ep.addr, err
			continue
		}
		ep.dialSucceeded()
		lk.countDial(start, failOpen)
		return lk.connected(ep, c.(*net.TCPConn))
	}
	// Reset rather than close: to a client whose own failure detector
	// treats a completed close as a live server, a reset looks like the
	// refused connection it stands for.
	if lastErr != nil {
		lk.setReason(CloseDialError, lastErr)
	} else {
		lk.setReason(CloseRefused, nil)
	}
	lk.resetClient()
	return false
}

// countDial counts a successful dial that started at start, and a link
// sent to an excluded endpoint because its pool or group fails open.
func (lk *link) countDial(start time.Time, failOpen bool) {
	took := time.Since(start)
	lk.dialed.connect.Store(int64(took))
	lk.l.m.DialDuration.Observe(took.Seconds())
	if failOpen && lk.failOpen {
		lk.l.m.FailOpenLinks.Inc()
	}
}

// connected takes over a dialled upstream connection.
func (lk *link) connected(ep *endpoint, up *net.TCPConn) bool {
	raw, err := up.SyscallConn()
	if err == nil {
		err = lk.fromUpstream.init(up)
	}
	if err != nil {
		_ = up.Close()
		lk.attach(ep)
		lk.fail(err)
		return false
	}
	if lk.l.p.transparent.Load() {
		lk.l.p.ownUp.Store(up.LocalAddr().String(), struct{}{})
	}
	lk.ackedAt.Store(mono()) // progress is measured from the connect on
	lk.attach(ep)
	lk.connMu.Lock()
	lk.upstream, lk.upRaw = up, raw
	closed := lk.closed
	lk.connMu.Unlock()
	if closed {
		// Aborted while dialling: the reason is already set.
		lk.l.p.ownUp.Delete(up.LocalAddr().String())
		_ = up.SetLinger(0)
		_ = up.Close()
		return false
	}
	lk.win = newWindowGuard(lk, lk.settings.TCPUserTimeout.D())
	return true
}

// pumpRequests reads the client for as long as the link lives and hands
// the bytes to the upstream: directly when nothing is queued and the
// kernel takes them at once (requests.handle, inside the read), through the
// queue otherwise (here, outside it: the queue may wait, or close the
// link).
func (lk *link) pumpRequests() {
	high := int64(lk.settings.WriteBuffer.HighWaterMark)
	for {
		if lk.backpressure() {
			if _, ok := lk.q.waitForRoom(high, int64(lk.settings.WriteBuffer.LowWaterMark)); !ok {
				return
			}
		}
		bp, n, err, werr := lk.client.readEach((*requests)(lk))
		if werr != nil {
			lk.fail(werr)
			return
		}
		if n > 0 {
			buf := (*bp)[:n]
			if lk.reqBegun {
				// requests.handle counted and recorded these bytes, and the
				// kernel took reqSent of them.
				buf = buf[int(lk.reqSent):]
				lk.reqBegun, lk.reqSent = false, 0
			} else {
				lk.l.p.budget.reading(int64(cap(*bp)))
				lk.countRequest(buf)
			}
			sent := lk.send(buf, high) // copies what it queues
			lk.l.p.budget.reading(-int64(cap(*bp)))
			putChunk(bp)
			if !sent {
				return
			}
			continue
		}
		if err == nil {
			continue // no room below the high watermark, or the queue closed
		}
		if errors.Is(err, io.EOF) {
			if lk.reqScan != nil && !lk.conv.off.Load() && lk.reqScan.midFrame() {
				lk.badFrame("request", errTruncated)
				return
			}
			lk.sawFin(CloseClientClosed)
			if lk.q.endOfInput() {
				return // the writer passes the FIN on after the queued bytes
			}
			// No writer means nothing was ever queued: pass it on now.
			if cerr := lk.passFin(lk.upstream.CloseWrite); cerr != nil {
				lk.fail(cerr)
			}
		} else {
			lk.abort(CloseClientError, err)
		}
		return
	}
}

// backpressure: the request pump reads no more than the room below the
// high watermark, unless reject is asked for ("" in a Config built in
// code is the default, backpressure).
func (lk *link) backpressure() bool {
	return lk.settings.WriteBuffer.HighWaterMark > 0 && lk.settings.WriteBuffer.OnOverflow != policy.OverflowReject
}

// requestLimit is how many bytes the request pump may read now: a chunk,
// or under backpressure the room below the high watermark (0 when there
// is none or the queue is closed: the pump then waits outside the read).
func (lk *link) requestLimit() int {
	if !lk.backpressure() {
		return chunkSize
	}
	room, open := lk.q.room(int64(lk.settings.WriteBuffer.HighWaterMark))
	if !open {
		return 0
	}
	return int(min(room, chunkSize))
}

// countRequest counts and records the requests in buf, bytes just read
// from the client. Recorded before the bytes go out, so that no answer
// can arrive before its request is known. Timed from now, not from the
// accept: the upstream could not answer before the connection to it
// existed, so a slow dial is no evidence against it.
func (lk *link) countRequest(buf []byte) {
	end := lk.bytesUp.Add(int64(len(buf)))
	if lk.trk != nil {
		lk.recordRequests(buf, mono(), end, !lk.readAny)
	}
	lk.readAny = true
}

// handle is the request pump's readEach handler: with nothing queued it
// writes the chunk to the upstream without waiting. Whatever would have
// to wait or close the link (a queue in use, a partial write, an error)
// is left to pumpRequests. (A method of requests itself, not a wrapper:
// a frame less on the pump's stack.)
func (s *requests) handle(bp *[]byte, n int) (handled, error) {
	lk := (*link)(s)
	if !lk.readAny && lk.conv != nil {
		// The first bytes of a profiled link are checked for TLS, which
		// may register the endpoint's probe anew: outside the read.
		return handledKeep, nil
	}
	if empty, open := lk.q.idle(); !empty || !open {
		return handledKeep, nil
	}
	buf := (*bp)[:n]
	lk.l.p.budget.reading(int64(cap(*bp)))
	lk.countRequest(buf)
	lk.win.arm() // bytes may wait for the upstream in the kernel: watch its window (see send)
	w, err := lk.tryWrite(buf)
	if err == nil && w < n {
		lk.reqBegun, lk.reqSent = true, int32(w) // the rest is queued by pumpRequests
		return handledKeep, nil
	}
	lk.l.p.budget.reading(-int64(cap(*bp)))
	if err != nil {
		return handledStop, err
	}
	return handledMore, nil
}

// recordRequests scans p, the bytes of one read from the client ending at
// stream offset end and handed on at mono time at, and records the
// requests in them. The first read of a link is checked for a TLS
// handshake record, which any length framing would misread as a length of
// hundreds of megabytes (the check is the same whatever the protocol).
func (lk *link) recordRequests(p []byte, at, end int64, first bool) {
	c := lk.conv
	if c == nil {
		// Opaque: a request is a burst of bytes, due within request_timeout.
		lk.trk.sent(pendingRequest{at: at, due: at + int64(lk.settings.Unanswered.RequestTimeout), end: end, n: 1,
			thr: int32(lk.settings.Unanswered.ConsecutiveTimeoutsThreshold)})
		return
	}
	if lk.reqScan == nil || c.off.Load() {
		lk.reqScan = nil // no longer tracked: nothing more is recorded
		return
	}
	if first && kafkawire.LooksLikeTLS(p) {
		c.untrack(metrics.UntrackedTLS, nil)
		lk.reqScan = nil
		return
	}
	c.sendAt = at
	_, ends, err := lk.reqScan.scan(p)
	if err != nil {
		c.untrack(metrics.UntrackedLimit, err)
		lk.reqScan = nil
		return
	}
	if ends > 0 && lk.reqScan.rd == nil {
		c.frames(ends, end)
	}
}

// send hands p to the upstream. It reports false when the link has ended.
func (lk *link) send(p []byte, high int64) bool {
	empty, open := lk.q.idle()
	if !open {
		return false
	}
	lk.win.arm() // bytes will wait for the upstream: watch its window
	if empty {
		// Nothing queued and nothing being written: try the kernel directly
		// and queue only what it does not take. This keeps the common case
		// free of a goroutine hand-off.
		n, err := lk.tryWrite(p)
		if err != nil {
			lk.fail(err)
			return false
		}
		if n == len(p) {
			return true
		}
		p = p[n:]
	}
	r := lk.q.push(p, high)
	if r == pushBudget {
		// The process's budget is full: wait for room, unless this link's
		// own upstream makes no progress (see budget).
		r = lk.waitForBudget(p, high)
	}
	switch r {
	case pushClosed:
		return false
	case pushStalled:
		lk.budgetClose()
		return false
	case pushOverflow:
		// Only reachable with on_overflow: reject; backpressure never reads
		// more than the room left. The link is closed: it cannot keep its
		// memory bound otherwise. The upstream is blamed only with evidence
		// that it stopped: nothing acknowledged for write_timeout. A client
		// that writes faster than a live server reads is not a dead server.
		lk.l.m.WatermarkRejections.Inc()
		lk.overflowStalled.Store(lk.stalled(lk.settings.WriteTimeout.D()))
		lk.abort(CloseWatermark, nil)
		return false
	case pushedStartWriter:
		lk.live.Add(1) // the request pump is live: the count cannot reach 0 meanwhile
		go lk.writeUpstreamOwned()
	}
	return true
}

func (lk *link) writeUpstreamOwned() {
	defer lk.exit()
	lk.writeUpstream()
}

func (lk *link) pumpResponsesOwned() {
	defer lk.exit()
	lk.pumpResponses()
}

func (lk *link) pumpRequestsOwned() {
	defer lk.exit()
	lk.pumpRequests()
}

// tryWrite writes p to the upstream without waiting: it returns what the
// kernel accepted at once (possibly 0).
func (lk *link) tryWrite(p []byte) (int, error) {
	lk.rawP = p
	werr := lk.upRaw.Write(lk.rawWriteFn)
	n, err := lk.rawN, lk.rawErr
	lk.rawP, lk.rawErr = nil, nil
	if werr != nil {
		return 0, werr
	}
	if err == syscall.EAGAIN || err == syscall.EINTR {
		return 0, nil
	}
	if n < 0 {
		n = 0
	}
	return n, err
}

// writeUpstream drains the queue into the upstream with a write deadline.
func (lk *link) writeUpstream() {
	wt := lk.settings.WriteTimeout.D()
	low := int64(lk.settings.WriteBuffer.LowWaterMark)
	for {
		step, queued := lk.q.next()
		switch step {
		case stopWriting:
			return
		case passFin:
			if err := lk.passFin(lk.upstream.CloseWrite); err != nil {
				lk.fail(err)
			}
			return
		}
		// The pump adds to bytesUp before it pushes: the oldest queued byte
		// is at this stream offset or later.
		head := lk.bytesUp.Load() - queued
		if lk.conv != nil {
			// A request past its deadline is never written, even in the
			// moment before the tracker's timer judges it.
			if overdue := lk.trk.overdueEnd(mono()); overdue > head {
				lk.dropStale(1)
				return
			}
		}
		var handed int
		lk.batch, handed = lk.q.batch(lk.batch[:0])
		if wt > 0 {
			lk.progressed()
			_ = lk.upstream.SetWriteDeadline(time.Now().Add(wt))
		}
		lk.toWrite = lk.batch
		n, err := lk.toWrite.WriteTo(lk.upstream)
		lk.toWrite = nil

		lk.q.consume(int(n), handed, low)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				if p, known := lk.progressed(); p || !known && n > 0 || lk.conv != nil && lk.conv.holding(mono()) {
					// The upstream acknowledged bytes within write_timeout:
					// a slow reader, not a stall (the kernel wakes a writer
					// only once a good part of its send buffer is free, so
					// a write can wait longer than any one ACK). Without
					// TCP_INFO, bytes the kernel took stand in. The next
					// batch gets a fresh deadline. A Kafka broker holding
					// a request within its own deadline reads nothing more
					// meanwhile: not a stall either.
					continue
				}
				if lk.abort(CloseWriteTimeout, err) {
					lk.l.m.WriteTimeouts.Inc()
				}
			} else {
				lk.fail(err)
			}
			return
		}
	}
}

// pumpResponses copies the upstream to the client (responses.handle,
// inside the read).
func (lk *link) pumpResponses() {
	_, _, err, werr := lk.fromUpstream.readEach((*responses)(lk))
	if werr != nil {
		lk.abort(CloseClientError, werr)
		return
	}
	if errors.Is(err, io.EOF) {
		if lk.respScan != nil && !lk.conv.off.Load() && lk.respScan.midFrame() {
			lk.badFrame("response", errTruncated)
			return
		}
		lk.passFinToClient()
		return
	}
	lk.fail(err)
}

// handle is the response pump's readEach handler: it passes a chunk read
// from the upstream on to the client. A failed write is left to
// pumpResponses (handledStop).
func (s *responses) handle(bp *[]byte, n int) (handled, error) {
	lk := (*link)(s)
	lk.l.p.budget.reading(int64(cap(*bp)))
	buf := (*bp)[:n]
	lk.bytesDown.Add(int64(n))
	// Any byte from the upstream is an answer: the server is alive (see
	// tracker), for the requests of every link to it, tracked by this
	// listener or not (see also dialFailed).
	lk.ep.answered(mono())
	if lk.trk != nil {
		if lk.respScan != nil {
			if lk.conv.off.Load() {
				lk.respScan = nil
			} else if _, _, ferr := lk.respScan.scan(buf); ferr != nil {
				lk.conv.untrack(metrics.UntrackedLimit, ferr)
				lk.respScan = nil
			}
		}
	}
	_, werr := lk.client.Write(buf)
	lk.l.p.budget.reading(-int64(cap(*bp)))
	if werr != nil {
		return handledStop, werr
	}
	return handledMore, nil
}

// passFinToClient passes the upstream's FIN on to the client.
func (lk *link) passFinToClient() {
	lk.sawFin(CloseUpstreamClosed)
	if cerr := lk.passFin(lk.client.CloseWrite); cerr != nil {
		lk.abort(CloseClientError, cerr)
	}
}

// passFin passes a FIN on with closeWrite (a shutdown), and records it.
// When the other direction has passed its FIN already, this one ends the
// link, and closing both sockets passes the FIN instead of a shutdown
// before the close: the socket it goes to has delivered its own FIN, so
// nothing is left in its receive queue and the close is a FIN, not a
// reset, after whatever the kernel still has to send.
func (lk *link) passFin(closeWrite func() error) error {
	lk.finMu.Lock()
	last := lk.fins == 1 && lk.stream == nil
	lk.finMu.Unlock()
	if last {
		lk.passedFin()
		lk.closeBoth()
		return nil
	}
	if err := closeWrite(); err != nil {
		return err
	}
	lk.passedFin()
	return nil
}

// badFrame ends the link on a frame the proxy cannot follow. It is not a
// server failure: the detector hears nothing of it.
func (lk *link) badFrame(direction string, err error) {
	if lk.abort(CloseBadFrame, err) {
		lk.l.log.Warn().Err(err).Str("direction", direction).Str("endpoint", lk.ep.addr).
			Str("client", lk.client.RemoteAddr().String()).Msg("bad frame: link closed")
	}
}

// judge applies the tracker's verdict on requests whose deadline passed.
// Unanswered ones count toward the endpoint's consecutive threshold. In
// framed mode, a request whose bytes the upstream has not even
// acknowledged by its (entry's) last deadline (still in the queue or the
// kernel's send queue) is stale: the link is reset so that those bytes are
// dropped rather than delivered to a server that recovers later.
func (lk *link) judge(judged []pendingRequest, left int) {
	n, since := lk.trk.unanswered(judged)
	lk.l.p.countUnanswered(lk.ep, lk.l, n, int(judged[0].thr), since)
	if lk.conv == nil {
		return
	}
	var last int64
	frames := left
	for _, r := range judged {
		if r.expired {
			last = max(last, r.end)
			frames += int(r.n)
		}
	}
	if last == 0 {
		return
	}
	if acked, ok := lk.ackedBytes(); ok && last > acked {
		lk.dropStale(frames)
	}
}

func (lk *link) dropStale(frames int) {
	if lk.abort(CloseStale, nil) {
		lk.l.m.StaleFramesDropped.Add(float64(frames))
	}
}

// progressed samples how much of the stream the upstream has acknowledged
// and reports whether that moved since the previous sample (known: false
// when the kernel does not say). The writer samples before each write and
// when a write's deadline passes; the request pump when the queue would
// overflow.
func (lk *link) progressed() (moved, known bool) {
	acked, ok := lk.ackedBytes()
	if !ok {
		return false, false
	}
	for {
		prev := lk.acked.Load()
		if acked <= prev {
			return false, true
		}
		if lk.acked.CompareAndSwap(prev, acked) {
			lk.ackedAt.Store(mono())
			return true, true
		}
	}
}

// stalled reports whether the upstream has acknowledged nothing of this
// link's stream for at least d, as far as the samples tell: the evidence a
// watermark overflow needs before it is held against the upstream.
func (lk *link) stalled(d time.Duration) bool {
	if d <= 0 {
		return false
	}
	moved, known := lk.progressed()
	now := mono()
	if lk.conv != nil && lk.conv.holding(now) {
		return false // a Kafka broker holding a request reads nothing meanwhile
	}
	return known && !moved && now-lk.ackedAt.Load() >= int64(d)
}

// ackedBytes is how many bytes of the stream the upstream has acknowledged.
func (lk *link) ackedBytes() (int64, bool) {
	lk.connMu.Lock()
	raw := lk.upRaw
	lk.connMu.Unlock()
	if raw == nil {
		return 0, false
	}
	return bytesAcked(raw)
}

// sawFin records which side sent FIN first, when it is read: passing it
// on lets the other side answer with its own FIN, which must not win.
func (lk *link) sawFin(reason CloseReason) {
	lk.finMu.Lock()
	defer lk.finMu.Unlock()
	if lk.firstFin == "" {
		lk.firstFin = reason
	}
}

// passedFin records that one direction finished cleanly. The first FIN
// arms half_close_timeout on the other direction.
func (lk *link) passedFin() {
	lk.finMu.Lock()
	defer lk.finMu.Unlock()
	lk.fins++
	if lk.fins == 1 {
		if hc := lk.settings.HalfCloseTimeout.D(); hc > 0 {
			lk.halfTimer = time.AfterFunc(hc, func() {
				lk.abort(CloseHalfCloseTimeout, nil)
			})
		}
		return
	}
	// Both directions done: the pumps are ending on their own.
	lk.setReason(lk.firstFin, nil)
}

// abort ends the link with reason, resetting both sides at once. It
// reports whether this call was the one that decided the reason.
//
// Reset, not FIN, on both sides: the upstream's kernel drops what it still
// holds for this connection instead of retransmitting it for minutes, and
// the client sees a reset where a direct connection would have given one
// (the upstream reset it, or timed out), or where the proxy cut it: a FIN
// would tell the client that a cut-short response was complete. A clean
// end (a FIN read on one side) is passed on as a FIN, not through here.
func (lk *link) abort(reason CloseReason, err error) bool {
	first := lk.setReason(reason, err)
	lk.connMu.Lock()
	if lk.upstream != nil && !lk.closed {
		_ = lk.upstream.SetLinger(0)
	}
	if !lk.closed {
		lk.client.abortive()
		if lk.stream != nil {
			lk.meshSess.resetStream(lk.stream) // the server behind the peer sidecar sees a reset too
		}
	}
	lk.connMu.Unlock()
	lk.closeBoth()
	return first
}

// resetClient closes the client with a reset where its transport has one.
func (lk *link) resetClient() {
	lk.client.abortive()
	_ = lk.client.Close()
}

func (lk *link) setReason(reason CloseReason, err error) bool {
	if !lk.reason.CompareAndSwap(nil, &reason) {
		return false
	}
	if err != nil {
		lk.endErr.Store(&err)
	}
	return true
}

// closeBoth closes both connections and wakes every goroutine of the link.
// The client goes first: a response pump blocked in a client write inside
// its read of the upstream (responses.handle) holds the upstream's read
// lock, and the upstream's Close waits for that write to give up.
func (lk *link) closeBoth() {
	lk.closeOnce.Do(func() {
		lk.q.close()
		_ = lk.client.Close()
		lk.connMu.Lock()
		lk.closed = true
		up, st := lk.upstream, lk.stream
		lk.connMu.Unlock()
		if up != nil {
			_ = up.Close()
		}
		if st != nil {
			_ = st.Close()                   // the half-close yamux has
			_ = st.SetDeadline(pastDeadline) // wakes the pumps' reads and writes
		}
	})
}

func (lk *link) stats() LinkStats {
	s := LinkStats{
		Listener:  lk.l.cfg.Name,
		Client:    lk.client.RemoteAddr().String(),
		BytesUp:   lk.bytesUp.Load(),
		BytesDown: lk.bytesDown.Load(),
		Opened:    lk.opened,
		Duration:  time.Since(lk.opened),
	}
	s.MaxQueued = lk.q.peak()
	s.ConnectAttempts, s.ConnectTime = int(lk.dialed.attempts.Load()), time.Duration(lk.dialed.connect.Load())
	if lk.ep != nil {
		s.Upstream = lk.ep.dial
	} else if tried := lk.dialed.tried.Load(); tried != nil {
		s.Upstream = *tried // none connected: the one that failed last
	}
	if r := lk.reason.Load(); r != nil {
		s.Reason = CloseReason(*r)
	}
	if e := lk.endErr.Load(); e != nil {
		s.Err = *e
	}
	return s
}

// clientEnded reports whether the client ended the link (a FIN it sent
// first, or an error on its socket).
func (lk *link) clientEnded() bool {
	r := lk.reason.Load()
	return r != nil && (*r == CloseClientClosed || *r == CloseClientError)
}

// fail ends the link on an error of its upstream socket, with the reason
// closeReasonFor gives it; a local error is logged as the proxy's own.
func (lk *link) fail(err error) {
	reason := closeReasonFor(err)
	if lk.abort(reason, err) && reason == CloseLocalError {
		lk.l.localError(lk.ep, err)
	}
}
