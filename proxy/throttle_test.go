package proxy

import (
	"context"
	"encoding/binary"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// startThrottlingBroker starts a loopback Kafka broker that throttles a
// client for a quota as a broker of KIP-219 does: it answers the request
// with correlation id 1 at once, with throttle_time_ms set, and then reads
// nothing from that connection for the throttle ("throttle by muting the
// channel"). It answers every other request at once, unthrottled; with
// dies set, it answers nothing after the throttled response and never
// reads again (a broker that stopped right after it).
func startThrottlingBroker(t *testing.T, throttle time.Duration, dies bool) *kafkaBroker {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return startThrottlingBrokerOn(t, ln, throttle, dies)
}

// startThrottlingBrokerOn is startThrottlingBroker on a listener of the
// test's own (small receive buffers, say).
func startThrottlingBrokerOn(t *testing.T, ln net.Listener, throttle time.Duration, dies bool) *kafkaBroker {
	t.Helper()
	return runKafkaBroker(t, &kafkaBroker{ln: ln, serveConn: func(c net.Conn, done <-chan struct{}) {
		serveThrottling(c, throttle, dies, done)
	}})
}

// throttledResponse is the frame of a response to the request of key
// and version with correlation id corr, throttle ms, as kmsg encodes it
// (header v1, with its empty tagged fields, where the version is
// flexible, except ApiVersions'), its fields otherwise empty.
func throttledResponse(key, version int16, corr, ms int32) []byte {
	r := kmsg.ResponseForKey(key)
	r.SetVersion(version)
	if tr, ok := r.(kmsg.SetThrottleResponse); ok {
		tr.SetThrottle(ms)
	}
	b := binary.BigEndian.AppendUint32(nil, 0)
	b = binary.BigEndian.AppendUint32(b, uint32(corr))
	if r.IsFlexible() && key != 18 {
		b = append(b, 0)
	}
	b = r.AppendTo(b)
	binary.BigEndian.PutUint32(b, uint32(len(b)-4))
	return b
}

func serveThrottling(c net.Conn, throttle time.Duration, dies bool, done <-chan struct{}) {
	for {
		p, ok := readKafkaRequest(c)
		if !ok {
			return
		}
		key, version := int16(binary.BigEndian.Uint16(p)), int16(binary.BigEndian.Uint16(p[2:]))
		corr := int32(binary.BigEndian.Uint32(p[4:]))
		if corr != 1 {
			if _, err := c.Write(throttledResponse(key, version, corr, 0)); err != nil {
				return
			}
			continue
		}
		if _, err := c.Write(throttledResponse(key, version, corr, int32(throttle/time.Millisecond))); err != nil {
			return
		}
		if dies {
			<-done
			return
		}
		select { // muted: nothing is read
		case <-time.After(throttle):
		case <-done:
			return
		}
	}
}

// A client keeps requests in flight when a throttled answer comes (the
// Java producer's five, say), and one that does not wait out the
// throttle (KIP-219 asks it to; not every client does) sends more into
// the mute. The broker reads none of them until the throttle is over:
// three times request_timeout here, with no other link answering
// meanwhile. That is the broker keeping to its protocol, not a dead one:
// the endpoint stays in, the link open, nothing counted.
func TestKafkaThrottleMuteIsNotASilence(t *testing.T) {
	const rt, throttle = time.Second, 3 * time.Second
	broker := startThrottlingBroker(t, throttle, false)
	h := start(t, broker.ln.Addr().String(), kafkaProfile(rt, 1))
	c := h.dial()
	// In flight together: the throttled one and one behind it.
	if _, err := c.Write(append(metadataReq(1), metadataReq(2)...)); err != nil {
		t.Fatal(err)
	}
	if id := readResponse(t, c, 5*time.Second); id != 1 {
		t.Fatalf("response %d, want 1", id)
	}
	muted := time.Now()
	for i := range 2 { // into the mute
		if _, err := c.Write(metadataReq(int32(3 + i))); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		if id := readResponse(t, c, 10*time.Second); id != int32(2+i) {
			t.Fatalf("response %d, want %d", id, 2+i)
		}
	}
	// A check of the test's broker, loose by design: muted was taken
	// after the mute began.
	if d := time.Since(muted); d < throttle/2 {
		t.Fatalf("the requests behind the throttled one were answered after %v: the test broker did not mute for %v", d, throttle)
	}
	m := h.m.ForListener("test")
	if got := testutil.ToFloat64(m.UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
	if got := testutil.ToFloat64(m.KafkaThrottles); got != 1 {
		t.Fatalf("kafka_throttles_total = %v, want 1 (one throttled response, the others unthrottled)", got)
	}
	if ep := h.endpoint(); ep.State != "healthy" || h.p.ActiveLinks() != 1 {
		t.Fatalf("endpoint %s (%s), %d links; want healthy with the link open", ep.State, ep.Reason, h.p.ActiveLinks())
	}
}

// The detection twin: a broker that throttles and then stops is still
// found, once the throttle is over and request_timeout has passed with
// nothing answered, whether the request it owes was in flight with the
// throttled one (its clock starts over at the end of the throttle: the
// throttled answer came before the broker read it, so it does not cover
// it) or sent into the mute.
func TestKafkaThrottledThenSilentBrokerExcluded(t *testing.T) {
	const rt, throttle = 300 * time.Millisecond, 1500 * time.Millisecond
	for _, pipelined := range []bool{true, false} {
		name := "sent into the mute"
		if pipelined {
			name = "in flight with the throttled request"
		}
		t.Run(name, func(t *testing.T) {
			broker := startThrottlingBroker(t, throttle, true)
			h := start(t, broker.ln.Addr().String(), kafkaProfile(rt, 1))
			c := h.dial()
			sent := time.Now() // before the throttled answer, which the mute follows
			first := metadataReq(1)
			if pipelined {
				first = append(first, metadataReq(2)...)
			}
			if _, err := c.Write(first); err != nil {
				t.Fatal(err)
			}
			if id := readResponse(t, c, 5*time.Second); id != 1 {
				t.Fatalf("response %d, want 1", id)
			}
			if !pipelined {
				if _, err := c.Write(metadataReq(2)); err != nil {
					t.Fatal(err)
				}
			}
			ep := h.waitState("excluded", 15*time.Second)
			if d := ep.Since.Sub(sent); d < throttle+rt {
				t.Fatalf("excluded %v after the throttled request, before the throttle and request_timeout (%v) were over", d, throttle+rt)
			}
			if ep.Reason != string(CloseUnanswered) {
				t.Fatalf("excluded for %s, want unanswered", ep.Reason)
			}
		})
	}
}

// A real client and broker: franz-go's client producing to kfake through
// the proxy, the broker throttling the first Produce for longer than
// request_timeout. The client waits the throttle out before it writes
// again (KIP-219), the proxy reads the throttle from the response the
// client's own Produce version gets, and the second record goes through
// on the same connection with nothing counted against the broker.
func TestKafkaThrottleRealClient(t *testing.T) {
	const rt, throttle = time.Second, 2 * time.Second
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	var offset atomic.Int64
	cluster.ControlKey(0, func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		// The first Produce, answered here with the throttle; the control
		// is dropped once it has handled one, and kfake answers the rest.
		req := kreq.(*kmsg.ProduceRequest)
		resp := req.ResponseKind().(*kmsg.ProduceResponse)
		resp.ThrottleMillis = int32(throttle / time.Millisecond)
		for _, rt := range req.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic, st.TopicID = rt.Topic, rt.TopicID
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.BaseOffset = offset.Add(1) - 1
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	h := start(t, cluster.ListenAddrs()[0], kafkaProfile(rt, 1))

	var throttled atomic.Int64
	var after atomic.Bool
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(h.addr),
		// kfake advertises its own address: every connection goes to the
		// proxy instead, as it would to a sidecar advertised in its place.
		kgo.Dialer(func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, h.addr)
		}),
		kgo.DefaultProduceTopic("t"),
		kgo.RequestRetries(0),
		kgo.WithHooks(throttleHook{func(d time.Duration, a bool) { throttled.Store(int64(d)); after.Store(a) }}),
	)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, kgo.StringRecord("one")).FirstErr(); err != nil {
		t.Fatalf("the first record: %v", err)
	}
	if time.Duration(throttled.Load()) != throttle || !after.Load() {
		t.Fatalf("the client saw a throttle of %v (after the response: %v), want %v after", time.Duration(throttled.Load()), after.Load(), throttle)
	}
	if err := cl.ProduceSync(ctx, kgo.StringRecord("two")).FirstErr(); err != nil {
		t.Fatalf("the second record: %v", err)
	}
	m := h.m.ForListener("test")
	if got := testutil.ToFloat64(m.KafkaThrottles); got != 1 {
		t.Fatalf("kafka_throttles_total = %v, want 1: the proxy did not read the throttle of the client's Produce", got)
	}
	if got := testutil.ToFloat64(m.UnansweredTimeouts); got != 0 {
		t.Fatalf("unanswered_timeouts_total = %v, want 0", got)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s), want healthy", ep.State, ep.Reason)
	}
}

// throttleHook reports the throttles franz-go's client sees.
type throttleHook struct{ f func(time.Duration, bool) }

func (h throttleHook) OnBrokerThrottle(_ kgo.BrokerMetadata, d time.Duration, after bool) {
	h.f(d, after)
}
