package testutil

import (
	"bytes"
	"sync"
)

// SyncBuffer is a bytes.Buffer that goroutines may write while a test
// reads it: a log sink for a proxy's goroutines, or a child's stderr.
type SyncBuffer struct {
	// Keep, if positive, bounds what is kept: once the buffer holds more
	// than Keep bytes, further writes are accepted and dropped (the
	// beginning says why a child failed; a chatty one cannot fill memory).
	Keep int

	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.Keep > 0 && s.b.Len() > s.Keep {
		return len(p), nil
	}
	return s.b.Write(p)
}

// String returns what was written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
