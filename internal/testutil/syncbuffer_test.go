package testutil

import (
	"strings"
	"sync"
	"testing"
)

// Concurrent writes all land; with Keep, what comes past the bound is
// accepted and dropped.
func TestSyncBuffer(t *testing.T) {
	var all SyncBuffer
	kept := SyncBuffer{Keep: 10}
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				for _, b := range []*SyncBuffer{&all, &kept} {
					if n, err := b.Write([]byte("x")); n != 1 || err != nil {
						t.Errorf("Write = %d, %v", n, err)
					}
				}
			}
		}()
	}
	wg.Wait()
	if got := all.String(); got != strings.Repeat("x", 400) {
		t.Errorf("all: %d bytes, want 400", len(got))
	}
	if got := kept.String(); len(got) != 11 { // kept while it held at most Keep
		t.Errorf("kept: %d bytes, want 11", len(got))
	}
}
