package proxy

import (
	"context"
	"sync"
	"sync/atomic"
)

// starters run the start of new links (the dial, then the pumps' launch:
// serveLink) and are kept for the next one once done, up to
// maxIdleStarters waiting. A link's start takes a goroutine the pumps do
// not keep (a link that idles for hours should not keep the stack the dial
// grew), and a new goroutine's first stack (2 KiB) is too small for the
// dial's call chain: every new connection paid a stack copy (each frame of
// the dial found, walked and moved) besides a goroutine's start and end.
// A kept starter has grown its stack once. Idle starters are few and
// bounded, and end with the proxy's context (Shutdown cancels it, then
// waits for bg).
type starters struct {
	ctx   context.Context
	bg    *sync.WaitGroup
	serve func(startJob)
	work  chan startJob // unbuffered: a send succeeds only to a starter waiting
	idle  atomic.Int32  // starters waiting for work (or about to)
	live  atomic.Int32  // starters running
}

// maxIdleStarters bounds the starters kept waiting: about as many as new
// links begin at once on a busy sidecar. When none waits a new one is
// made, and it ends once done if enough wait already.
const maxIdleStarters = 16

type startJob struct {
	l  *listener
	lk *link
}

func serveJob(j startJob) { j.l.serveLink(j.lk) }

func newStarters(ctx context.Context, bg *sync.WaitGroup, serve func(startJob)) *starters {
	return &starters{ctx: ctx, bg: bg, serve: serve, work: make(chan startJob)}
}

// start runs j on a starter waiting for work, or on a new one. Callers
// are accept loops, which Shutdown stops before it waits for bg.
func (s *starters) start(j startJob) {
	select {
	case s.work <- j:
	default:
		s.bg.Add(1)
		s.live.Add(1)
		go s.run(j)
	}
}

func (s *starters) run(j startJob) {
	defer s.bg.Done()
	defer s.live.Add(-1)
	for {
		s.serve(j)
		if s.idle.Add(1) > maxIdleStarters {
			s.idle.Add(-1)
			return
		}
		select {
		case j = <-s.work:
			s.idle.Add(-1)
		case <-s.ctx.Done():
			s.idle.Add(-1)
			return
		}
	}
}
