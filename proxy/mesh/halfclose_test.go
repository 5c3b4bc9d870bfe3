package mesh

import (
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/policy"
)

// half_close_timeout 0 disables the mechanism (README, "Configuration
// reference": "A duration or size of 0 disables the mechanism"): yamux's
// close timer is off too, and the stream is kept until the other side
// closes, as a plain link is. It was 5 minutes: a mesh link whose client
// half-closed was force-closed then, its answer cut short and passed on
// as a clean end. With a timeout, yamux's timer is armed past the link's
// own, which resets the stream both ways (TestMeshHalfCloseTimeoutResetsClient).
func TestZeroHalfCloseTimeoutKeepsStreams(t *testing.T) {
	m := policy.DefaultSettings().Mesh.OrDefaults()
	if got := yamuxConfig(m, 0, zerolog.Nop()).StreamCloseTimeout; got != 0 {
		t.Fatalf("half_close_timeout 0: yamux StreamCloseTimeout %v, want 0 (none: the stream is kept until the other side closes)", got)
	}
	hc := 10 * time.Second
	if got, least := yamuxConfig(m, hc, zerolog.Nop()).StreamCloseTimeout, hc+m.PingTimeout.D(); got <= least {
		t.Fatalf("half_close_timeout %v: yamux StreamCloseTimeout %v, want past the link's own timer (> %v)", hc, got, least)
	}
}
