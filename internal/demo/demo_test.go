package demo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRun runs the demo exactly as `livenessproxy demo` does (Run is
// run with defaultParams) and checks what it measured and printed.
func TestRun(t *testing.T) {
	if testing.Short() {
		t.Skip("the demo takes about 13 s")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // hang detector
	defer cancel()
	p := defaultParams()
	var buf bytes.Buffer
	start := time.Now()
	res, err := run(ctx, &buf, p)
	took := time.Since(start)
	t.Logf("output (%v):\n%s", took.Round(time.Millisecond), buf.String())
	if err != nil {
		t.Fatal(err)
	}
	if took > 30*time.Second {
		t.Errorf("the demo took %v, want well under a minute", took)
	}

	// Through the proxy: the stalled link is closed within about
	// write_timeout of the stall, the broker fails its in-flight queries
	// fast, and memory stays bounded on both sides of the proxy.
	px := res.Proxied
	var inStall []linkEnd
	for _, l := range res.LinkEnds {
		if l.At >= res.StallAt && l.At <= res.ResumeAt {
			inStall = append(inStall, l)
		}
		if l.Stats.MaxQueued > res.HighWater {
			t.Errorf("link queued %d bytes, above the high watermark %d", l.Stats.MaxQueued, res.HighWater)
		}
	}
	if len(inStall) == 0 {
		t.Fatalf("the proxy closed no link during the stall; links: %+v", res.LinkEnds)
	}
	first := inStall[0]
	switch first.Stats.Reason {
	case metrics.ReasonWriteTimeout, metrics.ReasonWatermark, metrics.ReasonUpstreamTimeout:
	default:
		t.Errorf("first link closed for %q, want a liveness reason", first.Stats.Reason)
	}
	if d := first.At - res.StallAt; d > p.writeTimeout+time.Second {
		t.Errorf("proxy closed the link %v after the stall, want within ~write_timeout (%v)", d, p.writeTimeout)
	}
	if len(res.BrokerCloses) == 0 || res.BrokerCloses[0].At < res.StallAt || res.BrokerCloses[0].Close.FailedFast == 0 {
		t.Errorf("proxied broker saw no close failing in-flight queries: %+v", res.BrokerCloses)
	}
	if px.Broker.FailedFast == 0 || px.FailedFastInStall == 0 {
		t.Errorf("no query failed fast through the proxy: %+v", px)
	}
	if px.Broker.PeakQueueBytes > 1<<20 {
		t.Errorf("proxied broker's outbound queue peaked at %d bytes, want it kept small by the proxy", px.Broker.PeakQueueBytes)
	}

	// Direct: the connection is never closed, queries only time out, the
	// outbound queue grows with the stall and the backlog runs stale.
	d := res.Direct
	if d.Broker.Closes != 0 || d.Broker.Connects != 1 || !d.ConnectedAtStallEnd {
		t.Errorf("direct connection was closed or replaced: %+v", d)
	}
	if d.Broker.FailedFast != 0 || d.TimedOutInStall == 0 {
		t.Errorf("direct path: want timeouts only, got %+v", d.Broker)
	}
	if d.QueueAtStallEnd < 2*res.HighWater {
		t.Errorf("direct outbound queue %d bytes at the end of the stall, want it to grow past %d", d.QueueAtStallEnd, 2*res.HighWater)
	}
	if d.Stale == 0 || d.Stale <= px.Stale {
		t.Errorf("stale executed: direct %d, proxied %d; want the direct backlog executed stale", d.Stale, px.Stale)
	}

	// The printed table carries the measured numbers.
	out := buf.String()
	if n := strings.Count(out, "\n"); n >= 30 {
		t.Errorf("output has %d lines, want under 30", n)
	}
	for _, want := range []string{
		"path ", "failed fast", "peak broker queue", "stale executed",
		"still open", first.Stats.Reason,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	for name, r := range map[string]pathResult{"direct ": d, "via proxy ": px} {
		fields := rowFields(t, out, name)
		want := []string{fmt.Sprint(r.Broker.Sent), fmt.Sprint(r.Broker.OK), fmt.Sprint(r.Broker.FailedFast),
			fmt.Sprint(r.Broker.TimedOut)}
		for i, w := range want {
			if fields[i] != w {
				t.Errorf("row %q column %d = %q, want %q", name, i+1, fields[i], w)
			}
		}
		if last := fields[len(fields)-1]; last != fmt.Sprint(r.Stale) {
			t.Errorf("row %q stale = %q, want %d", name, last, r.Stale)
		}
	}
	// Every query ended one way or another.
	for name, r := range map[string]pathResult{"direct": d, "proxied": px} {
		b := r.Broker
		if b.OK+b.FailedFast+b.TimedOut+b.Canceled != b.Sent || b.Sent == 0 {
			t.Errorf("%s: outcomes do not add up: %+v", name, b)
		}
	}
}

// rowFields returns the cells after the name of the table row starting with name.
func rowFields(t *testing.T, out, name string) []string {
	t.Helper()
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, name) {
			return strings.Fields(strings.TrimPrefix(line, name))
		}
	}
	t.Fatalf("no table row %q", name)
	return nil
}

// TestRunCanceled checks that Run stops early and cleans up when its
// context ends.
func TestRunCanceled(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	var buf bytes.Buffer
	start := time.Now()
	err := Run(ctx, &buf)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run = %v, want context.DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 4*time.Second {
		t.Fatalf("Run took %v to stop", d)
	}
	if !strings.Contains(buf.String(), "load starts") {
		t.Fatalf("output:\n%s", buf.String())
	}
}
