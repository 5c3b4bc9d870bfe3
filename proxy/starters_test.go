package proxy

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"
)

// waitUntil polls cond (the starters' own accounting) for up to 10 s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("not within 10s: %s", what)
		}
	}
}

// A burst of link starts gets a starter each; once done, at most
// maxIdleStarters stay, and they end with the proxy's context.
func TestStartersKeepFewAndEndWithTheProxy(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var bg sync.WaitGroup
	release := make(chan struct{})
	var ran sync.WaitGroup
	s := newStarters(ctx, &bg, func(startJob) { <-release; ran.Done() })
	const burst = 3 * maxIdleStarters
	ran.Add(burst)
	for range burst {
		s.start(startJob{})
	}
	if got := s.live.Load(); got != burst {
		t.Fatalf("%d starters for %d starts that all wait, want one each", got, burst)
	}
	close(release)
	ran.Wait()
	waitUntil(t, "the burst's starters idle or ended", func() bool {
		return s.live.Load() == maxIdleStarters && s.idle.Load() == maxIdleStarters
	})
	cancel()
	bg.Wait()
	if got := s.live.Load(); got != 0 {
		t.Fatalf("%d starters after the proxy's context ended, want 0", got)
	}
}

// startersInSelect counts the goroutines that wait in a starter's select
// (from their stacks: a starter counts itself idle just before it gets
// there, and a start finds it only once it is there).
func startersInSelect() int {
	n := 0
	for _, g := range strings.Split(allStacks(), "\n\n") {
		if strings.Contains(g, " [select") && strings.Contains(g, ").run(") && strings.Contains(g, "(*starters)") {
			n++
		}
	}
	return n
}

// Starts one after another run on the starter that waits: without reuse
// each would leave one more waiting, up to maxIdleStarters; without the
// wait, none would stay.
func TestStartersReuseAWaitingOne(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var bg sync.WaitGroup
	defer bg.Wait()
	defer cancel()
	done := make(chan struct{})
	s := newStarters(ctx, &bg, func(startJob) { done <- struct{}{} })
	for range 100 {
		waitUntil(t, "every starter waiting in its select", func() bool {
			return s.live.Load() == s.idle.Load() && startersInSelect() == int(s.live.Load())
		})
		s.start(startJob{})
		<-done
	}
	waitUntil(t, "the starter waiting again", func() bool { return startersInSelect() == int(s.live.Load()) })
	if got := s.live.Load(); got != 1 {
		t.Fatalf("%d starters after 100 starts one after another, want the one waiting, reused", got)
	}
}
