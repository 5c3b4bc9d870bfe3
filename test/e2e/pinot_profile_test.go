//go:build linux

package e2e

import (
	"context"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// pinotQueryTimeout is Pinot's default broker query timeout
// (pinot.broker.timeoutMs); the simulated broker sends the remaining
// budget as the timeoutMs query option, as Pinot does.
const pinotQueryTimeout = 10 * time.Second

// queryBurst sends n queries at once through addr and returns their
// outcomes.
func queryBurst(t *testing.T, b *pinotsim.Broker, addr string, n int) map[pinotsim.Outcome]int {
	t.Helper()
	var mu sync.Mutex
	out := map[pinotsim.Outcome]int{}
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := b.Query(context.Background(), addr)
			mu.Lock()
			out[r.Outcome]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out
}

// defaultsWith returns the default settings with framing type framing and
// only what a test cannot leave at its default.
func defaultsWith(framing string) policy.Settings {
	s := policy.DefaultSettings()
	s.Framing.Type = framing
	return s
}

// Five queries in flight at once, each answered after 5 s, well within
// their own 10 s timeout (beyond the 3 s request_timeout): with the default
// configuration, in the pinot profile and in length_field framing, none is
// lost and the server is never excluded. (Before protocol profiles, the
// length_field listener excluded the server and lost all five.)
func TestPinotSlowQueriesWithinTheirTimeout(t *testing.T) {
	for _, framing := range []string{policy.FramingPinot, policy.FramingLengthField} {
		t.Run(framing, func(t *testing.T) {
			t.Parallel()
			srv, err := pinotsim.NewServer(pinotsim.ServerConfig{Delay: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = srv.Close() })
			pp := startPinotProxy(t, srv.Addr(), defaultsWith(framing))
			b := pinotsim.NewBroker(pinotsim.BrokerConfig{Timeout: pinotQueryTimeout})
			t.Cleanup(func() { _ = b.Close() })
			w := watchEndpoint(t, pp, 30*time.Second)

			got := queryBurst(t, b, pp.addr, 5)
			time.Sleep(time.Second) // past the queries' own deadlines plus the judging slack
			w.Stop()
			if got[pinotsim.OK] != 5 {
				t.Fatalf("queries: %s; want 5 ok", fmtOutcomes(got))
			}
			for _, c := range w.Snapshot() {
				if c.State != "healthy" {
					t.Fatalf("endpoint %s (%s): %+v", c.State, c.Reason, w.Snapshot())
				}
			}
			if n := pp.counter(t, "unanswered_timeouts_total", "", ""); n != 0 {
				t.Fatalf("unanswered_timeouts_total = %v, want 0", n)
			}
			if ends := pp.links.All(); len(ends) != 0 {
				t.Fatalf("%d links ended (first: %s), want none", len(ends), ends[0].Reason)
			}
		})
	}
}

// The detection twin: the same five queries to a server process that is
// stopped (its kernel still ACKs) are counted at their own deadline,
// timeoutMs plus one second, and the default threshold of five excludes
// the server. The pinot profile's probe (GET /health on the admin port)
// keeps it excluded while it is stopped.
func TestPinotStoppedServerExcludedAtQueryTimeout(t *testing.T) {
	sp := startServerProcess(t)
	s := defaultsWith(policy.FramingPinot)
	port, err := strconv.Atoi(splitPort(t, sp.health))
	if err != nil {
		t.Fatal(err)
	}
	s.Detector.HTTP.Port = port // the child's admin port; Pinot's is 8097
	s.Detector.Jitter = 0
	pp := startPinotProxy(t, sp.addr, s)
	b := pinotsim.NewBroker(pinotsim.BrokerConfig{Timeout: pinotQueryTimeout})
	t.Cleanup(func() { _ = b.Close() })
	if got := queryBurst(t, b, pp.addr, 1); got[pinotsim.OK] != 1 {
		t.Fatalf("warm-up query: %s", fmtOutcomes(got))
	}
	w := watchEndpoint(t, pp, 40*time.Second)

	sp.sigstop(t, "server")
	sent := time.Now()
	got := queryBurst(t, b, pp.addr, 5) // each times out at the broker after 10s
	if got[pinotsim.OK] != 0 {
		t.Fatalf("queries to a stopped server: %s", fmtOutcomes(got))
	}
	ex := waitExcluded(t, pp, w, sent, 5*time.Second, "the queries' timeout")
	after := ex.At.Sub(sent)
	t.Logf("excluded %v after the queries were sent (reason %s)", ms(after), ex.Reason)
	// Not before the queries' own deadline (timeoutMs + 1s), and within the
	// judging slack and scheduling after it.
	if after < pinotQueryTimeout+time.Second || after > pinotQueryTimeout+3*time.Second {
		t.Errorf("excluded %v after the queries, want between %v and %v", ms(after),
			pinotQueryTimeout+time.Second, pinotQueryTimeout+3*time.Second)
	}
	if ex.Reason != string(proxy.CloseUnanswered) {
		t.Errorf("excluded for %q, want unanswered", ex.Reason)
	}
	// The http probe needs the process: it fails (each after its own
	// timeout, so when depends on the machine's pace), and the endpoint
	// stays excluded meanwhile.
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		st := pp.state()
		if st.State != "excluded" {
			t.Fatalf("while stopped: %+v, want excluded", st)
		}
		if st.FailedProbes >= 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("while stopped: %+v, want failed probes within 20s", st)
		}
	}
	sp.signal(t, syscall.SIGCONT)
	if !pp.waitState("healthy", 15*time.Second) {
		t.Fatalf("not readmitted after SIGCONT: %+v", pp.state())
	}
	w.Stop()
}
