//go:build linux

package proxy

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/dnstest"
	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// A pool member that leaves the DNS answer is detached under p.mu and
// forgotten after (pool.go drainMember: detachFromLocked, the "endpoint
// removed" log line, then p.forget). A refresh that has the member again
// in between makes a new endpoint of the address; the late forget leaves
// its detector state and its drain alone. Before (found by a review), it
// unregistered the new member (its failures went unreported) and marked
// its drain forgotten (it lapsed while it was a member). The log line,
// held by gateWriter, only widens the window the scheduler leaves open.
func TestForgetAfterRecreationSparesTheNewMember(t *testing.T) {
	peers, addrs := peersOn(t, faultpeer.Echo, "127.0.0.3")
	_ = peers
	port := netip.MustParseAddrPort(addrs[0]).Port()
	dead := fmt.Sprintf("127.0.0.2:%d", port)
	dns := dnstest.Start(t)
	setRecords(dns, "127.0.0.2", "127.0.0.3")

	g := &gateWriter{msg: "endpoint removed", reached: make(chan struct{}), release: make(chan struct{})}
	log := zerolog.New(g)
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	s.Detector.InitialDelay = policy.Duration(10 * time.Second)
	s.Detector.MaxDelay = policy.Duration(10 * time.Second)
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Settings: s,
		Pool: policy.Pool{DNS: fmt.Sprintf("pods.svc:%d", port), Refresh: policy.Duration(500 * time.Millisecond), Balance: policy.BalanceRoundRobin}}}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, cfg, Options{metrics: metrics.New(), Resolver: dns.Resolver(), Logger: &log})
	h := &harness{t: t, p: p, addr: p.Addr("test").String()}
	h.waitMembers([]string{dead, addrs[0]}, 3*time.Second)

	old := drainKeptFor.Load()
	drainKeptFor.Store(int64(500 * time.Millisecond))
	t.Cleanup(func() { drainKeptFor.Store(old) })
	if ok, _, err := p.Drain(dead); !ok || err != nil { // the operator drains it
		t.Fatalf("premise: drain %v %v", ok, err)
	}
	if !p.det.Report(dead, string(CloseDialError)) { // and it is dead
		t.Fatal("premise: exclusion")
	}

	setRecords(dns, "127.0.0.3") // one answer leaves it out: no links, its drain ends at once
	<-g.reached                  // detached and deleted from p.endpoints; forget not run yet
	setRecords(dns, "127.0.0.2", "127.0.0.3")
	h.waitMembers([]string{dead, addrs[0]}, 3*time.Second) // re-created meanwhile
	time.Sleep(50 * time.Millisecond)                      // past the refresh that re-created it
	close(g.release)                                       // the late forget runs
	time.Sleep(50 * time.Millisecond)

	h.waitMembers([]string{dead, addrs[0]}, time.Second) // still a member, routed to
	st, registered := p.det.State(dead)
	if !registered {
		p.mu.Lock()
		ep := p.endpoints[dead]
		p.mu.Unlock()
		t.Errorf("%s is a pool member unknown to the detector (the late forget unregistered the re-created endpoint): routed as %v, a dial_error report taken: %v (until the next refresh re-registers it)",
			dead, p.routingState(ep), p.det.Report(dead, string(CloseDialError)))
	} else if st != health.Excluded {
		t.Errorf("%s is %v, want excluded", dead, st)
	}
	time.Sleep(600 * time.Millisecond) // past drainKeptFor
	if !p.isDrained(dead) {
		t.Errorf("%s, drained by the operator and a pool member, is no longer drained %v later: the late forget marked the re-created endpoint's drain forgotten", dead, 800*time.Millisecond)
	}
}
