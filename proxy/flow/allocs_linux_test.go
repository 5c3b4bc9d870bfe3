package flow

import (
	"context"
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
		if ResetNotFin(rc, 0) {
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
