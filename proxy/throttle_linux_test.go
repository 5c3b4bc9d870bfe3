//go:build linux

package proxy

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/policy"
)

// A client that does not wait out a throttle pipelines four 1 MiB batches
// into the mute (acks=all, timeout_ms 100 ms: their own holds are short).
// The broker reads nothing for the throttle, four times write_timeout and
// four times request_timeout here: its 100 KiB receive buffer fills, the
// window goes to zero and the proxy's writes make no progress. That is the
// broker keeping to its protocol: the requests it holds unread excuse the
// stalled writes as a held request's do (TestMutedBrokerHoldingARequestIsNotDead),
// nothing ends, nothing is counted, and every batch is answered once the
// throttle is over.
func TestKafkaThrottleMuteWithFullWindowIsNotDead(t *testing.T) {
	const throttle, rt = 4 * time.Second, time.Second
	broker := startThrottlingBrokerOn(t, smallRcvbufListener(t, 100<<10), throttle, false)
	h := start(t, broker.ln.Addr().String(), func(s *policy.Settings) {
		kafkaProfile(rt, 1)(s)
		s.WriteTimeout = policy.Duration(time.Second)
		s.TCPUserTimeout = policy.Duration(time.Second)
	})
	c := h.dial()
	if _, err := c.Write(metadataReq(1)); err != nil {
		t.Fatal(err)
	}
	if id := readResponse(t, c, 5*time.Second); id != 1 {
		t.Fatalf("response %d, want 1", id)
	}
	muted := time.Now()
	errc := make(chan error, 1)
	go func() {
		var err error
		for i := range 4 {
			if _, err = c.Write(bigProduceReq(1<<20, 100*time.Millisecond, int32(i+2))); err != nil {
				break
			}
		}
		errc <- err
	}()
	for i := range 4 {
		if id := readResponse(t, c, throttle+20*time.Second); id != int32(i+2) {
			t.Fatalf("response %d, want %d", id, i+2)
		}
	}
	if err := <-errc; err != nil {
		t.Fatalf("writing the batches: %v", err)
	}
	if d := time.Since(muted); d < throttle/2 {
		t.Fatalf("answered after %v: the test broker did not mute for %v", d, throttle)
	}
	select {
	case s := <-h.ended:
		t.Fatalf("a link ended (%s, %v) while its broker throttled it", s.Reason, s.Err)
	default:
	}
	h.nothingCounted()
	if got := testutil.ToFloat64(h.m.ForListener("test").KafkaThrottles); got != 1 {
		t.Fatalf("kafka_throttles_total = %v, want 1", got)
	}
}
