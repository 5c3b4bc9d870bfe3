// Package harness holds the helpers the end-to-end tests and the incident
// replays share.
package harness

import (
	"sync"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy"
)

// StateChange is one observed endpoint state.
type StateChange struct {
	At     time.Time
	State  string
	Reason string
}

// StateWatcher polls an endpoint's status and records every change. A
// change of Since counts, so an exclusion and readmission between two
// polls is still seen, as the last of them.
type StateWatcher struct {
	quit chan struct{}
	done chan struct{}
	once sync.Once

	mu      sync.Mutex
	changes []StateChange
}

// WatchState polls poll every interval until Stop is called or
// maxDuration has passed; a poll that fails is skipped. The caller stops
// it (t.Cleanup(w.Stop)).
func WatchState(poll func() (proxy.EndpointStatus, error), interval, maxDuration time.Duration) *StateWatcher {
	w := &StateWatcher{quit: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		var since time.Time
		for end := time.Now().Add(maxDuration); time.Now().Before(end); {
			if st, err := poll(); err == nil && !st.Since.Equal(since) {
				since = st.Since
				w.mu.Lock()
				w.changes = append(w.changes, StateChange{At: st.Since, State: st.State, Reason: st.Reason})
				w.mu.Unlock()
			}
			select {
			case <-w.quit:
				return
			case <-tick.C:
			}
		}
	}()
	return w
}

// Stop ends the polling and waits for it.
func (w *StateWatcher) Stop() {
	w.once.Do(func() { close(w.quit) })
	<-w.done
}

// Snapshot returns the changes recorded so far.
func (w *StateWatcher) Snapshot() []StateChange {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]StateChange(nil), w.changes...)
}

// After returns the changes at or after t0.
func (w *StateWatcher) After(t0 time.Time) []StateChange {
	var out []StateChange
	for _, c := range w.Snapshot() {
		if !c.At.Before(t0) {
			out = append(out, c)
		}
	}
	return out
}

// FirstAfter returns the first recorded change to state at or after t0,
// waiting up to wait for the poller to catch up.
func (w *StateWatcher) FirstAfter(t0 time.Time, state string, wait time.Duration) (StateChange, bool) {
	for deadline := time.Now().Add(wait); ; time.Sleep(5 * time.Millisecond) {
		for _, c := range w.After(t0) {
			if c.State == state {
				return c, true
			}
		}
		if time.Now().After(deadline) {
			return StateChange{}, false
		}
	}
}
