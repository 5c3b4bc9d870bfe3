package proxy

import (
	"net"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// A guard whose last sample found the socket idle (no re-arm) keeps no
// due time, so that a send arming it again (the flag set a moment before
// the timer's Reset, which waits for a sample still running) is not taken
// for a guard that could not run: an ETIMEDOUT read in that moment is the
// upstream's as before. Before (found by a review), blindSince read the
// due of a sample taken on time minutes ago and excused it.
func TestIdleGuardIsNotBlind(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	g := &windowGuard{lk: new(link), raw: raw, ut: time.Second, raised: time.Second, bound: time.Second, period: 250 * time.Millisecond}
	g.timer = time.AfterFunc(time.Hour, func() {})
	defer g.timer.Stop()
	// The last sample was due a minute ago and ran on time (the socket is
	// idle: it does not re-arm).
	g.due.Store(flow.Mono())
	g.check()
	if d := g.due.Load(); d != 0 {
		t.Fatalf("due %d after a sample that did not re-arm, want 0", d)
	}
	g.mu.Lock() // a sample runs: arm waits for it after setting its flag
	done := make(chan struct{})
	go func() { g.arm(); close(done) }()
	for !g.armed.Load() {
		time.Sleep(time.Millisecond)
	}
	from, blind := g.blindSince()
	g.mu.Unlock()
	<-done
	if blind {
		t.Fatalf("blindSince = (%v ago, true) with no freeze", time.Duration(flow.Mono()-from))
	}
}
