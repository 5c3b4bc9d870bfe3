package mesh

import "testing"

// The heartbeat's silence counts the time since the peer was last heard
// during which this process ran: a late tick's lateness is taken off, but
// only the part after the peer was heard, and a new arrival starts the
// count again.
func TestSilenceCountsOnlyTimeThisProcessRan(t *testing.T) {
	const ms = int64(1_000_000)
	var s silence
	steps := []struct {
		now, heard, stalled, want int64
		what                      string
	}{
		{1000 * ms, 1000 * ms, 0, 0, "heard now"},
		{1250 * ms, 1000 * ms, 0, 250 * ms, "a tick on time"},
		{5250 * ms, 1000 * ms, 3750 * ms, 500 * ms, "a tick 3.75 s late: the stall is not the peer's silence"},
		{5500 * ms, 1000 * ms, 0, 750 * ms, "on time again: the silence grows from where it was"},
		{5750 * ms, 5600 * ms, 0, 150 * ms, "heard again: counted from the arrival"},
		{9750 * ms, 5600 * ms, 3750 * ms, 400 * ms, "late again, by less than the time since the arrival"},
		{20000 * ms, 19000 * ms, 10000 * ms, 0, "late by more than the time since the arrival: only that part"},
		{20100 * ms, 20200 * ms, 0, -100 * ms, "an arrival read after the tick's clock: no silence"},
	}
	for _, st := range steps {
		if got := s.update(st.now, st.heard, st.stalled); got != st.want {
			t.Fatalf("%s: silence %d ms, want %d ms", st.what, got/ms, st.want/ms)
		}
	}
}
