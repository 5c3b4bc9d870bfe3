package harness

import (
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy"
)

// A link end recorded in process and one read back from a proxy process's
// JSON line are the same record.
func TestLinkEndsRecordAndCollect(t *testing.T) {
	t0 := time.Now()
	s := proxy.LinkStats{Listener: "l", Client: "127.0.0.1:1", Upstream: "127.0.0.1:2", Reason: "unanswered",
		Err: errors.New("boom"), BytesUp: 3, BytesDown: 4, MaxQueued: 5, Opened: t0.Add(-time.Second), Duration: time.Second}
	var in LinkEnds
	in.Record(s)
	got := in.All()
	if len(got) != 1 || got[0].Reason != "unanswered" || got[0].Err != "boom" || got[0].MaxQueued != 5 ||
		got[0].Duration != time.Second || got[0].At.Before(t0) {
		t.Fatalf("recorded %+v", got)
	}

	line, err := json.Marshal(LinkEndLine{LinkEnd: &got[0]})
	if err != nil {
		t.Fatal(err)
	}
	lines := make(chan []byte, 4)
	done := make(chan struct{})
	lines <- []byte(`{"ready":{"admin":"127.0.0.1:9"}}`) // not a link end: skipped
	lines <- []byte("not json")
	lines <- line
	close(done) // the process exited: what is buffered is still read
	var out LinkEnds
	out.Collect(lines, done)
	back := out.All()
	if len(back) != 1 || !back[0].At.Equal(got[0].At) || !back[0].Opened.Equal(got[0].Opened) {
		t.Fatalf("collected %+v, want %+v", back, got)
	}
	back[0].At, back[0].Opened = got[0].At, got[0].Opened // monotonic readings do not survive JSON
	if back[0] != got[0] {
		t.Fatalf("collected %+v, want %+v", back[0], got[0])
	}

	reasons, before := out.Before(got[0].At.Add(time.Nanosecond))
	if len(before) != 1 || reasons["unanswered"] != 1 {
		t.Fatalf("Before: %v %+v", reasons, before)
	}
	if reasons, before := out.Before(got[0].At); len(before) != 0 || len(reasons) != 0 {
		t.Fatalf("Before the end: %v %+v, want none", reasons, before)
	}
}
