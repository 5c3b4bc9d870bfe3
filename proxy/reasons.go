package proxy

import "github.com/livenessproxy/livenessproxy/internal/metrics"

// CloseReason is why a link ended: LinkStats.Reason, and the reason label
// of livenessproxy_link_closes_total. The first reason that ended a link
// is the one recorded.
type CloseReason string

// The reasons a link ends.
const (
	CloseClientClosed     CloseReason = "client_closed"      // the client sent FIN first, both directions finished
	CloseUpstreamClosed   CloseReason = "upstream_closed"    // the upstream sent FIN first, both directions finished
	CloseClientError      CloseReason = "client_error"       // a reset or error on the client socket
	CloseUpstreamError    CloseReason = "upstream_error"     // a reset or error on the upstream socket
	CloseUpstreamTimeout  CloseReason = "upstream_timeout"   // the kernel gave up (ETIMEDOUT, or the ICMP error it saw): TCP_USER_TIMEOUT or keepalive
	CloseWriteTimeout     CloseReason = "write_timeout"      // the upstream acknowledged nothing, nor sent, for write_timeout
	CloseWatermark        CloseReason = "watermark"          // past the high watermark with on_overflow: reject
	CloseHalfCloseTimeout CloseReason = "half_close_timeout" // after a FIN, the other direction moved no byte for half_close_timeout
	CloseDialError        CloseReason = "dial_error"         // every upstream dial failed (refused, unreachable, timeout)
	CloseLocalError       CloseReason = "local_error"        // the proxy's own failure: descriptors, memory, a refused socket option
	CloseShutdown         CloseReason = "shutdown"           // still open when the drain timeout ran out
	CloseBadFrame         CloseReason = "bad_frame"          // a frame the proxy cannot follow
	CloseUnanswered       CloseReason = "unanswered"         // the endpoint reached its unanswered threshold
	CloseStale            CloseReason = "stale"              // a request past its deadline was still unsent or unacknowledged
	CloseEvicted          CloseReason = "evicted"            // the endpoint was excluded, disabled or readmitted, or an operator evicted it
	CloseRefused          CloseReason = "refused"            // accepted while the endpoint was out of routing: reset at once
	CloseNoMatch          CloseReason = "no_match"           // transparent: the original destination matches no entry
	CloseLoop             CloseReason = "loop"               // transparent: the connection is the proxy's own
	CloseCapacity         CloseReason = "capacity"           // transparent: a new destination past max_destinations; mesh ingress: a stream past ingress.max_streams
	CloseMeshDead         CloseReason = "mesh_dead"          // the mesh session the link ran on missed its heartbeats
	CloseBudget           CloseReason = "budget"             // the memory budget was full and the upstream acknowledged nothing, nor sent, for write_timeout
)

// closeReasons lists every reason once, for the series the metrics create
// at zero (link_closes_total takes its label values from here). transparent:
// only a transparent listener produces it.
var closeReasons = []struct {
	r           CloseReason
	transparent bool
}{
	{r: CloseClientClosed}, {r: CloseUpstreamClosed}, {r: CloseClientError}, {r: CloseUpstreamError},
	{r: CloseUpstreamTimeout}, {r: CloseWriteTimeout}, {r: CloseWatermark}, {r: CloseHalfCloseTimeout},
	{r: CloseDialError}, {r: CloseLocalError}, {r: CloseShutdown}, {r: CloseBadFrame}, {r: CloseUnanswered},
	{r: CloseStale}, {r: CloseEvicted}, {r: CloseRefused},
	{r: CloseNoMatch, transparent: true}, {r: CloseLoop, transparent: true}, {r: CloseCapacity, transparent: true},
	{r: CloseMeshDead}, {r: CloseBudget},
}

// reasonValues is every reason of closeReasons once, for reasonPtr.
var reasonValues = func() []CloseReason {
	rs := make([]CloseReason, len(closeReasons))
	for i, c := range closeReasons {
		rs[i] = c.r
	}
	return rs
}()

// reasonPtr is a pointer to r, as a link's reason holds it: r's entry in
// reasonValues, which nothing writes, so that a link's end allocates
// none (a pointer to setReason's own copy moved the copy to the heap,
// and its error with it, at every call). A reason not listed gets a copy
// of its own.
func reasonPtr(r CloseReason) *CloseReason {
	for i := range reasonValues {
		if reasonValues[i] == r {
			return &reasonValues[i]
		}
	}
	p := new(CloseReason)
	*p = r
	return p
}

// closeLabels returns the close reasons a listener of kind (metrics.Kind*,
// "": any) can produce, as label values.
func closeLabels(kind string) []string {
	ls := make([]string, 0, len(closeReasons))
	for _, c := range closeReasons {
		if kind == metrics.KindPool && c.transparent {
			continue
		}
		// An ingress refuses a stream past max_streams (capacity) or for
		// a port it does not serve (no_match); it has no loop.
		if kind == metrics.KindIngress && c.r == CloseLoop {
			continue
		}
		ls = append(ls, string(c.r))
	}
	return ls
}
