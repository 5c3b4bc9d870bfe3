package mesh

import "testing"

// The heartbeat's silence: after a stall of this process (a late tick),
// the time since the peer was last heard counts only the time this
// process ran (a late tick's lateness is taken off, but only the part
// after the peer was heard), until the process has run for grace since
// the stall; then all of it counts again. A new arrival starts the count
// again.
func TestSilenceCountsOnlyTimeThisProcessRan(t *testing.T) {
	const ms = int64(1_000_000)
	s := silence{grace: 1000 * ms}
	steps := []struct {
		now, heard, stalled, want int64
		what                      string
	}{
		{1000 * ms, 1000 * ms, 0, 0, "heard now"},
		{1250 * ms, 1000 * ms, 0, 250 * ms, "a tick on time"},
		{5250 * ms, 1000 * ms, 3750 * ms, 500 * ms, "a tick 3.75 s late: the stall is not the peer's silence"},
		{5500 * ms, 1000 * ms, 0, 750 * ms, "on time again: the silence grows from where it was"},
		{6000 * ms, 1000 * ms, 0, 1250 * ms, "within grace of the stall: still only the running time"},
		{6250 * ms, 1000 * ms, 0, 5250 * ms, "grace after the stall: the whole silence (a dead peer is judged now, not a ping_timeout of running time later)"},
		{6500 * ms, 6400 * ms, 0, 100 * ms, "heard again: counted from the arrival"},
		{10500 * ms, 6400 * ms, 3750 * ms, 350 * ms, "late again, by less than the time since the arrival"},
		{20000 * ms, 19000 * ms, 10000 * ms, 0, "late by more than the time since the arrival: only that part"},
		{20100 * ms, 20200 * ms, 0, -100 * ms, "an arrival read after the tick's clock: no silence"},
	}
	for _, st := range steps {
		if got := s.update(st.now, st.heard, st.stalled); got != st.want {
			t.Fatalf("%s: silence %d ms, want %d ms", st.what, got/ms, st.want/ms)
		}
	}
}

// Stalls that come more often than grace never let the whole silence
// count: the silence is then this process's running time, and a peer
// silent for that long is judged all the same.
func TestSilenceRepeatedStallsStillGrow(t *testing.T) {
	const ms = int64(1_000_000)
	s := silence{grace: 1000 * ms}
	now, got := int64(0), int64(0)
	s.update(now, 0, 0)
	for i := 0; i < 20; i++ {
		now += 250 * ms
		s.update(now, 0, 0)
		now += 750 * ms
		got = s.update(now, 0, 500*ms) // a tick 750 ms after the last (a step 250 ms): 500 ms of it a stall
	}
	if want := 20 * 500 * ms; got != want {
		t.Fatalf("silence after 20 s with a stall every second: %d ms, want %d ms (the running time)", got/ms, want/ms)
	}
}
