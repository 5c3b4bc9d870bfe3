package proxy

import (
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// blackholeOn listens on ip with a full accept queue: a connect to it
// stays under way (its SYNs dropped) until closeIt closes the listener,
// after which the next SYN sent again (1 s, 3 s, ... after the first) is
// refused.
func blackholeOn(t *testing.T, ip string) (addr string, closeIt func()) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	closeIt = func() { once.Do(func() { _ = unix.Close(fd) }) }
	t.Cleanup(closeIt)
	sa := &unix.SockaddrInet4{}
	copy(sa.Addr[:], net.ParseIP(ip).To4())
	if err := unix.Bind(fd, sa); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	got, _ := unix.Getsockname(fd)
	addr = net.JoinHostPort(ip, strconv.Itoa(got.(*unix.SockaddrInet4).Port))
	for range 2 { // fill the accept queue
		if c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond); err == nil {
			t.Cleanup(func() { _ = c.Close() })
		}
	}
	return addr, closeIt
}

// excludeHeld excludes each of addrs (for unanswered requests, evidence
// that evicts) while the test holds p.mu, so that the events wait to be
// delivered (onHealthEvent takes p.mu first): the detector has them
// excluded, the data plane does not know yet. It returns once every state
// changed; wait, called after p.mu is released, returns once every event
// was delivered.
func excludeHeld(t *testing.T, p *Proxy, addrs ...string) (wait func()) {
	t.Helper()
	var wg sync.WaitGroup
	for _, a := range addrs {
		wg.Add(1)
		go func() { defer wg.Done(); p.det.Report(a, string(CloseUnanswered)) }()
	}
	waitFor(t, 5*time.Second, "every endpoint excluded", func() bool {
		for _, a := range addrs {
			if st, _ := p.det.State(a); st != health.Excluded {
				return false
			}
		}
		return true
	})
	return wg.Wait
}

// A pool link accepted before its member's exclusion, but routed to it
// after (its connect to another member under way meanwhile; then, every
// member excluded, the pool fails open), went there knowingly: neither the
// exclusion's event, delivered only after the link is up (late), nor the
// member's readmission evicts it. Before, both compared the link's accept
// time with the instant the member left routing, and cut a link routed to
// an excluded member on purpose. The twin: a link routed to the member
// before its exclusion is evicted, the event late alike.
func TestLinkRoutedToAnExcludedMemberIsNotEvictedByThatExclusion(t *testing.T) {
	for _, late := range []bool{true, false} {
		t.Run("event late "+strconv.FormatBool(late), func(t *testing.T) {
			a, closeA := blackholeOn(t, "127.0.0.2")
			_, bs := peersOn(t, faultpeer.Echo, "127.0.0.3")
			b := bs[0]
			h := startPool(t, policy.Pool{Endpoints: []string{a, b}, FailOpen: true}, nil, func(s *policy.Settings) {
				s.ConnectAttempts = 2
				s.ConnectTimeout = policy.Duration(time.Minute) // the connect to a ends when the test closes a
			})
			c := h.dial() // round-robin: a first
			waitFor(t, 5*time.Second, "the link connecting to a", func() bool {
				h.p.mu.Lock()
				ep := h.p.endpoints[a]
				h.p.mu.Unlock()
				return ep.liveLinks() == 1
			})
			// The link was accepted; now b and a leave routing.
			var wait func()
			if late {
				h.p.mu.Lock()
				wait = excludeHeld(t, h.p, b, a)
			} else {
				wait = excludeHeld(t, h.p, b, a)
				wait()
			}
			closeA() // the connect to a is refused; the retry fails open to b
			roundTrip(t, c, []byte("through b, excluded"))
			if late {
				h.p.mu.Unlock()
				wait()
			}
			lm := h.m.ForListener("test")
			if got := testutil.ToFloat64(lm.FailOpenLinks); got != 1 {
				t.Fatalf("fail_open_links_total = %v, want 1: the link's pick of b failed open", got)
			}
			if got := testutil.ToFloat64(lm.Evictions(metrics.EvictExcluded)); got != 0 {
				t.Fatalf("evictions_total{reason=excluded} = %v: the exclusion of b evicted the link routed to b after it", got)
			}
			roundTrip(t, c, []byte("after the exclusion was applied"))
			if !h.p.det.Enable(b, "") {
				t.Fatal("premise: b not readmitted")
			}
			if got := testutil.ToFloat64(lm.Evictions(metrics.EvictReadmitted)); got != 0 {
				t.Fatalf("evictions_total{reason=readmitted} = %v: the readmission of b evicted a link routed to b while it was out", got)
			}
			roundTrip(t, c, []byte("after the readmission"))
		})
	}
}

// The twin: a link routed to a member before its exclusion is evicted by
// it, the event delivered late alike.
func TestLinkRoutedBeforeTheExclusionIsEvictedByIt(t *testing.T) {
	_, bs := peersOn(t, faultpeer.Echo, "127.0.0.3")
	b := bs[0]
	h := startPool(t, policy.Pool{Endpoints: bs, FailOpen: true}, nil, nil)
	c := h.dial()
	roundTrip(t, c, []byte("through b, healthy"))
	h.p.mu.Lock()
	wait := excludeHeld(t, h.p, b)
	if got := testutil.ToFloat64(h.m.ForListener("test").Evictions(metrics.EvictExcluded)); got != 0 {
		h.p.mu.Unlock()
		t.Fatalf("premise: evicted before the event was delivered (%v)", got)
	}
	h.p.mu.Unlock()
	wait()
	if got := testutil.ToFloat64(h.m.ForListener("test").Evictions(metrics.EvictExcluded)); got != 1 {
		t.Fatalf("evictions_total{reason=excluded} = %v, want 1: the link routed to b before its exclusion", got)
	}
	if s := h.linkEndOf(c, 5*time.Second); s.Reason != CloseUnanswered {
		t.Fatalf("the link ended %s, want %s (evicted by the exclusion)", s.Reason, CloseUnanswered)
	}
}
