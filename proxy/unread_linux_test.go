//go:build linux

package proxy

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// slowClient dials h with a small receive buffer, so that a client that
// does not read stops the response pump soon.
func slowClient(t *testing.T, h *harness) *net.TCPConn {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 16<<10)
		}); err != nil {
			return err
		}
		return serr
	}}
	c, err := d.Dial("tcp", h.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c.(*net.TCPConn)
}

// bigFrames is n frames of a mebibyte less their length fields: within
// framed()'s max_frame_length, and echoed back by a Framed fault peer.
// One allocation: grown by append, 60 of them took 23 s under -race on a
// loaded 2-core machine (2 s without), time a test's wait then spent
// before the client had sent a byte.
func bigFrames(n int) []byte {
	b := make([]byte, n<<20)
	for i := range n {
		binary.BigEndian.PutUint32(b[i<<20:], 1<<20-4)
	}
	return b
}

// backlogFrames is how many big requests behindAStalledClient sends: 20
// MiB of answers, more than the buffers between hold.
const backlogFrames = 20

// behindAStalledClient starts a proxy (request_timeout 300ms, threshold
// 1) in front of a Framed peer that answers the big requests (and, when
// answerAll, every later one too), and a client that sent backlogFrames
// big requests and reads nothing; it returns once the upstream is stalled
// by the client (stalledByClient). A setup that a loaded machine spoiled
// is started over, at most setupAttempts times: the peer, short of CPU,
// echoed a big request later than request_timeout before the stall, and
// the proxy counted it by that bound (no answer for 384-724ms, the
// endpoint excluded, in 9 of 13 runs with two CPU hogs, -race -cpu 1,2),
// or took in nothing while one waited past it in the proxy (dropped,
// stale). That is the rule applied to a slow peer, not what the tests
// are about: a request sent once the stall began.
func behindAStalledClient(t *testing.T, answerAll bool) (*harness, *net.TCPConn, *faultpeer.Server) {
	t.Helper()
	reqs := bigFrames(backlogFrames)
	for attempt := 1; ; attempt++ {
		h, c, peer, spoiled := stallByClient(t, answerAll, reqs)
		if spoiled == "" {
			return h, c, peer
		}
		if attempt == setupAttempts {
			t.Fatalf("the peer answered a big request later than request_timeout in each of %d setups, the last: %s", attempt, spoiled)
		}
		t.Logf("setup %d spoiled, started over: %s", attempt, spoiled)
		_ = c.Close()
	}
}

// setupAttempts bounds behindAStalledClient's setups.
const setupAttempts = 5

// stallByClient is one setup of behindAStalledClient; spoiled says how
// the proxy counted a big request unanswered or dropped one as stale
// during it ("": none).
func stallByClient(t *testing.T, answerAll bool, reqs []byte) (h *harness, c *net.TCPConn, peer *faultpeer.Server, spoiled string) {
	t.Helper()
	peer = faultpeer.New(t, faultpeer.Framed, faultpeer.Options{})
	if !answerAll {
		peer.SetAnswer(func(seq int64) (time.Duration, bool) { return 0, seq <= backlogFrames })
	}
	h = start(t, peer.Addr(), framed(300*time.Millisecond, 1, nil))
	c = slowClient(t, h)
	m := h.m.ForListener("test")
	counted := func() bool {
		return testutil.ToFloat64(m.UnansweredTimeouts)+testutil.ToFloat64(m.StaleFramesDropped) != 0
	}
	if _, err := c.Write(reqs); err != nil {
		if !counted() {
			t.Fatalf("sending the big requests: %v; %s", err, h.story())
		}
		return h, c, peer, fmt.Sprintf("sending the big requests: %v; %s", err, h.story())
	}
	if counted() {
		return h, c, peer, h.story()
	}
	stalledByClient(t, h)
	if counted() {
		return h, c, peer, h.story()
	}
	return h, c, peer, ""
}

// readBacklog reads the answers to behindAStalledClient's big requests.
func readBacklog(t *testing.T, c *net.TCPConn) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.CopyN(io.Discard, c, int64(backlogFrames)<<20); err != nil {
		t.Fatalf("reading the big answers: %v", err)
	}
}

// answersHold reads n answers from c, each a big one (bigFrames) or
// payload, and reports whether payload was one of them.
func answersHold(t *testing.T, c *net.TCPConn, n int, payload string) bool {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	found := false
	for i := range n {
		var hdr [4]byte
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			t.Fatalf("answer %d of %d: %v", i+1, n, err)
		}
		size := binary.BigEndian.Uint32(hdr[:])
		if size != 1<<20-4 && size != uint32(len(payload)) {
			t.Fatalf("answer %d of %d has %d bytes, want a big one (%d) or %q", i+1, n, size, 1<<20-4, payload)
		}
		p := make([]byte, size)
		if _, err := io.ReadFull(c, p); err != nil {
			t.Fatalf("answer %d of %d: %v", i+1, n, err)
		}
		found = found || string(p) == payload
	}
	return found
}

// stalledByClient waits until the link's upstream has sent what it can:
// bytes the proxy has not read wait in the socket, and no more have
// arrived for 300ms (the client reads nothing, so the response pump
// stopped, and the upstream's window closed; the kernel may still open it
// a little later, which the tests allow for).
func stalledByClient(t *testing.T, h *harness) {
	t.Helper()
	e := h.onlyEnd()
	var last int64 = -1
	still := 0
	for deadline := time.Now().Add(10 * time.Second); still < 6; time.Sleep(50 * time.Millisecond) {
		got, _, ok := e.received()
		if ok && got == last && got > e.lk.bytesDown.Load() {
			still++
		} else {
			still = 0
		}
		if time.Now().After(deadline) {
			t.Fatalf("the upstream's bytes did not stop arriving with some unread within 10s (received %d, read %d); %s", got, e.lk.bytesDown.Load(), h.story())
		}
		last = got
	}
}

// sendRecorded sends a frame on c and waits until the link has recorded it.
func sendRecorded(t *testing.T, h *harness, c *net.TCPConn, payload string) {
	t.Helper()
	lk := h.onlyLink(time.Second)
	before := lk.trk.Recorded()
	sendFrame(t, c, payload)
	for deadline := time.Now().Add(5 * time.Second); lk.trk.Recorded() <= before; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%q not recorded within 5s", payload)
		}
	}
}

// judgedOrPutOff waits until the link's requests have had their verdict
// or had it put off (unanswered_deferred_total), and reports whether one
// was put off.
func judgedOrPutOff(t *testing.T, h *harness) bool {
	t.Helper()
	lk := h.onlyLink(time.Second)
	m := h.m.ForListener("test")
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if testutil.ToFloat64(m.UnansweredDeferred) >= 1 {
			return true
		}
		if lk.trk.Pending() == 0 {
			return false
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d request(s) still wait for a verdict after 5s", lk.trk.Pending())
		}
	}
}

// A client that does not read what its server answers stops the response
// pump, and with it the server: its answers wait in the proxy's socket,
// then its window closes. A request the client sends meanwhile is past
// its deadline with no answer seen, but the silence is the proxy's (its
// client's), not the server's: the verdict is put off until the pump has
// read what the server sent, and nothing is counted. Before, the server
// was excluded. The twin is TestDeadServerBehindASlowClientIsJudged.
func TestUnreadAnswersAreNotSilence(t *testing.T) {
	h, c, _ := behindAStalledClient(t, true)
	sendRecorded(t, h, c, "q2")
	m := h.m.ForListener("test")
	// Put off, or covered by bytes the kernel let in after q2 was sent
	// (an answer, at the time the kernel says it came).
	t.Logf("verdict put off: %v", judgedOrPutOff(t, h))
	if got := testutil.ToFloat64(m.UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v while the server's answers waited unread in the proxy, want 0", got)
	}
	if st := h.endpoint(); st.State != "healthy" {
		t.Fatalf("endpoint %s (%s) behind a client that does not read, want healthy", st.State, st.Reason)
	}
	// The client reads at last: every answer comes, q2's too (the peer
	// answers in completion order: q2's may pass the last big ones).
	if !answersHold(t, c, backlogFrames+1, "q2") {
		t.Fatalf("no answer q2 among the %d; %s", backlogFrames+1, h.story())
	}
	if got := testutil.ToFloat64(m.UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
	if st := h.endpoint(); st.State != "healthy" || st.ConsecutiveUnanswered != 0 {
		t.Fatalf("endpoint %s with %d consecutive unanswered, want healthy with 0", st.State, st.ConsecutiveUnanswered)
	}
}

// The twin: a server that answers the big requests and then nothing, behind
// a client that reads late. Once the client has read the backlog, the next
// request is judged by its own deadline: putting verdicts off while the
// proxy held the server's bytes hides nothing after.
func TestDeadServerBehindASlowClientIsJudged(t *testing.T) {
	h, c, _ := behindAStalledClient(t, false)
	sendRecorded(t, h, c, "q2") // never answered
	judgedOrPutOff(t, h)
	if st := h.endpoint(); st.State != "healthy" {
		t.Fatalf("endpoint %s (%s) while its answers waited unread in the proxy, want healthy", st.State, st.Reason)
	}
	readBacklog(t, c)
	sent := time.Now()
	sendFrame(t, c, "q3") // after the backlog: the server's silence is its own
	st := h.waitState("excluded", 300*time.Millisecond+2*time.Second)
	if st.Reason != string(CloseUnanswered) {
		t.Fatalf("excluded for %q, want unanswered", st.Reason)
	}
	if took := time.Since(sent); took < 300*time.Millisecond {
		t.Fatalf("excluded %v after the request, before its deadline (300ms)", took)
	}
}

// A client that does not read, then gives up and closes, whether or not
// a verdict was put off yet: its requests are not handed to the
// endpoint's judgement while the server's answers wait unread in the
// proxy (the server could not answer them).
func TestSlowClientThatGivesUpHandsNothingOn(t *testing.T) {
	for _, wait := range []bool{false, true} {
		h, c, peer := behindAStalledClient(t, true)
		sendRecorded(t, h, c, "q2")
		if wait {
			t.Logf("verdict put off: %v", judgedOrPutOff(t, h))
		}
		ep := h.p.lookupEndpoint(peer.Addr())
		_ = c.Close() // gives up
		h.linkEnd(5 * time.Second)
		if p := ep.orphans.Pending(); p != 0 {
			t.Fatalf("the endpoint holds %d request(s) of a link that ended with the server's answers unread (after the verdict: %v), want 0", p, wait)
		}
		if st := h.endpoint(); st.State != "healthy" {
			t.Fatalf("endpoint %s (%s): a live server behind a client that did not read, then closed", st.State, st.Reason)
		}
	}
}

// Once the client has read the backlog, a verdict put off before says
// nothing more: a request sent after, to a server that stopped, whose
// client gives up before its deadline, is still judged by the endpoint.
func TestPutOffVerdictEndsWithTheBacklog(t *testing.T) {
	h, c, _ := behindAStalledClient(t, false)
	sendRecorded(t, h, c, "q2")
	t.Logf("verdict put off: %v", judgedOrPutOff(t, h))
	readBacklog(t, c)
	sendRecorded(t, h, c, "q3") // never answered
	_ = c.SetLinger(0)
	_ = c.Close() // gives up before q3's deadline
	h.linkEnd(5 * time.Second)
	st := h.waitState("excluded", 300*time.Millisecond+2*time.Second)
	if st.Reason != string(CloseUnanswered) {
		t.Fatalf("excluded for %q, want unanswered", st.Reason)
	}
}

// Bytes the kernel took in before the silence the consecutive count rests
// on are life, but not since then: the requests counted, sent after them,
// stay counted; bytes after it start the count over.
func TestHeardAtKeepsCountsOfLaterRequests(t *testing.T) {
	ep := &endpoint{}
	ep.lastAnswer.Store(flow.NoAnswer)
	ep.consecutive.Store(2)
	ep.silentSince.Store(1000)
	ep.heardAt(900)
	if got := ep.consecutive.Load(); got != 2 || ep.lastAnswer.Load() != 900 {
		t.Fatalf("after bytes from before the silence: consecutive %d, last answer %d; want 2, 900", got, ep.lastAnswer.Load())
	}
	ep.heardAt(1100)
	if got := ep.consecutive.Load(); got != 0 || ep.lastAnswer.Load() != 1100 {
		t.Fatalf("after bytes from within the silence: consecutive %d, last answer %d; want 0, 1100", got, ep.lastAnswer.Load())
	}
}

// A client that writes on and reads nothing stops the server too: the
// server's answers wait unread in the proxy, the server stops reading
// while it cannot send, and the client's requests wait in the proxy's
// queue with nothing acknowledged. That is the client's stall, not the
// server's: write_timeout does not end the link or exclude the server
// while the server's bytes wait unread in the proxy. Once the client
// reads, everything flows. (The twin, a server that stops reading with
// nothing of its own unread, is TestWriteTimeoutClosesStalledLink.)
func TestClientThatDoesNotReadIsNoWriteStall(t *testing.T) {
	const wt = time.Second
	peer := faultpeer.New(t, faultpeer.Serial, faultpeer.Options{})
	h := start(t, peer.Addr(), func(s *policy.Settings) { s.WriteTimeout = policy.Duration(wt) })
	c := slowClient(t, h)
	const frames = 3 * backlogFrames // more than the buffers between hold
	reqs := bigFrames(frames)        // before the wait's clock starts
	wrote := make(chan error, 1)
	go func() { _, err := c.Write(reqs); wrote <- err }()
	e := h.onlyEnd()
	lk := e.lk
	// Stalled by the client: requests wait in the proxy's queue for a
	// server whose own bytes wait unread in the proxy.
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		got, _, ok := e.received()
		if ok && got > lk.bytesDown.Load() && lk.q.Bytes() > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the link never held requests for a server with answers unread (sent up %d, queued %d, received %d ok %v, read %d); %s", lk.bytesUp.Load(), lk.q.Bytes(), got, ok, lk.bytesDown.Load(), h.story())
		}
	}
	stalledByClient(t, h) // the server's bytes stopped arriving: it waits
	time.Sleep(3 * wt)
	m := h.m.ForListener("test")
	if got := testutil.ToFloat64(m.WriteTimeouts); got != 0 {
		t.Fatalf("write_timeouts_total = %v behind a client that does not read, want 0; %s", got, h.story())
	}
	if st := h.endpoint(); st.State != "healthy" {
		t.Fatalf("endpoint %s (%s) behind a client that does not read, want healthy; %s", st.State, st.Reason, h.story())
	}
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.CopyN(io.Discard, c, int64(frames)<<20); err != nil {
		t.Fatalf("reading the answers once the client reads: %v", err)
	}
	if err := <-wrote; err != nil {
		t.Fatalf("the client's requests: %v", err)
	}
	sendFrame(t, c, "after")
	if got := readFrame(t, c, 5*time.Second); got != "after" {
		t.Fatalf("answer %q, want after", got)
	}
}

// Under the memory budget, a link whose client stalled its upstream (the
// upstream's answers unread in the proxy, the upstream no longer reading)
// holds memory for nothing and is closed for the budget, but the upstream
// is not blamed: it stays in routing. The twin, an upstream that stopped
// with nothing of its own unread, is excluded
// (TestBudgetClosesAWaiterWhoseUpstreamStopped).
func TestBudgetCloseOfAClientStalledLinkBlamesNoUpstream(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Serial, faultpeer.Options{})
	r := startBudget(t, peer.Addr(), policy.Limits{MemoryBudget: 4 << 20}, func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(time.Second)
		s.Detector.InitialDelay = policy.Duration(30 * time.Second)
	})
	c := r.dial(r.test)
	reqs := bigFrames(3 * backlogFrames) // before the wait's clock starts
	go func() { _, _ = c.Write(reqs) }() // ends with the close
	select {
	case s := <-r.ended:
		if s.Reason != CloseBudget {
			t.Fatalf("link ended %q (%v), want budget", s.Reason, s.Err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the client-stalled link was not closed for the budget within 20s")
	}
	if st, _ := r.p.det.State(peer.Addr()); st.String() != "healthy" {
		t.Fatalf("endpoint %s after the budget closed a link its client stalled, want healthy", st)
	}
	if got := testutil.ToFloat64(r.m.ForListener("test").WriteTimeouts); got != 0 {
		t.Fatalf("write_timeouts_total = %v, want 0", got)
	}
}

// urgentServer is a framed server that answers each of its first answer
// frames on a connection after delay with the frame itself, then an
// urgent byte (MSG_OOB, which the proxy does not read inline and so
// never relays); later frames get no answer. It ends with the test.
func urgentServer(t *testing.T, answer int, delay time.Duration) string {
	t.Helper()
	return serveConns(t, listenLoopback(t), func(c net.Conn, _ <-chan struct{}) {
		for n := 0; ; n++ {
			var hdr [4]byte
			if _, err := io.ReadFull(c, hdr[:]); err != nil {
				return
			}
			p := make([]byte, binary.BigEndian.Uint32(hdr[:]))
			if _, err := io.ReadFull(c, p); err != nil {
				return
			}
			if n >= answer {
				continue
			}
			time.Sleep(delay)
			rc, err := c.(*net.TCPConn).SyscallConn()
			if err != nil {
				return
			}
			var serr error
			if err := rc.Write(func(fd uintptr) bool {
				if _, serr = unix.Write(int(fd), append(hdr[:], p...)); serr == nil {
					serr = unix.Send(int(fd), []byte{'!'}, unix.MSG_OOB)
				}
				return true
			}); err != nil || serr != nil {
				return
			}
		}
	})
}

// An urgent byte is taken in by the upstream's kernel and never read (not
// inline), so the kernel's count of bytes taken in stays ahead of what
// the response pump read for good. That is no answer waiting unread: a
// server that answered with an urgent byte behind and then went silent is
// excluded by its request's deadline. Before, every verdict on its link
// was put off, again and again, and the dead server was never judged.
// The twin is TestUrgentBytesFromALiveServerAreNoSilence.
func TestUrgentByteIsNoAnswerHeldUnread(t *testing.T) {
	h := start(t, urgentServer(t, 1, 0), framed(300*time.Millisecond, 1, nil))
	c := h.dial()
	sendFrame(t, c, "q1")
	if got := readFrame(t, c, 5*time.Second); got != "q1" {
		t.Fatalf("answer %q, want q1", got)
	}
	e := h.onlyEnd()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		if got, _, _ := e.received(); got == int64(len("q1")+5) {
			break // the answer and the urgent byte behind it
		} else if time.Now().After(deadline) {
			t.Fatalf("the upstream's kernel took in %d bytes after 5s, want %d", got, len("q1")+5)
		}
	}
	sent := time.Now()
	sendFrame(t, c, "q2") // never answered
	h.excludedUnanswered(sent, 300*time.Millisecond, 300*time.Millisecond+2*time.Second)
	if got := testutil.ToFloat64(h.m.ForListener("test").UnansweredDeferred); got != 0 {
		t.Errorf("unanswered_deferred_total = %v: a verdict was put off for an urgent byte", got)
	}
}

// The twin: a server that answers every request (after 100ms of a 1s
// deadline) with an urgent byte behind each answer stays healthy, and
// every answer reaches the client.
func TestUrgentBytesFromALiveServerAreNoSilence(t *testing.T) {
	h := start(t, urgentServer(t, 1<<30, 100*time.Millisecond), framed(time.Second, 1, nil))
	c := h.dial()
	for i := range 5 {
		q := fmt.Sprintf("q%d", i)
		sendFrame(t, c, q)
		if got := readFrame(t, c, 5*time.Second); got != q {
			t.Fatalf("answer %q, want %q", got, q)
		}
	}
	m := h.m.ForListener("test")
	if got := testutil.ToFloat64(m.UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
	if st := h.endpoint(); st.State != "healthy" || st.ConsecutiveUnanswered != 0 {
		t.Fatalf("endpoint %s with %d consecutive unanswered, want healthy with 0", st.State, st.ConsecutiveUnanswered)
	}
}

// slowReader is a framed server behind a 4 KiB receive buffer that reads
// 1 KiB every 10ms and answers "ok" to each frame once it has read all
// of it; with stopAt > 0 it stops reading after stopAt bytes, its window
// closes, and it answers nothing. It ends with the test.
func slowReader(t *testing.T, stopAt int64) string {
	t.Helper()
	lc := net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 4<<10)
		}); err != nil {
			return err
		}
		return serr
	}}
	ln, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return serveConns(t, ln, func(c net.Conn, done <-chan struct{}) {
		var read int64
		var frame []byte
		buf := make([]byte, 1<<10)
		for {
			if stopAt > 0 && read >= stopAt {
				<-done
				return
			}
			select {
			case <-done:
				return
			case <-time.After(10 * time.Millisecond):
			}
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			read += int64(n)
			frame = append(frame, buf[:n]...)
			for len(frame) >= 4 && len(frame) >= 4+int(binary.BigEndian.Uint32(frame)) {
				frame = frame[4+int(binary.BigEndian.Uint32(frame)):]
				if _, err := c.Write(binary.BigEndian.AppendUint32(nil, 2)); err != nil {
					return
				}
				if _, err := c.Write([]byte("ok")); err != nil {
					return
				}
			}
		}
	})
}

// A request larger than the path carries within its deadline: a server
// behind a slow path (here a 4 KiB window read 1 KiB at a time) takes in
// 256 KiB over seconds, acknowledging as it goes, and answers once it has
// all of it. A server cannot answer a request it has not been given: the
// verdict is put off while the upstream still takes the request in, and
// the request is written on past its deadline rather than dropped as
// stale. Before, the server was excluded at 300ms. The twin is
// TestLargeRequestToAServerThatStopsReadingIsJudged.
func TestLargeRequestOnASlowPathIsNoSilence(t *testing.T) {
	h := start(t, slowReader(t, 0), framed(300*time.Millisecond, 1, nil))
	c := h.dial()
	sendFrame(t, c, string(make([]byte, 256<<10)))
	if got := readFrame(t, c, 60*time.Second); got != "ok" {
		t.Fatalf("answer %q, want ok", got)
	}
	m := h.m.ForListener("test")
	if got := testutil.ToFloat64(m.UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
	if st := h.endpoint(); st.State != "healthy" {
		t.Fatalf("endpoint %s (%s), want healthy", st.State, st.Reason)
	}
	if got := testutil.ToFloat64(m.UnansweredDeferred); got < 1 {
		t.Fatalf("unanswered_deferred_total = %v: the verdict was never put off, the request reached the server within its deadline (make it larger)", got)
	}
	// Answered, the putting off ends: the link's requests are evidence
	// again (owesNoEvidence) and no later request inherits its time.
	lk := h.onlyLink(time.Second)
	for deadline := time.Now().Add(5 * time.Second); lk.deliveryAllow.Load() != 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("5s after the answer, the verdict is still put off (allowance %v)", time.Duration(lk.deliveryAllow.Load()))
		}
	}
}

// A large request on a slow path, its verdict put off, and then another
// link to the same server gets answers: those answers cover the request
// (the putting off ends there, so the link's requests are evidence
// again), and it is not dropped as stale either while the server still
// takes it in. Before, the link was reset (stale), and the putting off
// outlived the answers.
func TestLargeRequestBesideAnsweredOnesIsNotStale(t *testing.T) {
	h := start(t, slowReader(t, 0), framed(300*time.Millisecond, 1, nil))
	big := h.dial()
	sendFrame(t, big, string(make([]byte, 256<<10)))
	lk := h.onlyLink(time.Second)
	for deadline := time.Now().Add(10 * time.Second); lk.deliveryAllow.Load() == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the large request's verdict was not put off within 10s")
		}
	}
	small := h.dial()
	sendFrame(t, small, "q")
	if a := readFrame(t, small, 10*time.Second); a != "ok" {
		t.Fatalf("small answer %q, want ok", a)
	}
	for deadline := time.Now().Add(5 * time.Second); lk.deliveryAllow.Load() != 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("5s after an answer covered the large request, its verdict is still put off")
		}
	}
	got := make(chan string, 1)
	go func() {
		_ = big.SetReadDeadline(time.Now().Add(60 * time.Second))
		var hdr [6]byte
		if _, err := io.ReadFull(big, hdr[:]); err != nil {
			got <- err.Error()
			return
		}
		got <- string(hdr[4:])
	}()
	for i := 0; ; i++ {
		select {
		case a := <-got:
			if a != "ok" {
				t.Fatalf("the large request's answer: %q, want ok", a)
			}
			m := h.m.ForListener("test")
			if n := testutil.ToFloat64(m.StaleFramesDropped); n != 0 {
				t.Fatalf("stale_frames_dropped_total = %v, want 0", n)
			}
			if n := testutil.ToFloat64(m.UnansweredTimeouts); n != 0 {
				t.Fatalf("unanswered_timeouts_total = %v, want 0", n)
			}
			return
		case <-time.After(100 * time.Millisecond):
		}
		if i > 600 {
			t.Fatal("no answer to the large request within 60s")
		}
		sendFrame(t, small, "q")
		if a := readFrame(t, small, 10*time.Second); a != "ok" {
			t.Fatalf("small answer %q, want ok", a)
		}
	}
}

// The twin: a server that takes in 8 KiB of a large request and then
// reads nothing (a process that stopped: its window closes, its kernel
// still answers window probes) is judged at the request's deadline, or
// flow.DeliveryQuiet after it stopped when that is later, not by
// write_timeout (10s).
func TestLargeRequestToAServerThatStopsReadingIsJudged(t *testing.T) {
	h := start(t, slowReader(t, 8<<10), framed(300*time.Millisecond, 1, nil))
	c := h.dial()
	sent := time.Now()
	sendFrame(t, c, string(make([]byte, 256<<10)))
	h.excludedUnanswered(sent, 300*time.Millisecond, 300*time.Millisecond+flow.DeliveryQuiet+3*time.Second)
}

// A request whose bytes the proxy itself holds past their deadline is no
// evidence against its server. A budget of 512 KiB is filled by a link to a
// server that never reads (write_timeout 3s, so the budget stays full that
// long); meanwhile a client of another listener sends a 1 MiB request to
// a live server behind a slow path (slowReader): what the kernel does not
// take at once waits in the proxy for the budget, the server having
// acknowledged all it was given. The verdict is put off while the proxy
// holds the request (and while the server still takes it in), so the
// live server is never counted or excluded; the request is answered, or,
// past its deadline once the budget frees, dropped as stale, with
// nothing handed to the endpoint either way. Before, the live server was
// excluded at the request's deadline, its links cut: the cascade of one
// stalled upstream onto healthy ones.
func TestRequestHeldForTheBudgetIsNoSilence(t *testing.T) {
	stalled := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	live := slowReader(t, 0)
	cfg := policy.DefaultConfig()
	cfg.Limits = policy.Limits{MemoryBudget: 512 << 10}
	stall := cfg.Defaults
	stall.WriteTimeout = policy.Duration(3 * time.Second)
	stall.Detector.InitialDelay = policy.Duration(30 * time.Second)
	tracked := cfg.Defaults
	framed(300*time.Millisecond, 1, nil)(&tracked)
	cfg.Listeners = []policy.Listener{
		{Name: "stall", Listen: "127.0.0.1:0", Upstream: stalled.Addr(), Settings: stall},
		{Name: "test", Listen: "127.0.0.1:0", Upstream: live, Settings: tracked},
	}
	m := metrics.New()
	ended := make(chan LinkStats, 16)
	p := New(cfg, Options{metrics: m, Logger: testLogger(), OnLinkEnd: func(s LinkStats) { ended <- s }})
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	dial := func(name string) net.Conn {
		c, err := net.Dial("tcp", p.Addr(name).String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	writeAsync(dial("stall"), 8<<20, 64<<10)
	for deadline := time.Now().Add(10 * time.Second); p.budget.Queued.Load() < 384<<10; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the budget did not fill within 10s (%d queued)", p.budget.Queued.Load())
		}
	}
	c := dial("test")
	sendFrame(t, c, string(make([]byte, 256<<10)))
	_ = c.SetReadDeadline(time.Now().Add(60 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, 6)); err != nil {
		// Past its deadline once the budget freed: dropped as stale.
		for {
			select {
			case st := <-ended:
				if st.Listener != "test" {
					continue
				}
				if st.Reason != CloseStale {
					t.Fatalf("no answer (%v) and the link ended %q, want stale", err, st.Reason)
				}
			case <-time.After(60 * time.Second):
				t.Fatal("the test link did not end within 60s")
			}
			break
		}
		t.Logf("no answer (%v): the request was dropped as stale", err)
	}
	if got := testutil.ToFloat64(m.BudgetWaits); got < 1 {
		t.Fatalf("budget waits %v: the request never waited in the proxy (make the budget fuller)", got)
	}
	if st, _ := p.det.State(live); st.String() != "healthy" {
		t.Fatalf("live server %s after the proxy held its request for the budget, want healthy", st)
	}
	if got := testutil.ToFloat64(m.ForListener("test").UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
	if n := p.lookupEndpoint(live).orphans.Pending(); n != 0 {
		t.Fatalf("the endpoint holds %d request(s) of a link whose request the proxy held, want 0", n)
	}
}
