//go:build linux

package flow

import (
	"bytes"
	"io"
	"os"
	"os/signal"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// SysWritev writes the buffers in order, skips empty ones, and takes at
// most maxIovecs buffers in one call; SysWrite and SysRead move bytes as
// write(2) and read(2) would, and say EAGAIN as they do.
func TestSysWritevWritesInOrder(t *testing.T) {
	c, s := tcpPair(t)
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	bufs := [][]byte{[]byte("ab"), nil, []byte("cde"), {}, []byte("f")}
	for i := range maxIovecs + 10 {
		bufs = append(bufs, []byte{byte('0' + i%10)})
	}
	var want []byte
	for _, b := range bufs {
		want = append(want, b...)
	}
	var n int
	var iov []unix.Iovec
	if werr := raw.Write(func(fd uintptr) bool {
		n, iov, err = SysWritev(int(fd), bufs, iov)
		return true
	}); werr != nil || err != nil {
		t.Fatal(werr, err)
	}
	// Three non-empty buffers, then single bytes up to maxIovecs vectors.
	if wantN := 2 + 3 + 1 + (maxIovecs - 3); n != wantN {
		t.Fatalf("writev took %d bytes, want %d (at most %d buffers)", n, wantN, maxIovecs)
	}
	for _, v := range iov[:cap(iov)] {
		if v.Base != nil {
			t.Fatal("the vector keeps a pointer into a written buffer")
		}
	}
	got := make([]byte, n)
	_ = s.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(s, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want[:n]) {
		t.Fatalf("read %q, want %q", got, want[:n])
	}

	// Nothing to read: EAGAIN, as recv(2) says; then what SysWrite wrote.
	sraw, err := s.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 16)
	var rn int
	var rerr error
	_ = sraw.Read(func(fd uintptr) bool { rn, rerr = SysRead(int(fd), p); return true })
	if rerr != syscall.EAGAIN || rn != -1 {
		t.Fatalf("read of an empty socket: %d, %v; want -1, EAGAIN", rn, rerr)
	}
	_ = raw.Write(func(fd uintptr) bool { n, err = SysWrite(int(fd), []byte("xyz")); return true })
	if err != nil || n != 3 {
		t.Fatalf("write: %d, %v", n, err)
	}
	_ = s.SetReadDeadline(time.Now().Add(5 * time.Second))
	_ = sraw.Read(func(fd uintptr) bool {
		rn, rerr = SysRead(int(fd), p)
		return rerr != syscall.EAGAIN
	})
	if rerr != nil || string(p[:rn]) != "xyz" {
		t.Fatalf("read %q, %v; want \"xyz\"", p[:max(rn, 0)], rerr)
	}
}

// A Writer writes nothing for an empty p and says so as net.Conn.Write
// does: (0, nil).
func TestWriterEmptyWrite(t *testing.T) {
	c, _ := tcpPair(t)
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var w Writer
	w.Init(raw)
	if n, err := w.Write(nil); n != 0 || err != nil {
		t.Fatalf("Write(nil) = %d, %v; want 0, nil", n, err)
	}
	if n, err := w.WriteBuffers([][]byte{{}, nil}); n != 0 || err != nil {
		t.Fatalf("WriteBuffers of empty buffers = %d, %v; want 0, nil", n, err)
	}
}

// SysWrite and SysWritev send with MSG_NOSIGNAL: writes to a connection
// its peer reset fail (ECONNRESET, then EPIPE) and raise no SIGPIPE. With
// write(2) or writev(2) the write that fails with EPIPE raises one, in
// the system call itself, so it is on its way before the write returns;
// the wait after the writes is for the runtime to pass it on.
func TestSysWriteToAResetPeerRaisesNoSigpipe(t *testing.T) {
	sig := make(chan os.Signal, 8)
	signal.Notify(sig, syscall.SIGPIPE)
	defer signal.Stop(sig)
	for _, vec := range []bool{false, true} {
		c, s := tcpPair(t)
		_ = s.SetLinger(0)
		_ = s.Close()
		raw, err := c.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var werr error
		for deadline := time.Now().Add(10 * time.Second); werr != syscall.EPIPE; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("vector %v: the writes to a reset peer never failed with EPIPE (last: %v)", vec, werr)
			}
			_ = raw.Control(func(fd uintptr) {
				if vec {
					_, _, werr = SysWritev(int(fd), [][]byte{[]byte("x")}, nil)
				} else {
					_, werr = SysWrite(int(fd), []byte("x"))
				}
			})
		}
	}
	select {
	case <-sig:
		t.Fatal("a write to a reset peer raised SIGPIPE")
	case <-time.After(300 * time.Millisecond):
	}
}

// SysWrite is send(2), SysWritev sendmsg(2) and SysRead recv(2): a
// descriptor that is not a socket is refused.
func TestSysWriteNeedsASocket(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if n, err := SysWrite(int(w.Fd()), []byte("x")); err != syscall.ENOTSOCK || n != -1 {
		t.Fatalf("SysWrite to a pipe: %d, %v; want -1, ENOTSOCK", n, err)
	}
	if n, _, err := SysWritev(int(w.Fd()), [][]byte{[]byte("x")}, nil); err != syscall.ENOTSOCK || n != -1 {
		t.Fatalf("SysWritev to a pipe: %d, %v; want -1, ENOTSOCK", n, err)
	}
	if n, err := SysRead(int(r.Fd()), make([]byte, 1)); err != syscall.ENOTSOCK || n != -1 {
		t.Fatalf("SysRead of a pipe: %d, %v; want -1, ENOTSOCK", n, err)
	}
}

// InitWrite and InitWriteBuffers bind one callback each, an allocation
// each where Init makes two; the other method still writes, binding its
// own at its first call.
func TestWriterInitBindsOnlyWhatItWrites(t *testing.T) {
	c, s := tcpPair(t)
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		init func(*Writer, syscall.RawConn)
		want float64
	}{{"Init", (*Writer).Init, 2}, {"InitWrite", (*Writer).InitWrite, 1}, {"InitWriteBuffers", (*Writer).InitWriteBuffers, 1}} {
		w := new(Writer)
		if n := testing.AllocsPerRun(100, func() { *w = Writer{}; tc.init(w, raw) }); n != tc.want {
			t.Errorf("%s: %v allocations, want %v", tc.name, n, tc.want)
		}
		if n, err := w.Write([]byte("ab")); n != 2 || err != nil {
			t.Fatalf("%s, then Write: %d, %v", tc.name, n, err)
		}
		if n, err := w.WriteBuffers([][]byte{[]byte("c"), []byte("d")}); n != 2 || err != nil {
			t.Fatalf("%s, then WriteBuffers: %d, %v", tc.name, n, err)
		}
	}
	got := make([]byte, 12)
	if _, err := io.ReadFull(s, got); err != nil || string(got) != "abcdabcdabcd" {
		t.Fatalf("the peer read %q, %v", got, err)
	}
}
