//go:build linux

package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/livenessproxy/livenessproxy/proxy"
)

// TestKafkaStoppedBrokerExcluded (kafka profile only) stops the broker
// process with SIGSTOP while a consumer group and a producer run through
// the proxy, and continues it later. A stopped process's kernel keeps
// ACKing and completing handshakes, so only requests that go unanswered
// past their deadline reveal it; under the kafka profile a request's
// deadline is request_timeout plus the hold it asks for.
//
// Traffic: six consumers in one group on a six-partition topic (Fetch
// max_wait_ms 5 s, heartbeats every second, autocommit) and an acks=1
// producer without idempotence (one Produce in flight, timeout_ms 4 s)
// sending a record every 100 ms, round robin over the partitions. The
// longest legitimate hold of any request is max(Fetch 5 s, Produce 4 s,
// OffsetCommit/Heartbeat 5 s: offsets.commit.timeout.ms).
//
// Which requests reveal the stop: under the profile's rule a request counts
// only if the endpoint answered nothing at all after it was sent. Held
// Fetches alone are not a reliable trigger: with records flowing each
// consumer's Fetch is sent just after its previous answer, interleaved
// with the other consumers' answers. What a running Kafka client keeps
// sending after the stop, whatever was answered last, are the group's
// heartbeats (one per member within a heartbeat interval, none queued
// behind another request) and commits, so the consecutive threshold is
// reached by the heartbeats if not sooner (checked: six members >= the
// threshold).
//
// Asserted, from the proxy's own records:
//   - excluded (reason unanswered), the exclusion's recorded since no later
//     than SIGSTOP + heartbeat interval (by when every request that can
//     count has been sent) + longest hold + request_timeout + 1 s of
//     judging slack, and no sooner than request_timeout - 1 s (no request
//     outstanding at the stop has an earlier deadline);
//   - a new TCP connect to the listener is refused (ECONNREFUSED) while
//     excluded (on_excluded: refuse, the default);
//   - it stays excluded until at least 3 probes failed (the detector probes
//     at a fixed 1 s interval here), and no probe succeeds: the profile's
//     default probe needs the broker process to answer (ApiVersions),
//     whereas a plain TCP connect to the stopped broker succeeds (checked:
//     the premise that a connect probe would readmit it);
//   - after SIGCONT it is readmitted within one probe interval + the probe
//     timeout (+ 2 s), and one record produced to each partition through
//     the proxy reaches the group again.
//
// TestKafkaLongPollConsumers, TestKafkaAcksZeroProducer and
// TestKafkaGroupJoinWaitsOnSlowMember are its healthy twins: the same
// kinds of held and unanswered-by-design requests with the broker running
// exclude nothing.
func TestKafkaStoppedBrokerExcluded(t *testing.T) {
	for _, mode := range kafkaModes {
		if mode.framing != "kafka" {
			continue
		}
		t.Run(mode.name, func(t *testing.T) { kafkaStoppedBrokerExcluded(t, mode) })
	}
}

func kafkaStoppedBrokerExcluded(t *testing.T, mode kafkaMode) {
	const (
		topic          = "stopped"
		group          = "stopped-group"
		consumers      = 6 // and partitions
		fetchWait      = 5 * time.Second
		heartbeat      = time.Second
		produceTimeout = 4 * time.Second
		produceEvery   = 100 * time.Millisecond
		// coordinatorWrite is offsets.commit.timeout.ms (broker default):
		// how long the coordinator may take to answer an OffsetCommit
		// or a Heartbeat, which carry no timeout field of their own.
		coordinatorWrite = 5 * time.Second
		judgingSlack     = time.Second
		minProbes        = 3
	)
	// Probe every second (no backoff, no jitter) so that three failed
	// probes fit in a short test; the probe kind is left to the profile.
	r := startKafkaRun(t, mode, fmt.Sprintf("%s:%d", topic, consumers),
		"  detector: {initial_delay: 1s, backoff_factor: 1, max_delay: 1s, jitter: 0}\n", 90*time.Second)
	start, kb, pp, w := r.start, r.kb, r.pp, r.w
	s := listenerSettings(r.cfg)
	rt := s.Unanswered.RequestTimeout.D()
	threshold := s.Unanswered.ConsecutiveTimeoutsThreshold
	interval, probeTimeout := s.Detector.InitialDelay.D(), s.Detector.ProbeTimeout.D()
	t.Logf("kafka profile: request_timeout %v, threshold %d, probe %q every %v (timeout %v), on_excluded %s",
		rt, threshold, s.Detector.Probe, interval, probeTimeout, s.OnExcluded)
	if threshold <= 0 || threshold > consumers {
		t.Fatalf("consecutive_timeouts_threshold %d: the %d members' heartbeats cannot reach it; adjust the test", threshold, consumers)
	}
	// Every request that can count was sent by one heartbeat interval
	// after SIGSTOP (the held Fetches and the Produce before it, each
	// member's next heartbeat within the interval), and none may be held
	// longer than maxHold.
	maxHold := max(fetchWait, produceTimeout, coordinatorWrite)
	bound := heartbeat + maxHold + rt + judgingSlack

	members := make([]*groupMember, consumers)
	cs := make([]*kafkaConsumer, consumers)
	for i := range cs {
		members[i] = &groupMember{}
		cs[i] = startKafkaConsumer(t, fmt.Sprintf("stopped-%d", i), pp.addr,
			kgo.ConsumeTopics(topic), kgo.ConsumerGroup(group), kgo.FetchMaxWait(fetchWait),
			kgo.HeartbeatInterval(heartbeat),
			kgo.OnPartitionsAssigned(members[i].onAssigned), kgo.OnPartitionsRevoked(members[i].onRevoked))
	}
	producer := newKafkaClient(t, "stopped-producer", pp.addr,
		kgo.DefaultProduceTopic(topic),
		kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.RequiredAcks(kgo.LeaderAck()),
		kgo.DisableIdempotentWrite(),
		kgo.MaxProduceRequestsInflightPerBroker(1),
		kgo.ProduceRequestTimeout(produceTimeout),
		kgo.ProducerLinger(0),
	)
	var (
		mu       sync.Mutex
		acked    int
		failures int
	)
	quit, produced := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(produced)
		tick := time.NewTicker(produceEvery)
		defer tick.Stop()
		for n := 0; ; n++ {
			select {
			case <-quit:
				return
			case <-tick.C:
			}
			r := &kgo.Record{Partition: int32(n % consumers), Value: []byte(fmt.Sprintf("load-%05d", n))}
			producer.Produce(context.Background(), r, func(_ *kgo.Record, err error) {
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					failures++
				} else {
					acked++
				}
			})
		}
	}()
	t.Cleanup(func() { close(quit); <-produced }) // before the producer closes
	// Continue the broker before the clients close (a failure while it is
	// stopped); kill continues it too, but runs last.
	t.Cleanup(func() { _ = syscall.Kill(kb.pid, syscall.SIGCONT) })

	// Warm up: the group is stable with a partition per member, every
	// member fetches, and produces are acked.
	if !waitAll(consumers, 30*time.Second, func(i int) bool {
		return members[i].partitions(topic) == 1 && cs[i].hooks.wrote(keyFetch)
	}) {
		for i := range cs {
			t.Logf("member %d owns %d partitions", i, members[i].partitions(topic))
		}
		t.Fatalf("the group did not settle on a partition per member within 30s")
	}
	if !waitAll(1, 15*time.Second, func(int) bool { mu.Lock(); defer mu.Unlock(); return acked >= 10 }) {
		t.Fatalf("fewer than 10 records acked within 15s")
	}
	time.Sleep(time.Second)
	if st := pp.state(); st.State != "healthy" {
		t.Fatalf("endpoint %s (reason %s) before the stop", st.State, st.Reason)
	}
	// (franz-go closes a fetch connection itself to abandon the fetch in
	// flight when a rebalance revokes partitions: client_closed.)
	if reasons, _ := pp.links.Before(time.Now()); len(reasons) > 0 && (len(reasons) > 1 || reasons[string(proxy.CloseClientClosed)] == 0) {
		t.Fatalf("links cut before the stop: %v", reasons)
	}

	stopAt := time.Now()
	kb.sigstop(t, "broker")
	stoppedAt := time.Now() // the broker is in state T from here (a loaded machine may take a while)
	t.Logf("SIGSTOP at +%v; exclusion bound %v (heartbeat %v + hold %v + request_timeout %v + %v)",
		ms(stopAt.Sub(start)), bound, heartbeat, maxHold, rt, judgingSlack)

	// The premise: the stopped broker's kernel completes a handshake, so
	// a connect probe would pass.
	if c, err := net.DialTimeout("tcp", kb.addr, time.Second); err != nil {
		t.Errorf("a TCP connect to the stopped broker failed (%v): the premise that a connect probe would pass does not hold", err)
	} else {
		_ = c.Close()
	}

	ex := waitExcluded(t, pp, w, stopAt, bound+5*time.Second, "SIGSTOP")
	excludedAfter := ex.At.Sub(stopAt)
	t.Logf("excluded %v after SIGSTOP (reason %s)", ms(excludedAfter), ex.Reason)
	// What the clients sent between the stop and the exclusion.
	sentAfter := map[int16][]time.Duration{}
	hooks := []*clientHooks{producer.hooks}
	for _, c := range cs {
		hooks = append(hooks, c.hooks)
	}
	for _, h := range hooks {
		for _, e := range h.since(&h.writes, stopAt) {
			if e.At.Before(ex.At) {
				sentAfter[e.Key] = append(sentAfter[e.Key], ms(e.At.Sub(stopAt)))
			}
		}
	}
	t.Logf("requests written between SIGSTOP and the exclusion, by API key: %v", sentAfter)
	// The upper bound counts from when the broker was seen stopped (it
	// answered until then, however long the stop took to take effect),
	// the lower one from before the signal.
	if d := ex.At.Sub(stoppedAt); d > bound {
		t.Errorf("excluded %v after the broker was stopped (%v after SIGSTOP), want <= %v", ms(d), ms(excludedAfter), bound)
	}
	if excludedAfter < rt-time.Second {
		t.Errorf("excluded %v after SIGSTOP, before any request outstanding at the stop reached its deadline (>= %v)", ms(excludedAfter), rt-time.Second)
	}
	if ex.Reason != string(proxy.CloseUnanswered) {
		t.Errorf("excluded for %q, want %q", ex.Reason, proxy.CloseUnanswered)
	}

	// Refused while excluded: the listener stops listening once the
	// exclusion is applied (a connection accepted in the instant before is
	// reset instead), so within a moment of it a connect is refused.
	refused, resets := false, 0
	var lastErr error
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline) && pp.state().State == "excluded"; {
		c, err := net.DialTimeout("tcp", pp.addr, time.Second)
		if c != nil {
			_ = c.Close()
		}
		lastErr = err
		if errors.Is(err, syscall.ECONNREFUSED) {
			refused = true
			break
		}
		if errors.Is(err, syscall.ECONNRESET) {
			resets++
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !refused {
		t.Errorf("no connect to the listener was refused within 2s of the exclusion (last: %v, %d reset); want ECONNREFUSED", lastErr, resets)
	}

	// Stays excluded while probes fail.
	probesBound := minProbes*(interval+probeTimeout) + 5*time.Second
	if !waitAll(1, probesBound, func(int) bool {
		st := pp.state()
		return st.FailedProbes >= minProbes || st.State != "excluded"
	}) {
		t.Errorf("fewer than %d failed probes %v after the exclusion: %+v", minProbes, probesBound, pp.state())
	}
	atCont := pp.state()
	// Read before SIGCONT: the probe waiting on the stopped broker then
	// succeeds at once (probes run back to back while clients wait).
	okWhileStopped := pp.counter(t, "probes_total", "result", "ok")
	contAt := time.Now()
	kb.signal(t, syscall.SIGCONT)
	if !kb.waitProcState("S", 2*time.Second) && kb.procState() == "T" {
		t.Fatalf("broker process %d still stopped after SIGCONT", kb.pid)
	}
	t.Logf("SIGCONT %v after the exclusion: %s, %d failed probes (last error %q)",
		ms(contAt.Sub(ex.At)), atCont.State, atCont.FailedProbes, atCont.LastProbeError)
	if atCont.State != "excluded" || atCont.FailedProbes < minProbes {
		t.Errorf("at SIGCONT the endpoint is %s with %d failed probes, want excluded with >= %d", atCont.State, atCont.FailedProbes, minProbes)
	}
	if d := contAt.Sub(ex.At); d < minProbes*interval {
		t.Errorf("excluded for only %v before SIGCONT, want >= %d probe intervals (%v)", ms(d), minProbes, minProbes*interval)
	}
	for _, c := range w.Snapshot() {
		if c.At.After(ex.At) && c.At.Before(contAt) {
			t.Errorf("state %s at +%v while the broker was stopped (reason %s): want excluded throughout", c.State, ms(c.At.Sub(stopAt)), c.Reason)
		}
	}
	if okWhileStopped != 0 {
		t.Errorf("%v probes succeeded against the stopped broker", okWhileStopped)
	}

	// Readmitted at the next probe, and records flow again.
	readmitBound := interval + probeTimeout + 2*time.Second
	if !pp.waitState("healthy", readmitBound+5*time.Second) {
		t.Fatalf("endpoint not healthy %v after SIGCONT: %+v", readmitBound+5*time.Second, pp.state())
	}
	back, ok := w.FirstAfter(contAt, "healthy", 200*time.Millisecond)
	if !ok {
		back = stateChange{At: pp.state().Since}
	}
	t.Logf("readmitted %v after SIGCONT", ms(back.At.Sub(contAt)))
	if d := back.At.Sub(contAt); d > readmitBound {
		t.Errorf("readmitted %v after SIGCONT, want <= %v (probe interval %v + probe timeout %v + 2s)", ms(d), readmitBound, interval, probeTimeout)
	}
	markers := make([]string, consumers)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	for p := range markers {
		markers[p] = fmt.Sprintf("after-sigcont-%d", p)
		r := &kgo.Record{Partition: int32(p), Value: []byte(markers[p])}
		if err := producer.ProduceSync(ctx, r).FirstErr(); err != nil {
			t.Errorf("producing %s after SIGCONT: %v", markers[p], err)
		}
	}
	cancel()
	groupGot := func() []string {
		var all []string
		for _, c := range cs {
			all = append(all, c.got()...)
		}
		return all
	}
	if !waitAll(1, 20*time.Second, func(int) bool {
		have := map[string]bool{}
		for _, v := range groupGot() {
			have[v] = true
		}
		for _, m := range markers {
			if !have[m] {
				return false
			}
		}
		return true
	}) {
		for i, c := range cs {
			t.Logf("client %s: owns %d partitions, %d fetch errors", c.hooks.name, members[i].partitions(topic), len(c.fetchErrors()))
		}
		t.Errorf("the group did not receive the %d records produced after SIGCONT within 20s", len(markers))
	}
	t.Logf("round trip after SIGCONT done %v after SIGCONT", ms(time.Since(contAt)))

	w.Stop()
	for _, c := range w.Snapshot() {
		t.Logf("state %-8s at %+8v (reason %s)", c.State, ms(c.At.Sub(stopAt)), c.Reason)
	}
	mu.Lock()
	t.Logf("producer: %d records acked, %d failed", acked, failures)
	mu.Unlock()
	logProxyCounters(t, pp)
}
