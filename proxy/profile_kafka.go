package proxy

import (
	"errors"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/kafkawire"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// The kafka profile: a Kafka connection's requests are answered one at a
// time, in order, each matched to its request by correlation id; a
// request may be held by the broker for as long as its own fields say
// (KAFKA.md), or, for a SyncGroup and a transaction's requests, the
// JoinGroup or InitProducerId sent before it on the same connection.

// kafkaReaders are the kafka profile's frame readers (see profiles).
func kafkaReaders(c *conv) (req, resp flow.FrameReader) {
	return &requestReader[kafkawire.Request]{c: c, first: kafkaFirstWindow,
		parse: kafkawire.ParseRequest, record: (*conv).kafkaRequest}, &kafkaResponses{c: c}
}

// maxOutstanding bounds the entries a link keeps for matching Kafka
// responses; past it a new request joins the newest entry (see
// outstanding). Java clients keep at most 5 in flight per connection by
// default.
const maxOutstanding = 1024

// kafkaFirstWindow is how much of a Kafka request the reader asks for
// first: enough for the header and the body fields of a request with a
// client id of a usual length.
const kafkaFirstWindow = 128

const kafkaSyncGroup = 14

// kafkaAddPartitionsToTxn is the api_key of AddPartitionsToTxn.
const kafkaAddPartitionsToTxn = 24

// maxTxnIDs bounds the transactional ids a link remembers a transaction
// timeout for. A client has one per producer, and the usual clients one
// producer per connection; a request of an id not remembered gets the
// bound kafkawire gives it without (transaction.max.timeout.ms).
const maxTxnIDs = 16

// outstanding is a Kafka request that expects a response; past
// maxOutstanding, the requests that joined the newest entry too (n of
// them: responses still come in order and count them off, only the
// first's correlation id is checked, and the entry's deadline is the
// first's, so the oldest request still gives the verdict).
type outstanding struct {
	id   int32 // correlation id (of the first)
	n    int32 // requests in the entry
	hold int64 // how long the broker may hold it once it starts on it, nanoseconds; the longest of the entry's
	due  int64 // mono deadline; never: not judged
	end  int64 // stream offset just past its last byte
	// joined: the entry's first request was answered; the others' ids
	// were not kept.
	joined bool
	// key and version of the (first) request: they say where its
	// response carries a throttle.
	key, version int16
}

// kafkaRequest records a parsed Kafka request whose last byte is at end.
func (c *conv) kafkaRequest(r *kafkawire.Request, end int64) {
	if r.SASLRaw {
		c.untrack(metrics.UntrackedSASL, nil)
		return
	}
	if r.NoResponse {
		return // Produce with acks=0: the broker sends nothing back
	}
	hold, known := c.kafkaHold(r)
	c.mu.Lock()
	if c.off.Load() {
		c.mu.Unlock()
		return
	}
	// The broker answers a connection's requests one at a time, in order:
	// a request cannot be answered before the one ahead of it, so it is
	// not due before that one is. It is due no later either than its own
	// deadline, or that one's: the answer to the request ahead comes after
	// this one was sent, so it covers this one (any answer since a request
	// was sent is life, see tracker). Queued requests therefore do not add
	// their deadlines up: the first one past its own is the evidence. A
	// request the broker may hold is the exception: its hold begins only
	// when the broker starts on it, once the one ahead is answered, and
	// kafkaResponse moves its deadline then (started).
	due := int64(flow.Never)
	if known {
		due = addDue(c.sendAt, int64(hold), c.rt)
		if c.mutedUntil > c.sendAt {
			// Sent while the broker throttles the connection (a client
			// that does not wait out the throttle, KIP-219): the broker
			// reads it, and starts on it, only once the throttle is over.
			due = max(due, addDue(c.mutedUntil, int64(hold), c.rt))
		}
		if c.head < len(c.queue) {
			due = max(due, c.queue[len(c.queue)-1].due)
		}
	}
	if c.head > 0 && 2*c.head >= len(c.queue) {
		// Keep the queue's memory bounded by what is outstanding.
		c.queue = c.queue[:copy(c.queue, c.queue[c.head:])]
		c.head = 0
	}
	h := int64(hold)
	if !known {
		h = -1
	}
	if len(c.queue)-c.head >= maxOutstanding {
		l := &c.queue[len(c.queue)-1]
		l.n++
		l.due, l.end = max(l.due, due), end
		if l.hold >= 0 && h >= 0 {
			l.hold = max(l.hold, h)
		} else {
			l.hold = -1 // one of them unknown: the entry is never judged
		}
	} else {
		c.queue = append(c.queue, outstanding{id: r.CorrelationID, n: 1, hold: h, due: due, end: end,
			key: r.APIKey, version: r.APIVersion})
	}
	// The broker may hold it until request_timeout before it is due;
	// its own response (matched in order) covers it before that.
	var abandoned int64
	if kafkaTxnCoordinator(r) {
		// A transaction's hold (up to its timeout, 15 minutes unknown)
		// outlasts the client's own wait (request.timeout.ms, 30 s in
		// Java): a client that gives up and closes would leave a stopped
		// coordinator unjudged for good. Abandoned so, the request is
		// judged by the bound it had before the transaction's timeout was
		// read: 5 s and request_timeout.
		abandoned = addDue(c.sendAt, int64(kafkaTxnAbandonedHold))
	}
	c.trackAbandonable(due-c.rt, due, abandoned, end, 1)
	c.mu.Unlock()
}

// kafkaTxnAbandonedHold is how long a transaction-coordinator request is
// held once its client abandoned it (see kafkaRequest): the bound the
// profile gave these requests before it read their transaction's timeout.
const kafkaTxnAbandonedHold = 5 * time.Second

// kafkaTxnCoordinator reports whether r is a request the transaction
// coordinator holds for its transaction's timeout: InitProducerId with a
// transactional id, AddPartitionsToTxn, AddOffsetsToTxn, EndTxn.
func kafkaTxnCoordinator(r *kafkawire.Request) bool {
	return r.TxnTimeout > 0 || r.TxnBound || r.APIKey == kafkaAddPartitionsToTxn
}

// kafkaHold returns how long the broker may hold request r once it starts
// on it (known false: a time the proxy does not know), from r's own fields
// or what the link's earlier requests said, and remembers what r says of
// the later ones. Only the request pump calls it.
func (c *conv) kafkaHold(r *kafkawire.Request) (hold time.Duration, known bool) {
	hold, known = r.Hold, !r.HoldUnknown
	if r.APIKey == kafkaSyncGroup && c.rebalance > 0 {
		// SyncGroup is parked until the group's rebalance completes: bound
		// it as the member's JoinGroup was.
		hold, known = kafkawire.GroupHold(c.rebalance), true
	}
	if r.RebalanceTimeout > 0 {
		c.rebalance = r.RebalanceTimeout
	}
	if t, ok := c.txnTimeouts[r.TxnID]; ok && r.TxnBound {
		// The transaction coordinator writes to its log with the
		// transaction's own timeout, the one the producer's InitProducerId
		// on this link set: bound it by that, not by the broker's maximum.
		// (Had another producer's InitProducerId for the same id set a
		// longer one since, this producer would be fenced: answered at
		// once, with no write.)
		hold = t
	}
	if r.TxnTimeout > 0 {
		c.txnTimeout(r.TxnID, r.TxnTimeout)
	}
	return hold, known
}

// txnTimeout remembers the transaction timeout an InitProducerId on the
// link asked for its transactional id: the longest one asked, since a
// failed InitProducerId leaves the transaction its earlier timeout.
func (c *conv) txnTimeout(id uint64, t time.Duration) {
	if old, ok := c.txnTimeouts[id]; ok {
		c.txnTimeouts[id] = max(old, t)
		return
	}
	if len(c.txnTimeouts) >= maxTxnIDs {
		return // its requests keep kafkawire's bound
	}
	if c.txnTimeouts == nil {
		c.txnTimeouts = make(map[uint64]time.Duration)
	}
	c.txnTimeouts[id] = t
}

// holding reports whether a Kafka broker may be holding this connection's
// oldest outstanding request, within its own deadline, at mono time now.
// A broker stops reading a connection while it works on a request, so
// while it holds one (a Produce waiting for its replicas, up to timeout_ms)
// nothing more is acknowledged: no evidence of a stall.
func (c *conv) holding(now int64) bool {
	if !c.kafka || c.off.Load() {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.head < len(c.queue) && c.queue[c.head].due > now
}

// kafkaResponse matches a response to the oldest outstanding request and
// returns that request's api key and version; ok false when the response
// matched none, or a request that joined an entry past maxOutstanding
// (whose key was not kept).
func (c *conv) kafkaResponse(id int32) (key, version int16, ok bool) {
	c.mu.Lock()
	if c.head == len(c.queue) {
		c.mu.Unlock()
		c.untrack(metrics.UntrackedDesync, nil)
		return 0, 0, false
	}
	h := &c.queue[c.head]
	if h.id != id && !h.joined {
		c.mu.Unlock()
		c.untrack(metrics.UntrackedDesync, nil)
		return 0, 0, false
	}
	key, version, ok = h.key, h.version, !h.joined
	if h.n > 1 {
		h.n, h.joined = h.n-1, true
	} else {
		c.lk.trk.AnsweredThrough(h.end)
		c.answered = h.end
		c.head++
		if c.head == len(c.queue) {
			c.queue, c.head = c.queue[:0], 0
		}
	}
	c.starting = true // once the response is read to its end (kafkaAnswered)
	c.mu.Unlock()
	return key, version, ok
}

// kafkaAnswered: the response kafkaResponse matched has been read to its
// end, at mono time now, with a throttle (nanoseconds; 0: none) that the
// broker applies after sending it (KIP-219). A broker writes a response
// whole before it reads the connection's next request: it starts on that
// one only now, or, throttled, only once the throttle is over: it mutes
// the connection for it once it has sent the response (seen here a
// little after it did).
func (c *conv) kafkaAnswered(now, throttle int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.starting {
		return
	}
	c.starting = false
	start := now
	if throttle > 0 {
		start = now + throttle
		c.mutedUntil = start
	}
	if c.head < len(c.queue) {
		c.startedLocked(now, start)
	}
}

// startedLocked: the one ahead of the oldest outstanding request was
// answered at mono time now, and the broker starts on it at start (it
// answers a connection's requests one at a time; past maxOutstanding,
// the next of the entry's requests): now, or the end of a throttle. A
// request it may hold is due its hold and request_timeout from start, if
// that is later than it was due: a Fetch queued behind a Fetch the broker
// held for its whole max_wait may be held for its own too. The requests
// behind it cannot be due before it. While the connection is muted for a
// throttle (start after now), every request is due from its end: the
// answer just given does not cover a request the broker has not read.
// c.mu is held.
func (c *conv) startedLocked(now, start int64) {
	next := &c.queue[c.head]
	if next.hold < 0 || (next.hold == 0 && start == now) {
		// Its own hold unknown: never judged. Or nothing held: the
		// answer just given covers it (see kafkaRequest).
		return
	}
	due := addDue(start, next.hold, c.rt)
	if next.due == flow.Never {
		// It queued behind a request whose hold is unknown and took that
		// one's "never" (kafkaRequest), so the tracker never had it. That
		// one is answered: its own clock starts.
		next.due = due
		c.lk.trk.Sent(flow.PendingRequest{At: now, Held: due - c.rt, Due: due, End: next.end, N: next.n, Thr: c.thr})
		return
	}
	if due <= next.due {
		return
	}
	for i := c.head; i < len(c.queue) && c.queue[i].due < due; i++ {
		c.queue[i].due = due
	}
	c.lk.trk.Extend(c.answered, due-c.rt, due)
}

// kafkaResponses reads Kafka response frames: their correlation id, and
// the throttle of a response whose broker mutes the connection after it
// (kafkawire.ThrottleAfter).
type kafkaResponses struct {
	c *conv
	n int64 // the frame's payload size
	// key and version of the request answered, once matched; key < 0
	// before.
	key, version int16
	throttle     int64 // the response's, in nanoseconds; 0: none
}

func (r *kafkaResponses) Begin(n int64) flow.Window {
	if n < 4 {
		r.c.untrack(metrics.UntrackedProtocol, errors.New("a response frame too short for a correlation id"))
		return flow.Window{}
	}
	r.n, r.key, r.throttle = n, -1, 0
	return flow.Window{Need: 4}
}

func (r *kafkaResponses) Read(b []byte) flow.Window {
	if r.key < 0 {
		id, ok := kafkawire.ResponseCorrelationID(b)
		if !ok {
			return flow.Window{}
		}
		key, version, ok := r.c.kafkaResponse(id)
		if !ok || !kafkawire.ThrottleAfter(key, version) {
			return flow.Window{}
		}
		r.key, r.version = key, version
	}
	ms, need, err := kafkawire.ResponseThrottle(r.key, r.version, b, int64(len(b)) >= r.n)
	switch {
	case err != nil:
		// Not read (a layout this package does not read, or a response
		// that is not one): the connection is judged as unthrottled.
		return flow.Window{}
	case need > len(b):
		return flow.Window{Need: need} // the same bytes and more
	case need > 0:
		return flow.Window{} // more than a window holds: not read
	case ms > 0:
		// In full, as KIP-219 asks of clients and franz-go's honours it:
		// Kafka bounds only its request-time quota's throttles; a
		// bandwidth quota's grows with the overshoot, and the broker
		// reads nothing for all of it.
		r.throttle = int64(ms) * int64(time.Millisecond)
		r.c.lk.m.KafkaThrottles.Inc()
	}
	return flow.Window{}
}

func (r *kafkaResponses) End(int64) { r.c.kafkaAnswered(flow.Mono(), r.throttle) }
