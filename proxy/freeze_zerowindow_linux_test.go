package proxy

import (
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
)

// The window guard lifts TCP_USER_TIMEOUT from an upstream whose window
// is zero while its kernel answers the probes (a peer that reads nothing
// is write_timeout's to judge). If the proxy cannot run its sample (a
// freeze: SIGSTOP here, CPU throttling in production), the kernel applies
// the bound and fails the socket with ETIMEDOUT. That is the proxy's own
// failure: the link ends local_error and the endpoint stays healthy.
// Before (found by a helper's audit), it ended upstream_timeout and the
// endpoint was excluded, every link to it closed. The control, not
// frozen, keeps the link through 3 s of zero window.
func TestFrozenProxyZeroWindowIsNoUpstreamTimeout(t *testing.T) {
	t.Run("control: not frozen", func(t *testing.T) { frozenZeroWindow(t, false) })
	t.Run("frozen", func(t *testing.T) { frozenZeroWindow(t, true) })
}

func frozenZeroWindow(t *testing.T, freeze bool) {
	peer := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	h := start(t, peer.Addr(), func(s *policy.Settings) {
		s.TCPUserTimeout = policy.Duration(time.Second)
		s.WriteTimeout = policy.Duration(30 * time.Second) // the peer stops reading for less than this
		// Keepalive off: the bound stays tcp_user_timeout while the link
		// idles (the guard raises it to keepalive's), so the freeze finds
		// it at the bound the guard would lift.
		s.Keepalive = policy.Keepalive{Idle: -1}
	})
	c := h.dial()
	if _, err := c.Write([]byte{1}); err != nil {
		t.Fatal(err)
	}
	// The raw dial sets tcp_user_timeout a quarter of it after the connect.
	for deadline := time.Now().Add(5 * time.Second); userTimeout(h) != 1000; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("TCP_USER_TIMEOUT %d on the upstream socket, want 1000", userTimeout(h))
		}
	}
	go func() {
		buf := make([]byte, 64<<10)
		for range 8 {
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	}()
	time.Sleep(30 * time.Millisecond) // the proxy hands the bytes to its upstream socket; the peer's window closes
	if !freeze {
		time.Sleep(3 * time.Second)
		select {
		case s := <-h.ended:
			t.Fatalf("not frozen: the link ended %s (%v): the control does not hold", s.Reason, s.Err)
		default:
		}
		if ep := h.endpoint(); ep.State != "healthy" {
			t.Fatalf("not frozen: endpoint %s (%s)", ep.State, ep.Reason)
		}
		t.Logf("not frozen: after 3s of a zero window (3 x tcp_user_timeout) the link lives and the endpoint is healthy (the guard lifted the bound)")
		return
	}
	freezeProcess(t, 3*time.Second)
	s := h.linkEnd(5 * time.Second)
	ep := h.endpoint()
	t.Logf("after a 3s freeze of the proxy: link ended %q (%v); endpoint %s (%s)", s.Reason, s.Err, ep.State, ep.Reason)
	if s.Reason == CloseUpstreamTimeout || ep.State != "healthy" {
		t.Fatalf("the proxy's own freeze ended the link as %s and left the endpoint %s (%s): a live, merely not-reading upstream was blamed", s.Reason, ep.State, ep.Reason)
	}
}
