package proxy

import (
	"errors"

	"github.com/livenessproxy/livenessproxy/internal/kafkawire"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// The kafka profile: a Kafka connection's requests are answered one at a
// time, in order, each matched to its request by correlation id; a
// request may be held by the broker for as long as its own fields say
// (KAFKA.md).

// kafkaReaders are the kafka profile's frame readers (see profiles).
func kafkaReaders(c *conv) (req, resp flow.FrameReader) {
	return &requestReader[kafkawire.Request]{c: c, first: kafkaFirstWindow,
		parse: kafkawire.ParseRequest, record: (*conv).kafkaRequest}, &kafkaResponses{c: c}
}

// maxOutstanding bounds the Kafka requests a link remembers for matching;
// past it the link is no longer tracked. Java clients keep at most 5 in
// flight per connection by default.
const maxOutstanding = 1024

// kafkaFirstWindow is how much of a Kafka request the reader asks for
// first: enough for the header and the body fields of a request with a
// client id of a usual length.
const kafkaFirstWindow = 128

const kafkaSyncGroup = 14

// outstanding is a Kafka request that expects a response.
type outstanding struct {
	id  int32 // correlation id
	due int64 // mono deadline; never: not judged
	end int64 // stream offset just past its last byte
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
	hold, known := r.Hold, !r.HoldUnknown
	if r.APIKey == kafkaSyncGroup && c.rebalance > 0 {
		// SyncGroup is parked until the group's rebalance completes: bound
		// it as the member's JoinGroup was.
		hold, known = c.rebalance+kafkawire.GroupLapse, true
	}
	if r.RebalanceTimeout > 0 {
		c.rebalance = r.RebalanceTimeout
	}
	c.mu.Lock()
	if c.off.Load() {
		c.mu.Unlock()
		return
	}
	if len(c.queue)-c.head >= maxOutstanding {
		c.mu.Unlock()
		c.untrack(metrics.UntrackedLimit, errors.New("too many requests outstanding"))
		return
	}
	// The broker answers a connection's requests one at a time, in order:
	// a request cannot be answered before the one ahead of it, so it is
	// not due before that one is. It is due no later either than its own
	// deadline, or that one's: the answer to the request ahead comes after
	// this one was sent, so it covers this one (any answer since a request
	// was sent is life, see tracker). Queued requests therefore do not add
	// their deadlines up: the first one past its own is the evidence.
	due := int64(flow.Never)
	if known {
		due = addDue(c.sendAt, int64(hold), c.rt)
		if c.head < len(c.queue) {
			due = max(due, c.queue[len(c.queue)-1].due)
		}
	}
	if c.head > 0 && 2*c.head >= len(c.queue) {
		// Keep the queue's memory bounded by what is outstanding.
		c.queue = c.queue[:copy(c.queue, c.queue[c.head:])]
		c.head = 0
	}
	c.queue = append(c.queue, outstanding{id: r.CorrelationID, due: due, end: end})
	// The broker may hold it until request_timeout before it is due;
	// its own response (matched in order) covers it before that.
	c.trackLocked(due-c.rt, due, end, 1)
	c.mu.Unlock()
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

// kafkaResponse matches a response to the oldest outstanding request.
func (c *conv) kafkaResponse(id int32) {
	c.mu.Lock()
	if c.head == len(c.queue) || c.queue[c.head].id != id {
		c.mu.Unlock()
		c.untrack(metrics.UntrackedDesync, nil)
		return
	}
	c.lk.trk.AnsweredThrough(c.queue[c.head].end)
	c.head++
	if c.head == len(c.queue) {
		c.queue, c.head = c.queue[:0], 0
	}
	c.mu.Unlock()
}

// kafkaResponses reads Kafka response frames: their correlation id.
type kafkaResponses struct{ c *conv }

func (r *kafkaResponses) Begin(n int64) flow.Window {
	if n < 4 {
		r.c.untrack(metrics.UntrackedProtocol, errors.New("a response frame too short for a correlation id"))
		return flow.Window{}
	}
	return flow.Window{Need: 4}
}

func (r *kafkaResponses) Read(b []byte) flow.Window {
	if id, ok := kafkawire.ResponseCorrelationID(b); ok {
		r.c.kafkaResponse(id)
	}
	return flow.Window{}
}

func (r *kafkaResponses) End(int64) {}
