package proxy

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// Two connect timeouts in a row exclude an endpoint (dial_error); a
// probe's connect then passes and readmits it. The count of timeouts in a
// row starts over: the first connect after the readmission that loses
// one SYN (a server just back, its accept queue full of the clients that
// waited for it) excludes nothing. Before (found by a review), it was the
// "third in a row" and excluded the server again at once.
func TestReadmissionStartsTheTimeoutCountOver(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.ConnectTimeout = policy.Duration(800 * time.Millisecond)
		s.Detector.InitialDelay = policy.Duration(100 * time.Millisecond)
		s.Detector.Probe = policy.ProbeKindConnect
	})
	h.p.mu.Lock()
	ep := h.p.endpoints[peer.Addr()]
	h.p.mu.Unlock()
	timeout := &net.OpError{Op: "dial", Net: "tcp", Err: context.DeadlineExceeded}
	lw := 800 * time.Millisecond

	// Two connects that timed out, one after the other.
	began := flow.Mono()
	if ep.dialFailed(began, lw, timeout) {
		t.Fatal("premise: one timeout reported")
	}
	began = flow.Mono()
	if !ep.dialFailed(began, lw, timeout) {
		t.Fatal("premise: the second timeout in a row not reported")
	}
	h.p.det.Report(ep.addr, string(CloseDialError)) // as lk.host.report does
	// The detector's state changes first; the proxy applies the
	// readmission (onReadmitted, which starts the count over) when the
	// event is delivered, a moment later and maybe on another goroutine.
	waitFor(t, 5*time.Second, "readmitted by its connect probe", func() bool { return h.stateOf(peer.Addr()) == "healthy" })
	waitFor(t, 5*time.Second, "the readmission applied", func() bool { return ep.dialTimeouts.Load() == 0 })

	// One connect after the readmission loses its SYN.
	began = flow.Mono()
	if ep.dialFailed(began, lw, timeout) {
		t.Fatalf("the first connect timeout after a probe readmitted the endpoint is reported (count %d): one lost SYN re-excludes a server just back",
			ep.dialTimeouts.Load())
	}
}
