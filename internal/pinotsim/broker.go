package pinotsim

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// BrokerConfig configures a simulated Pinot broker.
type BrokerConfig struct {
	// Timeout is the per-query timeout; non-positive: 3s (the incident's).
	Timeout time.Duration
	// DialTimeout bounds a connect; non-positive: 30s, Netty's default
	// CONNECT_TIMEOUT_MILLIS. The query's own deadline bounds it too.
	DialTimeout time.Duration
	// ID is the brokerId written in every request; empty: "Broker_pinotsim".
	ID string
	// Table is the table name of every request; empty: "t_REALTIME".
	Table string
	// RequestSize pads each request payload with segment names up to at
	// least this many bytes (real requests carry 40–70 B per segment).
	RequestSize int
	// MaxFrame bounds a response frame; non-positive: DefaultMaxFrame.
	MaxFrame int
	// OmitTimeoutOption leaves the query option timeoutMs out of requests.
	// By default every request carries it, as a real broker's do: the
	// query's remaining budget when the request is built, in milliseconds.
	OmitTimeoutOption bool
	// OnClose, if set, is called once for every cached connection that
	// closes, after its in-flight queries were failed. It runs on the
	// broker's own goroutines and must not block.
	OnClose func(ConnClose)
}

// ConnClose describes a cached connection that closed.
type ConnClose struct {
	Addr        string
	At          time.Time
	Err         error // what closed it (io.EOF: the peer closed)
	FailedFast  int   // in-flight queries failed at once
	QueuedBytes int64 // outbound bytes dropped, never written
}

// Outcome is how a query ended.
type Outcome int

// Outcomes of Query.
const (
	// OK: the server's response arrived before the timeout.
	OK Outcome = iota
	// FailedFast: the connection closed while the query was in flight, or
	// the connect failed (refused), as Pinot's channelInactive /
	// send-exception paths do.
	FailedFast
	// TimedOut: no response by the query's deadline; the connection is
	// left open, as Pinot does. A query that could not even take the
	// channel lock in time (a connect holding it) also ends here, with
	// ErrLockTimeout.
	TimedOut
	// Canceled: the caller's context was canceled first.
	Canceled
)

func (o Outcome) String() string {
	switch o {
	case OK:
		return "ok"
	case FailedFast:
		return "failed fast"
	case TimedOut:
		return "timed out"
	case Canceled:
		return "canceled"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Result is the outcome of one query.
type Result struct {
	Outcome Outcome
	ID      int64
	Latency time.Duration
	Err     error // why it failed or timed out
}

// BrokerStats are the broker's counters since it started.
type BrokerStats struct {
	Sent       int64 // queries submitted to Query
	OK         int64
	FailedFast int64
	TimedOut   int64
	Canceled   int64
	Connects   int64 // connections established
	DialErrors int64 // connects that failed
	Closes     int64 // cached connections that closed
	Late       int64 // responses for queries no longer waiting (dropped)
	// QueueBytes is what sits in outbound queues now, not yet accepted by
	// the kernel; PeakQueueBytes is the most it ever reached.
	QueueBytes     int64
	PeakQueueBytes int64
}

// Errors a Result may carry.
var (
	ErrBrokerClosed = errors.New("pinotsim: broker closed")
	ErrTimeout      = errors.New("pinotsim: query timed out")
	ErrLockTimeout  = errors.New("pinotsim: timeout while acquiring channel lock")
)

// Broker is a simulated Pinot broker as it behaved in the incidents: one
// cached connection per server address with every query pipelined on it;
// a query that times out leaves the connection open; the
// outbound queue is unbounded and drained by a writer goroutine with no
// write timeout; a connection is replaced only once it is closed, and its
// closing fails every in-flight query at once.
type Broker struct {
	cfg      BrokerConfig
	segments []string
	idBase   int64
	seq      atomic.Int64

	mu     sync.Mutex
	routes map[string]*route
	live   map[*brokerConn]struct{} // every open connection
	closed bool
	wg     sync.WaitGroup // every connection's reader and writer

	sent, ok, failed, timedOut, canceled atomic.Int64
	connects, dialErrs, closes, late     atomic.Int64
	queue, peak                          atomic.Int64
}

// route is the cached connection to one server address. lock is Pinot's
// ServerChannel._channelLock: held while connecting, taken with a timeout.
type route struct {
	lock chan struct{}
	conn atomic.Pointer[brokerConn] // replaced only while holding lock
}

// NewBroker returns a broker with no connections yet.
func NewBroker(cfg BrokerConfig) *Broker {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 3 * time.Second
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 30 * time.Second
	}
	if cfg.ID == "" {
		cfg.ID = "Broker_pinotsim"
	}
	if cfg.Table == "" {
		cfg.Table = "t_REALTIME"
	}
	b := &Broker{
		cfg:    cfg,
		routes: make(map[string]*route),
		live:   make(map[*brokerConn]struct{}),
		// BrokerRequestIdGenerator: rand(0..2^31-1)*1e9 + counter%1e9.
		idBase: rand.Int64N(1<<31) * 1_000_000_000,
	}
	b.segments = SegmentsFor(cfg.Table, cfg.RequestSize)
	return b
}

// SegmentsFor returns segment names, in the style of realtime segment
// names, enough for a request payload of about size bytes.
func SegmentsFor(table string, size int) []string {
	var segs []string
	n := 30 + len(table) // the least the rest of a request takes
	for i := 0; n < size; i++ {
		s := fmt.Sprintf("%s__%d__%d__20260101T0000Z", table, i%16, i/16)
		segs = append(segs, s)
		n += 1 + len(s) // uvarint length (names are short) + bytes
	}
	return segs
}

// Config returns the broker's configuration with defaults filled in.
func (b *Broker) Config() BrokerConfig { return b.cfg }

// Stats returns a snapshot of the counters.
func (b *Broker) Stats() BrokerStats {
	return BrokerStats{
		Sent: b.sent.Load(), OK: b.ok.Load(), FailedFast: b.failed.Load(),
		TimedOut: b.timedOut.Load(), Canceled: b.canceled.Load(),
		Connects: b.connects.Load(), DialErrors: b.dialErrs.Load(), Closes: b.closes.Load(),
		Late: b.late.Load(), QueueBytes: b.queue.Load(), PeakQueueBytes: b.peak.Load(),
	}
}

// Connected reports whether the broker holds an open connection to addr.
func (b *Broker) Connected(addr string) bool {
	b.mu.Lock()
	r := b.routes[addr]
	b.mu.Unlock()
	if r == nil {
		return false
	}
	c := r.conn.Load()
	return c != nil && !c.isClosed()
}

// Query sends one query to the server at addr on the cached connection
// (connecting first if there is none or it is closed) and waits for its
// response, its timeout, or the connection's close.
func (b *Broker) Query(ctx context.Context, addr string) Result {
	start := time.Now()
	b.sent.Add(1)
	deadline := start.Add(b.cfg.Timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	res := b.query(ctx, addr, start, deadline)
	res.Latency = time.Since(start)
	switch res.Outcome {
	case OK:
		b.ok.Add(1)
	case FailedFast:
		b.failed.Add(1)
	case TimedOut:
		b.timedOut.Add(1)
	case Canceled:
		b.canceled.Add(1)
	}
	return res
}

// query sends one query to addr over the route's cached connection
// (connecting it first if needed, holding the route's lock as Pinot's
// channel lock) and waits for its answer until deadline.
func (b *Broker) query(ctx context.Context, addr string, start, deadline time.Time) Result {
	r := b.routeTo(addr)
	if r == nil {
		return Result{Outcome: FailedFast, Err: ErrBrokerClosed}
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()

	// The request is serialized before the channel lock is taken, as
	// Pinot's ServerChannels.sendRequest does: the lock is held only to
	// connect and queue, so a large request does not make the queries
	// behind it wait out their timeout for the lock.
	id, frame := b.frame(start, deadline)

	// Take the channel lock, with the query's remaining time.
	select {
	case r.lock <- struct{}{}:
	case <-timer.C:
		return Result{Outcome: TimedOut, Err: ErrLockTimeout}
	case <-ctx.Done():
		return ctxResult(ctx)
	}
	c, res := b.connected(ctx, r, addr, deadline)
	if c == nil {
		return res
	}
	ch, err := c.send(id, frame)
	<-r.lock
	if err != nil {
		return Result{Outcome: FailedFast, ID: id, Err: err}
	}
	return b.await(ctx, timer, c, id, ch)
}

// routeTo is the route to addr, made on first use; nil once the broker
// is closed.
func (b *Broker) routeTo(addr string) *route {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	r := b.routes[addr]
	if r == nil {
		r = &route{lock: make(chan struct{}, 1)}
		b.routes[addr] = r
	}
	return r
}

// connected returns r's connection, holding r's lock: connectWithoutLocking
// dials only when it is null or inactive, synchronously, with the lock
// held. If the dial fails it releases the lock and returns nil and the
// query's result.
func (b *Broker) connected(ctx context.Context, r *route, addr string, deadline time.Time) (*brokerConn, Result) {
	c := r.conn.Load()
	if c != nil && !c.isClosed() {
		return c, Result{}
	}
	dctx, cancel := context.WithDeadline(ctx, minTime(deadline, time.Now().Add(b.cfg.DialTimeout)))
	var d net.Dialer
	nc, err := d.DialContext(dctx, "tcp", addr)
	cancel()
	if err != nil {
		<-r.lock
		b.dialErrs.Add(1)
		if ctx.Err() != nil {
			return nil, ctxResult(ctx)
		}
		if !time.Now().Before(deadline) {
			return nil, Result{Outcome: TimedOut, Err: err}
		}
		return nil, Result{Outcome: FailedFast, Err: err}
	}
	c = b.newConn(addr, nc)
	if c == nil {
		<-r.lock
		return nil, Result{Outcome: FailedFast, Err: ErrBrokerClosed}
	}
	r.conn.Store(c)
	b.connects.Add(1)
	return c, Result{}
}

// frame is the framed request for a query sent at start with its
// deadline, and the query's id.
func (b *Broker) frame(start, deadline time.Time) (int64, []byte) {
	id := b.idBase + b.seq.Add(1)%1_000_000_000
	req := Request{
		ID: id, Table: b.cfg.Table, Segments: b.segments, BrokerID: b.cfg.ID,
		CID: fmt.Sprint(id), SentAt: start, Deadline: deadline,
	}
	if !b.cfg.OmitTimeoutOption {
		req.TimeoutMs = remainingMs(deadline, time.Now())
	}
	frame := AppendRequest(make([]byte, HeaderLen, HeaderLen+b.cfg.RequestSize+256), &req)
	binary.BigEndian.PutUint32(frame, uint32(len(frame)-HeaderLen))
	return id, frame
}

// await waits for the answer to query id on ch until timer fires or ctx
// ends; an answer that came as the wait ended still counts.
func (b *Broker) await(ctx context.Context, timer *time.Timer, c *brokerConn, id int64, ch chan error) Result {
	select {
	case err := <-ch:
		return answered(id, err)
	case <-timer.C:
		if err, done := c.forget(id, ch); done {
			return answered(id, err)
		}
		return Result{Outcome: TimedOut, ID: id, Err: ErrTimeout}
	case <-ctx.Done():
		if err, done := c.forget(id, ch); done {
			return answered(id, err)
		}
		res := ctxResult(ctx)
		res.ID = id
		return res
	}
}

// answered is the result of query id answered with err (nil: a response).
func answered(id int64, err error) Result {
	if err != nil {
		return Result{Outcome: FailedFast, ID: id, Err: err}
	}
	return Result{Outcome: OK, ID: id}
}

// ctxResult is the result of a query whose ctx ended: timed out at its
// deadline, else canceled.
func ctxResult(ctx context.Context) Result {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return Result{Outcome: TimedOut, Err: ErrTimeout}
	}
	return Result{Outcome: Canceled, Err: ctx.Err()}
}

// remainingMs is the budget left at now, in whole milliseconds (truncated,
// as Pinot's broker computes it from millisecond clocks), and at least 1:
// 0 would mean "no option", and a broker never sends a query with nothing
// left (Pinot fails it before the scatter; the simulator sends it anyway
// and lets its timer end it).
func remainingMs(deadline, now time.Time) int64 {
	return max(deadline.Sub(now).Milliseconds(), 1)
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// Close closes every connection (in-flight queries fail fast) and waits
// for the broker's goroutines. Queries after Close fail fast. Idempotent.
func (b *Broker) Close() error {
	b.mu.Lock()
	b.closed = true
	b.mu.Unlock()
	b.closeAll()
	b.wg.Wait()
	return nil
}

// brokerConn is one cached connection: a writer goroutine drains the
// unbounded outbound queue, a reader goroutine matches responses by id.
type brokerConn struct {
	b    *Broker
	addr string
	c    net.Conn

	mu      sync.Mutex
	cond    sync.Cond // the writer waits for frames or close
	pending map[int64]chan error
	frames  [][]byte
	queued  int64
	closed  bool
	err     error
}

// newConn starts the connection's goroutines; nil once the broker closed.
func (b *Broker) newConn(addr string, nc net.Conn) *brokerConn {
	c := &brokerConn{b: b, addr: addr, c: nc, pending: make(map[int64]chan error)}
	c.cond.L = &c.mu
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		_ = nc.Close()
		return nil
	}
	b.live[c] = struct{}{}
	b.wg.Add(2)
	b.mu.Unlock()
	go c.writeLoop()
	go c.readLoop()
	return c
}

func (b *Broker) closeAll() {
	b.mu.Lock()
	cs := make([]*brokerConn, 0, len(b.live))
	for c := range b.live {
		cs = append(cs, c)
	}
	b.mu.Unlock()
	for _, c := range cs {
		c.close(ErrBrokerClosed)
	}
}

func (c *brokerConn) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// send registers id as in flight and queues its frame, without bound.
func (c *brokerConn) send(id int64, frame []byte) (chan error, error) {
	ch := make(chan error, 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, c.err
	}
	c.pending[id] = ch
	c.frames = append(c.frames, frame)
	c.queued += int64(len(frame))
	c.b.addQueue(int64(len(frame)))
	c.cond.Signal()
	return ch, nil
}

// forget drops id from the in-flight set after its timeout. If the answer
// (or the close) won the race, it reports it with done.
func (c *brokerConn) forget(id int64, ch chan error) (err error, done bool) {
	c.mu.Lock()
	_, waiting := c.pending[id]
	delete(c.pending, id)
	c.mu.Unlock()
	if waiting {
		return nil, false
	}
	return <-ch, true
}

func (b *Broker) addQueue(n int64) {
	v := b.queue.Add(n)
	for {
		p := b.peak.Load()
		if v <= p || b.peak.CompareAndSwap(p, v) {
			return
		}
	}
}

// close closes the connection once: every in-flight query fails at once
// (channelInactive) and the queued frames are dropped.
func (c *brokerConn) close(err error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	c.err = fmt.Errorf("connection to %s closed: %w", c.addr, err)
	pending := c.pending
	c.pending = nil
	dropped := c.queued
	c.b.addQueue(-c.queued)
	c.queued = 0
	c.frames = nil
	c.cond.Broadcast()
	c.mu.Unlock()

	_ = c.c.Close()
	for _, ch := range pending {
		ch <- c.err
	}
	b := c.b
	b.mu.Lock()
	delete(b.live, c)
	b.mu.Unlock()
	b.closes.Add(1)
	if b.cfg.OnClose != nil {
		b.cfg.OnClose(ConnClose{Addr: c.addr, At: time.Now(), Err: err, FailedFast: len(pending), QueuedBytes: dropped})
	}
}

// writeLoop writes queued frames one at a time, with no write timeout: a
// peer that stops reading blocks it for as long as the connection lives.
func (c *brokerConn) writeLoop() {
	defer c.b.wg.Done()
	for {
		c.mu.Lock()
		for len(c.frames) == 0 && !c.closed {
			c.cond.Wait()
		}
		if c.closed {
			c.mu.Unlock()
			return
		}
		f := c.frames[0]
		c.mu.Unlock()

		_, err := c.c.Write(f)

		c.mu.Lock()
		if !c.closed {
			c.frames[0] = nil
			c.frames = c.frames[1:]
			c.queued -= int64(len(f))
			c.b.addQueue(-int64(len(f)))
		}
		c.mu.Unlock()
		if err != nil {
			c.close(err)
			return
		}
	}
}

// readLoop matches responses to in-flight queries by requestId; a response
// for a query no longer waiting is dropped, as Pinot does.
func (c *brokerConn) readLoop() {
	defer c.b.wg.Done()
	br := bufio.NewReader(c.c)
	for {
		p, err := ReadFrame(br, c.b.cfg.MaxFrame)
		if err != nil {
			c.close(err)
			return
		}
		id, err := ResponseID(p)
		if err != nil {
			continue // DATA_TABLE_DESERIALIZATION_EXCEPTIONS: metered, ignored
		}
		c.mu.Lock()
		ch, ok := c.pending[id]
		delete(c.pending, id)
		c.mu.Unlock()
		if ok {
			ch <- nil
		} else {
			c.b.late.Add(1)
		}
	}
}
