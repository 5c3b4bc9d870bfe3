package health

import (
	"strconv"
	"testing"
	"time"
)

// An endpoint forgotten while excluded, or disabled by the operator,
// comes back in that state, with an event; one forgotten healthy, or
// disabled for another reason (the config's list, which the data plane
// applies itself), comes back healthy, as does one whose grave has aged
// past graveFor. The graves are bounded.
func TestForgottenVerdictIsKept(t *testing.T) {
	rec := newRecorder()
	d := New(Options{OnEvent: rec.onEvent})
	defer d.Close()
	pc := ProbeConfig{InitialDelay: time.Hour} // no probe runs in this test
	state := func(ep string) State {
		st, _ := d.State(ep)
		return st
	}
	for _, ep := range []string{"a:1", "b:1", "c:1", "e:1"} {
		d.Register(ep, pc)
	}
	d.Report("a:1", "unanswered")
	d.Disable("b:1", ReasonOperatorDisable)
	d.Disable("c:1", "config")
	for _, ep := range []string{"a:1", "b:1", "c:1", "e:1"} {
		d.Unregister(ep)
		d.Register(ep, pc)
	}
	for ep, want := range map[string]State{"a:1": Excluded, "b:1": Disabled, "c:1": Healthy, "e:1": Healthy} {
		if got := state(ep); got != want {
			t.Errorf("%s is %v after it was forgotten and came back, want %v", ep, got, want)
		}
	}
	rec.waitFor(t, "the restored exclusion's event", func(events []Event, _ []bool) bool {
		for _, ev := range events {
			if ev.Endpoint == "a:1" && ev.From == Healthy && ev.To == Excluded && ev.Reason == "unanswered" && ev.Evidence.Detail != "" {
				return true
			}
		}
		return false
	})

	// Aged past graveFor: afresh.
	old := graveFor
	graveFor = 50 * time.Millisecond
	defer func() { graveFor = old }()
	d.Unregister("a:1")
	time.Sleep(100 * time.Millisecond)
	d.Register("a:1", pc)
	if got := state("a:1"); got != Healthy {
		t.Errorf("a:1 is %v after its grave aged past graveFor, want healthy", got)
	}
	graveFor = old

	// Bounded: past maxGraves the oldest go first.
	for i := range maxGraves + 10 {
		ep := "x:" + strconv.Itoa(i)
		d.Register(ep, pc)
		d.Disable(ep, ReasonOperatorDisable)
		d.Unregister(ep)
	}
	d.mu.Lock()
	graves, order := len(d.graves), len(d.graveOrder)
	d.mu.Unlock()
	if graves > maxGraves || order > 2*maxGraves {
		t.Fatalf("%d graves (%d in order), want at most %d", graves, order, maxGraves)
	}
	d.Register("x:0", pc)
	d.Register("x:"+strconv.Itoa(maxGraves+9), pc)
	if state("x:0") != Healthy || state("x:"+strconv.Itoa(maxGraves+9)) != Disabled {
		t.Fatalf("x:0 %v, the newest %v: want the oldest grave dropped, the newest kept", state("x:0"), state("x:"+strconv.Itoa(maxGraves+9)))
	}
}
