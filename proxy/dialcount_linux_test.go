//go:build linux

package proxy

import (
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/policy"
)

// blipListener is a live server whose accept queue is full for a moment
// (a backlog of 0 whose one slot is taken: SYNs are dropped), after which
// it accepts everything until the test ends: resume starts accepting.
func blipListener(t *testing.T) (addr string, resume func()) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, _ := unix.Getsockname(fd)
	addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*unix.SockaddrInet4).Port))
	for range 2 { // fill the queue
		if c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond); err == nil {
			t.Cleanup(func() { _ = c.Close() })
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var accepted []int
	t.Cleanup(func() {
		close(stop)
		wg.Wait()
		for _, a := range accepted {
			_ = unix.Close(a)
		}
		_ = unix.Close(fd)
	})
	var once sync.Once
	resume = func() {
		once.Do(func() {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					if a, _, err := unix.Accept(fd); err == nil {
						accepted = append(accepted, a)
						continue
					}
					time.Sleep(2 * time.Millisecond)
				}
			})
		})
	}
	return addr, resume
}

// A connect timeout is held against an endpoint only as the second in a
// row: one can be one lost SYN. Two clients that connect at the same
// moment, while a live server's accept queue is full for 100 ms, each
// lose one SYN: their connects overlap, neither follows the other, and
// the server accepts again 100 ms later. They are one timeout, as one
// client's is: nothing is excluded, and each link's next attempt
// connects. Before, the second of the two overlapping timeouts excluded
// the endpoint (dial_error) and reset both clients (found by a helper's
// audit). Sequential timeouts still exclude: TestFrozenProxyBlamesNoUpstream's
// twin and TestEndpointWhoseConnectsAllFailIsExcluded (e2e).
func TestConcurrentConnectTimeoutsAreNotTwoInARow(t *testing.T) {
	// One client: the premise (its one lost SYN excludes nothing). Two
	// clients at once: the same moment.
	for _, clients := range []int{1, 2} {
		t.Run(strconv.Itoa(clients)+" clients", func(t *testing.T) {
			if reason := blipWithClients(t, clients); reason != "" {
				t.Fatalf("a live server whose accept queue was full for 100 ms was excluded (%s) with %d client(s) connecting at once: overlapping connect timeouts were counted as timeouts in a row",
					reason, clients)
			}
		})
	}
}

// blipWithClients connects clients at once through a proxy to a server
// whose accept queue is full for 100 ms, and returns the reason the
// endpoint was excluded within 2.5 s ("" if it was not).
func blipWithClients(t *testing.T, clients int) string {
	addr, resume := blipListener(t)
	h := start(t, addr, func(s *policy.Settings) {
		s.ConnectTimeout = policy.Duration(800 * time.Millisecond) // below the 1 s SYN retransmission: a lost SYN is a timeout
	})
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			c, err := net.Dial("tcp", h.addr)
			if err != nil {
				return
			}
			defer c.Close()
			_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
			_, _ = c.Read(make([]byte, 1))
		})
	}
	time.Sleep(100 * time.Millisecond)
	resume() // the server accepts again: 100 ms of a full queue
	defer wg.Wait()
	for end := time.Now().Add(2500 * time.Millisecond); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		for _, ep := range h.p.Endpoints() {
			if ep.Endpoint == addr && (ep.State == "excluded" || ep.Reason == health.ReasonProbeOK) {
				return ep.Reason
			}
		}
	}
	return ""
}
