package proxy

import (
	"net"
	"sync/atomic"
	"testing"
	"time"
)

// Past the bound of a link's records (linkRecordBound), a new request
// joins the newest record. It took that record's deadline and hold when
// they were earlier than its own: a request the broker may hold longer
// (a Fetch's max_wait, a JoinGroup, an acks=all Produce waiting for its
// replicas) was judged at another request's deadline. A busy acks=all
// producer fills the bound (each record is kept until its deadline, for
// the staleness check: timeout_ms plus request_timeout, 33 s with the
// Java defaults, so 32 Produce requests a second on one connection), and
// once it goes quiet a request held past the newest record's deadline
// found the broker silent since that record's hold ended: a healthy
// broker excluded and its links cut. The README: past the bound a request
// joins the newest record, "which can only delay a verdict".

// boundProduceHold and boundFetchHold: the fill's acks=all Produce
// requests may be held 5 s (their records are kept 5 s and
// request_timeout); the Fetch after them 6 s, past the newest record's
// deadline.
const (
	boundProduceHold = 5 * time.Second
	boundFetchHold   = 6 * time.Second
	boundRT          = 300 * time.Millisecond
)

// fillRecords makes more answered acks=all Produce round trips on c than
// the link keeps records for, each its own record (answered before the
// next is sent), all within the records' lifetime.
func fillRecords(t *testing.T, h *harness, c net.Conn) {
	t.Helper()
	n := linkRecordBound + 100
	for i := range n {
		if _, err := c.Write(produceAllReq(boundProduceHold, int32(i))); err != nil {
			t.Fatal(err)
		}
		if got := readResponse(t, c, 5*time.Second); got != int32(i) {
			t.Fatalf("response %d, want %d", got, i)
		}
	}
	// The proxy's own count: the records wait for their verdicts (a
	// machine too slow to make the round trips within their lifetime
	// would not have reached the bound).
	if p := h.onlyLink(time.Second).trk.Pending(); p < linkRecordBound {
		t.Fatalf("%d records wait for a verdict after %d round trips, want at least %d", p, n, linkRecordBound)
	}
}

func TestRequestPastTheRecordBoundKeepsItsOwnDeadline(t *testing.T) {
	broker := startKafkaBroker(t, func(key int16, _ int32) (time.Duration, bool) {
		if key == 1 {
			return boundFetchHold, true // held for its whole max_wait, as the protocol allows
		}
		return 0, true
	})
	h := start(t, broker.ln.Addr().String(), kafkaProfile(boundRT, 1))
	c := h.dial()
	fillRecords(t, h, c)
	if _, err := c.Write(fetchReq(boundFetchHold, 1<<20)); err != nil {
		t.Fatal(err)
	}
	if got := readResponse(t, c, boundFetchHold+5*time.Second); got != 1<<20 {
		t.Fatalf("response %d, want %d", got, 1<<20)
	}
	h.nothingCounted()
}

// The twin: a broker that stops answering after the fill is judged by
// the Fetch's own deadline (its max_wait and request_timeout), not before.
func TestRequestPastTheRecordBoundToADeadBrokerIsJudged(t *testing.T) {
	var dead atomic.Bool
	broker := startKafkaBroker(t, func(int16, int32) (time.Duration, bool) { return 0, !dead.Load() })
	h := start(t, broker.ln.Addr().String(), kafkaProfile(boundRT, 1))
	c := h.dial()
	fillRecords(t, h, c)
	dead.Store(true)
	sent := time.Now()
	if _, err := c.Write(fetchReq(boundFetchHold, 1<<20)); err != nil {
		t.Fatal(err)
	}
	h.excludedUnanswered(sent, boundFetchHold+boundRT, boundFetchHold+boundRT+3*time.Second)
}
