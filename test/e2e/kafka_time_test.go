//go:build linux

package e2e

import (
	"context"
	"fmt"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// Issue 19: detection by the clock a client waits by, whatever the
// client's request rate, and readmission within a second of recovery.
// Every test here runs the kafka profile with the proxy's defaults (the
// detector's schedule aside where said), a real client library
// (franz-go) and a kfake broker in a child process that is stopped with
// SIGSTOP (its kernel keeps ACKing).

// kafkaProfileMode is the kafka profile, the mode these tests are about.
var kafkaProfileMode = kafkaMode{"kafka", "kafka"}

// judgingInterval is the most a verdict may come after the deadline it
// judges: the tracker's slack is 100 ms at most; the rest is room for a
// busy machine, within the bound of one second.
const judgingInterval = time.Second

// TestKafkaStoppedBrokerExcludedByTheClock stops the broker under three
// kinds of client and measures the exclusion from the stop: it must come
// within the earliest deadline of the requests outstanding at the stop
// plus one judging interval, however few requests the clients send.
//   - one_fetch: one consumer, no group, one connection with a single
//     Fetch in flight (max_wait 500 ms, the Java default), nothing else:
//     within 500 ms + request_timeout + 1 s. (Before: never, until the
//     client's own timeout; the count of 5 was never reached.)
//   - long_poll: a group consumer with 5 s long polls (heartbeats every
//     3 s) alone: within 5 s + request_timeout + 1 s.
//   - pipelining: an idempotent acks=all producer (franz-go's defaults)
//     with up to five Produce requests in flight on one connection (timeout_ms 10 s, franz-go's
//     default), a record every 100 ms: within the first request's
//     deadline (10 s + request_timeout) + 1 s, not five times it.
func TestKafkaStoppedBrokerExcludedByTheClock(t *testing.T) {
	const topic = "clock"
	cases := []struct {
		name string
		// clients starts the traffic and returns the longest hold of a
		// request outstanding at the stop, a warm-up condition, and, when
		// the bound counts from the first request outstanding at the stop
		// rather than from the stop, when that request was written.
		clients func(t *testing.T, addr string) (hold time.Duration, ready func() bool, first func(stop time.Time) time.Time)
	}{
		{"one_fetch", func(t *testing.T, addr string) (time.Duration, func() bool, func(time.Time) time.Time) {
			const wait = 500 * time.Millisecond
			c := startKafkaConsumer(t, "one-fetch", addr, kgo.ConsumeTopics(topic), kgo.FetchMaxWait(wait))
			return wait, func() bool {
				ok, _ := c.hooks.answered(keyFetch, time.Time{}, time.Now())
				return len(ok) >= 3
			}, nil
		}},
		{"long_poll", func(t *testing.T, addr string) (time.Duration, func() bool, func(time.Time) time.Time) {
			const wait = 5 * time.Second
			m := &groupMember{}
			c := startKafkaConsumer(t, "long-poll", addr, kgo.ConsumeTopics(topic), kgo.ConsumerGroup("clock-group"),
				kgo.FetchMaxWait(wait), kgo.OnPartitionsAssigned(m.onAssigned), kgo.OnPartitionsRevoked(m.onRevoked))
			return wait, func() bool { return m.partitions(topic) == 1 && c.hooks.wrote(keyFetch) }, nil
		}},
		{"pipelining", func(t *testing.T, addr string) (time.Duration, func() bool, func(time.Time) time.Time) {
			const timeout = 10 * time.Second // franz-go's default ProduceRequestTimeout
			// Idempotent (the default): franz-go keeps up to five Produce
			// requests in flight per broker.
			p := newKafkaClient(t, "pipelining", addr, kgo.DefaultProduceTopic(topic), kgo.ProducerLinger(0))
			var mu sync.Mutex
			acked := 0
			stop := make(chan struct{})
			done := make(chan struct{})
			go func() {
				defer close(done)
				tick := time.NewTicker(100 * time.Millisecond)
				defer tick.Stop()
				for n := 0; n < 1200; n++ { // two minutes at most
					select {
					case <-stop:
						return
					case <-tick.C:
					}
					p.Produce(context.Background(), &kgo.Record{Value: fmt.Appendf(nil, "r%d", n)}, func(_ *kgo.Record, err error) {
						if err == nil {
							mu.Lock()
							acked++
							mu.Unlock()
						}
					})
				}
			}()
			t.Cleanup(func() { close(stop); <-done })
			// The first Produce outstanding at the stop: franz-go writes
			// them on one connection, which the broker answers in order,
			// so it is the first written after those answered before.
			first := func(stopAt time.Time) time.Time {
				// (Answers the broker sent before it stopped may be read
				// a moment after.)
				answered, _ := p.hooks.answered(keyProduce, time.Time{}, stopAt.Add(200*time.Millisecond))
				var writes []hookEvent
				for _, e := range p.hooks.since(&p.hooks.writes, time.Time{}) {
					if e.Key == keyProduce && e.Err == nil {
						writes = append(writes, e)
					}
				}
				if len(answered) < len(writes) {
					return writes[len(answered)].At
				}
				return stopAt
			}
			return timeout, func() bool { mu.Lock(); defer mu.Unlock(); return acked >= 10 }, first
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := startKafkaRun(t, kafkaProfileMode, topic, "", 2*time.Minute)
			t.Cleanup(func() { _ = syscall.Kill(r.kb.pid, syscall.SIGCONT) }) // before the clients close
			rt := r.requestTimeout()
			hold, ready, first := tc.clients(t, r.pp.addr)
			if !waitAll(1, 30*time.Second, func(int) bool { return ready() }) {
				t.Fatal("the clients did not warm up within 30s")
			}
			time.Sleep(500 * time.Millisecond)
			if st := r.pp.state(); st.State != "healthy" {
				t.Fatalf("endpoint %s (%s) before the stop", st.State, st.Reason)
			}
			bound := hold + rt + judgingInterval
			stopAt := time.Now()
			r.kb.sigstop(t, "broker")
			stoppedAt := time.Now() // the broker is in state T from here (a loaded machine may take a while)
			ex := waitExcluded(t, r.pp, r.w, stopAt, bound+20*time.Second, "SIGSTOP")
			after := ex.At.Sub(stopAt)
			st := r.pp.state()
			// The upper bound counts from when the broker was seen stopped
			// (it answered until then), the lower one from the signal.
			from, what := stoppedAt, "the broker was stopped"
			if first != nil {
				from, what = first(stopAt), "the first request outstanding at the stop"
			}
			t.Logf("%s: excluded %v after SIGSTOP, %v after %s (bound %v = hold %v + request_timeout %v + %v); evidence since +%v: %s",
				tc.name, ms(after), ms(ex.At.Sub(from)), what, bound, hold, rt, judgingInterval, ms(st.EvidenceSince.Sub(stopAt)), st.Evidence)
			if d := ex.At.Sub(from); d > bound {
				t.Errorf("excluded %v after %s, want within %v", ms(d), what, bound)
			}
			if after < rt-judgingInterval {
				t.Errorf("excluded %v after SIGSTOP, before any outstanding request could be due (request_timeout %v)", ms(after), rt)
			}
			if ex.Reason != string(proxy.CloseUnanswered) {
				t.Errorf("excluded for %q, want unanswered", ex.Reason)
			}
			if st.Evidence == "" || st.EvidenceSince.IsZero() || st.EvidenceSince.After(ex.At) {
				t.Errorf("status %+v: want the exclusion's evidence, starting before it", st)
			}
		})
	}
}

// TestKafkaReadmittedWithinASecond: a broker stopped long enough for the
// probe backoff to reach max_delay and stay there four times over is
// readmitted within probe_timeout + 1 s of SIGCONT, because its clients
// are being turned away (the listener is paused: on_excluded: refuse)
// and an endpoint clients wait for is probed every second; meanwhile
// the stopped broker got about one probe a second, no more. A client
// that connects then is served.
func TestKafkaReadmittedWithinASecond(t *testing.T) {
	const (
		topic    = "readmit"
		maxDelay = 5 * time.Second
	)
	r := startKafkaRun(t, kafkaProfileMode, topic, fmt.Sprintf("  detector: {max_delay: %v}\n", maxDelay), 3*time.Minute)
	t.Cleanup(func() { _ = syscall.Kill(r.kb.pid, syscall.SIGCONT) })
	s := listenerSettings(r.cfg)
	probeTimeout := s.Detector.ProbeTimeout.D()
	c := startKafkaConsumer(t, "readmit", r.pp.addr, kgo.ConsumeTopics(topic), kgo.FetchMaxWait(500*time.Millisecond))
	if !waitAll(1, 30*time.Second, func(int) bool {
		ok, _ := c.hooks.answered(keyFetch, time.Time{}, time.Now())
		return len(ok) >= 3
	}) {
		t.Fatal("the consumer did not fetch within 30s")
	}
	stopAt := time.Now()
	r.kb.sigstop(t, "broker")
	ex := waitExcluded(t, r.pp, r.w, stopAt, 20*time.Second, "SIGSTOP")
	t.Logf("excluded %v after SIGSTOP", ms(ex.At.Sub(stopAt)))

	// Four times max_delay's worth of backoff: by then the schedule alone
	// would probe every max_delay (±jitter).
	stopped := 4 * maxDelay
	time.Sleep(time.Until(ex.At.Add(stopped)))
	failed := r.pp.counter(t, "probes_total", "result", "fail")
	st := r.pp.state()
	if st.State != "excluded" {
		t.Fatalf("endpoint %s (%s) while the broker is stopped, want excluded", st.State, st.Reason)
	}
	// About one probe a second while clients wait (the listener is
	// paused): one starts every second at most, and each one waits out
	// probe_timeout for the stopped process (back to back when that is a
	// second or more).
	perProbe := max(probeTimeout, health.WaitingInterval)
	if most := float64(stopped/(900*time.Millisecond)) + 2; failed > most {
		t.Errorf("%v failed probes in %v, want at most %v (about one a second)", failed, stopped, most)
	}
	if least := float64(stopped/(perProbe+500*time.Millisecond)) - 2; failed < least {
		t.Errorf("%v failed probes in %v, want at least %v: an endpoint clients wait for is probed every second", failed, stopped, least)
	}

	contAt := time.Now()
	r.kb.signal(t, syscall.SIGCONT)
	bound := probeTimeout + time.Second
	if !r.pp.waitState("healthy", bound+10*time.Second) {
		t.Fatalf("not readmitted %v after SIGCONT: %+v", bound+10*time.Second, r.pp.state())
	}
	back, ok := r.w.FirstAfter(contAt, "healthy", 200*time.Millisecond)
	if !ok {
		back = stateChange{At: r.pp.state().Since}
	}
	t.Logf("stopped %v after the exclusion, %v failed probes; readmitted %v after SIGCONT (bound %v)",
		stopped, failed, ms(back.At.Sub(contAt)), bound)
	if d := back.At.Sub(contAt); d > bound {
		t.Errorf("readmitted %v after SIGCONT, want within probe_timeout + 1s (%v)", ms(d), bound)
	}

	// A client that connects now is served.
	p := newKafkaClient(t, "after-readmission", r.pp.addr, kgo.DefaultProduceTopic(topic))
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := p.ProduceSync(ctx, &kgo.Record{Value: []byte("back")}).FirstErr(); err != nil {
		t.Fatalf("a client connecting after the readmission: %v", err)
	}
	if !c.waitValues([]string{"back"}, 20*time.Second) {
		t.Errorf("the consumer did not receive the record produced after the readmission")
	}
}

// The healthy twins of the clock rule: what a time rule could mistake
// for a dead broker, with zero exclusions, zero redials, no request
// counted unanswered and no link cut, over three times the longest
// deadline involved.
//   - pause: the broker stopped (a stop-the-world pause) for less than
//     request_timeout while a consumer fetches and a producer produces:
//     every request outstanding in the pause is due after it.
//   - held_produce: every acks=all Produce held by the broker for most of
//     its timeout_ms (waiting for replicas), the producer alone, nothing
//     else answered meanwhile.
//   - slow_on_another: every Produce held past its own deadline (7 s,
//     against timeout_ms 3 s + request_timeout) while the broker answers
//     a consumer's fetches on another connection: any answer from the
//     endpoint is life, and the producer's own client waits longer.
func TestKafkaClockRuleHealthyTwins(t *testing.T) {
	const (
		topic          = "twins"
		produceTimeout = 3 * time.Second
	)
	cases := []struct {
		name     string
		consumer bool
		hold     time.Duration // every Produce held this long
		pause    time.Duration // SIGSTOP this long, once
	}{
		{"pause", true, 0, 2 * time.Second},
		{"held_produce", false, 2500 * time.Millisecond, 0},
		{"slow_on_another", true, 7 * time.Second, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := startKafkaRun(t, kafkaProfileMode, topic, "", 2*time.Minute)
			t.Cleanup(func() { _ = syscall.Kill(r.kb.pid, syscall.SIGCONT) })
			rt := r.requestTimeout()
			if tc.pause >= rt {
				t.Fatalf("a pause of %v is not shorter than request_timeout %v", tc.pause, rt)
			}
			if tc.hold > 0 {
				r.kb.holdProduce(t, tc.hold)
			}
			longest := max(produceTimeout+rt, tc.hold)
			var hooks []*clientHooks
			if tc.consumer {
				c := startKafkaConsumer(t, "twin-consumer", r.pp.addr, kgo.ConsumeTopics(topic), kgo.FetchMaxWait(500*time.Millisecond))
				hooks = append(hooks, c.hooks)
			}
			p := newKafkaClient(t, "twin-producer", r.pp.addr, kgo.DefaultProduceTopic(topic),
				kgo.ProduceRequestTimeout(produceTimeout), kgo.ProducerLinger(0))
			hooks = append(hooks, p.hooks)
			var mu sync.Mutex
			acked, failed := 0, 0
			stop, done := make(chan struct{}), make(chan struct{})
			go func() {
				defer close(done)
				tick := time.NewTicker(200 * time.Millisecond)
				defer tick.Stop()
				for n := 0; n < 600; n++ {
					select {
					case <-stop:
						return
					case <-tick.C:
					}
					p.Produce(context.Background(), &kgo.Record{Value: fmt.Appendf(nil, "t%d", n)}, func(_ *kgo.Record, err error) {
						mu.Lock()
						defer mu.Unlock()
						if err != nil {
							failed++
						} else {
							acked++
						}
					})
				}
			}()
			t.Cleanup(func() { close(stop); <-done })
			if !waitAll(1, 30*time.Second, func(int) bool { mu.Lock(); defer mu.Unlock(); return acked >= 3 }) {
				t.Fatal("fewer than 3 records acked within 30s")
			}
			warm := time.Now()
			if tc.pause > 0 {
				r.kb.sigstop(t, "broker")
				time.Sleep(tc.pause)
				r.kb.signal(t, syscall.SIGCONT)
			}
			time.Sleep(time.Until(warm.Add(3 * longest)))
			end := time.Now()
			mu.Lock()
			t.Logf("%s: %d records acked, %d failed over %v (longest deadline %v)", tc.name, acked, failed, ms(end.Sub(warm)), longest)
			if failed > 0 {
				t.Errorf("%d records failed", failed)
			}
			mu.Unlock()
			for _, h := range hooks {
				h.assertNoRedials(t, warm, end, r.start)
			}
			r.assertProxyStayedOut(t, end)
		})
	}
}
