package flow

import (
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// plainListen binds a plain TCP (not MPTCP) listener for a Listener, as
// the proxy's are.
func plainListen(t *testing.T, network, addr string) *net.TCPListener {
	t.Helper()
	lc := net.ListenConfig{KeepAlive: -1, Control: ListenControl}
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(t.Context(), network, addr)
	if err != nil {
		testutil.SkipOrFail(t, "no %s loopback: %v", network, err)
	}
	return ln.(*net.TCPListener)
}

// TestListenerAccepts: a socket the raw Listener accepts is on the
// runtime's poller (a read that has to wait is woken), has TCP_NODELAY
// from the listening socket without a
// setsockopt of its own, and comes
// with the client's address as net would give it; over IPv4 and IPv6.
func TestListenerAccepts(t *testing.T) {
	for _, c := range []struct{ network, addr string }{{"tcp4", "127.0.0.1:0"}, {"tcp6", "[::1]:0"}} {
		t.Run(c.network, func(t *testing.T) {
			ln := plainListen(t, c.network, c.addr)
			// A connection the kernel completes before NewListener takes
			// the socket inherits the options too (ListenControl set them
			// before listen).
			early, err := net.Dial(c.network, ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer early.Close()
			l, err := NewListener(ln)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			ef, _, err := l.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer ef.Close()
			if v := sockoptOf(t, ef, unix.IPPROTO_TCP, unix.TCP_NODELAY); v == 0 {
				t.Fatal("a connection completed before NewListener has no TCP_NODELAY")
			}
			client, err := net.Dial(c.network, l.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer client.Close()
			f, remote, err := l.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if got, want := remote.String(), client.LocalAddr().String(); got != want {
				t.Fatalf("client address %s, the client says %s", got, want)
			}
			if v := sockoptOf(t, f, unix.IPPROTO_TCP, unix.TCP_NODELAY); v == 0 {
				t.Fatal("the accepted socket has no TCP_NODELAY: it did not inherit the listener's")
			}
			// A read that waits for bytes sent after it started.
			got := make(chan []byte, 1)
			go func() {
				b := make([]byte, 5)
				_, err := io.ReadFull(f, b)
				if err != nil {
					b = []byte(err.Error())
				}
				got <- b
			}()
			time.Sleep(20 * time.Millisecond)
			if _, err := client.Write([]byte("hello")); err != nil {
				t.Fatal(err)
			}
			if b := <-got; string(b) != "hello" {
				t.Fatalf("read %q", b)
			}
			if _, err := f.Write([]byte("back")); err != nil {
				t.Fatal(err)
			}
			b := make([]byte, 4)
			if _, err := io.ReadFull(client, b); err != nil || string(b) != "back" {
				t.Fatalf("client read %q, %v", b, err)
			}
		})
	}
}

// TestListenerClose: Close ends an Accept that waits with net.ErrClosed,
// frees the address (it can be bound again at once), and a second Close
// says it was closed.
func TestListenerClose(t *testing.T) {
	l, err := NewListener(plainListen(t, "tcp4", "127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	done := make(chan error, 1)
	go func() {
		_, _, err := l.Accept()
		done <- err
	}()
	time.Sleep(20 * time.Millisecond)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Accept after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Accept still waits after Close")
	}
	if err := l.Close(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("second Close: %v", err)
	}
	again := plainListen(t, "tcp4", addr)
	_ = again.Close()
}

// TestReadEachOnAnAcceptedSocket: a reader of a socket the Listener
// accepted makes no read that finds nothing after a request once the
// socket has waited watchAfter times (a connection that lives) and its
// watch watches it: over five round trips its count of such reads stays
// at most watchAfter, and one more where its first read came before the
// first request; it is given to the watch once at most. It echoes every
// round and ends at the FIN.
func TestReadEachOnAnAcceptedSocket(t *testing.T) {
	l, err := NewListener(plainListen(t, "tcp4", "127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("tcp4", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	f, _, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var r SockReader
	r.InitRaw(mustRaw(f))
	w := &fakeWatch{}
	r.SetResetWatch(w, f)
	done := make(chan error, 1)
	go func() {
		_, _, err, werr := r.ReadEach(&echoSink{s: f})
		done <- errors.Join(err, werr)
	}()
	msg, got := []byte("ping"), make([]byte, 4)
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	for i := range 5 {
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, got); err != nil || string(got) != "ping" {
			t.Fatalf("round %d: %q, %v", i, got, err)
		}
	}
	_ = c.(*net.TCPConn).CloseWrite()
	select {
	case err := <-done:
		if !errors.Is(err, io.EOF) {
			t.Fatalf("ReadEach ended with %v, want io.EOF", err)
		}
	case <-time.After(20 * time.Second):
		_ = f.Close()
		t.Fatal("ReadEach did not see the FIN")
	}
	// The first read may come before the first request: one more.
	if r.waits > watchAfter+1 {
		t.Errorf("%d reads found nothing in 5 round trips, want at most %d", r.waits, watchAfter+1)
	}
	// Whether it was watched at all is the scheduler's: the reader's read
	// after an echo finds nothing only when it comes before the client's
	// next request (a busy machine can leave each read something to take).
	t.Logf("%d reads found nothing, watched %d times", r.waits, w.watches)
	if w.watches > 1 {
		t.Errorf("the socket was given to the watch %d times, want once at most", w.watches)
	}
}

// TestNewListenerWantsListenControl: a listening socket bound without
// ListenControl (no TCP_NODELAY for its connections to inherit) is
// refused, and closed, instead of accepting connections that would keep
// Nagle's algorithm for life.
func TestNewListenerWantsListenControl(t *testing.T) {
	lc := net.ListenConfig{KeepAlive: -1}
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(t.Context(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if l, err := NewListener(ln.(*net.TCPListener)); err == nil {
		_ = l.Close()
		t.Fatal("NewListener took a socket without TCP_NODELAY")
	}
	again := plainListen(t, "tcp4", addr) // the refused one was closed
	_ = again.Close()
}

// TestZoneNamesAreCached: a link-local client's zone is named as net
// names it (the interface's name, or the index where none has it), from
// a cache that asks the kernel for the interfaces once per maxAge, not
// once per accept.
func TestZoneNamesAreCached(t *testing.T) {
	ifs, err := net.Interfaces()
	if err != nil || len(ifs) == 0 {
		t.Fatalf("no interfaces: %v", err)
	}
	asked := 0
	z := zoneCache{maxAge: time.Hour, lookup: func() ([]net.Interface, error) {
		asked++
		return ifs, nil
	}}
	for range 3 {
		if got := z.name(ifs[0].Index); got != ifs[0].Name {
			t.Fatalf("index %d named %q, want %q", ifs[0].Index, got, ifs[0].Name)
		}
	}
	if got := z.name(1 << 20); got != "1048576" {
		t.Fatalf("an unknown index named %q, want its number", got)
	}
	if asked != 1 {
		t.Fatalf("the interfaces were asked for %d times, want once within maxAge", asked)
	}
	z.maxAge = 0 // stale: an unknown index asks again
	_ = z.name(1 << 20)
	if asked != 2 {
		t.Fatalf("a stale cache was not refreshed for an unknown index (%d asks)", asked)
	}
}
