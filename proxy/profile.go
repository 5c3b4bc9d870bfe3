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
	// Kafka: per transactional id (kafkawire's TxnID), the longest
	// transaction timeout an InitProducerId on this link asked for; at most
	// maxTxnIDs entries. Like rebalance, only the request pump uses it.
	txnTimeouts map[uint64]time.Duration
	// Kafka: a response was matched and is being read (kafkaAnswered
	// starts the next request's hold at its end); answered is the stream
	// end of the last request answered in full.
	starting bool
	answered int64
	// Kafka: until when the broker reads nothing more from the
	// connection, for a throttle (mono; 0: not muted).
	mutedUntil int64
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
	c.trackAbandonable(held, due, 0, end, n)
}

// trackAbandonable is trackLocked for a request judged, once its client
// abandoned it, as held until abandoned instead (flow.PendingRequest's
// Abandoned; 0: not judged then); c.mu is held.
func (c *conv) trackAbandonable(held, due, abandoned, end int64, n int32) {
	if due != flow.Never {
		c.lk.trk.Sent(flow.PendingRequest{At: c.sendAt, Held: held, Due: due, End: end, N: n, Thr: c.thr, Abandoned: abandoned})
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
	// skip, when set, reports whether a parse error leaves only its own
	// request unjudged, the link tracked: under a profile whose answers
	// are not matched to requests (pinot), one request left out changes
	// no other verdict.
	skip func(error) bool

	n       int64 // the frame's payload length
	req     R
	parsed  bool
	skipped bool
	dropped bool // the scanner stopped reading the frame: no room in the budget
}

// Dropped: the scanner stopped reading the frame's head for want of room
// in the memory budget (flow.WindowDropper).
func (r *requestReader[R]) Dropped() { r.dropped = true }

func (r *requestReader[R]) Begin(n int64) flow.Window {
	r.n, r.parsed, r.skipped, r.dropped = n, false, false, false
	return flow.Window{Need: int(min(n, int64(r.first)))}
}

func (r *requestReader[R]) Read(b []byte) flow.Window {
	req, need, err := r.parse(b, int64(len(b)) == r.n)
	switch {
	case err != nil && r.skip != nil && r.skip(err):
		r.skipped = true
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
	if r.skipped {
		r.c.lk.m.RequestsUnjudged.Inc()
		return
	}
	if !r.parsed && r.dropped {
		r.c.untrack(metrics.UntrackedLimit, errors.New("the memory budget had no room for the head of a request that straddles reads"))
		return
	}
	if !r.parsed {
		r.c.untrack(metrics.UntrackedProtocol, errors.New("a request frame too short for the protocol's header"))
		return
	}
	r.record(r.c, &r.req, off)
}

// profiles are the protocol profiles, by framing type: each makes the
// frame readers of a link under it, the requests' and, where the profile
// matches responses to their requests, the responses' (nil otherwise).
// A new profile is a file with its readers (as profile_kafka.go,
// profile_pinot.go) and one entry here, beside its framing type in policy.
var profiles = map[string]func(c *conv) (req, resp flow.FrameReader){
	policy.FramingKafka: kafkaReaders,
	policy.FramingPinot: pinotReaders,
}

// newConv sets up request tracking for a framed link (its scanners are
// set): under a profile, with the protocol's readers.
func newConv(lk *link) *conv {
	c := &conv{lk: lk, thr: int32(lk.settings.Unanswered.ConsecutiveTimeoutsThreshold), rt: int64(lk.settings.Unanswered.RequestTimeout.D()),
		kafka: lk.settings.Framing.Type == policy.FramingKafka, profile: policy.IsProfile(lk.settings.Framing.Type)}
	if readers := profiles[lk.settings.Framing.Type]; readers != nil {
		req, resp := readers(c)
		lk.reqScan.Rd = req
		if resp != nil {
			lk.respScan.Rd = resp
		}
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
