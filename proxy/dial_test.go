package proxy

import (
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// drainingServer is an echo server that can close its listener while it
// keeps serving the connections it accepted: a server draining for a
// graceful restart (or a pod whose listener is gone while its links
// finish).
type drainingServer struct {
	ln    net.Listener
	conns chan net.Conn
}

func startDrainingServer(t *testing.T) *drainingServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &drainingServer{ln: ln, conns: make(chan net.Conn, 16)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.conns <- c
			go func() { _, _ = io.Copy(c, c) }() // ends when the test closes c
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		<-done
		close(s.conns)
		for c := range s.conns {
			_ = c.Close()
		}
	})
	return s
}

// A refused connect while the endpoint answers on another link is no
// evidence against it (finding 2 of issue 20): the server closed its
// listener but still serves its links. Nothing is excluded and the link
// that answers is not touched. Once that link has been silent for
// connect_timeout, the next refusal excludes the endpoint (the dead twin),
// and the open link is still kept: a failed connect says nothing of it.
func TestRefusedConnectWhileAnsweringExcludesNothing(t *testing.T) {
	srv := startDrainingServer(t)
	h := start(t, srv.ln.Addr().String(), nil)
	c := h.dial()
	roundTrip(t, c, []byte("before the listener closed"))
	_ = srv.ln.Close()

	stop := make(chan struct{})
	done := make(chan error, 1)
	go func() { // the open link keeps answering
		buf := make([]byte, 4)
		for {
			select {
			case <-stop:
				done <- nil
				return
			case <-time.After(50 * time.Millisecond):
			}
			if _, err := c.Write([]byte("ping")); err != nil {
				done <- err
				return
			}
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			if _, err := io.ReadFull(c, buf); err != nil {
				done <- err
				return
			}
		}
	}()
	for range 3 {
		nc := h.dial()
		if err, _ := waitClosed(t, nc, 5*time.Second); err == nil {
			t.Fatal("a new link to a closed listener was not reset")
		}
		if s := h.linkEnd(5 * time.Second); s.Reason != CloseDialError {
			t.Fatalf("new link ended %s, want dial_error", s.Reason)
		}
	}
	close(stop)
	if err := <-done; err != nil {
		t.Fatalf("the open link while connects were refused: %v", err)
	}
	if got := testutil.ToFloat64(h.m.ForListener("test").DialErrors); got < 3 {
		t.Fatalf("dial_errors_total = %v, want at least 3", got)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s) while it answered on another link, want healthy", ep.State, ep.Reason)
	}

	// The dead twin: silent for connect_timeout (2s), then refused.
	time.Sleep(2500 * time.Millisecond)
	nc := h.dial()
	_, _ = waitClosed(t, nc, 5*time.Second)
	if s := h.linkEnd(5 * time.Second); s.Reason != CloseDialError {
		t.Fatalf("new link ended %s, want dial_error", s.Reason)
	}
	ep := h.waitState("excluded", 5*time.Second)
	if ep.Reason != string(CloseDialError) {
		t.Fatalf("excluded for %s, want dial_error", ep.Reason)
	}
	roundTrip(t, c, []byte("kept through the exclusion"))
	if n := h.p.ActiveLinks(); n != 1 {
		t.Fatalf("%d links open after a dial_error exclusion, want the open one kept", n)
	}
}

// An endpoint excluded for dial_error keeps its open links. A write
// timeout on one of them afterwards (the server takes no bytes) is the
// same evidence against the others as at a healthy endpoint ("all
// closed"): they are closed. Before, the report found the endpoint
// already out and nothing else happened. The twin: a link there that its
// client resets closes nothing else.
func TestLinkEvidenceOnAnExcludedEndpointClosesItsOtherLinks(t *testing.T) {
	for _, evidence := range []bool{true, false} {
		t.Run(fmt.Sprintf("evidence=%v", evidence), func(t *testing.T) {
			srv := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{})
			h := start(t, srv.Addr(), func(s *policy.Settings) {
				s.WriteTimeout = policy.Duration(300 * time.Millisecond)
				s.TCPUserTimeout = 0
			})
			l1, l2 := h.dial(), h.dial()
			waitFor(t, 5*time.Second, "two links accepted", func() bool { return srv.Accepted() >= 2 })
			h.p.det.Report(srv.Addr(), string(CloseDialError))
			h.waitState("excluded", 5*time.Second)
			if n := h.p.ActiveLinks(); n != 2 {
				t.Fatalf("%d links after a dial_error exclusion, want both kept", n)
			}
			if !evidence {
				_ = l1.SetLinger(0) // a reset: the link ends without waiting for the server's FIN
				_ = l1.Close()
				if s := h.linkEndOf(l1, 5*time.Second); s.Reason != CloseClientError {
					t.Fatalf("l1 ended %s (%v), want client_error", s.Reason, s.Err)
				}
				// An eviction would have been counted before l1's end was told.
				if got := testutil.ToFloat64(h.m.ForListener("test").Evictions(metrics.EvictExcluded)); got != 0 {
					t.Fatalf("%v links evicted after a client reset one, want the other kept", got)
				}
				return
			}
			go func() { // until the server's window and the queue are full
				buf := make([]byte, 64<<10)
				for {
					if _, err := l1.Write(buf); err != nil {
						return
					}
				}
			}()
			if s := h.linkEndOf(l1, 10*time.Second); s.Reason != CloseWriteTimeout {
				t.Fatalf("l1 ended %s (%v), want write_timeout", s.Reason, s.Err)
			}
			if got := testutil.ToFloat64(h.m.ForListener("test").Evictions(metrics.EvictExcluded)); got != 1 {
				t.Fatalf("%v links evicted, want 1", got)
			}
			if s := h.linkEndOf(l2, 5*time.Second); s.Reason != CloseEvicted {
				t.Fatalf("l2 ended %s (%v), want evicted: the server took no bytes for write_timeout", s.Reason, s.Err)
			}
			waitClosed(t, l2, 5*time.Second)
		})
	}
}
