package proxy

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"
)

// oneUpstream accepts one connection on loopback and runs serve on it in
// a goroutine the test waits for; serve's error is the test's.
func oneUpstream(t *testing.T, serve func(c *net.TCPConn) error) (addr string, wait func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		_ = ln.Close()
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		done <- serve(c.(*net.TCPConn))
	}()
	t.Cleanup(func() { _ = ln.Close() })
	return ln.Addr().String(), func() {
		t.Helper()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal("upstream: ", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("upstream did not finish within 30 s")
		}
	}
}

// The second FIN of a link is passed on by closing the link (one shutdown
// per link, not two): the close is still a FIN after every byte, never a
// reset, in either order. Client first: the client half-closes after its
// request, the upstream answers 4 MiB and closes; the client reads all of
// it, then a clean end.
func TestLastFINAfterAllBytesClientFirst(t *testing.T) {
	resp := bytes.Repeat([]byte("response"), 512<<10) // 4 MiB: more than the socket buffers hold
	addr, wait := oneUpstream(t, func(c *net.TCPConn) error {
		if _, err := io.ReadAll(c); err != nil { // the request, to the client's FIN
			return err
		}
		_, err := c.Write(resp)
		return err // the deferred close sends the upstream's FIN
	})
	h := start(t, addr, nil)
	c := h.dial()
	sendAndHalfClose(t, c, []byte("request"))
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	time.Sleep(100 * time.Millisecond) // let the proxy's send queue to the client fill
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("after %d of %d bytes: %v, want a clean end (FIN)", len(got), len(resp), err)
	}
	if !bytes.Equal(got, resp) {
		t.Fatalf("read %d bytes, want the %d of the response", len(got), len(resp))
	}
	wait()
	if s := h.linkEnd(5 * time.Second); s.Reason != CloseClientClosed {
		t.Fatalf("reason %q, want %q", s.Reason, CloseClientClosed)
	}
}

// Upstream first: the upstream sends 4 MiB and half-closes; the client
// reads all of it, then sends its last 4 MiB and closes. The upstream
// reads every byte, then a clean end.
func TestLastFINAfterAllBytesUpstreamFirst(t *testing.T) {
	resp := bytes.Repeat([]byte("response"), 512<<10)
	last := bytes.Repeat([]byte("farewell"), 512<<10)
	var got []byte
	addr, wait := oneUpstream(t, func(c *net.TCPConn) error {
		if _, err := c.Write(resp); err != nil {
			return err
		}
		if err := c.CloseWrite(); err != nil {
			return err
		}
		var err error
		got, err = io.ReadAll(c) // the client's bytes, to its FIN
		return err
	})
	h := start(t, addr, nil)
	c := h.dial()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	all, err := io.ReadAll(c)
	if err != nil || !bytes.Equal(all, resp) {
		t.Fatalf("client read %d bytes, %v; want the %d of the response, then a clean end", len(all), err, len(resp))
	}
	if _, err := c.Write(last); err != nil {
		t.Fatal(err)
	}
	_ = c.Close()
	wait()
	if !bytes.Equal(got, last) {
		t.Fatalf("upstream read %d bytes, want the %d the client sent", len(got), len(last))
	}
	if s := h.linkEnd(5 * time.Second); s.Reason != CloseUpstreamClosed {
		t.Fatalf("reason %q, want %q", s.Reason, CloseUpstreamClosed)
	}
}
