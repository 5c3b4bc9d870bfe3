package proxy

import (
	"errors"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

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
	set      policy.Settings // the listener's settings when the link opened
	frames   *frameSpec      // the listener's framing when the link opened; nil: opaque
	failOpen bool            // the listener's pool.fail_open or group_fail_open when the link opened
	dialer   *net.Dialer
	client   *net.TCPConn
	upstream *net.TCPConn
	upRaw    syscall.RawConn
	// fromClient and fromUpstream read each side only when it is readable
	// (each pump owns one).
	fromClient, fromUpstream sockReader
	opened                   time.Time

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

	reason    atomic.Pointer[string] // first reason that ended the link
	endErr    atomic.Pointer[error]
	closeOnce sync.Once

	finMu     sync.Mutex
	fins      int    // directions whose FIN has been passed on
	firstFin  string // reason if the link ends cleanly
	halfTimer *time.Timer
}

// newLink returns a link for a client connection. ep is the endpoint of a
// transparent listener's link; a pool listener's link picks one when it
// dials (nil here).
func newLink(l *listener, ep *endpoint, client *net.TCPConn) *link {
	t := l.tuning()
	k := &link{l: l, ep: ep, set: t.set, frames: t.frames, failOpen: t.failOpen || t.groupFailOpen, dialer: t.dialer,
		client: client, opened: time.Now()}
	k.q.init()
	k.rawWriteFn = func(fd uintptr) bool {
		k.rawN, k.rawErr = syscall.Write(int(fd), k.rawP)
		return true
	}
	return k
}

// start dials the upstream and starts the link's pumps; it reports false
// when the link ended at its dial. The goroutine that dialled returns
// then: the dial's deep call chain grew its stack, and a link that idles
// for hours should not keep that stack. The last of the link's goroutines
// to end accounts for the link (see exit).
func (k *link) start() bool {
	if !k.dial() {
		return false
	}
	k.live.Store(2)
	go k.pumpResponsesOwned()
	go k.pumpRequestsOwned()
	return true
}

// exit ends one of the link's goroutines; the last one finishes the link.
func (k *link) exit() {
	if k.live.Add(-1) == 0 {
		k.l.linkEnded(k, k.finish())
	}
}

// finish releases what the link holds once its goroutines have ended.
func (k *link) finish() LinkStats {
	k.closeBoth()
	if k.l.p.transparent.Load() {
		k.l.p.ownUp.Delete(k.upstream.LocalAddr().String())
	}
	if k.trk != nil {
		orphans := k.trk.stop()
		if k.conv != nil && k.conv.profile && k.clientEnded() {
			// Under a protocol profile every request carries its own
			// deadline and clients wait at least that long: one that closes
			// first abandons its requests, which can no longer be answered.
			orphans = nil
		}
		if len(orphans) > 0 {
			since := k.ep.readmitted.Load()
			orphans = slices.DeleteFunc(orphans, func(r pendingRequest) bool { return r.at <= since })
			k.ep.orphans.adopt(orphans)
		}
	}
	k.q.release()
	k.finMu.Lock()
	if k.halfTimer != nil {
		k.halfTimer.Stop()
	}
	k.finMu.Unlock()
	return k.stats()
}

// attach makes ep the link's endpoint once its dial succeeded: its
// requests are tracked against ep's answers, and ep's registry holds it
// for eviction (a transparent link is registered at accept).
func (k *link) attach(ep *endpoint) {
	k.ep = ep
	if u := k.set.Unanswered; u.Enabled(k.set.Framing.Type) {
		if k.frames != nil {
			k.reqScan, k.respScan = newFrameScanner(k.frames), newFrameScanner(k.frames)
		}
		k.trk = newTracker(judgingSlack(u.RequestTimeout.D()), k.reqScan == nil, &ep.lastAnswer, k.judge)
		if k.reqScan != nil {
			k.conv = newConv(k)
		}
	}
	if k.l.pool != nil {
		ep.add(k)
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
func (k *link) dial() bool {
	attempts := max(k.set.ConnectAttempts, 1)
	if k.l.pool == nil {
		attempts = 1
	}
	var avoid string
	var lastErr error
	for i := range attempts {
		if i > 0 {
			select {
			case <-time.After(connectBackoff(i)):
			case <-k.l.ctx.Done():
			}
		}
		ep, failOpen := k.ep, false
		if k.l.pool == nil {
			// A transparent destination let through while excluded: its
			// group is failing open (group_fail_open).
			st, _ := k.l.p.det.State(ep.addr)
			failOpen = st == health.Excluded
		} else {
			if ep, failOpen = k.l.pool.pick(avoid); ep == nil {
				break // nothing eligible is left
			}
		}
		start := time.Now()
		c, err := k.dialer.DialContext(k.l.ctx, "tcp", ep.dial)
		if err != nil && k.l.ctx.Err() != nil {
			// The proxy is shutting down: not the upstream's fault.
			k.setReason(metrics.ReasonShutdown, err)
			resetConn(k.client)
			return false
		}
		if err != nil && !upstreamFault(err) {
			// Out of descriptors, a socket option refused: the proxy's own
			// failure, never the upstream's; another endpoint would not help.
			k.setReason(metrics.ReasonLocalError, err)
			k.l.localError(ep, err)
			resetConn(k.client)
			return false
		}
		if err != nil {
			k.l.m.DialErrors.Inc()
			k.l.p.report(ep, metrics.ReasonDialError)
			avoid, lastErr = ep.addr, err
			continue
		}
		k.l.m.DialDuration.Observe(time.Since(start).Seconds())
		if failOpen && k.failOpen {
			k.l.m.FailOpenLinks.Inc()
		}
		return k.connected(ep, c.(*net.TCPConn))
	}
	// Reset rather than close: to a client whose own failure detector
	// treats a completed close as a live server, a reset looks like the
	// refused connection it stands for.
	if lastErr != nil {
		k.setReason(metrics.ReasonDialError, lastErr)
	} else {
		k.setReason(metrics.ReasonRefused, nil)
	}
	resetConn(k.client)
	return false
}

// connected takes over a dialled upstream connection.
func (k *link) connected(ep *endpoint, up *net.TCPConn) bool {
	raw, err := up.SyscallConn()
	if err == nil {
		err = k.fromUpstream.init(up)
	}
	if err == nil {
		err = k.fromClient.init(k.client)
	}
	if err != nil {
		_ = up.Close()
		k.attach(ep)
		k.fail(err)
		return false
	}
	if k.l.p.transparent.Load() {
		k.l.p.ownUp.Store(up.LocalAddr().String(), struct{}{})
	}
	k.ackedAt.Store(mono()) // progress is measured from the connect on
	k.attach(ep)
	k.connMu.Lock()
	k.upstream, k.upRaw = up, raw
	closed := k.closed
	k.connMu.Unlock()
	if closed {
		// Aborted while dialling: the reason is already set.
		k.l.p.ownUp.Delete(up.LocalAddr().String())
		_ = up.SetLinger(0)
		_ = up.Close()
		return false
	}
	return true
}

// pumpRequests reads the client for as long as the link lives and hands
// the bytes to the upstream: directly when nothing is queued and the
// kernel takes them at once, through the queue otherwise.
func (k *link) pumpRequests() {
	high := int64(k.set.WriteBuffer.HighWaterMark)
	backpressure := high > 0 && k.set.WriteBuffer.OnOverflow == policy.OverflowBackpressure
	first := true
	for {
		limit := chunkSize
		if backpressure {
			room, ok := k.q.waitForRoom(high, int64(k.set.WriteBuffer.LowWaterMark))
			if !ok {
				return
			}
			if room < int64(limit) {
				limit = int(room)
			}
		}
		bp, n, err := k.fromClient.read(limit)
		if n > 0 {
			buf := (*bp)[:n]
			end := k.bytesUp.Add(int64(n))
			if k.trk != nil {
				// Recorded before the bytes go out, so that no answer can
				// arrive before its request is known. Timed from now, not
				// from the accept: the upstream could not answer before
				// the connection to it existed, so a slow dial is no
				// evidence against it.
				k.recordRequests(buf, mono(), end, first)
			}
			first = false
			sent := k.send(buf, high) // copies what it queues
			putChunk(bp)
			if !sent {
				return
			}
			continue
		}
		if errors.Is(err, io.EOF) {
			if k.reqScan != nil && !k.conv.off.Load() && k.reqScan.midFrame() {
				k.badFrame("request", errTruncated)
				return
			}
			k.sawFin(metrics.ReasonClientClosed)
			if k.q.endOfInput() {
				return // the writer passes the FIN on after the queued bytes
			}
			// No writer means nothing was ever queued: pass it on now.
			if cerr := k.upstream.CloseWrite(); cerr != nil {
				k.fail(cerr)
				return
			}
			k.passedFin()
		} else {
			k.abort(metrics.ReasonClientError, err)
		}
		return
	}
}

// recordRequests scans p, the bytes of one read from the client ending at
// stream offset end and handed on at mono time at, and records the
// requests in them. The first read of a link is checked for a TLS
// handshake record, which any length framing would misread as a length of
// hundreds of megabytes (the check is the same whatever the protocol).
func (k *link) recordRequests(p []byte, at, end int64, first bool) {
	c := k.conv
	if c == nil {
		// Opaque: a request is a burst of bytes, due within request_timeout.
		k.trk.sent(pendingRequest{at: at, due: at + int64(k.set.Unanswered.RequestTimeout), end: end, n: 1,
			thr: int32(k.set.Unanswered.ConsecutiveTimeoutsThreshold)})
		return
	}
	if k.reqScan == nil || c.off.Load() {
		k.reqScan = nil // no longer tracked: nothing more is recorded
		return
	}
	if first && kafkawire.LooksLikeTLS(p) {
		c.untrack(metrics.UntrackedTLS, nil)
		k.reqScan = nil
		return
	}
	c.sendAt = at
	_, ends, err := k.reqScan.scan(p)
	if err != nil {
		c.untrack(metrics.UntrackedLimit, err)
		k.reqScan = nil
		return
	}
	if ends > 0 && k.reqScan.rd == nil {
		c.frames(ends, end)
	}
}

// send hands p to the upstream. It reports false when the link has ended.
func (k *link) send(p []byte, high int64) bool {
	empty, open := k.q.idle()
	if !open {
		return false
	}
	if empty {
		// Nothing queued and nothing being written: try the kernel directly
		// and queue only what it does not take. This keeps the common case
		// free of a goroutine hand-off.
		n, err := k.tryWrite(p)
		if err != nil {
			k.fail(err)
			return false
		}
		if n == len(p) {
			return true
		}
		p = p[n:]
	}
	switch k.q.push(p, high) {
	case pushClosed:
		return false
	case pushOverflow:
		// Only reachable with on_overflow: reject; backpressure never reads
		// more than the room left. The link is closed: it cannot keep its
		// memory bound otherwise. The upstream is blamed only with evidence
		// that it stopped: nothing acknowledged for write_timeout. A client
		// that writes faster than a live server reads is not a dead server.
		k.l.m.WatermarkRejections.Inc()
		k.overflowStalled.Store(k.stalled(k.set.WriteTimeout.D()))
		k.abort(metrics.ReasonWatermark, nil)
		return false
	case pushedStartWriter:
		k.live.Add(1) // the request pump is live: the count cannot reach 0 meanwhile
		go k.writeUpstreamOwned()
	}
	return true
}

func (k *link) writeUpstreamOwned() {
	defer k.exit()
	k.writeUpstream()
}

func (k *link) pumpResponsesOwned() {
	defer k.exit()
	k.pumpResponses()
}

func (k *link) pumpRequestsOwned() {
	defer k.exit()
	k.pumpRequests()
}

// tryWrite writes p to the upstream without waiting: it returns what the
// kernel accepted at once (possibly 0).
func (k *link) tryWrite(p []byte) (int, error) {
	k.rawP = p
	werr := k.upRaw.Write(k.rawWriteFn)
	n, err := k.rawN, k.rawErr
	k.rawP, k.rawErr = nil, nil
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
func (k *link) writeUpstream() {
	wt := k.set.WriteTimeout.D()
	low := int64(k.set.WriteBuffer.LowWaterMark)
	for {
		step, queued := k.q.next()
		switch step {
		case stopWriting:
			return
		case passFin:
			if err := k.upstream.CloseWrite(); err != nil {
				k.fail(err)
				return
			}
			k.passedFin()
			return
		}
		// The pump adds to bytesUp before it pushes: the oldest queued byte
		// is at this stream offset or later.
		head := k.bytesUp.Load() - queued
		if k.conv != nil {
			// A request past its deadline is never written, even in the
			// moment before the tracker's timer judges it.
			if overdue := k.trk.overdueEnd(mono()); overdue > head {
				k.dropStale(1)
				return
			}
		}
		var handed int
		k.batch, handed = k.q.batch(k.batch[:0])
		if wt > 0 {
			k.progressed()
			_ = k.upstream.SetWriteDeadline(time.Now().Add(wt))
		}
		k.toWrite = k.batch
		n, err := k.toWrite.WriteTo(k.upstream)
		k.toWrite = nil

		k.q.consume(int(n), handed, low)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				if p, known := k.progressed(); p || !known && n > 0 || k.conv != nil && k.conv.holding(mono()) {
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
				if k.abort(metrics.ReasonWriteTimeout, err) {
					k.l.m.WriteTimeouts.Inc()
				}
			} else {
				k.fail(err)
			}
			return
		}
	}
}

// pumpResponses copies the upstream to the client.
func (k *link) pumpResponses() {
	for {
		bp, n, err := k.fromUpstream.read(chunkSize)
		if n > 0 {
			buf := (*bp)[:n]
			k.bytesDown.Add(int64(n))
			if k.trk != nil {
				// Any byte from the upstream is an answer: the server is
				// alive (see tracker).
				k.ep.answered(mono())
				if k.respScan != nil {
					if k.conv.off.Load() {
						k.respScan = nil
					} else if _, _, ferr := k.respScan.scan(buf); ferr != nil {
						k.conv.untrack(metrics.UntrackedLimit, ferr)
						k.respScan = nil
					}
				}
			}
			_, werr := k.client.Write(buf)
			putChunk(bp)
			if werr != nil {
				k.abort(metrics.ReasonClientError, werr)
				return
			}
			continue
		}
		if errors.Is(err, io.EOF) {
			if k.respScan != nil && !k.conv.off.Load() && k.respScan.midFrame() {
				k.badFrame("response", errTruncated)
				return
			}
			k.sawFin(metrics.ReasonUpstreamClosed)
			if cerr := k.client.CloseWrite(); cerr != nil {
				k.abort(metrics.ReasonClientError, cerr)
				return
			}
			k.passedFin()
			return
		}
		k.fail(err)
		return
	}
}

// badFrame ends the link on a frame the proxy cannot follow. It is not a
// server failure: the detector hears nothing of it.
func (k *link) badFrame(direction string, err error) {
	if k.abort(metrics.ReasonBadFrame, err) {
		k.l.log.Warn().Err(err).Str("direction", direction).Str("endpoint", k.ep.addr).
			Str("client", k.client.RemoteAddr().String()).Msg("bad frame: link closed")
	}
}

// judge applies the tracker's verdict on requests whose deadline passed.
// Unanswered ones count toward the endpoint's consecutive threshold. In
// framed mode, a request whose bytes the upstream has not even
// acknowledged yet (still in the queue or the kernel's send queue) is
// stale: the link is reset so that those bytes are dropped rather than
// delivered to a server that recovers later.
func (k *link) judge(judged []pendingRequest, left int) {
	k.l.p.countUnanswered(k.ep, k.l, k.trk.unanswered(judged), int(judged[0].thr))
	if k.conv == nil {
		return
	}
	var last int64
	n := left
	for _, r := range judged {
		last = max(last, r.end)
		n += int(r.n)
	}
	if acked, ok := k.ackedBytes(); ok && last > acked {
		k.dropStale(n)
	}
}

func (k *link) dropStale(frames int) {
	if k.abort(metrics.ReasonStale, nil) {
		k.l.m.StaleFramesDropped.Add(float64(frames))
	}
}

// progressed samples how much of the stream the upstream has acknowledged
// and reports whether that moved since the previous sample (known: false
// when the kernel does not say). The writer samples before each write and
// when a write's deadline passes; the request pump when the queue would
// overflow.
func (k *link) progressed() (moved, known bool) {
	acked, ok := k.ackedBytes()
	if !ok {
		return false, false
	}
	for {
		prev := k.acked.Load()
		if acked <= prev {
			return false, true
		}
		if k.acked.CompareAndSwap(prev, acked) {
			k.ackedAt.Store(mono())
			return true, true
		}
	}
}

// stalled reports whether the upstream has acknowledged nothing of this
// link's stream for at least d, as far as the samples tell: the evidence a
// watermark overflow needs before it is held against the upstream.
func (k *link) stalled(d time.Duration) bool {
	if d <= 0 {
		return false
	}
	moved, known := k.progressed()
	now := mono()
	if k.conv != nil && k.conv.holding(now) {
		return false // a Kafka broker holding a request reads nothing meanwhile
	}
	return known && !moved && now-k.ackedAt.Load() >= int64(d)
}

// ackedBytes is how many bytes of the stream the upstream has acknowledged.
func (k *link) ackedBytes() (int64, bool) {
	k.connMu.Lock()
	raw := k.upRaw
	k.connMu.Unlock()
	if raw == nil {
		return 0, false
	}
	return bytesAcked(raw)
}

// sawFin records which side sent FIN first, when it is read: passing it
// on lets the other side answer with its own FIN, which must not win.
func (k *link) sawFin(reason string) {
	k.finMu.Lock()
	defer k.finMu.Unlock()
	if k.firstFin == "" {
		k.firstFin = reason
	}
}

// passedFin records that one direction finished cleanly. The first FIN
// arms half_close_timeout on the other direction.
func (k *link) passedFin() {
	k.finMu.Lock()
	defer k.finMu.Unlock()
	k.fins++
	if k.fins == 1 {
		if hc := k.set.HalfCloseTimeout.D(); hc > 0 {
			k.halfTimer = time.AfterFunc(hc, func() {
				k.abort(metrics.ReasonHalfCloseTimeout, nil)
			})
		}
		return
	}
	// Both directions done: the pumps are ending on their own.
	k.setReason(k.firstFin, nil)
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
func (k *link) abort(reason string, err error) bool {
	first := k.setReason(reason, err)
	k.connMu.Lock()
	if k.upstream != nil && !k.closed {
		_ = k.upstream.SetLinger(0)
	}
	if !k.closed {
		_ = k.client.SetLinger(0)
	}
	k.connMu.Unlock()
	k.closeBoth()
	return first
}

func (k *link) setReason(reason string, err error) bool {
	if !k.reason.CompareAndSwap(nil, &reason) {
		return false
	}
	if err != nil {
		k.endErr.Store(&err)
	}
	return true
}

// closeBoth closes both connections and wakes every goroutine of the link.
func (k *link) closeBoth() {
	k.closeOnce.Do(func() {
		k.q.close()
		_ = k.client.Close()
		k.connMu.Lock()
		k.closed = true
		up := k.upstream
		k.connMu.Unlock()
		if up != nil {
			_ = up.Close()
		}
	})
}

func (k *link) stats() LinkStats {
	s := LinkStats{
		Listener:  k.l.cfg.Name,
		Client:    k.client.RemoteAddr().String(),
		BytesUp:   k.bytesUp.Load(),
		BytesDown: k.bytesDown.Load(),
		Opened:    k.opened,
		Duration:  time.Since(k.opened),
	}
	s.MaxQueued = k.q.peak()
	if k.ep != nil {
		s.Upstream = k.ep.dial
	}
	if r := k.reason.Load(); r != nil {
		s.Reason = CloseReason(*r)
	}
	if e := k.endErr.Load(); e != nil {
		s.Err = *e
	}
	return s
}

// clientEnded reports whether the client ended the link (a FIN it sent
// first, or an error on its socket).
func (k *link) clientEnded() bool {
	r := k.reason.Load()
	return r != nil && (*r == metrics.ReasonClientClosed || *r == metrics.ReasonClientError)
}

// fail ends the link on an error of its upstream socket, with the reason
// closeReasonFor gives it; a local error is logged as the proxy's own.
func (k *link) fail(err error) {
	reason := closeReasonFor(err)
	if k.abort(reason, err) && reason == metrics.ReasonLocalError {
		k.l.localError(k.ep, err)
	}
}
