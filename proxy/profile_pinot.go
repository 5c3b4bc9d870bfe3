package proxy

import (
	"errors"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/pinotwire"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// The pinot profile: a broker's InstanceRequests each carry their own
// timeout; servers answer out of order, so answers are not matched
// (PINOT.md).

// pinotReaders are the pinot profile's frame readers (see profiles): its
// responses are not read.
func pinotReaders(c *conv) (req, resp flow.FrameReader) {
	return &requestReader[pinotwire.Request]{c: c, first: pinotFirstWindow,
		parse: pinotwire.ParseRequest, record: (*conv).pinotRequest, skip: pinotSkip}, nil
}

// pinotSkip: a request whose timeout lies past the parser's prefix limit
// (a filter with a long IN list comes before the query options) is
// forwarded and left unjudged, its timeout unknown; so is a frame that is
// no InstanceRequest, which a server drops without a reply (PINOT.md). The
// link stays tracked. Pinot answers are not matched to requests, so no
// other verdict changes, and a broker keeps one connection per server for
// good: were the link untracked, a server that hangs later would never be
// judged on it.
func pinotSkip(err error) bool {
	return errors.Is(err, pinotwire.ErrTooLong) || errors.Is(err, pinotwire.ErrNotRequest)
}

// pinotTimeoutSlack is added to a Pinot request's own timeoutMs: the
// server answers with a timeout error once the budget is spent, and the
// answer still has to be serialized and sent.
const pinotTimeoutSlack = time.Second

// pinotFirstWindow is the same for a Pinot InstanceRequest: the id, and
// usually the query options.
const pinotFirstWindow = 2 << 10

// pinotServerDefaultTimeout is how long a Pinot server lets a query run
// that carries no timeoutMs (pinot.server.query.executor.timeout's
// default, PINOT.md).
const pinotServerDefaultTimeout = 15 * time.Second

// pinotRequest records a parsed Pinot InstanceRequest: due by its own
// timeoutMs, or, when it carries none, by the server's default timeout
// (request_timeout when that is longer: a server configured with a longer
// default), each with the slack.
func (c *conv) pinotRequest(r *pinotwire.Request, end int64) {
	due := addDue(c.sendAt, max(c.rt, int64(pinotServerDefaultTimeout)), int64(pinotTimeoutSlack))
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
