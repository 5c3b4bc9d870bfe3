package policy

import "strconv"

// EndpointState is an endpoint as the selector sees it.
type EndpointState int

// The states an endpoint can be in, for Select.
const (
	// Routable: the detector holds the endpoint healthy.
	Routable EndpointState = iota
	// Excluded: the detector excluded the endpoint (it is probed until a
	// probe readmits it). Only fail-open routes to it.
	Excluded
	// Disabled: the operator disabled the endpoint. Nothing routes to it,
	// not even fail-open.
	Disabled
)

func (s EndpointState) String() string {
	switch s {
	case Routable:
		return "routable"
	case Excluded:
		return "excluded"
	case Disabled:
		return "disabled"
	}
	return "EndpointState(" + strconv.Itoa(int(s)) + ")"
}

// Candidate is one endpoint of a pool.
type Candidate struct {
	// Addr is the endpoint's address, as the caller names it; Select
	// compares it with avoid.
	Addr string
	// State is the endpoint's state.
	State EndpointState
	// Links is the endpoint's live link count, which least_links compares.
	Links int
}

// Choice is the selector's answer.
type Choice struct {
	Index    int  // into the candidates; -1: refuse the link
	FailOpen bool // no endpoint was routable and fail_open sent the link to an excluded one
}

// Select picks the endpoint for the next connect attempt of a new link.
// cursor is the pool's round-robin position (advanced on each call; the caller keeps it, under its own lock).
// tried are the addresses the earlier attempts of the same link failed
// on, the last the most recent (none for the first attempt): one of them
// is not chosen while an eligible candidate not among them exists, and
// when every eligible one was tried, the last tried is not chosen while
// another exists. So a link's attempts go to members it has not tried
// before they go back to one (a least_links pool would otherwise return
// to a member with few links that refuses, passing over one that serves).
//
// The eligible candidates are the Routable ones. Only when none is
// Routable and failOpen is set are they the Excluded ones instead, and the
// Choice says FailOpen: all-or-nothing, a routable endpoint is never passed
// over for fail-open, and a Disabled one is never chosen, even when nothing
// else is left. With no eligible candidate the Index is -1: refuse the
// link.
//
// Among the eligible candidates, taken in the order given (the caller
// keeps it stable) and rotated by the cursor, balance round_robin picks
// the first and least_links the first with the fewest Links; a balance
// that is neither is round_robin. So N calls over the same N eligible
// candidates pick each once, and a retry moves on to the next member it
// has not tried in the balance order. Select is pure
// apart from advancing *cursor; a nil cursor is a cursor at 0.
func Select(cs []Candidate, balance string, failOpen bool, cursor *uint64, tried []string) Choice {
	var turn uint64
	if cursor != nil {
		turn = *cursor
		*cursor++
	}

	want, open := Routable, false
	if !hasState(cs, Routable) {
		if !failOpen {
			return Choice{Index: -1}
		}
		want, open = Excluded, true
	}
	// The eligible candidates' indexes, in the given order (on the stack
	// for pools of ordinary size).
	var buf [64]int
	eligible := buf[:0]
	first := triedLast + 1 // the best rank among the eligible ones
	for i, c := range cs {
		if c.State == want {
			eligible = append(eligible, i)
			first = min(first, triedRank(tried, c.Addr))
		}
	}
	n := len(eligible)
	if n == 0 {
		return Choice{Index: -1}
	}
	start := int(turn % uint64(n))
	best := -1
	for k := range n {
		i := eligible[(start+k)%n]
		if triedRank(tried, cs[i].Addr) != first {
			continue
		}
		if balance != BalanceLeastLinks {
			best = i
			break
		}
		if best < 0 || cs[i].Links < cs[best].Links {
			best = i
		}
	}
	return Choice{Index: best, FailOpen: open}
}

// The ranks of a candidate by the link's earlier attempts: chosen from
// the best rank present.
const (
	untried   = iota
	triedOnce // tried, not by the last attempt
	triedLast // tried by the last attempt
)

// triedRank is addr's rank by tried (the last the most recent).
func triedRank(tried []string, addr string) int {
	for j := len(tried) - 1; j >= 0; j-- {
		if tried[j] == addr {
			if j == len(tried)-1 {
				return triedLast
			}
			return triedOnce
		}
	}
	return untried
}

func hasState(cs []Candidate, s EndpointState) bool {
	for _, c := range cs {
		if c.State == s {
			return true
		}
	}
	return false
}
