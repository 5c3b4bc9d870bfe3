package testutil

import "testing"

// Two picks never return the same address, though the kernel may hand a
// closed port out again at once.
func TestPickClosedAddrNeverRepeats(t *testing.T) {
	seen := map[string]bool{}
	for range 2000 {
		addr, err := PickClosedAddr()
		if err != nil {
			t.Fatal(err)
		}
		if seen[addr] {
			t.Fatalf("%s handed out twice", addr)
		}
		seen[addr] = true
	}
}

// The record of picks is bounded, oldest forgotten first.
func TestPickedSetIsBounded(t *testing.T) {
	p := pickedSet{seen: map[string]bool{}}
	for i := range pickedMax + 10 {
		if !p.take(string(rune('a'+i%26)) + string(rune(i))) {
			t.Fatalf("pick %d refused", i)
		}
	}
	if len(p.order) != pickedMax || len(p.seen) != pickedMax {
		t.Fatalf("%d in order, %d seen; want %d", len(p.order), len(p.seen), pickedMax)
	}
	if !p.take(string(rune('a')) + string(rune(0))) {
		t.Fatal("the oldest pick was not forgotten")
	}
}
