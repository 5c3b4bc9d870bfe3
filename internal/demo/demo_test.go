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

	"github.com/livenessproxy/livenessproxy/proxy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRun runs the demo exactly as `livenessproxy demo` does (run with
// defaultParams) and checks what it measured and printed: replay 1's
// targets through the proxy, and the direct path stuck.
func TestRun(t *testing.T) {
	if testing.Short() {
		t.Skip("the demo takes about 10 s")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // hang detector
	defer cancel()
	p := defaultParams()
	var buf timedWriter
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

	// Through the proxy: the dead links are closed by the proxy itself,
	// every connection recovers within request_timeout + 2 s, and nothing
	// waits out the broker's timeout.
	px := res.Proxied
	if !px.Recovered || px.Recovery > p.requestTimeout+2*time.Second {
		t.Errorf("proxied: recovered %v after %v, want within %v", px.Recovered, px.Recovery, p.requestTimeout+2*time.Second)
	}
	if px.TimedOut != 0 {
		t.Errorf("proxied: %d queries timed out, want them to fail fast", px.TimedOut)
	}
	if px.OK == 0 || px.FailedFast == 0 {
		t.Errorf("proxied: want queries failed fast and then answered again: %+v", px)
	}
	dead := 0
	for _, e := range res.LinkEnds {
		if e.Stats.Opened.Before(start.Add(res.FlapAt)) {
			dead++
			switch e.Stats.Reason {
			case proxy.CloseUnanswered, proxy.CloseStale, proxy.CloseUpstreamTimeout, proxy.CloseWriteTimeout, proxy.CloseEvicted:
			default:
				t.Errorf("a dead link ended for %q, want the proxy to have closed it", e.Stats.Reason)
			}
			if e.At > p.requestTimeout+time.Second {
				t.Errorf("a dead link was closed %v after the flap, want within request_timeout + 1s", e.At)
			}
		}
	}
	if dead != p.conns {
		t.Errorf("the proxy closed %d pre-flap links after the flap, want %d: %+v", dead, p.conns, res.LinkEnds)
	}

	// Direct: stuck on the dead connections for the whole observation.
	d := res.Direct
	if d.Recovered || d.OKAfterFlap != 0 || d.TimedOut == 0 || d.FailedFast != 0 {
		t.Errorf("direct: want every query after the flap to time out: %+v", d)
	}
	if d.OpenAtEnd != p.conns {
		t.Errorf("direct: %d of %d connections still open at the end, want all", d.OpenAtEnd, p.conns)
	}
	for name, r := range map[string]pathResult{"direct": d, "proxied": px} {
		if r.Sent == 0 || r.OK+r.FailedFast+r.TimedOut+r.Canceled != r.Sent || r.Canceled != 0 {
			t.Errorf("%s: outcomes do not add up or were cut: %+v", name, r)
		}
	}

	// The output: a short timeline and the two-row table with the
	// measured numbers.
	out := buf.String()
	if n := strings.Count(out, "\n"); n >= 25 {
		t.Errorf("output has %d lines, want under 25", n)
	}
	for _, want := range []string{"flap:", "proxy closes a dead link", "endpoint excluded", "every connection answered again", "still open", "time to recovery"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	// Each event after the flap is printed as it happens: during the
	// observation, not in a batch at its end.
	obsEnd := start.Add(res.FlapAt + p.observe)
	for _, want := range []string{"proxy closes a dead link", "endpoint excluded", "every connection answered again"} {
		at, ok := buf.writtenAt(want)
		if !ok {
			continue // reported above
		}
		if !at.Before(obsEnd) {
			t.Errorf("%q was printed %v after the observation ended, not as it happened", want, at.Sub(obsEnd))
		}
	}
	for name, r := range map[string]pathResult{"direct ": d, "via proxy ": px} {
		fields := rowFields(t, out, name)
		want := []string{fmt.Sprint(r.Sent), fmt.Sprint(r.OK), fmt.Sprint(r.FailedFast), fmt.Sprint(r.TimedOut)}
		for i, w := range want {
			if fields[i] != w {
				t.Errorf("row %q column %d = %q, want %q", name, i+1, fields[i], w)
			}
		}
		if r.Recovered {
			if rec := fmt.Sprintf("%.2fs", r.Recovery.Seconds()); fields[4] != rec {
				t.Errorf("row %q recovery = %q, want %q", name, fields[4], rec)
			}
		} else if !strings.HasPrefix(strings.Join(fields[4:], " "), "none in") {
			t.Errorf("row %q recovery = %q, want none", name, strings.Join(fields[4:], " "))
		}
	}
}

// timedWriter keeps what was written and when each write came.
type timedWriter struct {
	bytes.Buffer
	writes []timedWrite
}

type timedWrite struct {
	at   time.Time
	text string
}

func (w *timedWriter) Write(p []byte) (int, error) {
	w.writes = append(w.writes, timedWrite{time.Now(), string(p)})
	return w.Buffer.Write(p)
}

// writtenAt returns when the first write containing s came.
func (w *timedWriter) writtenAt(s string) (time.Time, bool) {
	for _, wr := range w.writes {
		if strings.Contains(wr.text, s) {
			return wr.at, true
		}
	}
	return time.Time{}, false
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
