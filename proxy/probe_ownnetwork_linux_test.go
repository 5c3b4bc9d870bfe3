package proxy

import (
	"strings"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/policy"
)

// The probes of an excluded endpoint that fail at the proxy's own route
// lookup (its route to the endpoint removed: the connect fails at once,
// ENETUNREACH, with no route of its own there) ask nothing of the
// endpoint: they neither count as its failed probes nor grow its backoff,
// and the next comes at the initial delay. So an endpoint that recovered
// while the proxy's route was gone is readmitted at the first probe after
// the route's return, within the initial delay, not after a backoff grown
// through the outage. A pool member is probed on the backoff alone (the
// next member serves its clients: none wait), where the growth showed.
// Before, every such probe counted: failed_probes grew with each and the
// delay doubled. The twin: the member's host really dead (its packets
// dropped) behind a route the proxy keeps: its probes time out, count,
// and the backoff grows as before.
func TestProbesAtTheProxysOwnRouteDoNotBackOff(t *testing.T) {
	eachCut(t, []string{"route removed", "twin: member blackholed, route kept"}, probesAtOwnRouteGone)
}

func probesAtOwnRouteGone(t *testing.T, cut string) {
	const initial = 200 * time.Millisecond
	peer, link, far, _, h := farNearPool(t, "10.231.49", func(s *policy.Settings) {
		s.Detector.Probe = policy.ProbeKindConnect
		s.Detector.ProbeTimeout = policy.Duration(300 * time.Millisecond)
		s.Detector.InitialDelay = policy.Duration(initial)
		s.Detector.BackoffFactor = 2
		s.Detector.MaxDelay = policy.Duration(time.Minute)
		s.Detector.Jitter = 0
	})
	status := func() EndpointStatus {
		for _, ep := range h.p.Endpoints() {
			if ep.Endpoint == far.String() {
				return ep
			}
		}
		t.Fatalf("no endpoint %s", far)
		return EndpointStatus{}
	}
	// The far member's host answers its connects with an ICMP host
	// unreachable: it is excluded, and its probes fail and back off.
	unreachableAtPeer(t, peer)
	for i := 0; i < 4 && status().State != "excluded"; i++ {
		c := h.dial()
		roundTrip(t, c, []byte{byte(i)})
		_ = c.Close()
		h.linkEnd(5 * time.Second)
	}
	asleep := func(what string, cond func(EndpointStatus) bool) EndpointStatus {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			// NextProbe is set while the probe loop waits: every probe
			// begun before has its verdict.
			if st := status(); st.State == "excluded" && !st.NextProbe.IsZero() && cond(st) {
				return st
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: never; the far member %+v", what, status())
			}
		}
	}
	asleep("two failed probes of the excluded member", func(st EndpointStatus) bool { return st.FailedProbes >= 2 })

	// The member answers again only after the proxy's route is gone, and
	// its reject becomes a drop in one nft transaction: a probe between
	// two steps (the next comes 0.8 s after the last, and each step is a
	// command a loaded machine may take that long to run) never finds the
	// member answering and readmits it.
	twin := strings.HasPrefix(cut, "twin")
	if twin {
		// The member's host drops what comes to it; the route stays.
		if err := peer.NFT("flush chain inet lpka in\nadd rule inet lpka in tcp dport 9000 drop\n"); err != nil {
			t.Fatal(err)
		}
	} else {
		cutOwnRoute(t, cut, link)
		if _, err := peer.Run("", "nft", "delete", "table", "inet", "lpka"); err != nil {
			t.Fatal(err) // and the member answers again, unseen
		}
	}
	before := asleep("the probe loop waiting", func(EndpointStatus) bool { return true })

	// Longer than several backoff steps from before's (0.8 s, 1.6 s,
	// 3.2 s after two failed probes). Each next probe the loop plans
	// (NextProbe) is its delay or more after the one before (the end of
	// a probe, then the delay): a plan sooner after the last than the
	// backoff's delay shows the backoff did not hold.
	backoff := initial << before.FailedProbes
	outage := time.Now().Add(4 * time.Second)
	var plans []time.Time
	for time.Now().Before(outage) {
		if st := status(); !st.NextProbe.IsZero() && (len(plans) == 0 || !st.NextProbe.Equal(plans[len(plans)-1])) {
			plans = append(plans, st.NextProbe)
		}
		time.Sleep(10 * time.Millisecond)
	}
	gap := time.Duration(1<<63 - 1)
	for i := 1; i < len(plans); i++ {
		gap = min(gap, plans[i].Sub(plans[i-1]))
	}
	after := asleep("the probe loop waiting", func(EndpointStatus) bool { return true })
	t.Logf("%s for 4 s: failed probes %d before, %d after; %d probes planned meanwhile, the soonest %v after the one before (the backoff's delay: %v)",
		cut, before.FailedProbes, after.FailedProbes, len(plans)-1, gap.Round(time.Millisecond), backoff)
	if twin {
		if after.FailedProbes <= before.FailedProbes || gap < backoff {
			t.Fatalf("a dead member behind a route the proxy keeps: failed probes %d before, %d after 4 s, probes %v apart or more (the backoff's delay %v): its probes no longer count, or the backoff did not hold", before.FailedProbes, after.FailedProbes, gap, backoff)
		}
		if strings.HasPrefix(after.LastProbeError, health.OwnFailurePrefix) {
			t.Fatalf("a dead member behind a route the proxy keeps: last_probe_error %q calls its failure the proxy's own", after.LastProbeError)
		}
		return
	}
	if after.FailedProbes != before.FailedProbes || len(plans) < 2 {
		t.Fatalf("the proxy's own route gone for 4 s: failed probes %d before, %d after, %d probes planned: its own failure held against the member (or no probe ran)", before.FailedProbes, after.FailedProbes, len(plans)-1)
	}
	if gap >= backoff {
		t.Fatalf("the proxy's own route gone for 4 s: its probes came %v or more apart, the backoff's delay %v: not retried at the initial delay %v, the member readmitted only that long after the route's return", gap, backoff, initial)
	}
	if !strings.HasPrefix(after.LastProbeError, health.OwnFailurePrefix) {
		t.Fatalf("the proxy's own route gone for 4 s: last_probe_error %q, want it to say the failure is the proxy's own, not counted (an operator reads there why the member is not readmitted)", after.LastProbeError)
	}
	restored := time.Now()
	ip(t, "route", "add", link.LocalAddrs[0].Masked().String(), "dev", link.Local)
	for deadline := time.Now().Add(10 * time.Second); status().State != "healthy"; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the route back and the member answering, it is still %+v after 10 s", status())
		}
	}
	st := status()
	t.Logf("readmitted %v after the route's return, %d failed probes", time.Since(restored).Round(time.Millisecond), st.FailedProbes)
	if st.FailedProbes != before.FailedProbes {
		t.Fatalf("readmitted with %d failed probes, %d before the route went: a probe failed after its return", st.FailedProbes, before.FailedProbes)
	}
}

// So are the probes through the mesh of an endpoint behind a peer
// sidecar: one whose session dial fails at the proxy's own route to the
// peer sidecar (the session is dialled with the upstream's mark, as a
// link's) asks nothing of the endpoint and does not count as its failed
// probe. Before, each counted and grew its backoff. The endpoint is
// excluded first by the peer sidecar gone silent behind a route the proxy
// keeps (mesh_dead), whose probes time out and count.
func TestMeshProbesAtTheProxysOwnRouteDoNotCount(t *testing.T) {
	eachCut(t, []string{"route removed"}, meshProbesAtOwnRouteGone)
}

func meshProbesAtOwnRouteGone(t *testing.T, cut string) {
	pingTimeout := time.Second
	peer, link, in, eg := meshOverVeth(t, "10.231.50", pingTimeout, func(s *policy.Settings) {
		s.Detector.ProbeTimeout = policy.Duration(500 * time.Millisecond) // shorter than the second between probes while clients wait
		s.Detector.InitialDelay = policy.Duration(200 * time.Millisecond)
		s.Detector.BackoffFactor = 2
		s.Detector.MaxDelay = policy.Duration(time.Minute)
		s.Detector.Jitter = 0
	})
	c := eg.dial()
	roundTrip(t, c, []byte("hello"))
	dropMeshPort(t, peer, in.port)
	eg.linkEnd(pingTimeout + 10*time.Second)
	asleep := func(what string, cond func(EndpointStatus) bool) EndpointStatus {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if st := eg.endpoint(); st.State == "excluded" && !st.NextProbe.IsZero() && cond(st) {
				return st
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: never; the endpoint %+v", what, eg.endpoint())
			}
		}
	}
	asleep("a failed probe through the silent peer sidecar", func(st EndpointStatus) bool { return st.FailedProbes >= 1 })
	cutOwnRoute(t, cut, link)
	if _, err := peer.Run("", "nft", "delete", "table", "inet", "meshdrop"); err != nil {
		t.Fatal(err) // the peer sidecar answers again, unseen
	}
	before := asleep("the probe loop waiting", func(EndpointStatus) bool { return true })
	time.Sleep(3 * time.Second) // probes every 0.2 to 1 s meanwhile
	after := asleep("the probe loop waiting", func(EndpointStatus) bool { return true })
	t.Logf("%s to the peer sidecar for 3 s: failed probes %d before, %d after (last error %q)", cut, before.FailedProbes, after.FailedProbes, after.LastProbeError)
	if after.FailedProbes != before.FailedProbes {
		t.Fatalf("the proxy's own route to the peer sidecar gone: failed probes %d before, %d after 3 s: its own failure held against the endpoint", before.FailedProbes, after.FailedProbes)
	}
	if !strings.HasPrefix(after.LastProbeError, health.OwnFailurePrefix) {
		t.Fatalf("the proxy's own route to the peer sidecar gone: last_probe_error %q, want it to say the failure is the proxy's own, not counted", after.LastProbeError)
	}
	ip(t, "route", "add", link.LocalAddrs[0].Masked().String(), "dev", link.Local)
	for deadline := time.Now().Add(15 * time.Second); eg.endpoint().State != "healthy"; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the route back and the peer sidecar answering, the endpoint is still %+v after 15 s", eg.endpoint())
		}
	}
	if st := eg.endpoint(); st.FailedProbes != before.FailedProbes {
		t.Fatalf("readmitted with %d failed probes, %d before the route went", st.FailedProbes, before.FailedProbes)
	}
}
