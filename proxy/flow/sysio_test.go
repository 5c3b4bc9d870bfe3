//go:build linux

package flow

import (
	"bytes"
	"io"
	"syscall"
	"testing"
	"time"
)

// SysWritev writes the buffers in order, skips empty ones, and takes at
// most maxIovecs buffers in one call; SysWrite and SysRead move bytes as
// write(2) and read(2) do, and say EAGAIN as they do.
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
	var iov []syscall.Iovec
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

	// Nothing to read: EAGAIN, as read(2) says; then what SysWrite wrote.
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
