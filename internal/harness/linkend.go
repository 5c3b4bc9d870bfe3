package harness

import (
	"encoding/json"
	"sync"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy"
)

// LinkEnd is one link that ended, as a proxy reports it (proxy.LinkStats)
// with the time its end was reported. It is also the JSON form a proxy in
// a child process prints, one {"link_end": ...} line per link.
type LinkEnd struct {
	Listener  string        `json:"listener"`
	Client    string        `json:"client"`
	Upstream  string        `json:"upstream"`
	Reason    string        `json:"reason"`
	Err       string        `json:"err,omitempty"`
	BytesUp   int64         `json:"bytes_up"`
	BytesDown int64         `json:"bytes_down"`
	MaxQueued int64         `json:"max_queued"`
	Opened    time.Time     `json:"opened"`
	Duration  time.Duration `json:"duration"`
	At        time.Time     `json:"at"`
}

// EndOf returns the LinkEnd of s, reported at at.
func EndOf(s proxy.LinkStats, at time.Time) LinkEnd {
	e := LinkEnd{Listener: s.Listener, Client: s.Client, Upstream: s.Upstream, Reason: string(s.Reason),
		BytesUp: s.BytesUp, BytesDown: s.BytesDown, MaxQueued: s.MaxQueued, Opened: s.Opened, Duration: s.Duration, At: at}
	if s.Err != nil {
		e.Err = s.Err.Error()
	}
	return e
}

// LinkEndLine is the line a proxy process prints for a link that ended.
type LinkEndLine struct {
	LinkEnd *LinkEnd `json:"link_end,omitempty"`
}

// LinkEnds records the links a proxy reports ended: in process through
// Record (a proxy.Options.OnLinkEnd), or from a proxy process's output
// lines through Collect.
type LinkEnds struct {
	mu   sync.Mutex
	ends []LinkEnd
}

// Record records s as ended now. It is a proxy.Options.OnLinkEnd.
func (r *LinkEnds) Record(s proxy.LinkStats) { r.add(EndOf(s, time.Now())) }

func (r *LinkEnds) add(e LinkEnd) {
	r.mu.Lock()
	r.ends = append(r.ends, e)
	r.mu.Unlock()
}

// Collect records the link ends among lines (JSON, as LinkEndLine; other
// lines are skipped) until done is closed, then those still buffered in
// lines, and returns. The caller runs it in a goroutine it waits for.
func (r *LinkEnds) Collect(lines <-chan []byte, done <-chan struct{}) {
	take := func(line []byte) {
		var l LinkEndLine
		if json.Unmarshal(line, &l) == nil && l.LinkEnd != nil {
			r.add(*l.LinkEnd)
		}
	}
	for {
		select {
		case line := <-lines:
			take(line)
		case <-done:
			for len(lines) > 0 { // what was read before the end
				take(<-lines)
			}
			return
		}
	}
}

// All returns the links that ended so far, in the order they were recorded.
func (r *LinkEnds) All() []LinkEnd {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]LinkEnd(nil), r.ends...)
}

// Before returns the links that ended before t0, and how many by reason.
func (r *LinkEnds) Before(t0 time.Time) (map[string]int, []LinkEnd) {
	reasons := map[string]int{}
	var out []LinkEnd
	for _, e := range r.All() {
		if e.At.Before(t0) {
			reasons[e.Reason]++
			out = append(out, e)
		}
	}
	return reasons, out
}
