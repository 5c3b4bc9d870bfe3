package proxy

import (
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/policy"
)

// listenBacklog0 listens on 127.0.0.2 with an accept queue of one: a
// second connect's SYN is dropped until the first is accepted.
func listenBacklog0(t *testing.T) (net.Listener, string) {
	return listenBacklog0On(t, [4]byte{127, 0, 0, 2})
}

// listenBacklog0On is listenBacklog0 on the address ip.
func listenBacklog0On(t *testing.T, ip [4]byte) (net.Listener, string) {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: ip}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "l")
	ln, err := net.FileListener(f)
	_ = f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	return ln, ln.Addr().String()
}

// A stream an egress link gives up is reset, not half-closed. Was: an
// egress link that gives up waiting for the ingress's ack
// (awaitAck) closes its stream with a FIN, not a reset. When the
// ingress's connect to its server completes later, the ingress link
// passes that FIN to the server as the client's clean half-close, and
// with half_close_timeout 0 (and yamux's close timer now off with it) the
// egress's stream, which no link holds any more, stays in yamux's map for
// as long as the server keeps its connection.
func TestMeshAbandonedOpenIsReset(t *testing.T) {
	ln, addr := listenBacklog0(t)
	var mu sync.Mutex
	var held []net.Conn
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			_ = c.Close()
		}
	})
	hc0 := func(s *policy.Settings) { s.HalfCloseTimeout = 0 }
	in := startIngressL(t, "127.0.0.2", addr, func(l *policy.Listener) {
		l.Ingress.CheckInterval = policy.Duration(time.Hour) // its first check's connection fills the queue
		l.Settings.HalfCloseTimeout = 0
		l.Settings.ConnectTimeout = policy.Duration(10 * time.Second)
	})
	eg := startEgress(t, addr, in.port, func(s *policy.Settings) {
		hc0(s)
		s.ConnectTimeout = policy.Duration(200 * time.Millisecond)
		s.Mesh.Sessions = 1
	})
	c := eg.dial()
	_, _ = c.Write([]byte("hello"))
	s := eg.linkEndOf(c, 5*time.Second) // the egress gave up on the ack
	t.Logf("egress link ended %s (%v)", s.Reason, s.Err)
	go func() { // now the server accepts, and holds every connection (a server that does not close on a half-close)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
		}
	}()
	time.Sleep(4 * time.Second) // the ingress's SYN is retransmitted at ~1 s and ~3 s
	es := firstEgressSession(eg.p)
	es.mu.Lock()
	links := len(es.links)
	es.mu.Unlock()
	inLinks := len(in.p.listeners[0].snapshotLinks())
	t.Logf("egress session: %d streams (status stream included), %d links; ingress links %d; yamux StreamCloseTimeout %v",
		es.Sess.NumStreams(), links, inLinks, 0)
	if es.Sess.NumStreams() > 1 && links == 0 {
		t.Errorf("the egress session keeps %d streams with no link on it (yamux close timer off): the abandoned stream leaks while the ingress link (%d) lives",
			es.Sess.NumStreams()-1, inLinks)
	}
}
