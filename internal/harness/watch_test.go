package harness

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/livenessproxy/livenessproxy/proxy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The watcher records each change of Since once, skips failed polls, and
// Stop ends its goroutine.
func TestWatchStateRecordsChanges(t *testing.T) {
	t0 := time.Unix(1000, 0)
	seq := []proxy.EndpointStatus{
		{State: "healthy", Since: t0},
		{State: "healthy", Since: t0}, // unchanged: not recorded again
		{},                            // stands for a failed poll
		{State: "excluded", Reason: "unanswered", Since: t0.Add(time.Second)},
		{State: "healthy", Reason: "probe_ok", Since: t0.Add(2 * time.Second)},
	}
	var n atomic.Int32
	w := WatchState(func() (proxy.EndpointStatus, error) {
		i := int(n.Add(1)) - 1
		if i >= len(seq) {
			i = len(seq) - 1
		}
		if seq[i].State == "" {
			return proxy.EndpointStatus{}, errors.New("admin not answering")
		}
		return seq[i], nil
	}, time.Millisecond, time.Minute)
	c, ok := w.FirstAfter(t0.Add(2*time.Second), "healthy", 10*time.Second)
	w.Stop()
	if !ok || c.Reason != "probe_ok" {
		t.Fatalf("FirstAfter: %+v %v, want the readmission", c, ok)
	}
	got := w.Snapshot()
	if len(got) != 3 || got[0].State != "healthy" || got[1].State != "excluded" || got[2].State != "healthy" {
		t.Fatalf("changes %+v, want healthy, excluded, healthy", got)
	}
	if after := w.After(t0.Add(time.Second)); len(after) != 2 {
		t.Fatalf("After: %+v, want the last two", after)
	}
}
