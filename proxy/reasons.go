package proxy

import "github.com/livenessproxy/livenessproxy/internal/metrics"

// CloseReason is why a link ended: LinkStats.Reason, and the reason label
// of livenessproxy_link_closes_total. The first reason that ended a link
// is the one recorded.
type CloseReason string

// The reasons a link ends.
const (
	CloseClientClosed     CloseReason = metrics.ReasonClientClosed     // the client sent FIN first, both directions finished
	CloseUpstreamClosed   CloseReason = metrics.ReasonUpstreamClosed   // the upstream sent FIN first, both directions finished
	CloseClientError      CloseReason = metrics.ReasonClientError      // a reset or error on the client socket
	CloseUpstreamError    CloseReason = metrics.ReasonUpstreamError    // a reset or error on the upstream socket
	CloseUpstreamTimeout  CloseReason = metrics.ReasonUpstreamTimeout  // ETIMEDOUT: TCP_USER_TIMEOUT or keepalive gave up
	CloseWriteTimeout     CloseReason = metrics.ReasonWriteTimeout     // the upstream acknowledged nothing for write_timeout
	CloseWatermark        CloseReason = metrics.ReasonWatermark        // past the high watermark with on_overflow: reject
	CloseHalfCloseTimeout CloseReason = metrics.ReasonHalfCloseTimeout // the other direction still open half_close_timeout after a FIN
	CloseDialError        CloseReason = metrics.ReasonDialError        // every upstream dial failed (refused, unreachable, timeout)
	CloseLocalError       CloseReason = metrics.ReasonLocalError       // the proxy's own failure: descriptors, memory, a refused socket option
	CloseShutdown         CloseReason = metrics.ReasonShutdown         // still open when the drain timeout ran out
	CloseBadFrame         CloseReason = metrics.ReasonBadFrame         // a frame the proxy cannot follow
	CloseUnanswered       CloseReason = metrics.ReasonUnanswered       // the endpoint reached its unanswered threshold
	CloseStale            CloseReason = metrics.ReasonStale            // a request past its deadline was still unsent or unacknowledged
	CloseEvicted          CloseReason = metrics.ReasonEvicted          // the endpoint was excluded, disabled or readmitted, or an operator evicted it
	CloseRefused          CloseReason = metrics.ReasonRefused          // accepted while the endpoint was out of routing: reset at once
	CloseNoMatch          CloseReason = metrics.ReasonNoMatch          // transparent: the original destination matches no entry
	CloseLoop             CloseReason = metrics.ReasonLoop             // transparent: the connection is the proxy's own
	CloseCapacity         CloseReason = metrics.ReasonCapacity         // transparent: a new destination past max_destinations
)
