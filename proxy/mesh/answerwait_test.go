package mesh

import (
	"testing"
	"time"
)

// AnyAnswers waits d of this process's running time for an answer: a
// stall of its own (a poll a quarter of d late or more) is added to the
// wait, but scheduling noise is not. Here its 5 ms polls come 25 ms apart
// (a busy process on two cores: 8 goroutines spinning made a 1 s wait
// take 5.8 to 6.5 s of real sockets' time when each poll's lateness
// counted), and the wait of 1 s is over at 1 s; a poll 600 ms late (a
// stall) puts it off by the stall.
func TestAnswerWaitCountsStallsNotSchedulingNoise(t *testing.T) {
	const ms = int64(time.Millisecond)
	for _, c := range []struct {
		what  string
		stall int64 // at 500 ms, this long (0: none)
		want  int64 // the wait is over at the first poll at or past this
	}{
		{"polls 25 ms apart, no stall", 0, 1000 * ms},
		{"polls 25 ms apart, one 600 ms late", 600 * ms, 1500 * ms}, // the gap, 625 ms, less an eighth of d
	} {
		w := newAnswerWait(0, time.Second)
		now, over := int64(0), int64(-1)
		for now < 10_000*ms {
			now += 25 * ms
			if c.stall > 0 && now == 500*ms {
				now += c.stall
			}
			if w.over(now) {
				over = now
				break
			}
		}
		if over < c.want || over > c.want+25*ms {
			t.Errorf("%s: the 1 s wait was over at %d ms, want at the first poll at or past %d ms", c.what, over/ms, c.want/ms)
		}
	}
}
