//go:build linux

package proxy

import (
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// watchedPair is a loopback pair whose accepted end s is read by r with w
// as its reset watch, after the round trips that make r wait after short
// reads (the socket has waited for data twice): each echoes "ping" and
// ends at a short read deadline.
func watchedPair(t *testing.T, w *resetWatch) (c, s *net.TCPConn, r *flow.SockReader) {
	t.Helper()
	s, c = acceptedPair(t)
	rc, err := s.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	r = &flow.SockReader{}
	r.SetResetWatch(w, s)
	r.InitRaw(rc)
	got := make([]byte, 4)
	for range 2 {
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		_ = s.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		if _, _, err, werr := r.ReadEach(echoTo{s}); !errors.Is(err, os.ErrDeadlineExceeded) || werr != nil {
			t.Fatalf("round trip: %v, %v; want the deadline", err, werr)
		}
		if _, err := io.ReadFull(c, got); err != nil {
			t.Fatal(err)
		}
	}
	_ = s.SetReadDeadline(time.Time{})
	return c, s, r
}

// echoTo is a flow.ChunkSink that writes each chunk to w.
type echoTo struct{ w io.Writer }

func (echoTo) Limit() int { return flow.ChunkSize }

func (e echoTo) Handle(bp *[]byte, n int) (flow.Handled, error) {
	if _, err := e.w.Write((*bp)[:n]); err != nil {
		return flow.HandledStop, err
	}
	return flow.HandledMore, nil
}

func newTestResetWatch(t *testing.T) *resetWatch {
	t.Helper()
	w, err := newResetWatch(testLogger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.stop)
	return w
}

// A reset that came in behind the last bytes, before the read that takes
// them, is seen: the read is short, and the edge the reset
// raised is gone (the runtime cleared the socket's readiness as the read
// began). Two orders:
//   - watched at that read: the watch reports the socket's error at once
//     (its registration is level-triggered) and shuts its read side,
//     which wakes the reader's wait, and the next read returns the reset;
//   - watched before the reset: the report came before the read, and its
//     edge went the same way as the reset's; the reader sees the report's
//     flag after the read and reads on.
//
// Without the shutdown the first order waits for the 10 s deadline, and
// without the flag the second does (each mutation fails here). The watch
// forgets the socket on its report, and has nothing left.
func TestResetWatchWakesAReaderForAResetBehindTheLastBytes(t *testing.T) {
	for _, early := range []bool{false, true} {
		name := "watched at the read"
		if early {
			name = "watched before the reset"
		}
		t.Run(name, func(t *testing.T) {
			w := newTestResetWatch(t)
			c, s, r := watchedInOrder(t, w, early)
			testutil.ResetBehind(t, c, s, []byte("last"))
			if early {
				waitShut(t, w, 1) // the report, before the read
			}
			// An idle moment, in which the runtime's poller takes the
			// edges there are (and ReadEach's start then clears them): the
			// case the watch is for. With the watch the test passes
			// whether or not the poller took them.
			time.Sleep(20 * time.Millisecond)
			_ = s.SetReadDeadline(time.Now().Add(10 * time.Second))
			_, _, err, werr := r.ReadEach(echoTo{io.Discard})
			if werr != nil || !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("ReadEach ended with %v (%v), want ECONNRESET (a timeout: the reset was missed)", err, werr)
			}
			// The watch reports the socket whether the reader needed it or
			// not: its registration is level-triggered, and the error stays.
			waitShut(t, w, 1)
			r.Forget()
			if n := w.watched(); n != 0 {
				t.Fatalf("%d sockets still watched", n)
			}
		})
	}
}

// waitWoken waits until w has woken n readers with a deadline.
func waitWoken(t *testing.T, w *resetWatch, n int64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for w.woken.Load() != n {
		if time.Now().After(deadline) {
			t.Fatalf("the watch woke %d readers in 5 s, want %d", w.woken.Load(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitShut waits until w has shut n sockets.
func waitShut(t *testing.T, w *resetWatch, n int64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for w.shut.Load() != n {
		if time.Now().After(deadline) {
			t.Fatalf("the watch shut %d sockets in 5 s, want %d", w.shut.Load(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// The realistic shape, twenty times: the reader already waits (drained,
// watched) when the peer answers and closes with bytes of ours unread in
// its receive queue, so that the kernel sends an RST right behind the
// answer. Every reader sees the answer and then the reset.
func TestResetWatchAnswerThenResetWhileTheReaderWaits(t *testing.T) {
	w := newTestResetWatch(t)
	for i := range 20 {
		c, s, r := watchedPair(t, w)
		if _, err := s.Write([]byte("a request the peer never reads")); err != nil {
			t.Fatal(err)
		}
		var answer []byte
		done := make(chan error, 1)
		_ = s.SetReadDeadline(time.Now().Add(10 * time.Second))
		go func() {
			_, _, err, werr := r.ReadEach(sinkFunc(func(p []byte) { answer = append(answer, p...) }))
			done <- errors.Join(err, werr)
		}()
		testutil.WaitUnread(t, c, len("a request the peer never reads"))
		if _, err := c.Write([]byte("answer")); err != nil {
			t.Fatal(err)
		}
		_ = c.Close() // unread bytes: an RST, not a FIN
		err := <-done
		if !errors.Is(err, syscall.ECONNRESET) || string(answer) != "answer" {
			t.Fatalf("round %d: ReadEach ended with %v after %q, want ECONNRESET after the answer", i, err, answer)
		}
		r.Forget()
	}
	if n := w.watched(); n != 0 {
		t.Fatalf("%d sockets still watched after every reader forgot its own", n)
	}
}

// The twin: a peer that is slow but alive. A watched reader waits through
// a pause longer than any of the watch's work, the watch reports nothing
// and shuts nothing, and the answer after the pause arrives whole; bytes
// and the peer's FIN are not the watch's (the reader sees EOF after the
// last answer, as without it).
func TestResetWatchLeavesASlowPeerAlone(t *testing.T) {
	w := newTestResetWatch(t)
	c, s, r := watchedPair(t, w)
	var answers []byte
	done := make(chan error, 1)
	_ = s.SetReadDeadline(time.Now().Add(20 * time.Second))
	go func() {
		_, _, err, werr := r.ReadEach(sinkFunc(func(p []byte) { answers = append(answers, p...) }))
		done <- errors.Join(err, werr)
	}()
	for _, a := range []string{"slow", "slower"} {
		time.Sleep(300 * time.Millisecond) // a pause, not a synchronisation: the reader waits either way
		if _, err := c.Write([]byte(a)); err != nil {
			t.Fatal(err)
		}
	}
	if got := w.shut.Load(); got != 0 {
		t.Fatalf("the watch shut %d sockets of a live peer", got)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, io.EOF) {
		t.Fatalf("ReadEach ended with %v, want io.EOF", err)
	}
	if string(answers) != "slowslower" {
		t.Fatalf("read %q, want both answers", answers)
	}
	// The FIN is the watch's too now (a short read does not say it): it
	// reports the socket and shuts its read side, which changes nothing
	// for a socket that can receive nothing more.
	waitShut(t, w, 1)
	if got := w.woken.Load(); got != 0 {
		t.Fatalf("the watch woke %d readers of a live peer", got)
	}
	r.Forget()
	if n := w.watched(); n != 0 {
		t.Fatalf("%d sockets still watched", n)
	}
}

// finBehind writes last on c and half-closes it, and waits until both the
// bytes and the FIN are in s's receive queue, unread.
func finBehind(t *testing.T, c, s *net.TCPConn, last []byte) {
	t.Helper()
	if _, err := c.Write(last); err != nil {
		t.Fatal(err)
	}
	testutil.WaitUnread(t, s, len(last))
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitTCPState(t, s, unix.BPF_TCP_CLOSE_WAIT)
}

// A FIN that came in behind the last bytes, before the read that takes
// them, is seen: the read is short, and the edge the FIN raised is gone
// (the runtime cleared the socket's readiness as the read began), so the
// read after it, which would return 0, is the watch's to ask for. The two
// orders of TestResetWatchWakesAReaderForAResetBehindTheLastBytes:
// watched at that read (the watch reports the FIN at once and shuts the
// read side, whose edge wakes the wait), and watched before the FIN (the
// report came first; the reader sees its flag and reads on). Without
// EPOLLRDHUP in the watch both wait for the 10 s deadline.
func TestResetWatchWakesAReaderForAFINBehindTheLastBytes(t *testing.T) {
	for _, early := range []bool{false, true} {
		name := "watched at the read"
		if early {
			name = "watched before the FIN"
		}
		t.Run(name, func(t *testing.T) {
			w := newTestResetWatch(t)
			c, s, r := watchedInOrder(t, w, early)
			finBehind(t, c, s, []byte("last"))
			if early {
				waitShut(t, w, 1) // the report, before the read
			}
			time.Sleep(20 * time.Millisecond) // the poller takes the edges there are, as for the reset
			_ = s.SetReadDeadline(time.Now().Add(10 * time.Second))
			var got []byte
			_, _, err, werr := r.ReadEach(sinkFunc(func(p []byte) { got = append(got, p...) }))
			if werr != nil || !errors.Is(err, io.EOF) || string(got) != "last" {
				t.Fatalf("ReadEach ended with %v (%v) after %q, want io.EOF after \"last\" (a timeout: the FIN was missed)", err, werr, got)
			}
			waitShut(t, w, 1)
			r.Forget()
			if n := w.watched(); n != 0 {
				t.Fatalf("%d sockets still watched", n)
			}
		})
	}
}

// watchedInOrder is a watchedPair whose socket the watch has taken
// already (early: one more round trip, whose short read has the watch
// take it) or not yet (the watch takes it at the next short read).
func watchedInOrder(t *testing.T, w *resetWatch, early bool) (c, s *net.TCPConn, r *flow.SockReader) {
	t.Helper()
	c, s, r = watchedPair(t, w)
	for try := 1; !early && w.watched() != 0; try++ {
		// A "ping" that came after a read in watchedPair's round trips
		// made a wait more, and the socket was watched early: not this
		// order. Again, with a new pair.
		if try == 10 {
			t.Fatal("the socket was watched early in 10 pairs of 10")
		}
		r.Forget()
		c, s, r = watchedPair(t, w)
	}
	if early {
		watchNow(t, c, s, r, w)
	}
	return c, s, r
}

// watchNow makes one more round trip on a watchedPair, whose short read
// has the watch take the socket.
func watchNow(t *testing.T, c, s *net.TCPConn, r *flow.SockReader, w *resetWatch) {
	t.Helper()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	_ = s.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if _, _, err, _ := r.ReadEach(echoTo{s}); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("round trip: %v", err)
	}
	if n := w.watched(); n != 1 {
		t.Fatalf("%d sockets watched, want 1", n)
	}
	if _, err := io.ReadFull(c, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
}

// A read that starts at an urgent mark while the thread has a signal
// pending returns EAGAIN with the bytes behind the mark queued, and no
// edge comes for them. A reader whose watch reported (it reads on after
// every read from then on) asks whether it stands at a mark and reads
// again. The test floods the process with SIGURG (the runtime's own
// preemption signal, harmless) while the peer sends 200 requests each
// with an urgent byte in its middle, one at a time: every request's bytes
// but the urgent one arrive within a second. Without the read made again
// some stall, their bytes read only when the next request's come (1, 2
// and 1 of 200 in three runs without it).
func TestUrgentMarkWithASignalPendingIsReadPast(t *testing.T) {
	w := newTestResetWatch(t)
	c, s, r := watchedInOrder(t, w, true)
	var (
		mu  sync.Mutex
		got []byte
	)
	done := make(chan error, 1)
	go func() {
		for {
			_, _, err, werr := r.ReadEach(sinkFunc(func(p []byte) { mu.Lock(); got = append(got, p...); mu.Unlock() }))
			if errors.Is(err, os.ErrDeadlineExceeded) { // the watch's wake-up, as tcpEnd.park takes it
				_ = s.SetReadDeadline(time.Time{})
				continue
			}
			done <- errors.Join(err, werr)
			return
		}
	}()
	stop := make(chan struct{})
	flooded := make(chan struct{})
	go func() {
		defer close(flooded)
		for pid := os.Getpid(); ; {
			select {
			case <-stop:
				return
			default:
				_ = syscall.Kill(pid, syscall.SIGURG)
			}
		}
	}()
	const rounds = 200
	stalls := 0
	for i := range rounds {
		testutil.SendUrgent(t, c, "ab", 'X', "def")
		want := (i + 1) * len("abdef")
		for deadline := time.Now().Add(time.Second); ; time.Sleep(100 * time.Microsecond) {
			mu.Lock()
			n := len(got)
			mu.Unlock()
			if n >= want {
				break
			}
			if time.Now().After(deadline) {
				stalls++
				break
			}
		}
	}
	close(stop)
	<-flooded
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, io.EOF) {
		t.Fatalf("ReadEach ended with %v, want io.EOF", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if stalls != 0 || len(got) != rounds*len("abdef") {
		t.Fatalf("%d of %d requests stalled at the urgent mark; %d bytes read in all, want %d", stalls, rounds, len(got), rounds*len("abdef"))
	}
	r.Forget()
}

// received is what s's socket has received so far, read or not
// (TCP_INFO's bytes_received).
func received(t *testing.T, s *net.TCPConn) uint64 {
	t.Helper()
	rc, err := s.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var got uint64
	_ = rc.Control(func(fd uintptr) {
		if ti, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			got = ti.Bytes_received
		}
	})
	return got
}

// waitReceived waits until s's socket has received n bytes, read or not.
func waitReceived(t *testing.T, s *net.TCPConn, n uint64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for received(t, s) < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d bytes received in 5 s, want %d", received(t, s), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// stopAt is a flow.ChunkSink that collects what it is handed and stops
// the read once it has n bytes.
type stopAt struct {
	n   int
	got *[]byte
}

func (stopAt) Limit() int { return flow.ChunkSize }

func (s stopAt) Handle(bp *[]byte, n int) (flow.Handled, error) {
	*s.got = append(*s.got, (*bp)[:n]...)
	if len(*s.got) >= s.n {
		return flow.HandledStop, nil
	}
	return flow.HandledMore, nil
}

// Urgent data (MSG_OOB) stops a read short at its mark with bytes behind
// it, and no edge comes after the read for them: the watch reports the
// urgent data (EPOLLPRI) and, the socket being alive, wakes the reader
// with a read deadline in the past instead of a shutdown. The reader's
// owner takes that deadline as a wake-up (as tcpEnd.park does) and reads
// on: every byte but the urgent one (not inline, as without the proxy)
// arrives, and the reader reads on after every read from then on. Both
// orders, as for the FIN. Without EPOLLPRI in the watch the reader waits
// for the 10 s deadline with "ab" read and "def" left in the queue.
func TestResetWatchWakesAReaderForUrgentData(t *testing.T) {
	for _, early := range []bool{false, true} {
		name := "watched at the read"
		if early {
			name = "watched before the urgent data"
		}
		t.Run(name, func(t *testing.T) {
			w := newTestResetWatch(t)
			c, s, r := watchedInOrder(t, w, early)
			base := received(t, s)
			testutil.SendUrgent(t, c, "ab", 'X', "def")
			testutil.WaitUnread(t, s, len("ab")) // SIOCINQ counts up to the urgent mark
			waitReceived(t, s, base+uint64(len("abXdef")))
			if early {
				waitWoken(t, w, 1) // the report, before the read
			}
			time.Sleep(20 * time.Millisecond) // the poller takes the edges there are, as for the reset
			start := time.Now()
			var got []byte
			for wakes := 0; len(got) < len("abdef"); wakes++ {
				_ = s.SetReadDeadline(start.Add(10 * time.Second))
				_, _, err, werr := r.ReadEach(stopAt{n: len("abdef"), got: &got})
				if werr != nil {
					t.Fatal(werr)
				}
				if err == nil {
					break
				}
				if !errors.Is(err, os.ErrDeadlineExceeded) || wakes > 0 || time.Since(start) > 5*time.Second {
					t.Fatalf("ReadEach ended with %v after %q, the watch woke %d readers: the bytes behind the urgent mark were missed", err, got, w.woken.Load())
				}
			}
			if string(got) != "abdef" {
				t.Fatalf("read %q, want \"abdef\"", got)
			}
			// At the read, the watch reports the urgent data if the reader
			// has not read past its mark by the time the watch looks (its
			// report is level-triggered: a mark read past is not reported);
			// either way every byte came.
			t.Logf("the watch woke %d readers", w.woken.Load())
			if n := w.shut.Load(); n != 0 {
				t.Fatalf("the watch shut %d sockets of a live peer", n)
			}
			r.Forget()
			if n := w.watched(); n != 0 {
				t.Fatalf("%d sockets still watched", n)
			}
		})
	}
}

// sinkFunc is a flow.ChunkSink that hands each chunk's bytes to f.
type sinkFunc func(p []byte)

func (sinkFunc) Limit() int { return flow.ChunkSize }

func (f sinkFunc) Handle(bp *[]byte, n int) (flow.Handled, error) {
	f((*bp)[:n])
	return flow.HandledMore, nil
}

// Through the proxy: an upstream answers and closes with request bytes
// unread, so that its kernel sends an RST right behind the answer, on a
// link that lives (round trips first, so that both readers wait after
// drained reads). The client gets the answer and then the link's end
// within 10 s (where the reset is missed it waits for park_idle_after's
// level-triggered wait, or for ever without parking: the two subtests),
// and the link ends as the upstream's reset. The watch holds nothing once
// the links are gone.
func TestUpstreamResetBehindTheAnswerEndsTheLink(t *testing.T) {
	for _, park := range []time.Duration{0, time.Minute} {
		t.Run("park_idle_after "+park.String(), func(t *testing.T) {
			addr, wait := oneUpstream(t, func(c *net.TCPConn) error {
				if err := echoThenRead(c, 6); err != nil { // "last"; "UNREAD" stays behind it
					return err
				}
				for flow.UnreadBytes(c) == 0 { // the unread bytes are in
					time.Sleep(time.Millisecond)
				}
				_, err := c.Write([]byte("resp"))
				return err // the deferred close, with unread bytes: an RST
			})
			h := startParking(t, addr, park, nil)
			c := liveLink(t, h)
			lastAnswered(t, c, "lastUNREAD")
			err, _ := waitClosed(t, c, 10*time.Second)
			wait()
			st := h.linkEnd(10 * time.Second)
			t.Logf("client saw %v; link ended as %s", err, st.Reason)
			if st.Reason != CloseUpstreamError {
				t.Errorf("link ended as %s, want %s", st.Reason, CloseUpstreamError)
			}
			if n := h.p.rwatch.watched(); n != 0 {
				t.Errorf("the reset watch holds %d sockets after the link ended", n)
			}
		})
	}
}

// The client's side of the same: a client that sends its last request and
// resets right behind it (SO_LINGER 0), on a link that lives, while the
// upstream holds the request unanswered (a long poll). The link ends as
// the client's error within 10 s, not when the upstream answers: the
// client's socket is watched too.
func TestClientResetBehindTheLastRequestEndsTheLink(t *testing.T) {
	release := make(chan struct{})
	addr, wait := oneUpstream(t, func(c *net.TCPConn) error {
		if err := echoThenRead(c, 6); err != nil { // "last", held unanswered
			return err
		}
		<-release
		return nil
	})
	defer wait()
	defer close(release)
	h := startParking(t, addr, 0, nil)
	c := liveLink(t, h)
	if _, err := c.Write([]byte("last")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetLinger(0)
	_ = c.Close() // an RST behind "last"
	st := h.linkEnd(10 * time.Second)
	if st.Reason != CloseClientError {
		t.Errorf("link ended as %s, want %s", st.Reason, CloseClientError)
	}
	if n := h.p.rwatch.watched(); n != 0 {
		t.Errorf("the reset watch holds %d sockets after the link ended", n)
	}
}

// Through the proxy, the FIN's case: an upstream answers its last
// request and closes, the answer and the FIN in one segment (corked), on
// a link that lives and never parks (where the FIN were missed the
// response pump would wait for ever: nothing else wakes it). The client
// gets the answer and then the FIN within 10 s, and the link ends as the
// upstream's close once the client closes too.
func TestUpstreamFinBehindTheAnswerEndsTheLink(t *testing.T) {
	addr, wait := oneUpstream(t, func(c *net.TCPConn) error {
		if err := echoThenRead(c, 6); err != nil { // and "last", unanswered so far
			return err
		}
		rc, err := c.SyscallConn()
		if err != nil {
			return err
		}
		var serr error
		_ = rc.Control(func(fd uintptr) {
			if serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_CORK, 1); serr != nil {
				return
			}
			if _, serr = unix.Write(int(fd), []byte("resp")); serr != nil {
				return
			}
			if serr = unix.Shutdown(int(fd), unix.SHUT_WR); serr != nil {
				return
			}
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_CORK, 0)
		})
		if serr != nil {
			return serr
		}
		_, err = io.Copy(io.Discard, c) // until the client's FIN
		return err
	})
	h := startParking(t, addr, 0, nil)
	c := liveLink(t, h)
	lastAnswered(t, c, "last")
	got := make([]byte, 4)
	if n, err := c.Read(got); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("after the answer: %d bytes, %v; want the FIN (a timeout: the proxy missed it)", n, err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	wait()
	if st := h.linkEnd(10 * time.Second); st.Reason != CloseUpstreamClosed {
		t.Errorf("link ended as %s, want %s", st.Reason, CloseUpstreamClosed)
	}
	if n := h.p.rwatch.watched(); n != 0 {
		t.Errorf("the reset watch holds %d sockets after the link ended", n)
	}
}

// Through the proxy, urgent data's case: a client on a link that lives
// sends a request with an urgent byte in its middle (MSG_OOB), all in one
// segment, so that the request pump's read stops short at the mark with
// the rest of the request behind it. The watch wakes the pump (a read
// deadline, which the pump takes as a wake-up: tcpEnd.park), the rest
// reaches the upstream, and the answer comes back within 10 s. The urgent
// byte itself is not relayed (the socket does not read it inline), as
// with any proxy that relays the stream. Without the watch's EPOLLPRI the
// pump waits for bytes that are already there, and the client waits for
// ever.
func TestClientUrgentDataDoesNotStallTheLink(t *testing.T) {
	addr, wait := oneUpstream(t, func(c *net.TCPConn) error {
		_, err := io.Copy(c, c) // an echo, until the client's FIN
		return err
	})
	h := startParking(t, addr, 0, nil)
	c := liveLink(t, h)
	testutil.SendUrgent(t, c, "pi", 'X', "ng")
	got := make([]byte, 4)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "ping" {
		t.Fatalf("echo %q, %v; want \"ping\" (a timeout: the request pump stalled at the urgent mark)", got, err)
	}
	roundTrip(t, c, []byte("pong")) // and the link goes on
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(c); err != nil {
		t.Fatal(err)
	}
	wait()
	if st := h.linkEnd(10 * time.Second); st.Reason != CloseClientClosed {
		t.Errorf("link ended as %s, want %s", st.Reason, CloseClientClosed)
	}
}

// liveLink dials h and makes six round trips of "ping" on the link (its
// upstream echoes them: echoThenRead), so that both of its readers wait
// after short reads and are watched.
func liveLink(t *testing.T, h *harness) *net.TCPConn {
	t.Helper()
	c := h.dial()
	for range 6 {
		roundTrip(t, c, []byte("ping"))
	}
	return c
}

// lastAnswered sends last on c and reads the upstream's 4-byte answer,
// "resp", within 10 s (the read deadline stays).
func lastAnswered(t *testing.T, c *net.TCPConn, last string) {
	t.Helper()
	if _, err := c.Write([]byte(last)); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "resp" {
		t.Fatalf("answer %q, %v", got, err)
	}
}

// echoThenRead echoes n 4-byte requests on c and reads one more, which it
// does not answer.
func echoThenRead(c *net.TCPConn, n int) error {
	buf := make([]byte, 4)
	for range n {
		if _, err := io.ReadFull(c, buf); err != nil {
			return err
		}
		if _, err := c.Write(buf); err != nil {
			return err
		}
	}
	_, err := io.ReadFull(c, buf)
	return err
}

// A watch whose wait fails (the proxy's own failure; here its epoll set is
// closed under it) marks every socket it held as reported, so that their
// readers read on after every read and a reset behind the last bytes is
// still seen, and takes no more sockets.
func TestResetWatchFailureMarksItsSockets(t *testing.T) {
	w := newTestResetWatch(t)
	c, s, r := watchedPair(t, w)
	// One more round trip: its drained read has the watch take the socket.
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	_ = s.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if _, _, err, _ := r.ReadEach(echoTo{s}); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("round trip: %v", err)
	}
	if _, err := io.ReadFull(c, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	if n := w.watched(); n != 1 {
		t.Fatalf("%d sockets watched, want 1", n)
	}
	w.set.close()
	err := <-w.runErr
	w.runErr <- err // for stop, in the cleanup
	if _, ok := w.Watch(-1, nil, nil, new(atomic.Bool)); ok {
		t.Fatal("a failed watch took a socket")
	}
	testutil.ResetBehind(t, c, s, []byte("last"))
	time.Sleep(20 * time.Millisecond) // as in TestResetWatchWakes...: the poller takes the edge
	_ = s.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, _, err, werr := r.ReadEach(echoTo{io.Discard}); werr != nil || !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("ReadEach ended with %v (%v), want ECONNRESET (a timeout: the reset was missed)", err, werr)
	}
	if got := w.shut.Load(); got != 0 {
		t.Fatalf("a failed watch shut %d sockets", got)
	}
}
