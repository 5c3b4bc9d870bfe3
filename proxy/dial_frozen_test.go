package proxy

import (
	"errors"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// A connect timeout that the proxy noticed at least connect_timeout after
// its deadline (the proxy could not run meanwhile) is never held against
// the endpoint and leaves its count of timeouts in a row as it was: it
// neither counts nor starts the count over. One noticed in time counts as
// before, and nothing else is taken for a late one.
func TestLateDialTimeoutIsNotCounted(t *testing.T) {
	_, timedOut := (&net.Dialer{Timeout: 50 * time.Millisecond}).Dial("tcp", blackholeListener(t))
	if !dialTimedOut(timedOut) {
		t.Fatalf("a dial to a full accept queue: %v, want a connect timeout", timedOut)
	}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}

	const timeout = time.Second
	now := flow.Mono()
	isLate := func(err error) bool { return errors.As(err, new(errFrozenDial)) }
	if err := frozenDial(timedOut, now-int64(timeout+timeout/2), timeout); isLate(err) {
		t.Fatalf("a timeout noticed half a timeout late was taken for a frozen proxy's: %v", err)
	}
	late := frozenDial(timedOut, now-int64(2*timeout), timeout)
	if !isLate(late) {
		t.Fatalf("a timeout noticed a whole timeout late: %v, want it told", late)
	}
	if !strings.Contains(late.Error(), "the proxy could not run") || !dialTimedOut(late) || !upstreamFault(late) {
		t.Fatalf("late timeout %q: want it still a connect timeout (the link's dial_error), saying the proxy could not run", late)
	}
	if err := frozenDial(refused, now-int64(10*timeout), timeout); isLate(err) {
		t.Fatalf("a refusal taken for a late timeout: %v", err)
	}
	if err := frozenDial(timedOut, now-int64(10*time.Second), 0); isLate(err) {
		t.Fatalf("with no connect_timeout, nothing is late: %v", err)
	}

	ep := &endpoint{}
	ep.lastAnswer.Store(flow.NoAnswer)
	began := flow.Mono()
	for i := range 3 {
		if ep.dialFailed(began, timeout, late) {
			t.Fatalf("late timeout %d held against the endpoint", i+1)
		}
	}
	if n := ep.dialTimeouts.Load(); n != 0 {
		t.Fatalf("%d timeouts in a row counted after three late ones, want 0", n)
	}
	if ep.dialFailed(began, timeout, timedOut) {
		t.Fatal("the first timeout in time was reported (a lost SYN explains one)")
	}
	if ep.dialFailed(began, timeout, late) {
		t.Fatal("a late timeout after one in time was reported")
	}
	if ep.dialFailed(began, timeout, timedOut) {
		t.Fatal("a timeout whose connect overlapped the first one's was reported: it is the same moment, not the next in a row")
	}
	if !ep.dialFailed(flow.Mono(), timeout, timedOut) {
		t.Fatal("the second timeout in time, a late one between them, was not reported")
	}
}
