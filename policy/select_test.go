package policy

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// pool builds candidates a0, a1, ... from states, with no links.
func cands(states ...EndpointState) []Candidate {
	cs := make([]Candidate, len(states))
	for i, s := range states {
		cs[i] = Candidate{Addr: fmt.Sprintf("a%d:80", i), State: s}
	}
	return cs
}

// withLinks sets the candidates' link counts, in order.
func withLinks(cs []Candidate, links ...int) []Candidate {
	for i, n := range links {
		cs[i].Links = n
	}
	return cs
}

const (
	R = Routable
	X = Excluded
	D = Disabled
)

func TestSelect(t *testing.T) {
	rr, ll := BalanceRoundRobin, BalanceLeastLinks
	cases := []struct {
		name     string
		cs       []Candidate
		balance  string
		failOpen bool
		cursor   uint64
		tried    []string
		want     Choice
	}{
		{name: "empty pool", cs: nil, balance: rr, failOpen: true, want: Choice{Index: -1}},
		{name: "routable at the cursor", cs: cands(R, R, R), balance: rr, cursor: 1, want: Choice{Index: 1}},
		{name: "cursor wraps", cs: cands(R, R, R), balance: rr, cursor: 5, want: Choice{Index: 2}},
		{name: "rotation is over the eligible ones", cs: cands(X, R, D, R), balance: rr, cursor: 1, want: Choice{Index: 3}},
		{name: "excluded and disabled are skipped", cs: cands(X, D, R), balance: rr, want: Choice{Index: 2}},
		{name: "a healthy choice is never overridden by fail-open", cs: cands(X, X, R, X), balance: rr, failOpen: true, cursor: 3,
			want: Choice{Index: 2}},
		{name: "no routable, no fail-open: refuse", cs: cands(X, X, D), balance: rr, want: Choice{Index: -1}},
		{name: "fail-open to an excluded one", cs: cands(X, D, X), balance: rr, failOpen: true, want: Choice{Index: 0, FailOpen: true}},
		{name: "fail-open round-robin among the excluded", cs: cands(X, D, X), balance: rr, failOpen: true, cursor: 1,
			want: Choice{Index: 2, FailOpen: true}},
		{name: "never a disabled one, even with nothing left", cs: cands(D, D), balance: rr, failOpen: true, want: Choice{Index: -1}},
		{name: "fail-open with least_links among the excluded", cs: withLinks(cands(X, X, D), 5, 2, 0), balance: ll, failOpen: true,
			want: Choice{Index: 1, FailOpen: true}},
		{name: "avoid moves to the next in turn", cs: cands(R, R, R), balance: rr, cursor: 1, tried: []string{"a1:80"}, want: Choice{Index: 2}},
		{name: "avoid wraps to the first", cs: cands(R, R, R), balance: rr, cursor: 2, tried: []string{"a2:80"}, want: Choice{Index: 0}},
		{name: "avoid not at the cursor changes nothing", cs: cands(R, R, R), balance: rr, cursor: 0, tried: []string{"a1:80"}, want: Choice{Index: 0}},
		{name: "avoid is taken when it is the only eligible one", cs: cands(X, R, D), balance: rr, failOpen: true, tried: []string{"a1:80"},
			want: Choice{Index: 1}},
		{name: "avoid does not fail open while it is routable", cs: cands(R, X), balance: rr, failOpen: true, tried: []string{"a0:80"},
			want: Choice{Index: 0}},
		{name: "avoid among fail-open candidates", cs: cands(X, X), balance: rr, failOpen: true, tried: []string{"a0:80"},
			want: Choice{Index: 1, FailOpen: true}},
		{name: "avoid unknown changes nothing", cs: cands(R, R), balance: rr, cursor: 1, tried: []string{"zz:1"}, want: Choice{Index: 1}},
		{name: "least_links picks the fewest", cs: withLinks(cands(R, R, R), 3, 1, 2), balance: ll, want: Choice{Index: 1}},
		{name: "least_links ignores ineligible ones", cs: withLinks(cands(X, R, D, R), 0, 4, 0, 3), balance: ll, failOpen: true,
			want: Choice{Index: 3}},
		{name: "least_links ties in turn", cs: withLinks(cands(R, R, R), 1, 1, 1), balance: ll, cursor: 2, want: Choice{Index: 2}},
		{name: "least_links ties in turn from the cursor", cs: withLinks(cands(R, R, R), 1, 2, 1), balance: ll, cursor: 1,
			want: Choice{Index: 2}},
		{name: "least_links avoids the failed one even if it has the fewest", cs: withLinks(cands(R, R, R), 0, 5, 3), balance: ll,
			tried: []string{"a0:80"}, want: Choice{Index: 2}},
		{name: "a retry goes to a member not tried before going back", cs: withLinks(cands(R, R, R), 2, 2, 3), balance: ll,
			tried: []string{"a0:80", "a1:80"}, want: Choice{Index: 2}},
		{name: "round_robin: a member not tried, past the cursor", cs: cands(R, R, R), balance: rr, cursor: 2,
			tried: []string{"a2:80", "a0:80"}, want: Choice{Index: 1}},
		{name: "every member tried: not the last while another exists", cs: cands(R, R), balance: rr,
			tried: []string{"a0:80", "a1:80"}, want: Choice{Index: 0}},
		{name: "every member tried, least_links among the earlier ones", cs: withLinks(cands(R, R, R), 4, 0, 1), balance: ll,
			tried: []string{"a0:80", "a2:80", "a1:80"}, want: Choice{Index: 2}},
		{name: "untried excluded members do not fail open while a tried one is routable", cs: cands(R, X), balance: rr, failOpen: true,
			tried: []string{"a0:80"}, want: Choice{Index: 0}},
		{name: "unknown balance is round_robin", cs: withLinks(cands(R, R), 9, 0), balance: "", want: Choice{Index: 0}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cursor := tc.cursor
			got := Select(tc.cs, tc.balance, tc.failOpen, &cursor, tc.tried)
			if got != tc.want {
				t.Errorf("Select(%v, %s, failOpen %v, cursor %d, tried %q) = %+v, want %+v",
					tc.cs, tc.balance, tc.failOpen, tc.cursor, tc.tried, got, tc.want)
			}
			if cursor != tc.cursor+1 {
				t.Errorf("cursor %d after the call, want %d", cursor, tc.cursor+1)
			}
		})
	}
}

// A link's retries walk the pool in balance order: each attempt goes to a
// member the earlier ones did not fail on.
func TestSelectRetriesMoveOn(t *testing.T) {
	cs := cands(R, R, R)
	var cursor uint64
	first := Select(cs, BalanceRoundRobin, false, &cursor, nil)
	second := Select(cs, BalanceRoundRobin, false, &cursor, []string{cs[first.Index].Addr})
	third := Select(cs, BalanceRoundRobin, false, &cursor, []string{cs[first.Index].Addr, cs[second.Index].Addr})
	if got := []int{first.Index, second.Index, third.Index}; got[0] != 0 || got[1] != 1 || got[2] != 2 {
		t.Errorf("attempts went to %v, want [0 1 2]", got)
	}
	// One endpoint: a retry goes to it again (there is nowhere else).
	one := cands(R)
	if ch := Select(one, BalanceRoundRobin, false, &cursor, []string{one[0].Addr}); ch.Index != 0 {
		t.Errorf("single endpoint retry = %+v, want index 0", ch)
	}
	if ch := Select(cands(R, R), BalanceRoundRobin, false, nil, nil); ch.Index != 0 {
		t.Errorf("nil cursor = %+v, want index 0", ch)
	}
}

// TestSelectProperties checks Select's rules over thousands of random pools.
func TestSelectProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(17, 1908))
	for iter := range 5000 {
		n := rng.IntN(9) // 0..8 candidates
		cs := make([]Candidate, n)
		for i := range cs {
			cs[i] = Candidate{Addr: fmt.Sprintf("10.0.0.%d:9092", i), State: EndpointState(rng.IntN(3)), Links: rng.IntN(4)}
		}
		balance := []string{BalanceRoundRobin, BalanceLeastLinks}[rng.IntN(2)]
		failOpen := rng.IntN(2) == 0
		var tried []string // a link's earlier attempts: 0 to 3, repeats allowed
		for range rng.IntN(4) {
			if n > 0 {
				tried = append(tried, cs[rng.IntN(n)].Addr)
			}
		}
		cursor := rng.Uint64()
		desc := fmt.Sprintf("iteration %d: Select(%v, %s, failOpen %v, cursor %d, tried %q)", iter, cs, balance, failOpen, cursor, tried)

		want := Routable
		if !hasState(cs, Routable) {
			want = Excluded
		}
		var eligible []int
		if want == Routable || failOpen {
			for i, c := range cs {
				if c.State == want {
					eligible = append(eligible, i)
				}
			}
		}
		best := triedLast // the best rank by tried among the eligible
		for _, i := range eligible {
			best = min(best, triedRank(tried, cs[i].Addr))
		}

		ch := Select(cs, balance, failOpen, &cursor, tried)
		if (ch.Index == -1) != (len(eligible) == 0) {
			t.Fatalf("%s = %+v; eligible %v: -1 exactly when nothing is eligible", desc, ch, eligible)
		}
		if ch.Index == -1 {
			if ch.FailOpen {
				t.Fatalf("%s = %+v: a refusal is not fail-open", desc, ch)
			}
			continue
		}
		if ch.Index < -1 || ch.Index >= n {
			t.Fatalf("%s = %+v: index out of range", desc, ch)
		}
		got := cs[ch.Index]
		switch {
		case got.State == Disabled:
			t.Fatalf("%s = %+v: chose a disabled endpoint", desc, ch)
		case hasState(cs, Routable) && got.State != Routable:
			t.Fatalf("%s = %+v: chose %s while a routable endpoint exists", desc, ch, got.State)
		case got.State == Excluded && !failOpen:
			t.Fatalf("%s = %+v: chose an excluded endpoint without fail_open", desc, ch)
		case ch.FailOpen != (got.State == Excluded):
			t.Fatalf("%s = %+v: FailOpen must say the choice is an excluded endpoint", desc, ch)
		case triedRank(tried, got.Addr) != best:
			t.Fatalf("%s = %+v: chose a member of rank %d by tried while one of rank %d (0 untried, 2 the last tried) is eligible",
				desc, ch, triedRank(tried, got.Addr), best)
		}
		if balance == BalanceLeastLinks {
			for _, i := range eligible {
				if triedRank(tried, cs[i].Addr) == best && cs[i].Links < got.Links {
					t.Fatalf("%s = %+v: least_links chose %d links, candidate %d has %d", desc, ch, got.Links, i, cs[i].Links)
				}
			}
		}

		// N consecutive round_robin calls over N eligible endpoints, none
		// tried: each exactly once.
		seen := map[int]int{}
		for range eligible {
			ch := Select(cs, BalanceRoundRobin, failOpen, &cursor, nil)
			seen[ch.Index]++
		}
		if len(seen) != len(eligible) {
			t.Fatalf("iteration %d: %d round_robin calls over %v (eligible %v) chose %v: want each once",
				iter, len(eligible), cs, eligible, seen)
		}
		for _, i := range eligible {
			if seen[i] != 1 {
				t.Fatalf("iteration %d: %d round_robin calls over %v (eligible %v) chose %v: want each once",
					iter, len(eligible), cs, eligible, seen)
			}
		}
	}
}

// More candidates than Select keeps on the stack work the same.
func TestSelectLargePool(t *testing.T) {
	states := make([]EndpointState, 200)
	for i := range states {
		states[i] = []EndpointState{R, X, D}[i%3]
	}
	cs := cands(states...)
	var cursor uint64
	seen := map[int]bool{}
	for range 67 { // 67 routable: indexes 0, 3, ..., 198
		ch := Select(cs, BalanceRoundRobin, true, &cursor, nil)
		if ch.Index%3 != 0 || ch.FailOpen || seen[ch.Index] {
			t.Fatalf("choice %+v (seen %v)", ch, seen)
		}
		seen[ch.Index] = true
	}
}

func TestEndpointStateString(t *testing.T) {
	for s, want := range map[EndpointState]string{Routable: "routable", Excluded: "excluded", Disabled: "disabled", 7: "EndpointState(7)"} {
		if got := s.String(); got != want {
			t.Errorf("%d.String() = %q, want %q", int(s), got, want)
		}
	}
}
