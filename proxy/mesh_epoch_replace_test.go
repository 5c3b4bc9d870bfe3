package proxy

import (
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
)

// A refusal seen only by the ingress a reload replaced still draws a new
// epoch (the memo records refusals). Was: the old ingress saw the port refuse (pc.refused), the server came
// back, and the reload replaced the ingress before the old one checked
// again. The new ingress takes the memo's epoch with a fresh portCheck
// (refused false) and keeps the old epoch: README "drawn again when it
// turns ready after refusing connections" does not hold.
func TestMeshReplacedIngressRefusalSeenByTheOldOne(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	addr := srv.Addr()
	listen := net.JoinHostPort("127.0.0.2", strconv.Itoa(refusingPort(t, "127.0.0.2")))
	in := startIngressL(t, "127.0.0.2", addr, func(l *policy.Listener) {
		l.Listen = listen
		l.Ingress.CheckInterval = policy.Duration(time.Hour) // checks at start and when kicked only
	})
	eg := startEgress(t, addr, in.port, nil)
	roundTrip(t, eg.dial(), []byte("before"))
	pr := eg.p.meshPeer("127.0.0.2", in.port)
	_, sp, _ := net.SplitHostPort(addr)
	n, _ := strconv.Atoi(sp)
	first := waitEpoch(t, pr, uint16(n))

	srv.Close()
	old := in.p.listeners[0].ingress
	old.kickCheck() // as a link to the server that failed does
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		old.mu.Lock()
		refused := old.checks[uint16(n)].refused
		old.mu.Unlock()
		if refused {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("premise: the old ingress did not see the port refuse")
		}
	}
	ready := func() bool {
		pr.mu.Lock()
		defer pr.mu.Unlock()
		return pr.status[uint16(n)].Ready
	}
	for deadline := time.Now().Add(5 * time.Second); ready(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("premise: the egress did not hear the port not ready")
		}
	}
	faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: addr}) // the server, restarted
	in.rename(t)
	for deadline := time.Now().Add(5 * time.Second); !ready(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the egress did not hear the port ready from the new ingress")
		}
	}
	eg.waitReadmittedOf(addr, 10*time.Second)
	if got := pr.epochOf(uint16(n)); got == first {
		t.Fatalf("epoch %d unchanged after the server refused (seen by the old ingress) and came back under a replaced ingress", got)
	}
}
