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
// bytes in bursts too, each under write_timeout apart.
func chunkyReader(t *testing.T, size int, every time.Duration) (addr string, read *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	read = new(atomic.Int64)
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, size)
		for {
			n, err := io.ReadFull(c, buf)
			read.Add(int64(n))
			if err != nil {
				return
			}
			time.Sleep(every)
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); <-done })
	return ln.Addr().String(), read
}

// A slow reader that acknowledges in bursts under write_timeout apart is
// live, also while the memory budget is full: the budget's reaper samples
// the acknowledged count every BudgetRecheck (stalled) while the link
// waits, and a burst it saw first is progress for the writer's deadline
// too. The writer's own sample, before its deadline, must not be the only
// one that counts: the link lives, the endpoint stays healthy, and the
// upstream reads everything.
func TestSlowReaderUnderAFullBudgetIsNoWriteStall(t *testing.T) {
	const wt = time.Second
	addr, read := chunkyReader(t, 512<<10, 700*time.Millisecond)
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
