package proxy

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// acceptedPair is a loopback connection: c as a listener accepted it, and
// the peer that dialled it, each with 64 KiB socket buffers so that a
// large write has to wait for the peer to read. (Not smaller: with a 4 KiB
// send buffer Linux may never say the socket is writable again, for
// net.Conn.Write as for any writer.)
func acceptedPair(t *testing.T) (c *net.TCPConn, peer *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	d, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	a, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	peer, c = d.(*net.TCPConn), a.(*net.TCPConn)
	_ = peer.SetReadBuffer(64 << 10)
	_ = c.SetWriteBuffer(64 << 10)
	t.Cleanup(func() { _ = peer.Close(); _ = c.Close() })
	return c, peer
}

// A client write (the raw write the response pump makes) writes all of p
// even when the client's window fills and the write has to wait for the
// poller, and reports a closed socket as net.Conn.Write does.
func TestClientWriteWaitsForRoom(t *testing.T) {
	c, peer := acceptedPair(t)
	cl := newTCPClient(c)
	msg := bytes.Repeat([]byte("0123456789abcdef"), 512<<10) // 8 MiB: far more than the buffers hold
	type result struct {
		n   int
		err error
	}
	done := make(chan result, 1)
	go func() {
		n, err := cl.Write(msg)
		done <- result{n, err}
	}()
	got := make([]byte, len(msg))
	_ = peer.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.ReadFull(peer, got); err != nil {
		t.Fatal(err)
	}
	if r := <-done; r.n != len(msg) || r.err != nil {
		t.Fatalf("Write = %d, %v; want %d, nil", r.n, r.err, len(msg))
	}
	if !bytes.Equal(got, msg) {
		t.Fatal("the peer read other bytes than were written")
	}

	_ = c.Close()
	n, err := cl.Write([]byte("late"))
	var op *net.OpError
	if n != 0 || !errors.Is(err, net.ErrClosed) || !errors.As(err, &op) || op.Op != "write" {
		t.Fatalf("Write on a closed client = %d, %v; want 0 and a write error wrapping net.ErrClosed", n, err)
	}
}
