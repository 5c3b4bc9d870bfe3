package proxy

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// tcpEnd is a link's upstream over a TCP connection it dialled: the
// request pump writes to the socket without waiting, queueing only what
// the kernel does not take (a writer drains the queue under the write
// deadline), and the response pump reads the socket only when it is
// readable.
type tcpEnd struct {
	lk *link
	// conn is the socket: an *os.File from flow.DialRaw, or a
	// *net.TCPConn where net dialled it (a name to resolve, a zone, or
	// not Linux).
	conn upstreamSocket
	raw  syscall.RawConn
	// local is the socket's local address, asked for once and only where
	// it is used (see localAddr).
	local net.Addr
	// r reads the upstream only when it is readable (the response pump
	// owns it).
	r flow.SockReader
	// win keeps TCP_USER_TIMEOUT off a zero window whose peer answers
	// (see windowGuard); nil without tcp_user_timeout.
	win *windowGuard

	// batch is the writer's view of queued bytes, kept here so that a
	// batch costs no allocation; w writes it.
	batch net.Buffers
	w     flow.Writer

	// rawP, rawN, rawErr and rawWriteFn carry tryWrite's arguments so the
	// per-write callback is allocated once per link, not once per write.
	rawP       []byte
	rawN       int
	rawErr     error
	rawWriteFn func(fd uintptr)
	// heardBy (mono time, 0: none) is when the excuse of the write
	// deadline that passed last lapses, where it rests on the upstream's
	// bytes arriving (writeFailed): the writer's next deadline is no
	// later, so that an upstream that stopped sending as well as reading
	// is judged write_timeout after its last byte. The writer's alone.
	heardBy int64

	// livePending: flow.DialRaw left tcp_user_timeout and keepalive
	// unset, for the window guard to set (windowGuard.setLivenessLater).
	livePending bool
	// owned: the loop guard holds local (ownConn), for release to forget.
	owned bool

	// lowatAt: TCP_NOTSENT_LOWAT is set on the socket (flow.SetNotsentLowat)
	// before the request pump hands it more than this many bytes in all;
	// -1 once set (by the dial's Control, where net dialled). Until then
	// the kernel cannot hold more than that unsent, which is all the
	// option bounds; handed counts the bytes (the request pump's alone).
	lowatAt, handed int64

	// What requests.Handle leaves for pumpRequests to do outside the read
	// (see flow.SockReader.readEach): a chunk it began to send, of which the
	// kernel took reqSent bytes (with reqBegun).
	reqSent  int32
	reqBegun bool

	// Parking (park.go): parkReq marks the pumps the sweep asked to park
	// (bit parkRequests, parkResponses); parked, the pumps parked now;
	// parkKey their keys in the parker (under its mu).
	parkReq atomic.Uint32
	parked  atomic.Uint32
	parkKey [2]uint64

	// peeked: a peek at the socket (flow.UnreadInBand) has begun, which
	// may have taken a reset's error (see link.finOnly).
	peeked atomic.Bool
}

// upstreamSocket is what a TCP end needs of its socket; *os.File and
// *net.TCPConn have it.
type upstreamSocket interface {
	syscall.Conn
	SetReadDeadline(t time.Time) error
	SetWriteDeadline(t time.Time) error
	Close() error
}

// newTCPEnd makes the end of lk over c, a connection just dialled; on an
// error c is closed.
func newTCPEnd(lk *link, c upstreamSocket) (*tcpEnd, error) {
	e := &tcpEnd{lk: lk, conn: c, lowatAt: -1}
	_, dialRaw := c.(*os.File)
	if dialRaw {
		e.lowatAt = int64(flow.NotsentLowat(int64(lk.settings.WriteBuffer.HighWaterMark)))
	}
	raw, err := c.SyscallConn()
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	e.raw = raw
	e.win = newWindowGuard(lk, raw, lk.settings.TCPUserTimeout.D())
	if dialRaw && e.win == nil {
		// flow.DialRaw left tcp_user_timeout and keepalive unset, and
		// there is no guard to set them later (attach): now.
		if err := flow.SetLiveness(raw, lk.settings); err != nil {
			_ = c.Close()
			return nil, err
		}
	}
	e.livePending = dialRaw && e.win != nil
	e.r.InitRaw(raw) // the reader, the writer and tryWrite share one raw connection
	e.r.SetResetWatch(lk.host.resetWatch(), e.conn)
	e.rawWriteFn = func(fd uintptr) {
		e.rawN, e.rawErr = flow.SysWrite(int(fd), e.rawP)
	}
	e.w.InitWriteBuffers(raw) // the writer's batches; tryWrite has its own callback
	return e, nil
}

// requests and responses are a TCP end as the flow.ChunkSink of its request
// and response pumps (a pointer conversion: nothing is allocated).
type (
	requests  tcpEnd
	responses tcpEnd
)

func (s *requests) Limit() int { return s.lk.requestLimit() }

func (*responses) Limit() int { return flow.ChunkSize }

func (e *tcpEnd) attach(ep *endpoint) bool {
	lk := e.lk
	if !e.owned { // a raw dial's guard registered it at the connect (directDialer)
		e.owned = lk.host.ownConn(e)
	}
	lk.ackedAt.Store(flow.Mono()) // progress is measured from the connect on
	lk.attach(ep)
	if !lk.adopt(e) {
		// Aborted while dialling: the reason is already set (release, at
		// the link's finish, forgets the socket).
		e.abortive()
		_ = e.conn.Close()
		return false
	}
	e.win.setLivenessLater(liveDelay(lk.settings), e.livePending)
	return true
}

func (e *tcpEnd) run() {
	go e.pumpResponsesOwned()
	go e.pumpRequestsOwned()
}

// closeWrite passes the client's FIN on; the window guard watches it as it
// watches a send (TCP_USER_TIMEOUT bounds its retransmissions too).
func (e *tcpEnd) closeWrite() error {
	err := flow.ShutdownWrite(e.raw)
	e.win.arm()
	return err
}

func (*tcpEnd) finByClose() bool { return true }

func (e *tcpEnd) abortive() { _ = flow.SetLinger0(e.raw) }

// localAddr is the socket's local address: net's, which it recorded at the
// connect, or asked of the kernel once.
func (e *tcpEnd) localAddr() net.Addr {
	if e.local == nil {
		if tc, ok := e.conn.(*net.TCPConn); ok {
			e.local = tc.LocalAddr()
		} else {
			e.local = flow.LocalAddr(e.raw)
		}
	}
	return e.local
}

// close closes the socket, then resumes the pumps that are parked: each
// sees the close as a waiting pump would (park.go). The client is closed
// already (closeBoth).
func (e *tcpEnd) close() {
	_ = e.conn.Close()
	if e.parked.Load() != 0 {
		e.lk.host.parker().resumeAll(e)
	}
}

func (e *tcpEnd) acked() (int64, bool) { return flow.BytesAcked(e.raw) }

func (e *tcpEnd) received() (n, at int64, ok bool) { return flow.Received(e.raw) }

func (e *tcpEnd) unread() int { return flow.UnreadInBand(e.raw, &e.peeked) }

func (e *tcpEnd) delivery() (flow.Delivery, bool) { return flow.SampleDelivery(e.raw) }

func (e *tcpEnd) answersUnread() bool { return flow.UnreadFromALivePeer(e.raw, &e.peeked) }

func (e *tcpEnd) release() {
	e.r.Forget()
	if e.owned {
		e.lk.host.forgetConn(e.local)
	}
	e.win.stop()
}

func (e *tcpEnd) writeUpstreamOwned() {
	defer e.lk.exit()
	e.writeUpstream()
}

// pumpResponsesOwned and pumpRequestsOwned run a pump in its goroutine:
// the link's last goroutine to end finishes it, and a pump that parked
// ends its goroutine without ending (resume starts it again).
func (e *tcpEnd) pumpResponsesOwned() {
	if !e.pumpResponses() {
		e.lk.exit()
	}
}

func (e *tcpEnd) pumpRequestsOwned() {
	if !e.pumpRequests() {
		e.lk.exit()
	}
}

// resume starts the goroutine of the parked pump dir again.
func (e *tcpEnd) resume(dir int) {
	if dir == parkRequests {
		go e.pumpRequestsOwned()
	} else {
		go e.pumpResponsesOwned()
	}
}

// requestPark asks the link's pumps that are not parked to park: each
// wakes from its wait with os.ErrDeadlineExceeded and sees the mark (see
// park).
func (e *tcpEnd) requestPark() {
	want := uint32(1<<parkRequests|1<<parkResponses) &^ e.parked.Load() &^ e.parkReq.Load()
	if want == 0 {
		return // parked, or asked already and not yet there (a pump in a write or a wait for room)
	}
	e.parkReq.Or(want)
	if want&(1<<parkRequests) != 0 {
		if c, ok := e.lk.client.(*tcpClient); ok {
			_ = c.SetReadDeadline(pastDeadline)
		}
	}
	if want&(1<<parkResponses) != 0 {
		_ = e.conn.SetReadDeadline(pastDeadline)
	}
}

// park parks the pump dir when err, the error its read returned, is the
// sweep's request to (see park.go): it clears the deadline, hands the
// pump to the parker and has the parker's epoll set wait for the socket.
// parkDone: the pump's goroutine ends (a resume starts it again, or has
// already); parkContinue: the pump reads on; parkNone: err is the read's
// own.
//
// The proxy sets a read deadline on a TCP link's sockets (its client's, a
// tcpClient, and its upstream's) for nothing but this request and the
// reset watch's wake-up (urgent data on a live socket: resetWatch.report),
// so a deadline error there is never the link's: one without the mark is
// the watch's, or the late deadline of a request the pump has served
// already (the sweep marks, then sets the deadline; the pump may see the
// mark first), and the pump reads on.
func (e *tcpEnd) park(dir int, err error) parkOutcome {
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		return parkNone
	}
	var conn interface{ SetReadDeadline(time.Time) error } = e.conn
	rc := e.raw
	if dir == parkRequests {
		c, ok := e.lk.client.(*tcpClient)
		if !ok {
			return parkNone // a mesh stream's deadline: its own (streamClient)
		}
		conn, rc = c.sock, c.rc
	}
	_ = conn.SetReadDeadline(time.Time{})
	bit := uint32(1) << dir
	if e.parkReq.And(^bit)&bit == 0 {
		return parkContinue
	}
	pk := e.lk.host.parker()
	key, ok := pk.hold(e, dir)
	if !ok {
		return parkContinue // the proxy is stopping
	}
	// Nothing of the pump's is touched past hold: a resume may run it in
	// another goroutine from here on.
	var werr error
	if cerr := rc.Control(func(fd uintptr) { werr = pk.set.watch(int(fd), key) }); cerr != nil {
		werr = cerr
	}
	if werr == nil {
		return parkDone
	}
	if _, _, mine := pk.claim(key); !mine {
		return parkDone // the link's close resumed it meanwhile
	}
	if _, open := e.lk.q.Idle(); open && !errors.Is(werr, net.ErrClosed) {
		// A socket of net's says net.ErrClosed once closed; one of
		// flow.DialRaw's or flow.Listener's (an *os.File) says "use of
		// closed file", which nothing exported names, and closeBoth
		// closes the link's queue before it closes either socket.
		pk.parkFailed(werr)
	}
	return parkContinue // a closed socket: the read says so
}

// pumpRequests reads the client for as long as the link lives and hands
// the bytes to the upstream: directly when nothing is queued and the
// kernel takes them at once (requests.Handle, inside the read), through the
// queue otherwise (here, outside it: the queue may wait, or close the
// link). It reports true when the pump parked (park.go).
func (e *tcpEnd) pumpRequests() (parked bool) {
	lk := e.lk
	high := int64(lk.settings.WriteBuffer.HighWaterMark)
	for {
		if lk.backpressure() {
			if _, ok := lk.q.WaitForRoom(high, int64(lk.settings.WriteBuffer.LowWaterMark)); !ok {
				return false
			}
		}
		bp, n, err, werr := lk.client.readEach((*requests)(e))
		if werr != nil {
			e.fail(werr)
			return false
		}
		if n > 0 {
			if !e.sendRead(bp, n, high) {
				return false
			}
			continue
		}
		if err == nil {
			continue // no room below the high watermark, or the queue closed
		}
		switch e.park(parkRequests, err) {
		case parkDone:
			return true
		case parkContinue:
			continue
		}
		e.requestsEnded(err)
		return false
	}
}

// sendRead sends the n bytes of *bp, a chunk read from the client that
// requests.Handle did not send whole, and gives the chunk back. It
// reports false when the link has ended.
func (e *tcpEnd) sendRead(bp *[]byte, n int, high int64) bool {
	lk := e.lk
	buf := (*bp)[:n]
	if e.reqBegun {
		// requests.Handle counted and recorded these bytes, and the
		// kernel took reqSent of them.
		buf = buf[int(e.reqSent):]
		e.reqBegun, e.reqSent = false, 0
	} else {
		if err := e.hand(n); err != nil {
			flow.PutChunk(bp)
			e.fail(err)
			return false
		}
		lk.budget.Reading(int64(cap(*bp)))
		lk.countRequest(buf)
	}
	sent := e.send(buf, high) // copies what it queues
	lk.budget.Reading(-int64(cap(*bp)))
	flow.PutChunk(bp)
	return sent
}

// requestsEnded ends the request pump on err, the client's read error:
// a FIN is passed on after whatever is queued, anything else aborts.
func (e *tcpEnd) requestsEnded(err error) {
	lk := e.lk
	var fa finAck
	if errors.Is(err, io.EOF) {
		var reset bool
		if reset, fa = lk.clientReset(); reset {
			err = syscall.ECONNRESET // a write took the reset's error (see flow.ResetNotFin)
		}
	}
	if !errors.Is(err, io.EOF) {
		lk.abort(CloseClientError, err)
		return
	}
	if lk.reqScan != nil && !lk.conv.off.Load() && lk.reqScan.MidFrame() {
		lk.badFrame("request", flow.ErrTruncated)
		return
	}
	lk.sawFin(CloseClientClosed)
	if lk.q.EndOfInput() {
		return // the writer passes the FIN on after the queued bytes
	}
	// No writer means nothing was ever queued: pass it on now.
	if cerr := lk.passFin(e.closeWrite, fa); cerr != nil {
		e.fail(cerr)
	}
}

// Handle is the request pump's ReadEach handler: with nothing queued it
// writes the chunk to the upstream without waiting. Whatever would have
// to wait or close the link (a queue in use, a partial write, an error)
// is left to pumpRequests. (A method of requests itself, not a wrapper:
// a frame less on the pump's stack.)
func (s *requests) Handle(bp *[]byte, n int) (flow.Handled, error) {
	e := (*tcpEnd)(s)
	lk := e.lk
	if !lk.readAny && lk.conv != nil {
		// The first bytes of a profiled link are checked for TLS, which
		// may register the endpoint's probe anew: outside the read.
		return flow.HandledKeep, nil
	}
	if empty, open := lk.q.Idle(); !empty || !open {
		return flow.HandledKeep, nil
	}
	if err := e.hand(n); err != nil {
		return flow.HandledStop, err
	}
	buf := (*bp)[:n]
	lk.budget.Reading(int64(cap(*bp)))
	lk.countRequest(buf)
	w, err := e.tryWrite(buf)
	// Bytes may wait for the upstream in the kernel: the window guard
	// watches them. Armed after the write: an arm before it that found a
	// sample pending could have that sample find the socket idle (the
	// write not made yet), raise its bound and stop, leaving these bytes
	// to the raised bound.
	e.win.arm()
	if err == nil && w < n {
		e.reqBegun, e.reqSent = true, int32(w) // the rest is queued by pumpRequests
		return flow.HandledKeep, nil
	}
	lk.budget.Reading(-int64(cap(*bp)))
	if err != nil {
		return flow.HandledStop, err
	}
	return flow.HandledMore, nil
}

// send hands p to the upstream. It reports false when the link has ended.
func (e *tcpEnd) send(p []byte, high int64) bool {
	lk := e.lk
	empty, open := lk.q.Idle()
	if !open {
		return false
	}
	if empty {
		// Nothing queued and nothing being written: try the kernel directly
		// and queue only what it does not take. This keeps the common case
		// free of a goroutine hand-off.
		n, err := e.tryWrite(p)
		e.win.arm() // after the write, as in Handle; the writer arms for what it writes
		if err != nil {
			e.fail(err)
			return false
		}
		if n == len(p) {
			return true
		}
		p = p[n:]
	}
	return e.queue(p, high)
}

// hand counts n bytes handed to the upstream and sets TCP_NOTSENT_LOWAT
// before they take the total past it (see lowatAt). A refusal is the
// proxy's own failure (closeReasonFor: local_error).
func (e *tcpEnd) hand(n int) error {
	if e.lowatAt < 0 {
		return nil
	}
	if e.handed += int64(n); e.handed <= e.lowatAt {
		return nil
	}
	e.lowatAt = -1
	return flow.SetNotsentLowat(e.raw, int64(e.lk.settings.WriteBuffer.HighWaterMark))
}

// queue pushes p, bytes the kernel did not take, to the link's queue and
// starts the writer when it is the first to wait. It reports false when
// the link has ended.
func (e *tcpEnd) queue(p []byte, high int64) bool {
	lk := e.lk
	r := lk.q.Push(p, high)
	if r == flow.PushBudget {
		// The process's budget is full: wait for room, unless this link's
		// own upstream makes no progress (see budget).
		r = lk.waitForBudget(p, high)
	}
	switch r {
	case flow.PushClosed:
		return false
	case flow.PushStalled:
		lk.budgetClose()
		return false
	case flow.PushOverflow:
		// Only reachable with on_overflow: reject; backpressure never reads
		// more than the room left. The link is closed: it cannot keep its
		// memory bound otherwise. The upstream is blamed only with evidence
		// that it stopped: nothing acknowledged, nor sent, for
		// write_timeout (stalled). A client
		// that writes faster than a live server reads is not a dead server.
		lk.m.WatermarkRejections.Inc()
		lk.overflowStalled.Store(lk.stalled(lk.settings.WriteTimeout.D()) && !lk.answersWaiting())
		lk.abort(CloseWatermark, nil)
		return false
	case flow.PushedStartWriter:
		lk.live.Add(1) // the request pump is live: the count cannot reach 0 meanwhile
		go e.writeUpstreamOwned()
	}
	return true
}

// tryWrite writes p to the upstream without waiting: it returns what the
// kernel accepted at once (possibly 0).
//
// Through RawConn.Control, not RawConn.Write: a write that never waits
// needs no more than the descriptor held open (Control's reference), and
// Write's lock, its deadline check and the poller's reset cost about 120
// instructions per request more (docs/performance.md, "The proxy's own
// instructions per request"). Nothing else writes the socket meanwhile:
// tryWrite runs only while the queue is empty, so no writer is writing
// (Queue.Idle). The one write deadline set on the socket is the
// writer's, for a batch; in the moment after that batch drained the
// queue and before the writer clears it, Write failed with
// os.ErrDeadlineExceeded and the bytes queued, where now the kernel
// takes them: either way they go out in order, and a writer's deadline
// covers the ones that queue.
func (e *tcpEnd) tryWrite(p []byte) (int, error) {
	e.rawP = p
	werr := e.raw.Control(e.rawWriteFn)
	n, err := e.rawN, e.rawErr
	e.rawP, e.rawErr = nil, nil
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
func (e *tcpEnd) writeUpstream() {
	lk := e.lk
	wt := lk.settings.WriteTimeout.D()
	low := int64(lk.settings.WriteBuffer.LowWaterMark)
	for {
		step, queued := lk.q.Next()
		switch step {
		case flow.StopWriting, flow.Drained:
			return
		case flow.PassFin:
			if err := lk.passFin(e.closeWrite, finAck{}); err != nil {
				e.fail(err)
			}
			return
		}
		// The pump adds to bytesUp before it pushes: the oldest queued byte
		// is at this stream offset or later.
		head := lk.bytesUp.Load() - queued
		if lk.conv != nil {
			// A request past its deadline is never written, even in the
			// moment before the tracker's timer judges it, unless the
			// upstream is still taking in the stream (a large request on
			// a slow path): its verdict is put off then (heldBack).
			if overdue, sent := lk.trk.OverdueEnd(flow.Mono()); overdue > head {
				if d, ok := e.delivery(); !ok || !lk.takenSince(d, sent) {
					lk.dropStale(1)
					return
				}
			}
		}
		var handed int
		e.batch, handed = lk.q.Batch(e.batch[:0])
		if wt > 0 {
			lk.progressed()
			_ = e.conn.SetWriteDeadline(e.nextDeadline(wt))
		}
		// The window guard watches the batch as it watches the pump's
		// sends: a sample since the send that queued these bytes may
		// have found the socket idle and stopped. Armed before the write,
		// which may wait for room, and again after (see Handle).
		e.win.arm()
		n, err := e.w.WriteBuffers(e.batch)
		clear(e.batch) // the views go back with Consume
		if n > 0 {
			e.win.arm()
		}

		lk.q.Consume(int(n), handed, low)
		if err != nil && !e.writeFailed(err, n) {
			return
		}
		if wt > 0 && lk.q.Bytes() == 0 {
			// Drained: the deadline was this batch's. Left on the socket it
			// would pass while the link idles and fail the next direct
			// write (tryWrite). Cleared before Next, so that a writer
			// started after this one ends sets its own after this.
			_ = e.conn.SetWriteDeadline(time.Time{})
		}
	}
}

// writeFailed judges a failed write of the queue, of which n bytes went
// out: it reports true when the upstream made progress within
// write_timeout and the writer goes on, and otherwise ends the link.
func (e *tcpEnd) writeFailed(err error, n int64) bool {
	lk := e.lk
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		e.fail(err)
		return false
	}
	wt := lk.settings.WriteTimeout.D()
	p, known := lk.progressed()
	// Another sampler (the budget's reaper, an overflow, a tracked
	// request's delivery check) may have seen the count move first and
	// left this sample nothing to see: a move any sample saw within
	// write_timeout (ackedAt) is the same evidence. The deadline is at
	// least write_timeout after the writer's own last sample
	// (nextDeadline), so only a move since then counts.
	p = p || flow.Mono()-lk.ackedAt.Load() < int64(wt)
	if p || !known && n > 0 || lk.conv != nil && lk.conv.holding(flow.Mono()) || lk.answersWaiting() {
		// The upstream acknowledged bytes within write_timeout:
		// a slow reader, not a stall (the kernel wakes a writer
		// only once a good part of its send buffer is free, so
		// a write can wait longer than any one ACK). Without
		// TCP_INFO, bytes the kernel took stand in. The next
		// batch gets a fresh deadline. A Kafka broker holding
		// a request within its own deadline reads nothing more
		// meanwhile: not a stall either. Nor is an upstream
		// whose own bytes wait unread in the proxy, its client
		// not reading them (answersWaiting).
		return true
	}
	if at, ok := lk.heardWithin(wt); ok {
		// Nor is one whose bytes arrived within write_timeout: one that
		// reads its next request only once its answer is sent, sending
		// a long answer (heardWithin). Judged again once the excuse
		// lapses: write_timeout after its last byte.
		e.heardBy = at + int64(wt)
		return true
	}
	if lk.abort(CloseWriteTimeout, err) {
		lk.m.WriteTimeouts.Inc()
	}
	return false
}

// nextDeadline is the write deadline of the writer's next batch:
// write_timeout from now, or sooner when the last one's excuse lapses
// sooner (heardBy), though never sooner than write_timeout after the
// upstream was last seen to acknowledge more (ackedAt, sampled before).
func (e *tcpEnd) nextDeadline(wt time.Duration) time.Time {
	now := time.Now()
	d := now.Add(wt)
	if e.heardBy != 0 {
		by := max(e.heardBy, e.lk.ackedAt.Load()+int64(wt))
		if at := now.Add(time.Duration(by - flow.MonoOf(now))); at.Before(d) {
			d = at
		}
		e.heardBy = 0
	}
	return d
}

// pumpResponses copies the upstream to the client (responses.Handle,
// inside the read). It reports true when the pump parked (park.go).
func (e *tcpEnd) pumpResponses() (parked bool) {
	lk := e.lk
	for {
		_, _, err, werr := e.r.ReadEach((*responses)(e))
		if werr != nil {
			lk.abort(CloseClientError, werr)
			return false
		}
		switch e.park(parkResponses, err) {
		case parkDone:
			return true
		case parkContinue:
			continue
		}
		var fa finAck // what the upstream acknowledged, read with its end
		if errors.Is(err, io.EOF) && !lk.finOnly(&e.peeked) {
			var reset bool
			if reset, fa.n, fa.ok = flow.ResetNotFin(e.raw, lk.bytesDown.Load()); reset {
				err = errResetInferred{} // a write took the socket's error (see ResetNotFin)
			}
		}
		if errors.Is(err, io.EOF) {
			if lk.respScan != nil && !lk.conv.off.Load() && lk.respScan.MidFrame() {
				lk.badFrame("response", flow.ErrTruncated)
				return false
			}
			lk.passFinToClient(fa)
			return false
		}
		e.fail(err)
		return false
	}
}

// Handle is the response pump's ReadEach handler: it passes a chunk read
// from the upstream on to the client. A failed write is left to
// pumpResponses (flow.HandledStop).
func (s *responses) Handle(bp *[]byte, n int) (flow.Handled, error) {
	lk := s.lk
	lk.budget.Reading(int64(cap(*bp)))
	buf := (*bp)[:n]
	lk.answered(buf)
	_, werr := lk.client.Write(buf)
	lk.budget.Reading(-int64(cap(*bp)))
	if werr != nil {
		return flow.HandledStop, werr
	}
	return flow.HandledMore, nil
}

// fail ends the link on an error of its upstream socket (see link.fail).
// The kernel's verdict (kernelGaveUp: ETIMEDOUT) on a zero window, when
// the window guard could not sample while due (it samples every quarter of tcp_user_timeout while bytes
// wait; the proxy could not run: CPU throttling, a frozen host) and the
// upstream's kernel answered after that began, is the kernel applying
// the bound the guard lifts for such a window and could not lift in
// time. No evidence against the upstream: the link ends as the proxy's
// own failure (local_error). So is the verdict when the proxy's host has
// no route to the upstream (ownNetwork), or its bytes never left the
// proxy's host while the upstream's window was open (flow.NeverSent: a
// drop rule of the proxy's own, its egress queue): errOwnNetwork.
func (e *tcpEnd) fail(err error) {
	if g := e.win; g != nil && kernelGaveUp(err) {
		if from, blind := g.blindSince(); blind && flow.ZeroWindowAckedSince(e.raw, from) {
			err = errZeroWindowAbort{err}
		}
	}
	switch {
	case !kernelGaveUp(err):
	case ownNetwork(err, e.peer(), e.lk.settings.UpstreamMark):
		err = errOwnNetwork{cause: err}
	case flow.NeverSent(e.raw):
		err = errOwnNetwork{cause: err, neverSent: true}
	}
	e.lk.fail(err)
}

// peer is the upstream's address: the endpoint's, or the socket's peer
// when the endpoint dials a name.
func (e *tcpEnd) peer() netip.AddrPort {
	ap := e.lk.ep.dialAP
	if tc, ok := e.conn.(*net.TCPConn); !ap.IsValid() && ok {
		if ra, ok := tc.RemoteAddr().(*net.TCPAddr); ok {
			ap = ra.AddrPort()
		}
	}
	return ap
}

// errResetInferred is the end of the upstream's stream that the response
// pump's read takes for a reset (flow.ResetNotFin): the socket is closed
// with no FIN from the peer, and a write took its error. That error may
// have been the kernel giving up (ETIMEDOUT, or the ICMP error it saw)
// rather than a reset: the write that took it reports it, and
// link.fail lets it replace this inference (see replaceInferredReset).
// It unwraps to ECONNRESET.
type errResetInferred struct{}

func (errResetInferred) Error() string {
	return "connection reset by peer (inferred: another call on the socket took its error)"
}

func (errResetInferred) Unwrap() error { return syscall.ECONNRESET }

// errZeroWindowAbort is such an ETIMEDOUT; it does not unwrap to it, so
// that nothing takes it for the upstream's.
type errZeroWindowAbort struct{ cause error }

func (x errZeroWindowAbort) Error() string {
	return x.cause.Error() + " (TCP_USER_TIMEOUT on a zero window the upstream's kernel answered: the window guard could not lift it in time, the proxy could not run)"
}
