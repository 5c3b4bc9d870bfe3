//go:build linux

package flow

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// tcpPair is a connected loopback pair: c dialled, s accepted.
func tcpPair(t *testing.T) (c, s *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	dc, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	ac, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dc.Close(); _ = ac.Close() })
	return dc.(*net.TCPConn), ac.(*net.TCPConn)
}

// rawRead is one recv of s, raw as the reader's: the count, or the error
// (EAGAIN when the receive queue is empty).
func rawRead(t *testing.T, s *net.TCPConn, p []byte) (n int, err error) {
	t.Helper()
	if cerr := rawOf(t, s).Control(func(fd uintptr) { n, err = SysRead(int(fd), p) }); cerr != nil {
		t.Fatal(cerr)
	}
	return n, err
}

// The kernel's side of the reader's rule (ReadEach): a read that returns
// less than it asked for took everything the receive queue held, however
// many segments it came in (the writes below are separate segments: the
// client has TCP_NODELAY), so the read after it finds nothing; a read
// that fills its buffer may leave bytes behind. What a short read does
// not say is the FIN behind its bytes: the read after it returns 0, not
// EAGAIN (the watch's part, not the rule's).
func TestShortReadTakesAllThereIs(t *testing.T) {
	c, s := tcpPair(t)
	in := 0
	for _, w := range []string{"0123", "4567", "89"} {
		if _, err := c.Write([]byte(w)); err != nil {
			t.Fatal(err)
		}
		in += len(w)
		testutil.WaitUnread(t, s, in) // each in, before the next is written
	}
	buf := make([]byte, 64)
	if n, err := rawRead(t, s, buf); n != 10 || err != nil {
		t.Fatalf("read %d, %v; want all 10 bytes of three segments", n, err)
	}
	if _, err := rawRead(t, s, buf); err != syscall.EAGAIN {
		t.Fatalf("the read after a short one: %v, want EAGAIN", err)
	}
	if _, err := c.Write([]byte("0123456789")); err != nil {
		t.Fatal(err)
	}
	testutil.WaitUnread(t, s, 10)
	if n, err := rawRead(t, s, buf[:4]); n != 4 || err != nil {
		t.Fatalf("read %d of 10, %v; want a full 4", n, err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitTCPState(t, s, unix.BPF_TCP_CLOSE_WAIT) // the FIN has arrived, behind the 6 bytes
	if n, err := rawRead(t, s, buf); n != 6 || err != nil {
		t.Fatalf("read %d, %v; want the last 6 bytes", n, err)
	}
	if n, err := rawRead(t, s, buf); n != 0 || err != nil {
		t.Fatalf("read %d, %v after the FIN, want 0 (EOF)", n, err)
	}
}

// echoSink writes each chunk back to s; with a gate it first says it is
// there (a send on gate) and waits to be let go (a receive).
type echoSink struct {
	s    io.Writer
	gate chan struct{}
}

func (*echoSink) Limit() int { return ChunkSize }

func (e *echoSink) Handle(bp *[]byte, n int) (Handled, error) {
	if e.gate != nil {
		e.gate <- struct{}{}
		<-e.gate
	}
	if _, err := e.s.Write((*bp)[:n]); err != nil {
		return HandledStop, err
	}
	return HandledMore, nil
}

// echoEach runs ReadEach on s with an echoSink in a goroutine, whose
// error it reports.
func echoEach(t *testing.T, r *SockReader, s *net.TCPConn, gate chan struct{}) <-chan error {
	t.Helper()
	if err := r.Init(s); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, _, err, werr := r.ReadEach(&echoSink{s: s, gate: gate})
		if werr != nil {
			err = werr
		}
		done <- err
	}()
	return done
}

// endOf waits for the ReadEach goroutine; if it is stuck, closing s ends
// it (so the test fails instead of hanging, and leaks nothing).
func endOf(t *testing.T, done <-chan error, s *net.TCPConn) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(20 * time.Second):
		_ = s.Close()
		<-done
		t.Fatal("readEach did not return within 20 s")
		return nil
	}
}

// Once a socket has waited for data twice and is watched, a short read
// is not followed by one that finds nothing: the reader waits for the
// poller in the same RawConn.Read instead. No wake-up is lost (every
// round trip completes) and EOF is still seen (a FIN that comes while
// the reader waits raises an edge of its own). The reader's own count of
// reads that found nothing stays near watchAfter, where it would be one
// per round trip without the rule.
func TestReadEachSkipsTheReadThatFindsNothing(t *testing.T) {
	c, s := tcpPair(t)
	var r SockReader
	w := &fakeWatch{}
	r.SetResetWatch(w, s)
	done := echoEach(t, &r, s, nil)
	const rounds = 200
	msg := []byte("sixteen bytes..")
	got := make([]byte, len(msg))
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	for i := range rounds {
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, got); err != nil {
			t.Fatalf("round %d: %v", i, err)
		}
		if !bytes.Equal(got, msg) {
			t.Fatalf("round %d: %q", i, got)
		}
	}
	endsAtEOF(t, c, s, done, &r)
	if r.waits > watchAfter+rounds/4 {
		t.Fatalf("%d reads found nothing in %d round trips: the read after a drained one is still made", r.waits, rounds)
	}
	if w.watches != 1 {
		t.Fatalf("the socket was given to the watch %d times, want once", w.watches)
	}
	r.Forget()
	if w.forgotten != 1 || r.key != 0 {
		t.Fatalf("Forget: the watch forgot %d sockets (key %d), want 1", w.forgotten, r.key)
	}
}

// A FIN that came in the same segment as the last bytes is seen by a
// reader that nothing watches, or whose watch refused the socket: it
// reads on after every read, and the read after the last bytes returns 0.
// (A watched reader waits after the short read instead, and the watch's
// report of the FIN ends the wait: proxy's resetWatch tests.) The client
// corks its socket so that the kernel tacks the FIN onto the unsent
// bytes.
func TestReadEachSeesAFINThatCameWithTheLastBytes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		watch *fakeWatch
	}{{"no watch", nil}, {"refused", &fakeWatch{refuse: true}}} {
		t.Run(tc.name, func(t *testing.T) {
			c, s := tcpPair(t)
			var r SockReader
			if tc.watch != nil {
				r.SetResetWatch(tc.watch, s)
			}
			done := echoEach(t, &r, s, nil)
			msg := []byte("ping")
			got := make([]byte, len(msg))
			_ = c.SetDeadline(time.Now().Add(20 * time.Second))
			for range 10 { // past watchAfter: a watched reader would wait after each short read
				if _, err := c.Write(msg); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(c, got); err != nil {
					t.Fatal(err)
				}
			}
			rc, err := c.SyscallConn()
			if err != nil {
				t.Fatal(err)
			}
			_ = rc.Control(func(fd uintptr) { _ = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_CORK, 1) })
			if _, err := c.Write([]byte("last")); err != nil {
				t.Fatal(err)
			}
			if err := c.CloseWrite(); err != nil {
				t.Fatal(err)
			}
			if err := endOf(t, done, s); !errors.Is(err, io.EOF) {
				t.Fatalf("readEach ended with %v, want io.EOF", err)
			}
			if _, err := io.ReadFull(c, got); err != nil || string(got) != "last" {
				t.Fatalf("echo of the last bytes: %q, %v", got, err)
			}
			if r.key != 0 {
				t.Fatal("the reader is watched")
			}
		})
	}
}

// Bytes that arrive while the handler is still busy with the previous
// chunk (after the read that drained the socket, before the wait) wake
// the wait at once: the runtime recorded the edge.
func TestReadEachWakesForBytesThatCameDuringTheHandler(t *testing.T) {
	c, s := tcpPair(t)
	var r SockReader
	r.SetResetWatch(&fakeWatch{}, s)
	gate := make(chan struct{})
	done := echoEach(t, &r, s, gate)
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	msg := []byte("ping")
	got := make([]byte, 2*len(msg))
	for range 50 { // the reader waits after short reads once it found nothing twice: mostly after 2 rounds
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		<-gate
		gate <- struct{}{}
		if _, err := io.ReadFull(c, got[:len(msg)]); err != nil {
			t.Fatal(err)
		}
	}
	// "ping" is read (the socket drained) and its handler held; "pong"
	// arrives and waits in the receive queue before the handler ends.
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	<-gate
	if _, err := c.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	testutil.WaitUnread(t, s, len("pong"))
	gate <- struct{}{}
	<-gate // the handler of "pong": the wait woke
	gate <- struct{}{}
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "pingpong" {
		t.Fatalf("echo %q, %v; want both writes back", got, err)
	}
	endsAtEOF(t, c, s, done, &r)
}

// endsAtEOF half-closes c and checks that the ReadEach on s ends at the
// FIN, the reader watched by then (so that it waited after short reads).
func endsAtEOF(t *testing.T, c, s *net.TCPConn, done <-chan error, r *SockReader) {
	t.Helper()
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if err := endOf(t, done, s); !errors.Is(err, io.EOF) {
		t.Fatalf("readEach ended with %v, want io.EOF", err)
	}
	if r.key == 0 {
		t.Fatal("the reader was never watched: it never waited after a short read")
	}
}

// fakeWatch is a flow.ResetWatch that watches nothing: for the tests of
// the reads a reader makes (proxy's resetWatch, the real one, has the
// tests of resets). refuse refuses every socket; stopped marks each one
// reported as it takes it, as a watch whose wait failed marks those it
// held. Read only after the reader's goroutine has ended.
type fakeWatch struct {
	refuse, stopped    bool
	watches, forgotten int
}

func (w *fakeWatch) Watch(_ int, _ syscall.RawConn, _ Deadliner, reported *atomic.Bool) (uint64, bool) {
	w.watches++
	if w.stopped {
		reported.Store(true)
	}
	return uint64(w.watches), !w.refuse
}

func (w *fakeWatch) Forget(uint64) { w.forgotten++ }

// An RST that came in behind the last bytes, before the read that takes
// them, is seen by a reader that nothing watches: the read is short, and
// the reader reads again, which returns the reset. So it does when the watch refuses the socket,
// or has stopped watching (the socket is marked reported). (With a live
// watch the reader waits instead, and the watch's wake-up ends the wait:
// proxy's resetWatch tests.)
func TestReadEachWithoutAWatchSeesAResetBehindTheLastBytes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		watch *fakeWatch
	}{
		{"no watch", nil},
		{"refused", &fakeWatch{refuse: true}},
		{"stopped", &fakeWatch{stopped: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, s := tcpPair(t)
			var r SockReader
			if tc.watch != nil {
				r.SetResetWatch(tc.watch, s)
			}
			if err := r.Init(s); err != nil {
				t.Fatal(err)
			}
			// Round trips until the socket has waited watchAfter times, when
			// a watched reader would start to wait after drained reads: each
			// ReadEach echoes "ping", then finds nothing and waits, until a
			// read deadline ends the wait.
			sink := &echoSink{s: s}
			got := make([]byte, 4)
			for range watchAfter {
				if _, err := c.Write([]byte("ping")); err != nil {
					t.Fatal(err)
				}
				_ = s.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
				if _, _, err, werr := r.ReadEach(sink); !errors.Is(err, os.ErrDeadlineExceeded) || werr != nil {
					t.Fatalf("round trip: %v, %v; want the deadline", err, werr)
				}
				if _, err := io.ReadFull(c, got); err != nil {
					t.Fatal(err)
				}
			}
			if r.waits < watchAfter { // more where a "ping" came after a read
				t.Fatalf("%d reads found nothing, want at least %d", r.waits, watchAfter)
			}
			testutil.ResetBehind(t, c, s, []byte("last"))
			_ = s.SetReadDeadline(time.Now().Add(10 * time.Second))
			_, _, err, werr := r.ReadEach(&echoSink{s: io.Discard})
			if werr != nil || !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("ReadEach ended with %v (%v), want ECONNRESET (a timeout: the reader waited after the drained read)", err, werr)
			}
			if w := tc.watch; w != nil && w.refuse && w.watches != 1 {
				t.Fatalf("a refused watch was asked %d times, want once", w.watches)
			}
		})
	}
}

// ShutdownReadAtEnd shuts the read side only of a socket that can receive
// nothing more, and wakes its waiters then: a live socket is left as it
// is (a byte sent after the call still arrives); one closed by a reset,
// or one whose peer's FIN is in, is shut, its queued bytes still read
// first (then the reset, or EOF).
func TestShutdownReadAtEnd(t *testing.T) {
	t.Run("live", func(t *testing.T) {
		c, s := tcpPair(t)
		if ShutdownReadAtEnd(rawOf(t, s)) {
			t.Fatal("shut a live socket")
		}
		if _, err := c.Write([]byte("still")); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 5)
		_ = s.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(s, got); err != nil || string(got) != "still" {
			t.Fatalf("after the call: %q, %v", got, err)
		}
	})
	t.Run("reset", func(t *testing.T) {
		c, s := tcpPair(t)
		testutil.ResetBehind(t, c, s, []byte("last"))
		if !ShutdownReadAtEnd(rawOf(t, s)) {
			t.Fatal("a socket closed by a reset was not shut")
		}
		got := make([]byte, 4)
		if _, err := io.ReadFull(s, got); err != nil || string(got) != "last" {
			t.Fatalf("queued bytes: %q, %v", got, err)
		}
		if _, err := s.Read(got); !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("after the bytes: %v, want ECONNRESET", err)
		}
	})
	t.Run("peer's FIN in", func(t *testing.T) {
		c, s := tcpPair(t)
		if _, err := c.Write([]byte("last")); err != nil {
			t.Fatal(err)
		}
		if err := c.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		testutil.WaitTCPState(t, s, unix.BPF_TCP_CLOSE_WAIT)
		if !ShutdownReadAtEnd(rawOf(t, s)) {
			t.Fatal("a socket whose peer's FIN is in was not shut")
		}
		got := make([]byte, 4)
		if _, err := io.ReadFull(s, got); err != nil || string(got) != "last" {
			t.Fatalf("queued bytes: %q, %v", got, err)
		}
		if _, err := s.Read(got); !errors.Is(err, io.EOF) {
			t.Fatalf("after the bytes: %v, want EOF", err)
		}
	})
}

// rawOf is c's raw connection.
func rawOf(t *testing.T, c *net.TCPConn) syscall.RawConn {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	return rc
}
