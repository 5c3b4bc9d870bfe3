package proxy

import (
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	lptestutil "github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
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
	recordsFull(t, h, n)
}

// recordsFull fails the test unless the link keeps as many records as it
// may, after n round trips (the proxy's own count: a machine too slow to
// make them within the records' lifetime would not have reached it).
func recordsFull(t *testing.T, h *harness, n int) {
	t.Helper()
	if r := h.onlyLink(time.Second).trk.Records(); r < linkRecordBound {
		t.Fatalf("%d records kept after %d round trips, want %d", r, n, linkRecordBound)
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

// framedPingPong makes n framed round trips on c, each answered before
// the next is sent: each request its own record.
func framedPingPong(t *testing.T, c net.Conn, n int) {
	t.Helper()
	for range n {
		roundTripFrame(t, c, "q")
	}
}

// A client that makes request after request on one connection, each
// answered before the next (a Pinot broker's queries, any RPC client in a
// loop), fills the link's records: each is kept until its deadline for
// the staleness check, answered or not (here 1,124 within request_timeout).
// Past the bound a new request joined the newest record, answered
// already: a server that stopped then was never judged by the request
// left waiting on it, the client's last. The README: a dead upstream is
// out "within the earliest deadline of the requests outstanding to it
// plus the judging slack ... whether its clients keep one request in
// flight on one connection or hundreds on many".
func TestRequestPastTheRecordBoundToASilentServerIsJudged(t *testing.T) {
	const rt = 4 * time.Second
	const fill = linkRecordBound + 100
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	peer.SetAnswer(func(n int64) (time.Duration, bool) { return 0, n <= fill })
	h := start(t, peer.Addr(), framed(rt, 1, nil))
	c := h.dial()
	framedPingPong(t, c, fill)
	recordsFull(t, h, fill)
	sent := time.Now()
	sendFrame(t, c, "unanswered")
	h.excludedUnanswered(sent, rt, rt+3*time.Second)
}

// The twin: the same client with a server that answers every request,
// for longer than the records live, is never judged, and no request is
// taken for stale.
func TestRequestsPastTheRecordBoundToALiveServer(t *testing.T) {
	const rt = 2 * time.Second
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	h := start(t, peer.Addr(), framed(rt, 1, nil))
	c := h.dial()
	for end := time.Now().Add(rt + time.Second); time.Now().Before(end); {
		framedPingPong(t, c, linkRecordBound/4)
	}
	h.nothingCounted()
	if m := testutil.ToFloat64(h.m.ForListener("test").StaleFramesDropped); m != 0 {
		t.Fatalf("stale_frames_dropped_total = %v, want 0", m)
	}
	h.noLinkEnded("a link to a live server")
}

// The same with the incident's own client: a Pinot broker's queries on its
// one connection to a server, each answered, fill the link's records
// (each kept until its timeoutMs and a second), and then the server
// stops answering (it still reads: wedged). The query left waiting is
// the evidence at its own deadline. Before, it joined an answered record
// and was never judged.
func TestPinotQueryPastTheRecordBoundToAStoppedServerIsJudged(t *testing.T) {
	srv, h, query := pinotQueries(t)
	const fill = linkRecordBound + 100
	for i := range fill {
		query(int64(i+1), true)
	}
	recordsFull(t, h, fill)
	srv.SetSilent(true)
	sent := time.Now()
	query(fill+1, false)
	h.excludedUnanswered(sent, pinotBoundTimeout+time.Second, pinotBoundTimeout+time.Second+3*time.Second)
}

// The twin: queries answered past the bound, for longer than the records
// live, are never judged.
func TestPinotQueriesPastTheRecordBoundToALiveServer(t *testing.T) {
	_, h, query := pinotQueries(t)
	id := int64(0)
	for end := time.Now().Add(pinotBoundTimeout + 2*time.Second); time.Now().Before(end); {
		id++
		query(id, true)
	}
	if id <= linkRecordBound {
		t.Logf("only %d queries: the bound was not reached", id)
	}
	h.nothingCounted()
	h.noLinkEnded("a link to a live Pinot server")
}

// pinotBoundTimeout is the queries' timeoutMs: due a second later.
const pinotBoundTimeout = 3 * time.Second

// pinotQueries starts a Pinot server and a proxy with the pinot profile in
// front of it, and returns a function that sends a query on one client
// connection and, if wait, reads its answer.
func pinotQueries(t *testing.T) (*pinotsim.Server, *harness, func(id int64, wait bool)) {
	t.Helper()
	srv, err := pinotsim.NewServer(pinotsim.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	h := start(t, srv.Addr(), func(s *policy.Settings) {
		s.Framing.Type = policy.FramingPinot
		s.Detector.Probe = policy.ProbeKindConnect
		s.Detector.InitialDelay = policy.Duration(10 * time.Second)
	})
	c := h.dial()
	return srv, h, func(id int64, wait bool) {
		t.Helper()
		q := pinotsim.AppendRequest(nil, &pinotsim.Request{ID: id, Table: "t_OFFLINE", TimeoutMs: pinotBoundTimeout.Milliseconds()})
		if _, err := c.Write(lptestutil.LengthPrefixed(q)); err != nil {
			t.Fatal(err)
		}
		if wait {
			readFrame(t, c, 5*time.Second)
		}
	}
}

// The endpoint's record of requests whose links ended (clients that gave
// up) makes room the same way. Clients send a request each and reset
// their connection at once, while the server answers nothing; then the
// server answers (on a link that stayed), which covers all of them, and
// stops. The request of the next client that gives up is the evidence at
// its own deadline. Before, it joined an answered record and was never
// judged.
func TestAbandonedRequestPastTheRecordBoundIsJudged(t *testing.T) {
	abandonedPastTheBound(t, true)
}

// The twin: the server goes on answering; the next client that gives up
// has its answer on the link that stayed, and nothing is counted, though
// every abandoned request's deadline passes.
func TestAbandonedRequestsPastTheRecordBoundToALiveServer(t *testing.T) {
	abandonedPastTheBound(t, false)
}

// abandonedPastTheBound: see its two tests; stops says whether the server
// stops answering after the answer that covers the abandoned requests.
func abandonedPastTheBound(t *testing.T, stops bool) {
	const rt = 8 * time.Second
	var answer atomic.Bool
	peer := faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	peer.SetAnswer(func(int64) (time.Duration, bool) { return 0, answer.Load() })
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) }) // after the proxy's close: cleanups run last first
	h := start(t, peer.Addr(), framed(rt, 1, nil))
	go func() { // more links end than the harness keeps
		for {
			select {
			case <-h.ended:
			case <-stop:
				return
			}
		}
	}()
	stays := h.dial()
	giveUp := func() {
		c := h.dial()
		sendFrame(t, c, "given up")
		_ = c.SetLinger(0)
		_ = c.Close()
	}
	const churn = linkRecordBound + 100
	for range churn {
		giveUp()
	}
	ep := h.p.lookupEndpoint(peer.Addr())
	waitFor(t, 5*time.Second, "every abandoned request adopted", func() bool {
		return ep.orphans.Pending() >= churn
	})
	answer.Store(true)
	roundTripFrame(t, stays, "an answer after them all")
	answer.Store(!stops)
	if r := ep.orphans.Records(); r < linkRecordBound {
		t.Fatalf("%d records of abandoned requests, want %d", r, linkRecordBound)
	}
	sent := time.Now()
	giveUp()
	if stops {
		h.excludedUnanswered(sent, rt, rt+3*time.Second)
		return
	}
	for end := time.Now().Add(rt + time.Second); time.Now().Before(end); {
		roundTripFrame(t, stays, "answered")
		time.Sleep(10 * time.Millisecond)
	}
	h.nothingCounted()
}
