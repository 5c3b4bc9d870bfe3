package proxy

import (
	"errors"
	"math"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/livenessproxy/livenessproxy/internal/kafkawire"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/rs/zerolog"
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
// Goroutines: start (the caller's) dials and has the upstream end run the
// two pumps (a TCP end's request pump starts its writer when bytes must
// queue). Every goroutine ends once both connections are closed, which
// abort guarantees, and the last one to end finishes the link.
type link struct {
	host     linkHost          // the listener that accepted the link (linkhost.go)
	name     string            // the listener's
	m        *metrics.Listener // the listener's series
	log      *zerolog.Logger   // the listener's
	budget   *flow.Budget      // the process's memory budget
	ep       *endpoint         // set at accept (transparent) or when the dial succeeds (pool)
	settings *policy.Settings  // the listener's settings when the link opened (its spec's: never written)
	frames   *flow.FrameSpec   // the listener's framing when the link opened; nil: opaque
	slot     bool              // holds a max_links slot of l (given back when it ends)
	dialer   *net.Dialer
	client   clientSide
	// up is the upstream end (upstream.go): set once the dial succeeded,
	// under connMu.
	up     upstreamEnd
	opened time.Time // accepted (the stats' Opened and Duration)
	// bound is the mono time the link was routed to ep: a pool's pick,
	// a transparent or mesh ingress link's last admission (serveLink).
	// An exclusion or readmission of ep evicts the links routed before
	// it (evict), not those accepted before it: a link accepted earlier
	// and routed to ep while ep was out went there knowingly (fail-open,
	// on_excluded: allow), whenever the event that says ep is out is
	// delivered.
	bound  atomic.Int64
	dialed dialRecord // what the dial did (accesslog.go)

	// connMu orders the dial's assignment of up against closeBoth called
	// from another goroutine (eviction, shutdown) during the dial.
	connMu sync.Mutex
	closed bool

	// q holds what the upstream did not take at once (a TCP end's writer
	// drains it).
	q flow.Queue
	// live counts the link's goroutines: the two pumps and, while it runs,
	// a TCP end's writer. The writer starts on a byte the kernel does not
	// take at once and ends once it has drained the queue (flow.Drained):
	// most request/response links never need it, and an idle link has
	// none. The last to end finishes the link.
	live atomic.Int32

	readAny bool // the request pump has read bytes before

	// idleBytes is bytesUp+bytesDown at the park sweep that last saw them
	// move, at idleSince (unix ns); the sweep alone uses them (park.go).
	idleBytes, idleSince int64

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
	reqScan, respScan *flow.FrameScanner
	// scans are the two scanners for the link's life (reqScan and
	// respScan go nil when tracking stops): finish gives back what their
	// windows hold of the budget.
	scans [2]*flow.FrameScanner
	// trk follows requests and judges them; nil when tracking is off.
	trk *flow.Tracker
	// conv is what the pumps share about the protocol; nil unless reqScan
	// was set.
	conv *conv

	// dialing: a pool link's connect to a member is under way; it is in
	// the member's links for the member's drain only (see evict).
	dialing atomic.Bool
	// heldUnread is how far the response pump must read (bytesDown) to
	// have read what waited unread in the upstream's socket when a verdict
	// on the link's requests was put off (heardUnread), or when the link
	// closed; 0: nothing waited. While the pump has not read that far, its
	// requests are not handed on when it ends.
	heldUnread atomic.Int64
	// deliveryAllow is the time its deadline gave the request a verdict was
	// put off for while it had not all reached the upstream: the upstream
	// has as long once it has all of it. 0: no verdict put off so
	// (heldBack).
	deliveryAllow atomic.Int64
	// upstreamBadFrame: the bad frame that ended the link was the
	// upstream's (a response cut short), not the client's.
	upstreamBadFrame atomic.Bool

	reason    atomic.Pointer[CloseReason] // first reason that ended the link
	endErr    atomic.Pointer[error]
	closeOnce sync.Once

	finMu     sync.Mutex
	fins      int         // directions whose FIN has been passed on
	firstFin  CloseReason // reason if the link ends cleanly
	halfTimer *time.Timer
	halfMoved int64 // halfProgress when halfTimer was last armed
}

// newLink returns a link for a client connection. ep is the endpoint of a
// transparent listener's link; a pool listener's link picks one when it
// dials (nil here).
func newLink(l *listener, ep *endpoint, client clientSide) *link {
	t := l.spec()
	lk := &link{host: l, name: l.cfg.Name, m: l.m, log: &l.log, budget: &l.p.budget,
		ep: ep, settings: &t.settings, frames: t.frames, dialer: t.dialer,
		client: client, opened: time.Now()}
	lk.bound.Store(flow.Mono())
	lk.q.Init(&l.p.budget)
	if tc, ok := client.(*tcpClient); ok {
		tc.r.SetResetWatch(l.resetWatch(), tc.sock)
	}
	return lk
}

// start dials the upstream and starts the link's pumps; it reports false
// when the link ended at its dial. The goroutine that dialled returns
// then, to wait for the next link's start (starters.go): the dial's deep
// call chain needs a grown stack, and a link that idles for hours should
// not keep it. The last of the link's goroutines to end accounts for the
// link (see exit).
func (lk *link) start() bool {
	if !lk.dial() {
		return false
	}
	if err := lk.client.upstreamConnected(); err != nil {
		lk.abort(CloseClientError, err)
		return false
	}
	lk.live.Store(2)
	lk.up.run()
	return true
}

// exit ends one of the link's goroutines; the last one finishes the link.
func (lk *link) exit() {
	if lk.live.Add(-1) == 0 {
		// finish, then the stats, each from here: the last pump's
		// goroutine, about to end, then needs no more than its first
		// stack (finish returning the stats grew it once per link).
		lk.finish()
		lk.host.linkEnded(lk, lk.stats())
	}
}

// finish releases what the link holds once its goroutines have ended;
// lk.stats() then says how it went.
func (lk *link) finish() {
	lk.closeBoth()
	if tc, ok := lk.client.(*tcpClient); ok {
		tc.r.Forget()
	}
	up := lk.upEnd()
	if up != nil {
		up.release()
	}
	for _, s := range lk.scans {
		if s != nil {
			s.Release()
		}
	}
	if lk.trk != nil {
		orphans := lk.trk.Stop()
		if lk.abandonedByItsClient() {
			// Requests held longer than any client waits (a Kafka
			// transaction's) are judged by a shorter hold once abandoned.
			orphans = slices.DeleteFunc(orphans, func(r flow.PendingRequest) bool { return r.Abandoned == 0 })
			for i := range orphans {
				r := &orphans[i]
				r.Held, r.Due = r.Abandoned, addDue(r.Abandoned, lk.conv.rt)
			}
		} else if lk.owesNoEvidence() {
			// Under a protocol profile every request carries its own
			// deadline and clients wait at least that long: one that closes
			// first abandons its requests, which can no longer be answered;
			// a server that closes instead of answering (a request it will
			// not serve) has said so.
			// A link the proxy cut for a reason that says nothing of its
			// upstream (an eviction, a client's bad frame, its own error)
			// took away the answers itself: the endpoint's silence on
			// other links is no evidence about them. Nor is it for a link
			// whose verdicts were put off, the upstream's bytes unread in
			// the proxy (its client not reading): the upstream could not
			// answer.
			orphans = nil
		}
		if len(orphans) > 0 {
			since := lk.ep.readmitted.Load()
			orphans = slices.DeleteFunc(orphans, func(r flow.PendingRequest) bool { return r.At <= since })
			lk.ep.orphans.Adopt(orphans)
		}
	}
	lk.q.Release()
	lk.finMu.Lock()
	if lk.halfTimer != nil {
		lk.halfTimer.Stop()
		lk.halfTimer = nil // a run already under way ends the link no more
	}
	lk.finMu.Unlock()
}

// attach makes ep the link's endpoint once its dial succeeded: its
// requests are tracked against ep's answers, and ep's registry holds it
// for eviction (a transparent link is registered at accept).
func (lk *link) attach(ep *endpoint) {
	lk.ep = ep
	if u := lk.settings.Unanswered; u.Enabled(lk.settings.Framing.Type) {
		if lk.frames != nil {
			lk.reqScan, lk.respScan = flow.NewFrameScanner(lk.frames), flow.NewFrameScanner(lk.frames)
			lk.reqScan.Budget, lk.respScan.Budget = lk.budget, lk.budget
			lk.scans = [2]*flow.FrameScanner{lk.reqScan, lk.respScan}
		}
		lk.trk = flow.NewTracker(flow.JudgingSlack(u.RequestTimeout.D()), lk.reqScan == nil, &ep.lastAnswer, lk.judge)
		if lk.reqScan != nil {
			lk.conv = newConv(lk)
		}
	}
	if lk.host.routing() != nil {
		ep.add(lk)
	}
}

// adopt makes up the link's upstream end. It reports false when the link
// was closed meanwhile (aborted during the dial): up is the caller's to
// close then.
func (lk *link) adopt(up upstreamEnd) bool {
	lk.connMu.Lock()
	defer lk.connMu.Unlock()
	lk.up = up
	return !lk.closed
}

// upEnd is the link's upstream end, nil before its dial succeeded.
func (lk *link) upEnd() upstreamEnd {
	lk.connMu.Lock()
	defer lk.connMu.Unlock()
	return lk.up
}

// abortedMeanwhile reports whether the link was closed (aborted) while
// its dial was under way.
func (lk *link) abortedMeanwhile() bool {
	lk.connMu.Lock()
	defer lk.connMu.Unlock()
	return lk.closed
}

// answered accounts for buf, bytes of the upstream's on their way to the
// client. Any byte from the upstream is an answer: the server is alive
// (see tracker), for the requests of every link to it, tracked by this
// listener or not (see also dialFailed).
func (lk *link) answered(buf []byte) {
	lk.bytesDown.Add(int64(len(buf)))
	lk.ep.answered(flow.Mono())
	if lk.trk != nil && lk.respScan != nil {
		if lk.conv.off.Load() {
			lk.respScan = nil
		} else if _, _, ferr := lk.respScan.Scan(buf); ferr != nil {
			if lk.respScan.Rd != nil {
				// Responses are matched to requests: lost, the link's
				// requests can no longer be told answered.
				lk.conv.untrack(metrics.UntrackedLimit, ferr)
			}
			// Otherwise (pinot, length_field) responses are followed only
			// to tell one cut short: a response longer than
			// max_frame_length (Pinot's have no practical cap) ends that
			// check on the link, and its requests stay judged.
			lk.respScan = nil
		}
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
		return flow.ChunkSize
	}
	room, open := lk.q.Room(int64(lk.settings.WriteBuffer.HighWaterMark))
	if !open {
		return 0
	}
	return int(min(room, flow.ChunkSize))
}

// countRequest counts and records the requests in buf, bytes just read
// from the client. Recorded before the bytes go out, so that no answer
// can arrive before its request is known. Timed from now, not from the
// accept: the upstream could not answer before the connection to it
// existed, so a slow dial is no evidence against it.
func (lk *link) countRequest(buf []byte) {
	end := lk.bytesUp.Add(int64(len(buf)))
	if lk.trk != nil {
		lk.recordRequests(buf, flow.Mono(), end, !lk.readAny)
	}
	lk.readAny = true
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
		lk.trk.Sent(flow.PendingRequest{At: at, Due: at + int64(lk.settings.Unanswered.RequestTimeout), End: end, N: 1,
			Thr: int32(lk.settings.Unanswered.ConsecutiveTimeoutsThreshold)})
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
	_, ends, err := lk.reqScan.Scan(p)
	if err != nil {
		c.untrack(metrics.UntrackedLimit, err)
		lk.reqScan = nil
		return
	}
	if ends > 0 && lk.reqScan.Rd == nil {
		c.frames(ends, end)
	}
}

// passFinToClient passes the upstream's FIN on to the client; fa is what
// the upstream had acknowledged when its FIN was read, if known.
func (lk *link) passFinToClient(fa finAck) {
	if lk.trk != nil && lk.conv != nil && lk.conv.profile && lk.bytesDown.Load() > 0 {
		// A server that answered on the link and then ends it will answer
		// nothing more here: a broker closes instead of answering a
		// request it will not serve (KAFKA.md: "close all outstanding
		// entries at EOF"). Its requests are no evidence, now or when the
		// link ends (owesNoEvidence).
		lk.trk.Stop()
	}
	lk.sawFin(CloseUpstreamClosed)
	if cerr := lk.passFin(lk.client.CloseWrite, fa); cerr != nil {
		lk.abort(CloseClientError, cerr)
	}
}

// flow.PassFin passes a FIN on with closeWrite (a shutdown), and records it.
// When the other direction has passed its FIN already, this one ends the
// link, and closing both sockets passes the FIN instead of a shutdown
// before the close: the socket it goes to has delivered its own FIN, so
// nothing is left in its receive queue and the close is a FIN, not a
// reset, after whatever the kernel still has to send. fa: see passedFin.
func (lk *link) passFin(closeWrite func() error, fa finAck) error {
	lk.finMu.Lock()
	last := lk.fins == 1 && lk.up.finByClose()
	lk.finMu.Unlock()
	if last {
		lk.passedFin(fa)
		lk.closeBoth()
		return nil
	}
	if err := closeWrite(); err != nil {
		return err
	}
	lk.passedFin(fa)
	return nil
}

// badFrame ends the link on a frame the proxy cannot follow. It is not a
// server failure: the detector hears nothing of it.
func (lk *link) badFrame(direction string, err error) {
	if direction == "response" {
		lk.upstreamBadFrame.Store(true)
	}
	if lk.abort(CloseBadFrame, err) {
		lk.host.badFrame(lk, direction, err)
	}
}

// judge applies the tracker's verdict on requests whose deadline passed.
// Unanswered ones count toward the endpoint's consecutive threshold. In
// framed mode, a request whose bytes the upstream has not even
// acknowledged by its (entry's) last deadline (still in the queue or the
// kernel's send queue) is stale: the link is reset so that those bytes are
// dropped rather than delivered to a server that recovers later.
func (lk *link) judge(judged []flow.PendingRequest, left int) {
	n, since := lk.trk.Unanswered(judged)
	if n == 0 {
		lk.endDelivery() // answered: no verdict is put off any more
	}
	if n > 0 && lk.reason.Load() != nil && lk.owesNoEvidence() {
		n = 0 // a verdict due as the link ends, cut by the proxy: as finish
	}
	if n > 0 {
		if lk.heardUnread(judged) {
			n = 0
		} else {
			n, since = lk.trk.Unanswered(judged) // an answer the kernel gave may cover some
		}
	}
	if n > 0 && lk.heldBack(judged) {
		return // put off, and not stale: its bytes are still on their way
	}
	if n > 0 {
		// Those sent before the endpoint's readmission are counted,
		// no evidence (countUnanswered); those sent since are, even
		// when judged with them.
		fresh, freshSince := lk.trk.UnansweredFrom(judged, lk.ep.judgedFrom())
		if fresh < n {
			lk.host.countUnanswered(lk.ep, n-fresh, int(judged[0].Thr), since)
			n, since = fresh, freshSince
		}
	}
	lk.host.countUnanswered(lk.ep, n, int(judged[0].Thr), since)
	if lk.conv == nil {
		return
	}
	var last int64
	sent := int64(math.MaxInt64)
	frames := left
	for _, r := range judged {
		if r.Expired {
			last = max(last, r.End)
			sent = min(sent, r.At)
			frames += int(r.N)
		}
	}
	if last == 0 {
		return
	}
	if acked, ok := lk.ackedBytes(); ok && last > acked && !lk.beingTakenIn(sent) {
		lk.dropStale(frames)
	}
}

// beingTakenIn reports whether the upstream is still taking the stream
// in since mono time sent (takenSince): a request past its deadline is
// not stale while it is, answered on another link or not.
func (lk *link) beingTakenIn(sent int64) bool {
	up := lk.upEnd()
	if up == nil {
		return false
	}
	d, ok := up.delivery()
	return ok && lk.takenSince(d, sent)
}

// heardUnread looks, before requests of the link are counted unanswered,
// at what the upstream's kernel took in that the proxy has not passed on:
// the endpoint's silence must be the endpoint's, not the proxy's.
//   - Bytes that arrived after a request was sent, which the response pump
//     had not read yet (the proxy was descheduled or throttled past the
//     deadline), are an answer, at the time the kernel says they came:
//     the verdict is taken again with it.
//   - Bytes still unread that arrived before (the client is not reading
//     what the pump passes on, so the pump stopped reading the upstream,
//     whose window closed: it cannot answer) put the verdict off: the
//     requests not covered are judged again a slack later, until the pump
//     has read what the upstream sent.
//
// It reports true when nothing is to be counted now. Only the link's own
// socket is asked, once per verdict that would count.
func (lk *link) heardUnread(judged []flow.PendingRequest) bool {
	up := lk.upEnd()
	if up == nil {
		return false
	}
	_, at, ok := up.received()
	if !ok {
		return false
	}
	if at > lk.ep.lastAnswer.Load() {
		lk.ep.heardAt(at)
		if n, _ := lk.trk.Unanswered(judged); n == 0 {
			return true
		}
	}
	mark := lk.unreadMark(up)
	lk.heldUnread.Store(mark)
	if mark == 0 {
		return false // the pump has read all of it: the silence is the endpoint's
	}
	if lk.conv != nil && lk.conv.off.Load() {
		return true // no longer tracked meanwhile: nothing to judge again
	}
	lk.putOff(judged, 0)
	return true
}

// unreadMark is how far the response pump must read (bytesDown) to have
// read what waits unread in up's socket now; 0 when nothing waits. The
// pump may read meanwhile: the count it had read is taken on both sides
// of the kernel's answer, and asked again when it moved.
func (lk *link) unreadMark(up upstreamEnd) int64 {
	for range 4 {
		before := lk.bytesDown.Load()
		n := up.unread()
		if n == 0 {
			return 0
		}
		if lk.bytesDown.Load() == before {
			return before + int64(n)
		}
	}
	// Still reading: bytes read in between may be counted twice, which
	// only holds the link's requests back longer.
	return lk.bytesDown.Load() + int64(up.unread())
}

// putOff gives the judged requests not covered another verdict at due,
// or (0) a slack later: the judge could not tell.
func (lk *link) putOff(judged []flow.PendingRequest, due int64) {
	var again []flow.PendingRequest
	for i := range judged {
		if r := &judged[i]; r.Verdict && !lk.trk.Covered(r) {
			again = append(again, *r)
		}
	}
	if due == 0 {
		due = flow.Mono() + max(int64(flow.JudgingSlack(lk.settings.Unanswered.RequestTimeout.D())), int64(10*time.Millisecond))
	}
	lk.trk.Defer(again, due)
	lk.m.UnansweredDeferred.Inc()
}

// heldBack looks, before requests of the link are counted unanswered, at
// whether the first of them has reached the upstream: a server cannot
// answer a request it has not been given. Not all of it acknowledged, the
// verdict is put off (a slack at a time) while
//   - the proxy holds the rest, the upstream having acknowledged all it
//     was handed (the pump waits for the memory budget, or was not
//     scheduled): the proxy's delay, never the upstream's; or
//   - the upstream's kernel has acknowledged bytes since the request was
//     sent, its window open: a large request on a slow path, still being
//     delivered.
//
// Once all of it is acknowledged, the server gets the request's own time
// (its deadline less its send time) from then: its clock starts when it
// has the request. Not put off when bytes wait in the kernel for a peer
// that has acknowledged nothing more for flow.DeliveryQuiet (a host or
// path gone, or a process that stopped reading, its window closed): that
// is the silence the rule is for. A link whose verdict was put off so is
// not judged by its requests when it ends meanwhile (owesNoEvidence).
// One TCP_INFO and one ioctl, asked only when a verdict would count.
func (lk *link) heldBack(judged []flow.PendingRequest) bool {
	up := lk.upEnd()
	if up == nil {
		return false
	}
	var first *flow.PendingRequest
	for i := range judged {
		if r := &judged[i]; r.Verdict && !lk.trk.Covered(r) {
			first = r
			break
		}
	}
	if first == nil {
		return false
	}
	d, ok := up.delivery()
	if !ok {
		lk.endDelivery()
		return false
	}
	if first.End <= d.Acked {
		allow := lk.deliveryAllow.Load()
		lk.endDelivery()
		if allow > 0 {
			lk.putOff(judged, flow.Mono()+allow) // delivered since the last look
			return true
		}
		return false
	}
	// The proxy holds the rest: the upstream acknowledged all it was
	// handed (a kernel that counts acknowledged bytes: d.Acked > 0).
	if !(d.Queued == 0 && d.Acked > 0 || lk.takenSince(d, first.At)) {
		lk.endDelivery()
		return false
	}
	lk.deliveryAllow.CompareAndSwap(0, max(first.Due-first.At, 1)) // its deadline not yet moved
	lk.putOff(judged, 0)
	return true
}

// endDelivery ends a verdict's putting off for its request not having
// reached the upstream (heldBack): the request reached it, or was
// answered, or the upstream stopped taking it in.
func (lk *link) endDelivery() { lk.deliveryAllow.Store(0) }

func (lk *link) dropStale(frames int) {
	if lk.abort(CloseStale, nil) {
		lk.m.StaleFramesDropped.Add(float64(frames))
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
	return lk.noteAcked(acked, flow.Mono()), true
}

// noteAcked records acked, a sample of the bytes the upstream
// acknowledged taken at mono time now, and reports whether it moved since
// the previous sample (ackedAt is then now).
func (lk *link) noteAcked(acked, now int64) bool {
	for {
		prev := lk.acked.Load()
		if acked <= prev {
			return false
		}
		if lk.acked.CompareAndSwap(prev, acked) {
			lk.ackedAt.Store(now)
			return true
		}
	}
}

// takenSince reports, given d (a sample of what the upstream's kernel
// says), whether the upstream is still taking the stream in since mono
// time at: an ACK came from it after at (the kernel's own clock: a path
// that died before at sent none), and it was seen to acknowledge more of
// the stream within the last flow.DeliveryQuiet (a peer whose window
// closed, a process that stopped reading, answers window probes but
// acknowledges no byte more), or the kernel still awaits the answer to
// bytes in flight (d.Awaiting: a lossy path, its retransmissions backing
// off, is silent longer than that with the peer alive; a dead one is
// judged once two retransmissions in a row went unanswered).
func (lk *link) takenSince(d flow.Delivery, at int64) bool {
	if d.AckAt <= at {
		return false
	}
	now := flow.Mono()
	lk.noteAcked(d.Acked, now)
	return d.Awaiting || lk.ackedAt.Load() > max(at, now-int64(flow.DeliveryQuiet))
}

// stalled reports whether the upstream has acknowledged nothing of this
// link's stream for at least d, as far as the samples tell, nor sent a
// byte (heardWithin): the evidence a watermark overflow needs before it is
// held against the upstream, and the budget before it closes a link.
func (lk *link) stalled(d time.Duration) bool {
	if d <= 0 {
		return false
	}
	moved, known := lk.progressed()
	now := flow.Mono()
	if lk.conv != nil && lk.conv.holding(now) {
		return false // a Kafka broker holding a request reads nothing meanwhile
	}
	if !known || moved || now-lk.ackedAt.Load() < int64(d) {
		return false
	}
	_, sending := lk.heardWithin(d) // sending a long answer: not stalled
	return !sending
}

// heardWithin reports whether the latest of the upstream's bytes arrived
// within d (at: when, as a mono time no later than the arrival). An
// upstream that acknowledges nothing while it sends is one that reads its
// next request only once its answer is sent (a thread per connection, a
// Kafka broker's muted channel), sending a long one to a client that
// reads it: it makes progress, the pump keeping up with it. Only data
// taken in counts: the kernel's clock (tcpi_last_data_recv) moves for no
// window probe, pure ACK or retransmission of bytes already in, so a
// dead path or an upstream that stopped sending as well as reading is
// judged d after its last byte. One TCP_INFO, asked at a verdict.
func (lk *link) heardWithin(d time.Duration) (at int64, ok bool) {
	up := lk.upEnd()
	if up == nil || d <= 0 {
		return 0, false
	}
	_, at, ok = up.received()
	return at, ok && flow.Mono()-at < int64(d)
}

// answersWaiting reports whether bytes the upstream sent wait unread in
// the proxy's socket (the response pump stopped: the client does not read
// them) while the upstream's kernel answers. An upstream that acknowledges
// nothing meanwhile may be one that reads its next request only once it
// has sent its last answer (a thread per connection, a Kafka broker's
// muted channel): the stall is the client's, and is no evidence against
// the upstream until the client has read what it sent. An upstream whose
// kernel leaves two window probes in a row unanswered is not excused (its
// host or path may be gone), nor is one once the client has read. stalled
// does not ask it: a link that holds memory for nothing may still be
// closed for the budget, only not blamed on its upstream. One ioctl (and
// a TCP_INFO when bytes wait), asked only when a verdict would count.
func (lk *link) answersWaiting() bool {
	up := lk.upEnd()
	return up != nil && up.answersUnread()
}

// ackedBytes is how many bytes of the stream the upstream has acknowledged.
func (lk *link) ackedBytes() (int64, bool) {
	up := lk.upEnd()
	if up == nil {
		return 0, false
	}
	return up.acked()
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

// finOnly reports whether the end of the stream a pump just read from
// one of the link's sockets can only be the peer's FIN, so that
// flow.ResetNotFin need not ask the kernel. The kernel reports a reset's
// error once, to the first call on the socket that looks: a write, a
// peek (peeked, set before it; nil for a socket nothing peeks at), or
// the read, which would then have returned it. Once the other direction
// has passed its FIN on to this socket, every write to it has returned
// without an error (a failed write ends the link: no FIN is passed after
// it) and none comes after. So with no peek begun and the link not
// ending (an abort may close the socket under the read, which
// ResetNotFin counts as a reset), only the read itself can have taken
// an error. That is the second FIN of every link that ends cleanly:
// one getsockopt fewer per link.
func (lk *link) finOnly(peeked *atomic.Bool) bool {
	if peeked != nil && peeked.Load() || lk.reason.Load() != nil {
		return false
	}
	lk.finMu.Lock()
	other := lk.fins == 1 // this direction passes its FIN once, after this
	lk.finMu.Unlock()
	return other
}

// passedFin records that one direction finished cleanly. The first FIN
// arms half_close_timeout on the other direction. fa is what the socket
// the FIN came from had acknowledged when it was read (flow.ResetNotFin's
// TCP_INFO), where the FIN is passed on at once, in the same pump: the
// snapshot takes it instead of asking the kernel again.
func (lk *link) passedFin(fa finAck) {
	lk.finMu.Lock()
	defer lk.finMu.Unlock()
	lk.fins++
	if lk.fins == 1 {
		if hc := lk.settings.HalfCloseTimeout.D(); hc > 0 {
			lk.halfMoved = lk.halfProgress(fa)
			lk.halfTimer = time.AfterFunc(hc, func() { lk.halfClosedIdle(hc) })
		}
		return
	}
	// Both directions done: the pumps are ending on their own.
	lk.setReason(lk.firstFin, nil)
}

// halfClosedIdle runs half_close_timeout (hc) after the first FIN, and
// again hc after each run that found bytes moved: the direction still
// open is ended (both sides reset) once it has moved no byte for hc.
// An inactivity bound, as HAProxy's client-fin and server-fin: a client
// that half-closes after its request while a long answer streams in, or
// an upload that goes on after the server's answer, is healthy and kept
// for as long as bytes move; one that stopped is cut.
func (lk *link) halfClosedIdle(hc time.Duration) {
	moved := lk.halfProgress(finAck{})
	lk.finMu.Lock()
	if lk.fins != 1 || lk.halfTimer == nil {
		// The other direction ended cleanly meanwhile, or the link did.
		lk.finMu.Unlock()
		return
	}
	if moved != lk.halfMoved {
		lk.halfMoved = moved
		lk.halfTimer.Reset(hc)
		lk.finMu.Unlock()
		return
	}
	lk.finMu.Unlock()
	lk.abort(CloseHalfCloseTimeout, nil)
}

// halfProgress is a count that grows while the link moves bytes: read
// from either side, or acknowledged by either peer's kernel (what a
// slow reader takes of a write the pump is waiting in: the pump reads
// nothing meanwhile). A mesh stream's side counts by its reads alone.
// fa, when ok, is one socket's acknowledged count read a moment before
// (at its FIN), taken instead of asking its TCP_INFO again.
func (lk *link) halfProgress(fa finAck) int64 {
	n := lk.bytesUp.Load() + lk.bytesDown.Load()
	if fa.ok && !fa.client {
		n += fa.n
	} else if a, ok := lk.ackedBytes(); ok {
		n += a
	}
	if c, ok := lk.client.(*tcpClient); ok && c.rc != nil {
		if fa.ok && fa.client {
			n += fa.n
		} else if a, ok := flow.BytesAcked(c.rc); ok {
			n += a
		}
	}
	return n
}

// finAck is what one of the link's sockets had acknowledged (n,
// flow.BytesAcked's count) when the pump read its FIN, from the TCP_INFO
// flow.ResetNotFin read then: client says which socket; ok false when
// not known. The pump that read the FIN passes it on at once (passFin),
// and half_close_timeout's snapshot there takes it, one getsockopt fewer
// at every link's first FIN. Taken the one shutdown before, it can only
// count as moved an acknowledgement that came in that moment, never miss
// one.
type finAck struct {
	n          int64
	client, ok bool
}

// abort ends the link with reason, resetting both sides at once. It
// reports whether this call was the one that decided the reason.
//
// Reset, not FIN, on both sides: the proxy's kernel drops what it still
// holds for the upstream instead of retransmitting it for minutes (and
// the upstream's kernel, at the reset, what it holds for the proxy), and
// the client sees a reset where a direct connection would have given one
// (the upstream reset it, or timed out), or where the proxy cut it: a FIN
// would tell the client that a cut-short response was complete. A clean
// end (a FIN read on one side) is passed on as a FIN, not through here.
func (lk *link) abort(reason CloseReason, err error) bool {
	first := lk.setReason(reason, err)
	lk.connMu.Lock()
	if !lk.closed {
		if lk.up != nil {
			lk.up.abortive()
		}
		lk.client.abortive()
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
	if !lk.reason.CompareAndSwap(nil, reasonPtr(reason)) {
		return false
	}
	if err != nil {
		e := new(error)
		*e = err
		lk.endErr.Store(e)
	}
	return true
}

// closeBoth closes both connections and wakes every goroutine of the link.
// The client goes first: a response pump blocked in a client write inside
// its read of the upstream (responses.Handle) holds the upstream's read
// lock, and the upstream's Close waits for that write to give up.
func (lk *link) closeBoth() {
	lk.closeOnce.Do(func() {
		lk.q.Close()
		_ = lk.client.Close()
		lk.connMu.Lock()
		lk.closed = true
		up := lk.up
		lk.connMu.Unlock()
		if up != nil {
			if lk.trk != nil && lk.trk.Pending() > 0 {
				// The upstream's bytes still unread when the link ends: it
				// could not answer the requests it is left with (finish).
				if mark := lk.unreadMark(up); mark > 0 {
					lk.heldUnread.Store(mark)
				}
			}
			up.close()
		}
	})
}

// stats says how the link went, so far.
//
// Client is left empty: linkEnded fills it where it is read (the access
// log, Options.OnLinkEnd), so that a link nobody reports on formats no
// address, and its last goroutine's first stack holds its end (the
// formatting alone outgrew it).
func (lk *link) stats() LinkStats {
	s := LinkStats{
		Listener:  lk.name,
		BytesUp:   lk.bytesUp.Load(),
		BytesDown: lk.bytesDown.Load(),
		Opened:    lk.opened,
		Duration:  time.Since(lk.opened),
	}
	s.MaxQueued = lk.q.Peak()
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

// owesNoEvidence reports whether the link's requests say nothing of its
// endpoint once the link has ended (see finish): under a protocol profile
// its client gave up, or the upstream, having answered on it, closed it
// (a broker closes instead of answering a request it will not serve:
// KAFKA.md, "close all outstanding entries at EOF"); the proxy cut it;
// or the pump had not read what the upstream sent when a verdict was put
// off, or a verdict is put off while the request has not all reached the
// upstream (heldBack).
func (lk *link) owesNoEvidence() bool {
	if lk.conv != nil && lk.conv.profile && (lk.clientEnded() || lk.upstreamEndedAfterAnswers()) {
		return true
	}
	return lk.answersKeptFromIt()
}

// answersKeptFromIt reports whether the proxy kept the link's requests
// from being answered: it cut the link, its pump had not read what the
// upstream sent when a verdict was put off, or a request had not all
// reached the upstream when one was (heldBack).
func (lk *link) answersKeptFromIt() bool {
	return lk.proxyCut() || lk.bytesDown.Load() < lk.heldUnread.Load() || lk.deliveryAllow.Load() != 0
}

// abandonedByItsClient reports whether the link's requests are no
// evidence only because its client closed it under a protocol profile
// (see owesNoEvidence): those with a shorter hold for that case are.
func (lk *link) abandonedByItsClient() bool {
	return lk.conv != nil && lk.conv.profile && lk.clientEnded() && !lk.answersKeptFromIt()
}

// upstreamEndedAfterAnswers reports whether the upstream closed the link
// (its FIN, or its reset) after it had sent something on it. One that
// accepts and closes without a byte is not taken at its word: its
// requests stay evidence. Nor is an end that is no close of the peer's
// (upstream_timeout, the kernel giving up: a path gone, whether it says
// ETIMEDOUT or the host unreachable it saw meanwhile).
func (lk *link) upstreamEndedAfterAnswers() bool {
	r := lk.reason.Load()
	if r == nil || lk.bytesDown.Load() == 0 {
		return false
	}
	switch *r {
	case CloseUpstreamClosed:
		return true
	case CloseUpstreamError:
		if e := lk.endErr.Load(); e != nil {
			return errors.Is(*e, syscall.ECONNRESET) || errors.Is(*e, syscall.EPIPE)
		}
	}
	return false
}

// proxyCut reports whether the proxy ended the link itself for a reason
// that is no evidence against its upstream, so the answers its requests
// were owed could no longer be seen. A watermark or budget overflow is
// such a reason unless the upstream had stalled (then it is evidence); a
// bad frame is, unless it was the upstream's.
func (lk *link) proxyCut() bool {
	r := lk.reason.Load()
	if r == nil {
		return false
	}
	switch *r {
	case CloseEvicted, CloseHalfCloseTimeout, CloseLocalError, CloseShutdown:
		return true
	case CloseBadFrame:
		return !lk.upstreamBadFrame.Load() // a response cut short is the upstream's
	case CloseWatermark, CloseBudget:
		return !lk.overflowStalled.Load()
	}
	return false
}

// fail ends the link on an error of its upstream socket, with the reason
// closeReasonFor gives it; a local error is logged as the proxy's own.
func (lk *link) fail(err error) {
	reason := closeReasonFor(err)
	first := lk.abort(reason, err)
	switch {
	case first && reason == CloseLocalError:
		lk.host.localError(lk.ep, err)
	case !first && reason == CloseUpstreamTimeout:
		lk.replaceInferredReset(err)
	}
}

// replaceInferredReset makes err, the kernel giving up on the upstream
// socket, the link's end where the response pump got there first with a
// reset it inferred (errResetInferred) because this error had been taken
// by the write now reporting it: the kernel reports a socket's error to
// one call only, and the read after it sees the stream end as after a
// reset. The write's goroutine is one of the link's, so the link's end is
// not yet accounted (exit). Before, whichever failed first decided: a
// dead path under an upload ended upstream_error, blaming nothing, in 3
// runs of 20 (netns, GOMAXPROCS 2).
func (lk *link) replaceInferredReset(err error) {
	cur := lk.reason.Load()
	e := lk.endErr.Load()
	if cur == nil || *cur != CloseUpstreamError || e == nil || !errors.As(*e, new(errResetInferred)) {
		return
	}
	if lk.reason.CompareAndSwap(cur, reasonPtr(CloseUpstreamTimeout)) {
		ne := new(error)
		*ne = err
		lk.endErr.Store(ne)
	}
}
