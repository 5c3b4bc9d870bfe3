package flow

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/policy"
)

// The calls made once per socket at a link's end allocate nothing: each
// was a closure over its locals handed to RawConn.Control (an interface,
// so the closure and what it captured escaped), four allocations for
// ResetNotFin and two for ShutdownWrite. (AllocsPerRun rounds down: a
// pool emptied by a GC meanwhile does not fail it.)
func TestLinkEndCallsAllocateNothing(t *testing.T) {
	a, b := tcpPair(t)
	rc, err := a.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if n := testing.AllocsPerRun(100, func() {
		if reset, _, _ := ResetNotFin(rc, 0); reset {
			t.Fatal("an open socket taken as reset")
		}
	}); n != 0 {
		t.Errorf("ResetNotFin: %v allocations per call, want 0", n)
	}
	if n := testing.AllocsPerRun(100, func() {
		if err := ShutdownWrite(rc); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Errorf("ShutdownWrite: %v allocations per call, want 0", n)
	}
	// The shutdown passed a FIN: the peer reads the end of the stream.
	if n, err := b.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Fatalf("peer read %d, %v after the shutdown, want the end", n, err)
	}
}

// BytesAcked, which half_close_timeout asks of both sockets of every link
// at its first FIN, allocates nothing, and reads what was acknowledged:
// through a closure over its results it was four allocations per call.
func TestBytesAckedAllocatesNothing(t *testing.T) {
	a, b := tcpPair(t)
	if _, err := a.Write(make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Read(make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	rc, err := a.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, ok := BytesAcked(rc)
		if !ok {
			t.Fatal("BytesAcked: the kernel does not say")
		}
		if n == 100 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("BytesAcked %d, want 100 once the peer read them", n)
		}
		time.Sleep(time.Millisecond)
	}
	if n := testing.AllocsPerRun(100, func() {
		if _, ok := BytesAcked(rc); !ok {
			t.Fatal("BytesAcked: the kernel does not say")
		}
	}); n != 0 {
		t.Errorf("BytesAcked: %v allocations per call, want 0", n)
	}
}

// A dial that connects at once allocates only what the runtime's os.File
// costs (the file, its inner file, its RawConn): its address on the stack,
// its wait's state pooled, the error's address made only for an error.
// Nothing accepts: the connects complete in the listener's backlog.
func TestDialAllocatesOnlyTheFile(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ap := ln.Addr().(*net.TCPAddr).AddrPort()
	s := policy.Settings{}
	ctx := context.Background()
	if n := testing.AllocsPerRun(50, func() {
		f, err := DialRaw(ctx, ap, &s, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		_ = f.Close()
	}); n != 3 {
		t.Errorf("DialRaw: %v allocations per dial, want 3 (os.NewFile's 2, SyscallConn's 1)", n)
	}
}

// ResetNotFin says what the peer acknowledged as BytesAcked does, from
// the same TCP_INFO: half_close_timeout's snapshot at a link's first FIN
// takes its count, and compares it later with BytesAcked's. Both ends:
// the connecting socket's count leaves out its SYN, the accepted one's
// starts at 0; and after the peer's FIN, when the read has returned the
// end of the stream.
func TestResetNotFinAckedIsBytesAcked(t *testing.T) {
	c, s := tcpPair(t)
	for _, tc := range []struct {
		name     string
		from, to *net.TCPConn
	}{{"connected", c, s}, {"accepted", s, c}} {
		rc := rawOf(t, tc.from)
		if _, err := tc.from.Write(make([]byte, 1000)); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(tc.to, make([]byte, 1000)); err != nil {
			t.Fatal(err)
		}
		want := int64(1000)
		if tc.name == "accepted" {
			want-- // its count starts at 0, one short (BytesAcked)
		}
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
			if a, ok := BytesAcked(rc); ok && a == want {
				break
			} else if time.Now().After(deadline) {
				t.Fatalf("%s: BytesAcked = %d, %v after 5s, want %d", tc.name, a, ok, want)
			}
		}
		reset, acked, ok := ResetNotFin(rc, 0)
		if reset || !ok || acked != want {
			t.Fatalf("%s: ResetNotFin = %v, %d, %v; want false, %d (BytesAcked's), true", tc.name, reset, acked, ok, want)
		}
	}
	// The client's FIN read at the server: what the pump asks then.
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("server read %d, %v; want the end of the stream", n, err)
	}
	rs := rawOf(t, s)
	reset, acked, ok := ResetNotFin(rs, 1000)
	if a, aok := BytesAcked(rs); reset || !ok || !aok || acked != a {
		t.Fatalf("at the FIN: ResetNotFin = %v, %d, %v; BytesAcked = %d, %v", reset, acked, ok, a, aok)
	}
}
