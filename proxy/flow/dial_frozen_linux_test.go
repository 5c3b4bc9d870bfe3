package flow

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// stateOf is fd's TCP state (tcpi_state: unix.BPF_TCP_*).
func stateOf(fd int) (uint8, error) {
	ti, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
	if err != nil {
		return 0, err
	}
	return ti.State, nil
}

// holdDials holds each dial of the test in awaitConnect, once its connect
// is under way and its deadline armed, until hold(fd) returns: the
// dialling goroutine cannot run, as in a process frozen past the deadline
// (CPU throttling, a host under contention), while the kernel goes on
// with the handshake. It returns the count of dials held.
func holdDials(t *testing.T, hold func(fd int)) *atomic.Int32 {
	t.Helper()
	var held atomic.Int32
	h := func(fd int) {
		held.Add(1)
		hold(fd)
	}
	testHookConnectPending.Store(&h)
	t.Cleanup(func() { testHookConnectPending.Store(nil) })
	return &held
}

// waitTCPState waits until the kernel has taken fd to state: the wait is
// the kernel's (a SYN sent again a second after the first, three under
// load), bounded well above it. It runs on the dialling goroutine, inside
// the dial: a failure is reported and the dial goes on.
func waitTCPState(t *testing.T, fd int, state uint8) {
	t.Helper()
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		st, err := stateOf(fd)
		if err != nil {
			t.Errorf("TCP_INFO of the dialling socket: %v", err)
			return
		}
		if st == state {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("the dialling socket is in state %d after 15s, want %d", st, state)
			return
		}
	}
}

// TestDialRawLooksAgainAfterItsDeadline: a wait that ends on the dial's
// deadline is not taken for a timeout until the socket is looked at once
// more. The runtime runs an expired timer before it polls the network, so
// in a process that could not run past the deadline the wait ends with
// the deadline's error whatever the socket did meanwhile: a connect that
// completed meanwhile is a connection (with no deadline left on it), one
// refused meanwhile is refused, and only one still unanswered (SYN_SENT)
// times out. Each connect goes to a listener whose accept queue is full
// (its SYN is dropped, so the connect is under way at the first look) and
// is held past its deadline while the test changes what the kernel does
// with the SYN sent again a second later.
func TestDialRawLooksAgainAfterItsDeadline(t *testing.T) {
	for _, timeout := range []time.Duration{
		time.Nanosecond,        // past when it is armed: the wait ends at once
		100 * time.Millisecond, // passes while the dial is held: its timer fires meanwhile
	} {
		t.Run("completed meanwhile, timeout "+timeout.String(), func(t *testing.T) {
			ap, lfd, _ := fullListener(t)
			held := holdDials(t, func(fd int) {
				if nfd, _, err := unix.Accept(lfd); err == nil { // room for the SYN sent again
					unix.Close(nfd)
				}
				waitTCPState(t, fd, unix.BPF_TCP_ESTABLISHED)
			})
			f, err := DialRaw(context.Background(), ap, dialSettings(), timeout)
			if n := held.Load(); n != 1 {
				t.Fatalf("%d dials held, want 1: the connect was not under way at the first look", n)
			}
			if err != nil {
				t.Fatalf("a connect that completed while its dial could not run: %v", err)
			}
			defer f.Close()
			sfd, _, err := unix.Accept(lfd)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(sfd)
			// The deadline has passed: a write that still had it would
			// time out.
			if _, err := f.Write([]byte("x")); err != nil {
				t.Fatalf("a write on the connection: %v (the dial left its deadline)", err)
			}
			b := make([]byte, 1)
			if n, err := unix.Read(sfd, b); n != 1 || err != nil || b[0] != 'x' {
				t.Fatalf("the server read %q, %v", b[:max(n, 0)], err)
			}
		})
	}

	t.Run("refused meanwhile", func(t *testing.T) {
		ap, _, closeListener := fullListener(t)
		held := holdDials(t, func(fd int) {
			closeListener() // the SYN sent again is answered with a reset
			waitTCPState(t, fd, unix.BPF_TCP_CLOSE)
		})
		f, err := DialRaw(context.Background(), ap, dialSettings(), time.Nanosecond)
		if err == nil {
			f.Close()
			t.Fatal("a connect refused while its dial was held succeeded")
		}
		if n := held.Load(); n != 1 {
			t.Fatalf("%d dials held, want 1", n)
		}
		var oe *net.OpError
		if !errors.As(err, &oe) || oe.Op != "dial" || !errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("err %v, want a dial OpError with ECONNREFUSED, not the deadline's", err)
		}
	})

	t.Run("unanswered", func(t *testing.T) {
		ap, _, _ := fullListener(t)
		held := holdDials(t, func(fd int) {
			if st, err := stateOf(fd); err != nil || st != unix.BPF_TCP_SYN_SENT {
				t.Errorf("the held connect is in state %d (%v), want SYN_SENT", st, err)
			}
		})
		f, err := DialRaw(context.Background(), ap, dialSettings(), time.Nanosecond)
		if err == nil {
			f.Close()
			t.Fatal("a connect whose SYN was dropped succeeded")
		}
		if n := held.Load(); n != 1 {
			t.Fatalf("%d dials held, want 1", n)
		}
		var ne net.Error
		if !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("err %v, want the deadline's", err)
		}
	})

	// The fast path: a connect that completed inside connect(2) (a local
	// peer) is a connection at the first look, whatever the deadline, and
	// arms none (the hook is never reached).
	t.Run("completed at the first look", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		held := holdDials(t, func(int) {})
		f, err := DialRaw(context.Background(), netip.MustParseAddrPort(ln.Addr().String()), dialSettings(), time.Nanosecond)
		if err != nil {
			t.Fatalf("a local connect with its deadline already passed: %v", err)
		}
		f.Close()
		if n := held.Load(); n != 0 {
			t.Fatalf("%d dials armed a deadline, want 0", n)
		}
	})
}
