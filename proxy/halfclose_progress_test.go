package proxy

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/policy"
)

// halfCloseRig is a link, plain or through the mesh, with
// half_close_timeout 300 ms, in front of a server that serves each
// connection with serve.
func halfCloseRig(t *testing.T, meshed bool, serve func(c net.Conn, done <-chan struct{})) *harness {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	serveConns(t, ln, serve)
	hc := func(s *policy.Settings) { s.HalfCloseTimeout = policy.Duration(300 * time.Millisecond) }
	if !meshed {
		return start(t, ln.Addr().String(), hc)
	}
	in := startIngress(t, "127.0.0.2", ln.Addr().String(), hc)
	return startEgress(t, ln.Addr().String(), in.port, hc)
}

// sendAndHalfClose writes p to c, then its FIN.
func sendAndHalfClose(t *testing.T, c *net.TCPConn, p []byte) {
	t.Helper()
	if _, err := c.Write(p); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
}

// forEachTransport runs f on a plain link and on one through the mesh.
func forEachTransport(t *testing.T, f func(t *testing.T, meshed bool)) {
	for _, meshed := range []bool{false, true} {
		name := "plain"
		if meshed {
			name = "mesh"
		}
		t.Run(name, func(t *testing.T) { f(t, meshed) })
	}
}

// A client that half-closes after its request while the answer streams
// in for longer than half_close_timeout is kept for as long as bytes
// move, and gets the whole answer and its clean end: half_close_timeout
// bounds the time the open direction moves nothing (as HAProxy's
// client-fin and server-fin do), not the time since the FIN. Before, the
// link was reset half_close_timeout after the client's FIN, the answer
// cut short (a helper measured 600 of 2,000 bytes at 302 ms).
//
// The twins: TestHalfCloseTimeout and TestMeshHalfCloseTimeoutResetsClient,
// a server that sends nothing after the client's FIN, cut at the timeout.
func TestHalfClosedStreamingAnswerIsKept(t *testing.T) {
	const chunks, every = 24, 50 * time.Millisecond // 1.2 s of answer, 4 times the timeout
	forEachTransport(t, func(t *testing.T, meshed bool) {
		h := halfCloseRig(t, meshed, func(c net.Conn, done <-chan struct{}) {
			if _, err := io.Copy(io.Discard, c); err != nil {
				return
			}
			for range chunks {
				if _, err := c.Write([]byte("0123456789abcdef")); err != nil {
					return
				}
				select {
				case <-done:
					return
				case <-time.After(every):
				}
			}
			_ = c.(*net.TCPConn).CloseWrite()
		})
		c := h.dial()
		sendAndHalfClose(t, c, []byte("request"))
		_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
		got, err := io.ReadAll(c)
		if err != nil || len(got) != chunks*16 {
			t.Fatalf("the client read %d of %d bytes of an answer streaming after its FIN, then %v: want all of it and a clean end", len(got), chunks*16, err)
		}
		if s := h.linkEndOf(c, 5*time.Second); s.Reason == CloseHalfCloseTimeout {
			t.Fatalf("link ended %s", s.Reason)
		}
	})
}

// A client that half-closes and then reads a large answer slowly is
// kept while it reads: the response pump waits in its write to the
// client, reading nothing from the server meanwhile, and the client's
// kernel acknowledging what it takes is the progress. Once it has read
// everything and the server, which never closes, sends nothing more, the
// link is cut at the timeout (the twin, in the same run).
func TestHalfClosedSlowReaderIsKept(t *testing.T) {
	const size = 2 << 20
	h := halfCloseRig(t, false, func(c net.Conn, done <-chan struct{}) {
		if _, err := io.Copy(io.Discard, c); err != nil {
			return
		}
		if _, err := c.Write(make([]byte, size)); err != nil {
			return
		}
		<-done // holds the connection open, sends nothing more
	})
	c := h.dial()
	_ = c.SetReadBuffer(16 << 10)
	sendAndHalfClose(t, c, []byte("request"))
	// 32 KiB every 20 ms: about 1.3 s for the answer, four times the
	// timeout, while the proxy holds what the client has not taken.
	buf := make([]byte, 32<<10)
	read := 0
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	for read < size {
		n, err := io.ReadFull(c, buf[:min(len(buf), size-read)])
		read += n
		if err != nil {
			t.Fatalf("the client read %d of %d bytes, reading slowly after its FIN, then %v: cut while it read", read, size, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	err, _ := waitClosed(t, c, 10*time.Second)
	if s := h.linkEndOf(c, 5*time.Second); s.Reason != CloseHalfCloseTimeout {
		t.Fatalf("after the whole answer, with the server silent and open, the link ended %s (client saw %v), want %s", s.Reason, err, CloseHalfCloseTimeout)
	}
}
