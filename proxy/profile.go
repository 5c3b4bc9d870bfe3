package proxy

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/livenessproxy/livenessproxy/internal/kafkawire"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/pinotwire"
	"github.com/livenessproxy/livenessproxy/policy"
)

// pinotTimeoutSlack is added to a Pinot request's own timeoutMs: the
// server answers with a timeout error once the budget is spent, and the
// answer still has to be serialized and sent.
const pinotTimeoutSlack = time.Second

// maxOutstanding bounds the Kafka requests a link remembers for matching;
// past it the link is no longer tracked. Java clients keep at most 5 in
// flight per connection by default.
const maxOutstanding = 1024

// kafkaFirstWindow is how much of a Kafka request the reader asks for
// first: enough for the header and the body fields of a request with a
// client id of a usual length.
const kafkaFirstWindow = 128

// pinotFirstWindow is the same for a Pinot InstanceRequest: the id, and
// usually the query options.
const pinotFirstWindow = 2 << 10

// outstanding is a Kafka request that expects a response.
type outstanding struct {
	id  int32 // correlation id
	due int64 // mono deadline; never: not judged
	end int64 // stream offset just past its last byte
}

// conv is a link's protocol state under a profile: what the request pump
// learned that the response pump needs, and whether the link is still
// tracked. The pumps each own their scanner; conv is what they share.
type conv struct {
	lk  *link
	thr int32
	rt  int64 // request_timeout in nanoseconds

	// off: the link is no longer tracked; both pumps stop scanning.
	off atomic.Bool
	// kafka, profile: the framing is Kafka's; is a protocol profile.
	kafka, profile bool

	// sendAt is the mono time of the read being scanned by the request
	// pump (only it reads and writes it).
	sendAt int64

	mu        sync.Mutex
	queue     []outstanding // Kafka: requests awaiting a response, in order
	head      int           // queue[head:] are outstanding
	rebalance time.Duration // Kafka: the last JoinGroup's rebalance timeout on this link
}

// untrack stops tracking the link: it is still proxied, byte for byte,
// and what it recorded is forgotten. Requests are recorded under c.mu
// after checking off, so none is recorded after this returns.
func (c *conv) untrack(reason string, err error) {
	c.mu.Lock()
	if c.off.Load() {
		c.mu.Unlock()
		return
	}
	c.off.Store(true)
	c.queue, c.head = nil, 0
	c.mu.Unlock()
	c.lk.trk.Clear()
	c.lk.host.untracked(c.lk, reason, err)
	if reason == metrics.UntrackedTLS {
		c.lk.host.sawTLS(c.lk.ep)
	}
}

// untrackFor maps a reader's parse error to an untrack reason.
func (c *conv) untrackFor(err error) {
	switch {
	case errors.Is(err, kafkawire.ErrUnknownVersion):
		c.untrack(metrics.UntrackedVersion, err)
	case errors.Is(err, kafkawire.ErrTooLong), errors.Is(err, pinotwire.ErrTooLong):
		c.untrack(metrics.UntrackedLimit, err)
	default:
		c.untrack(metrics.UntrackedProtocol, err)
	}
}

// track records one request that the server may hold until held and that
// expects an answer by due; c.mu is held.
func (c *conv) trackLocked(held, due, end int64, n int32) {
	if due != flow.Never {
		c.lk.trk.Sent(flow.PendingRequest{At: c.sendAt, Held: held, Due: due, End: end, N: n, Thr: c.thr})
	}
}

// frames records n requests of unknown protocol (length_field framing),
// the last ending at end: each expects an answer within request_timeout.
func (c *conv) frames(n int, end int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.off.Load() {
		c.trackLocked(c.sendAt, c.sendAt+c.rt, end, int32(n))
	}
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

// pinotRequest records a parsed Pinot InstanceRequest: due by its own
// timeoutMs, or request_timeout when it carries none.
func (c *conv) pinotRequest(r *pinotwire.Request, end int64) {
	due := addDue(c.sendAt, c.rt)
	if r.HasTimeout {
		due = addDue(c.sendAt, int64(r.Timeout), int64(pinotTimeoutSlack))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.off.Load() {
		// Covered by any answer after it was sent: Pinot servers answer
		// out of order and answers are not matched to requests, so an
		// answer to this one could not be told from another's.
		c.trackLocked(c.sendAt, due, end, 1)
	}
}

const kafkaSyncGroup = 14

// addDue adds durations to a mono time, saturating at never: a request
// that asks for a longer hold than any deadline can express is never
// judged, rather than wrapping round to a deadline in the past.
func addDue(at int64, ds ...int64) int64 {
	due := at
	for _, d := range ds {
		if due == flow.Never || d < 0 || d > flow.Never-due {
			return flow.Never
		}
		due += d
	}
	return due
}

// requestReader reads one profile's request frames: it asks for the
// first bytes of each, then for as many as the profile's parser needs, and
// records the request when its frame ends.
type requestReader[R any] struct {
	c      *conv
	first  int // the first window: enough for most requests
	parse  func(b []byte, complete bool) (R, int, error)
	record func(c *conv, r *R, end int64)

	n      int64 // the frame's payload length
	req    R
	parsed bool
}

func (r *requestReader[R]) Begin(n int64) flow.Window {
	r.n, r.parsed = n, false
	return flow.Window{Need: int(min(n, int64(r.first)))}
}

func (r *requestReader[R]) Read(b []byte) flow.Window {
	req, need, err := r.parse(b, int64(len(b)) == r.n)
	switch {
	case err != nil:
		r.c.untrackFor(err)
	case need > 0:
		return flow.Window{Need: need}
	default:
		r.req, r.parsed = req, true
	}
	return flow.Window{}
}

func (r *requestReader[R]) End(off int64) {
	if r.c.off.Load() {
		return
	}
	if !r.parsed {
		r.c.untrack(metrics.UntrackedProtocol, errors.New("a request frame too short for the protocol's header"))
		return
	}
	r.record(r.c, &r.req, off)
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

// newConv sets up request tracking for a framed link (its scanners are
// set): under a profile, with the protocol's readers.
func newConv(lk *link) *conv {
	c := &conv{lk: lk, thr: int32(lk.settings.Unanswered.ConsecutiveTimeoutsThreshold), rt: int64(lk.settings.Unanswered.RequestTimeout.D()),
		kafka: lk.settings.Framing.Type == policy.FramingKafka, profile: policy.IsProfile(lk.settings.Framing.Type)}
	switch lk.settings.Framing.Type {
	case policy.FramingKafka:
		lk.reqScan.Rd = &requestReader[kafkawire.Request]{c: c, first: kafkaFirstWindow,
			parse: kafkawire.ParseRequest, record: (*conv).kafkaRequest}
		lk.respScan.Rd = &kafkaResponses{c: c}
	case policy.FramingPinot:
		lk.reqScan.Rd = &requestReader[pinotwire.Request]{c: c, first: pinotFirstWindow,
			parse: pinotwire.ParseRequest, record: (*conv).pinotRequest}
	}
	return c
}

// untracked counts a link that stopped being tracked and says so in the
// log: once per listener and reason at info, every link at debug.
func (l *listener) untracked(lk *link, reason string, err error) {
	if c := l.m.Untracked(reason); c != nil {
		c.Inc()
	}
	if _, seen := l.untrackedSeen.LoadOrStore(reason, true); !seen {
		l.log.Info().Str("reason", reason).AnErr("cause", err).Str("endpoint", lk.ep.addr).
			Str("client", lk.client.RemoteAddr().String()).
			Msg("link no longer tracked, still proxied (logged once per reason; untracked_links_total counts them)")
		return
	}
	l.log.Debug().Str("reason", reason).AnErr("cause", err).Str("endpoint", lk.ep.addr).
		Str("client", lk.client.RemoteAddr().String()).Msg("link no longer tracked, still proxied")
}
