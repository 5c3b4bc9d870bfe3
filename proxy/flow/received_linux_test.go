package flow

import (
	"io"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// Received says how many bytes of the peer's the kernel took in, and
// when the latest arrived, never later than it did: nothing before the
// first byte (the kernel's clock then starts at the handshake, which is no
// answer), then the count, with an arrival between the write that sent
// them less the kernel's granularity (Received takes 11ms off) and now.
func TestReceivedSaysWhatCameAndWhen(t *testing.T) {
	c, s := tcpPair(t)
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(30 * time.Millisecond) // the handshake well behind
	if n, _, ok := Received(raw); ok {
		t.Fatalf("Received = %d bytes before any came", n)
	}
	before := Mono()
	if _, err := s.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	var n, at int64
	var ok bool
	for deadline := time.Now().Add(5 * time.Second); n < 5; time.Sleep(time.Millisecond) {
		if n, at, ok = Received(raw); time.Now().After(deadline) {
			t.Fatalf("Received = %d, %v after 5s, want 5 bytes", n, ok)
		}
	}
	after := Mono()
	if n != 5 {
		t.Fatalf("Received = %d bytes, want 5", n)
	}
	if at > after || at < before-int64(25*time.Millisecond) {
		t.Fatalf("arrival %v after the write began, want within [-25ms, %v]", time.Duration(at-before), time.Duration(after-before))
	}
	// Unread or read, the kernel's count and clock are the same.
	if _, err := c.Read(make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	if n2, at2, _ := Received(raw); n2 != 5 || at2 > after || at2 < before-int64(25*time.Millisecond) {
		t.Fatalf("after the read: %d bytes at %v, want 5 at the same arrival", n2, time.Duration(at2-before))
	}
	// The peer's FIN takes a sequence number, not a byte.
	_ = s.Close()
	if _, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("read after the peer's close: %v, want EOF", err)
	}
	if n3, _, ok := Received(raw); n3 != 5 || !ok {
		t.Fatalf("after the peer's FIN: %d bytes (%v), want 5", n3, ok)
	}
}

// A connection whose peer sent only its FIN has received nothing.
func TestReceivedCountsNoFIN(t *testing.T) {
	c, s := tcpPair(t)
	_ = s.Close()
	if _, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("read: %v, want EOF", err)
	}
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if n, _, ok := Received(raw); ok {
		t.Fatalf("Received = %d bytes from a peer that sent only its FIN", n)
	}
}

// A socket that half-closed first (FIN_WAIT2) goes to CLOSE, not
// TIME_WAIT, when the peer's FIN comes (a user's socket never shows
// TIME_WAIT): bytes that came with it and wait unread are still counted.
func TestReceivedAfterOurFINThenThePeers(t *testing.T) {
	c, s := tcpPair(t)
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(s); err != nil { // our FIN has reached the peer
		t.Fatal(err)
	}
	if _, err := s.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); tcpState(raw) != unix.BPF_TCP_CLOSE; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("state %d after 5s, want CLOSE", tcpState(raw))
		}
	}
	if n, _, ok := Received(raw); !ok || n != 5 {
		t.Fatalf("Received = %d, %v with 5 bytes unread after both FINs; want 5", n, ok)
	}
}

func tcpState(raw syscall.RawConn) uint8 {
	var st uint8
	_ = raw.Control(func(fd uintptr) {
		if ti, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			st = ti.State
		}
	})
	return st
}

// UnreadInBand counts what a read would still return, urgent data
// around: the bytes before an urgent mark, then (at the mark, where
// SIOCINQ says 0) one for the bytes behind it, then nothing once they are
// read. An urgent byte that came last leaves nothing to read, though the
// kernel's count of bytes taken in (Received) stays one ahead of what was
// read for good: that count cannot say whether bytes wait. Its peek, at
// the mark alone, is marked (peeked) before it is made: a peek takes a
// reset's error, which the socket's reader must then not count on.
func TestUnreadInBandSkipsUrgentBytes(t *testing.T) {
	c, s := tcpPair(t)
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	waitReceived := func(want int64) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
			if n, _, _ := Received(raw); n == want {
				return
			} else if time.Now().After(deadline) {
				t.Fatalf("Received = %d after 5s, want %d", n, want)
			}
		}
	}
	read := func(want string) {
		t.Helper()
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		b := make([]byte, 16)
		n, err := c.Read(b)
		if err != nil || string(b[:n]) != want {
			t.Fatalf("read %q, %v; want %q", b[:n], err, want)
		}
	}
	var peeked atomic.Bool
	if n := UnreadInBand(raw, &peeked); n != 0 {
		t.Fatalf("UnreadInBand = %d before anything came", n)
	}
	testutil.SendUrgent(t, s, "ab", 'X', "def")
	waitReceived(6)
	if n := UnreadInBand(raw, &peeked); n != 2 {
		t.Fatalf("UnreadInBand = %d with \"ab\" before the mark, want 2", n)
	}
	if peeked.Load() {
		t.Fatal("peeked before the read reached the urgent mark")
	}
	read("ab") // stops short at the mark
	if n := UnreadInBand(raw, &peeked); n != 1 {
		t.Fatalf("UnreadInBand = %d at the mark with \"def\" behind it, want 1", n)
	}
	if !peeked.Load() {
		t.Fatal("a peek at the urgent mark left peeked unset")
	}
	read("def") // past the urgent byte, which is not read inline
	if n := UnreadInBand(raw, &peeked); n != 0 {
		t.Fatalf("UnreadInBand = %d with everything read, want 0", n)
	}
	testutil.SendUrgent(t, s, "gh", 'Y', "")
	waitReceived(9)
	if n := UnreadInBand(raw, &peeked); n != 2 {
		t.Fatalf("UnreadInBand = %d with \"gh\" before the last byte's mark, want 2", n)
	}
	read("gh")
	if n := UnreadInBand(raw, &peeked); n != 0 {
		t.Fatalf("UnreadInBand = %d at a mark with nothing behind it, want 0", n)
	}
	if n, _, _ := Received(raw); n != 9 {
		t.Fatalf("Received = %d, want 9: two urgent bytes that no read returns among them", n)
	}
}
