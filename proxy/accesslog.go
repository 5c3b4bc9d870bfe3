package proxy

import (
	"sync/atomic"
)

// dialRecord is what a link's dial did, for its stats and the access log:
// the connect attempts it made (a pool's failover retries included), the
// upstream it tried last (the one that failed, when none connected), and
// how long the connect that succeeded took.
type dialRecord struct {
	attempts atomic.Int32
	tried    atomic.Pointer[string]
	connect  atomic.Int64 // nanoseconds; 0: no connect completed
}

// try records a connect attempt to ep.
func (d *dialRecord) try(ep *endpoint) {
	d.attempts.Add(1)
	d.tried.Store(&ep.dial)
}

// endedBy says who ended a link, HAProxy's first termination flag: the
// client (its FIN or an error on its socket), the upstream (its FIN or
// an error on its socket), or the proxy (every other reason: a timeout,
// the watermark, an eviction, a dial that failed, shutdown, ...).
func endedBy(reason CloseReason) string {
	switch reason {
	case CloseClientClosed, CloseClientError:
		return "client"
	case CloseUpstreamClosed, CloseUpstreamError:
		return "upstream"
	case "":
		return ""
	}
	return "proxy"
}

// logLinkEnd writes the access log line of a finished link (log.access: at
// info; without it at debug): the listener, client, upstream (the one the
// dial tried last when none connected), the termination (who ended it, the
// reason, the error), bytes each way under the names of bytes_total's
// direction, the connect time and attempts, the queue peak, when it opened
// and how long it lived.
func (l *listener) logLinkEnd(lk *link, s LinkStats) {
	e := l.log.Debug()
	if l.p.accessLog {
		e = l.log.Info()
	}
	if !e.Enabled() {
		return
	}
	if s.Client == "" {
		s.Client = lk.client.RemoteAddr().String()
	}
	e = e.Str("client", s.Client).Str("upstream", s.Upstream).
		Str("ended_by", endedBy(s.Reason)).Str("reason", string(s.Reason)).AnErr("cause", s.Err).
		Int64("request_bytes", s.BytesUp).Int64("response_bytes", s.BytesDown).
		Int("connect_attempts", s.ConnectAttempts)
	if s.ConnectTime > 0 {
		e = e.Dur("connect_ms", s.ConnectTime)
	}
	e.Int64("max_queued", s.MaxQueued).Time("opened", s.Opened).Int64("duration_ms", s.Duration.Milliseconds()).
		Msg("link closed")
}
