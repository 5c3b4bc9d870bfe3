package mesh

import (
	"testing"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/policy"
)

// yamux's own close timer is off: armed from a stream's close, it would
// end a stream whose other direction still streams (an answer that goes
// on after the client's FIN) as if the peer had ended it. The link's
// half_close_timeout, a bound on the time the open direction moves no
// byte, judges half-closed streams, and resets them both ways
// (TestMeshHalfClosedStreamingAnswerIsKept, TestMeshHalfCloseTimeoutResetsClient).
// Before, it was armed at half_close_timeout + ping_timeout + 1 s from
// the close, whatever moved.
func TestYamuxCloseTimerIsOff(t *testing.T) {
	m := policy.DefaultSettings().Mesh.OrDefaults()
	if got := yamuxConfig(m, zerolog.Nop()).StreamCloseTimeout; got != 0 {
		t.Fatalf("yamux StreamCloseTimeout %v, want 0 (none: the link's half_close_timeout judges a half-closed stream)", got)
	}
}
