package main

import (
	"time"

	"github.com/rs/zerolog"
)

// graceTick is how often the shutdown grace looks at the link count.
const graceTick = 50 * time.Millisecond

// shutdownGrace keeps the proxy accepting and serving after SIGTERM, for
// the client in the same pod, which got SIGTERM at the same moment and may
// still be finishing requests and opening connections. It returns once
// no link has been open for idle (the client has closed its connections:
// it has gone), or when grace has passed, whichever is first; idle 0
// waits out the whole grace. links reports the open links.
func shutdownGrace(grace, idle time.Duration, links func() int, log zerolog.Logger) {
	if grace <= 0 {
		return
	}
	log.Info().Dur("shutdown_grace_ms", grace).Dur("shutdown_idle_ms", idle).Int("links", links()).
		Msg("shutdown grace: still accepting until the client's links are gone")
	begin := time.Now()
	deadline := time.NewTimer(grace)
	defer deadline.Stop()
	tick := time.NewTicker(graceTick)
	defer tick.Stop()
	var idleSince time.Time // zero: a link is open
	for {
		select {
		case <-deadline.C:
			log.Info().Dur("waited_ms", time.Since(begin)).Int("links", links()).
				Msg("shutdown grace over: links still open")
			return
		case now := <-tick.C:
			if links() > 0 {
				idleSince = time.Time{}
				continue
			}
			if idleSince.IsZero() {
				idleSince = now
			}
			if idle > 0 && now.Sub(idleSince) >= idle {
				log.Info().Dur("waited_ms", time.Since(begin)).Msg("shutdown grace ended early: no link left")
				return
			}
		}
	}
}
