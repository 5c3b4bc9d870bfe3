//go:build linux

package proxy

import (
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/policy"
)

// chunkyReader is a live upstream that reads slowly in bursts: size bytes
// at once, then nothing for every. Its kernel acknowledges the proxy's
// bytes in bursts too, each under write_timeout apart. With stopAfter > 0
// it stops reading (and keeps the connection open) once it has read that
// many bytes; lastRead is when it last read, Unix nanoseconds.
func chunkyReader(t *testing.T, size int, every time.Duration, stopAfter int64) (addr string, read, lastRead *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done, stop := make(chan struct{}), make(chan struct{})
	read, lastRead = new(atomic.Int64), new(atomic.Int64)
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, size)
		for stopAfter <= 0 || read.Load() < stopAfter {
			n, err := io.ReadFull(c, buf)
			read.Add(int64(n))
			lastRead.Store(time.Now().UnixNano())
			if err != nil {
				return
			}
			time.Sleep(every)
		}
		<-stop
	}()
	t.Cleanup(func() { _ = ln.Close(); close(stop); <-done })
	return ln.Addr().String(), read, lastRead
}

// A slow reader that acknowledges in bursts under write_timeout apart is
// live, also while the memory budget is full: the budget's reaper samples
// the acknowledged count every BudgetRecheck (stalled) while the link
// waits, and a burst it saw first is progress for the writer's deadline
// too. The writer's own sample, before its deadline, must not be the only
// one that counts: the link lives, the endpoint stays healthy, and the
// upstream reads everything. (The twin, the same reader stopping, is
// TestStoppedReaderUnderAFullBudgetIsJudged.)
func TestSlowReaderUnderAFullBudgetIsNoWriteStall(t *testing.T) {
	const wt = time.Second
	addr, read, _ := chunkyReader(t, 512<<10, 700*time.Millisecond, 0)
	r := startBudget(t, addr, policy.Limits{MemoryBudget: 1 << 20}, func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(wt)
	})
	c := r.dial(r.test)
	const total = 8 << 20
	go func() { _, _ = c.Write(make([]byte, total)) }() // ends with c (t.Cleanup)
	for deadline := time.Now().Add(60 * time.Second); read.Load() < total; time.Sleep(10 * time.Millisecond) {
		select {
		case s := <-r.ended:
			st := r.p.Endpoints()
			t.Fatalf("link toward a live slow reader ended %q (%v) after %v, %d of %d bytes read; endpoints %+v",
				s.Reason, s.Err, s.Duration, read.Load(), total, st)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the upstream read %d of %d bytes in 60 s", read.Load(), total)
		}
	}
	for _, st := range r.p.Endpoints() {
		if st.State != "healthy" {
			t.Fatalf("endpoint %s %s (%s), want healthy", st.Endpoint, st.State, st.Reason)
		}
	}
}

// The twin of TestSlowReaderUnderAFullBudgetIsNoWriteStall: the same
// reader stops reading (its connection open) after 2 MiB. Its kernel
// acknowledges what fits in its receive buffer, then nothing: the link is
// closed (write_timeout, or budget: whichever sees it first) and the
// endpoint excluded, no later than before: within two write_timeouts of
// its last read (a deadline's verdict comes up to two after the last
// acknowledgement), plus a second.
func TestStoppedReaderUnderAFullBudgetIsJudged(t *testing.T) {
	const wt = time.Second
	addr, read, lastRead := chunkyReader(t, 512<<10, 700*time.Millisecond, 2<<20)
	r := startBudget(t, addr, policy.Limits{MemoryBudget: 1 << 20}, func(s *policy.Settings) {
		s.WriteTimeout = policy.Duration(wt)
	})
	c := r.dial(r.test)
	go func() { _, _ = c.Write(make([]byte, 16<<20)) }() // ends with c (t.Cleanup)
	var s LinkStats
	select {
	case s = <-r.ended:
	case <-time.After(60 * time.Second):
		t.Fatalf("the link toward a reader that stopped did not end in 60 s (%d bytes read)", read.Load())
	}
	if s.Reason != CloseWriteTimeout && s.Reason != CloseBudget {
		t.Fatalf("link ended %q (%v), want write_timeout or budget", s.Reason, s.Err)
	}
	if read.Load() < 2<<20 {
		t.Fatalf("link ended %q after %d bytes read, before the reader stopped", s.Reason, read.Load())
	}
	after := s.Opened.Add(s.Duration).Sub(time.Unix(0, lastRead.Load()))
	t.Logf("ended %s %v after the last read (write_timeout %v)", s.Reason, after, wt)
	if after > 2*wt+time.Second {
		t.Fatalf("ended %s %v after the upstream's last read, want within 2 x write_timeout (%v) + 1 s", s.Reason, after, wt)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		st, _ := r.p.det.State(addr)
		if st.String() == "excluded" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("endpoint %s after a stopped reader's link ended %s, want excluded", st, s.Reason)
		}
	}
}
