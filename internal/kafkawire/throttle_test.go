package kafkawire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/twmb/franz-go/pkg/kmsg"
)

// kmsgResponse encodes a response to key at version the way a broker
// writes it (the payload after the size: correlation id, the header's
// tagged fields when the header is flexible, then the body), with
// throttle ms. Produce and ApiVersions responses get content before the
// throttle, so that the walk over it is tested.
func kmsgResponse(t *testing.T, key, version int16, ms int32) []byte {
	t.Helper()
	r := kmsg.ResponseForKey(key)
	r.SetVersion(version)
	r.(kmsg.SetThrottleResponse).SetThrottle(ms)
	switch r := r.(type) {
	case *kmsg.ProduceResponse:
		for ti, name := range []string{"orders", "t"} {
			topic := kmsg.NewProduceResponseTopic()
			topic.Topic = name
			for pi := range 3 {
				p := kmsg.NewProduceResponseTopicPartition()
				p.Partition = int32(pi)
				p.BaseOffset = int64(1000 * ti)
				if pi == 1 {
					msg := "batch 0 was bad"
					p.ErrorCode = 87
					p.ErrorMessage = &msg
					e := kmsg.NewProduceResponseTopicPartitionErrorRecord()
					e.RelativeOffset = 2
					e.ErrorMessage = &msg
					p.ErrorRecords = append(p.ErrorRecords, e, kmsg.NewProduceResponseTopicPartitionErrorRecord())
				}
				if pi == 2 && version >= 10 {
					p.CurrentLeader.LeaderID = 3 // a tagged field
					p.CurrentLeader.LeaderEpoch = 7
				}
				topic.Partitions = append(topic.Partitions, p)
			}
			r.Topics = append(r.Topics, topic)
		}
		if version >= 10 {
			b := kmsg.NewProduceResponseBroker()
			b.NodeID, b.Host, b.Port = 3, "broker-3", 9092
			r.Brokers = append(r.Brokers, b) // a tagged field after the throttle
		}
	case *kmsg.ApiVersionsResponse:
		for k := int16(0); k < 70; k += 3 {
			ak := kmsg.NewApiVersionsResponseApiKey()
			ak.ApiKey, ak.MinVersion, ak.MaxVersion = k, 0, k%9
			r.ApiKeys = append(r.ApiKeys, ak)
		}
	}
	b := binary.BigEndian.AppendUint32(nil, 0x0102_0304) // correlation id
	if r.IsFlexible() && key != keyAPIVersions {
		b = append(b, 0) // the header's empty tagged fields
	}
	return r.AppendTo(b)
}

// TestThrottleTableMatchesKmsg checks, for every key and version kmsg
// knows, that ResponseThrottle reads the throttle kmsg wrote wherever
// kmsg says the broker applies it after the response, and only there,
// from the whole payload and from every prefix the way the proxy feeds it
// (the first need bytes, then more).
func TestThrottleTableMatchesKmsg(t *testing.T) {
	const ms = 0x1234_5678
	for k := int16(0); k <= maxKmsgKey; k++ {
		r := kmsg.ResponseForKey(k)
		if r == nil {
			if ThrottleAfter(k, 0) {
				t.Errorf("key %d: a throttle for a key kmsg does not know", k)
			}
			continue
		}
		for v := int16(0); v <= r.MaxVersion(); v++ {
			r := kmsg.ResponseForKey(k)
			r.SetVersion(v)
			tr, has := r.(kmsg.ThrottleResponse)
			after := false
			field := false
			if has {
				_, after = tr.Throttle()
				// kmsg reports "after" for OffsetForLeaderEpoch v0-v1, which
				// have no throttle field: whether the field is there is
				// whether the encoding changes with it.
				field = string(kmsgResponse(t, k, v, 1)) != string(kmsgResponse(t, k, v, 2))
			}
			unread := k >= 38 && k <= 41 // delegation tokens: not read, by design
			want := after && field && !unread
			if got := ThrottleAfter(k, v); got != want {
				t.Errorf("key %d v%d (%T): ThrottleAfter %v, want %v (kmsg after %v, field %v)", k, v, r, got, want, after, field)
				continue
			}
			if !want {
				if _, _, err := ResponseThrottle(k, v, []byte{0, 0, 0, 1, 0, 0, 0, 0}, true); !errors.Is(err, ErrNoThrottle) {
					t.Errorf("key %d v%d: ResponseThrottle error %v, want ErrNoThrottle", k, v, err)
				}
				continue
			}
			b := kmsgResponse(t, k, v, ms)
			got, need, err := ResponseThrottle(k, v, b, true)
			if err != nil || need != 0 || got != ms {
				t.Errorf("key %d v%d (%T): ResponseThrottle = %#x, need %d, %v; want %#x", k, v, r, got, need, err, ms)
				continue
			}
			if calls := feedThrottle(t, k, v, b, ms); calls > 3 {
				t.Errorf("key %d v%d: %d calls", k, v, calls)
			}
			// Every prefix that ends before the throttle, fed as the whole
			// payload, is malformed.
			end := bytes.Index(b, []byte{0x12, 0x34, 0x56, 0x78}) + 4
			for n := range end {
				if _, _, err := ResponseThrottle(k, v, b[:n], true); !errors.Is(err, ErrNotKafka) {
					t.Errorf("key %d v%d: complete prefix %d of %d: %v, want ErrNotKafka", k, v, n, len(b), err)
					break
				}
			}
		}
	}
}

// feedThrottle feeds b to ResponseThrottle as the proxy's frame scanner
// does (the first 4 bytes, then each time the first need bytes, cut at
// the end of the payload), checks that it reads ms, and returns the
// number of calls.
func feedThrottle(t *testing.T, k, v int16, b []byte, ms int32) int {
	t.Helper()
	n, calls := min(4, len(b)), 0
	for {
		calls++
		got, need, err := ResponseThrottle(k, v, b[:n], n == len(b))
		if err != nil {
			t.Errorf("key %d v%d: prefix %d: %v", k, v, n, err)
			return calls
		}
		if need == 0 {
			if got != ms {
				t.Errorf("key %d v%d: prefix %d: %#x, want %#x", k, v, n, got, ms)
			}
			return calls
		}
		if need <= n || need > MaxThrottleWindow {
			t.Errorf("key %d v%d: prefix %d of %d asks for %d", k, v, n, len(b), need)
			return calls
		}
		n = min(need, len(b))
	}
}

// A large Produce response (2,000 partitions) is walked once more after
// the first bytes, not once per partition.
func TestResponseThrottleLargeProduceInFewCalls(t *testing.T) {
	r := kmsg.NewPtrProduceResponse()
	r.SetVersion(11)
	r.ThrottleMillis = 777
	topic := kmsg.NewProduceResponseTopic()
	topic.Topic = "large"
	for i := range 2000 {
		p := kmsg.NewProduceResponseTopicPartition()
		p.Partition = int32(i)
		topic.Partitions = append(topic.Partitions, p)
	}
	r.Topics = append(r.Topics, topic)
	b := r.AppendTo(append(binary.BigEndian.AppendUint32(nil, 7), 0))
	if len(b) < 40_000 {
		t.Fatalf("only %d bytes", len(b))
	}
	if calls := feedThrottle(t, keyProduce, 11, b, 777); calls != 2 {
		t.Errorf("%d calls, want 2", calls)
	}
}

func TestResponseThrottleCases(t *testing.T) {
	// Fetch v12: header v1 (flexible), then the throttle first.
	fetch := []byte{0, 0, 0, 9, 0, 0, 0, 0x01, 0xf4, 0, 0}
	if ms, need, err := ResponseThrottle(1, 12, fetch, false); ms != 500 || need != 0 || err != nil {
		t.Errorf("Fetch v12: %d, %d, %v", ms, need, err)
	}
	if _, need, err := ResponseThrottle(1, 12, fetch[:4], false); need != 9 || err != nil {
		t.Errorf("Fetch v12, 4 bytes: need %d, %v; want 9", need, err)
	}
	// A header with a tagged field: it is skipped.
	tagged := []byte{0, 0, 0, 9, 1, 5, 2, 0xaa, 0xbb, 0, 0, 0x03, 0xe8}
	if ms, _, err := ResponseThrottle(1, 12, tagged, true); ms != 1000 || err != nil {
		t.Errorf("Fetch v12 with a header tag: %d, %v", ms, err)
	}
	// Fetch v7 delays the response instead: nothing to read.
	if _, _, err := ResponseThrottle(1, 7, fetch, true); !errors.Is(err, ErrNoThrottle) {
		t.Errorf("Fetch v7: %v, want ErrNoThrottle", err)
	}
	// A negative throttle reads as 0.
	neg := []byte{0, 0, 0, 9, 0, 0xff, 0xff, 0xff, 0xff}
	if ms, _, err := ResponseThrottle(1, 12, neg, true); ms != 0 || err != nil {
		t.Errorf("negative: %d, %v", ms, err)
	}
	// Truncated: malformed once complete.
	if _, _, err := ResponseThrottle(1, 12, fetch[:6], true); !errors.Is(err, ErrNotKafka) {
		t.Errorf("truncated: %v, want ErrNotKafka", err)
	}
	// ApiVersions with an error (answered in the v0 layout): not read.
	av := []byte{0, 0, 0, 9, 0, 35, 0, 0, 0, 0, 0, 0, 0, 0}
	if _, _, err := ResponseThrottle(keyAPIVersions, 3, av, true); !errors.Is(err, ErrNoThrottle) {
		t.Errorf("ApiVersions error 35: %v, want ErrNoThrottle", err)
	}
	// A Produce version newer than known: not read; a first-field API's
	// newer version: read.
	if ThrottleAfter(keyProduce, apis[keyProduce].maxVersion+1) {
		t.Error("Produce above the known versions is read")
	}
	if !ThrottleAfter(keyFetch, apis[keyFetch].maxVersion+1) {
		t.Error("Fetch above the known versions is not read")
	}
	// A Produce response whose topic count runs past the window.
	huge := []byte{0, 0, 0, 9, 0, 0x7f, 0xff, 0xff, 0xff}
	if _, need, err := ResponseThrottle(keyProduce, 8, huge, false); err != nil || need != MaxThrottleWindow {
		t.Errorf("huge count: need %d, %v", need, err)
	}
	if _, _, err := ResponseThrottle(keyProduce, 8, huge, true); !errors.Is(err, ErrNotKafka) {
		t.Errorf("huge count, complete: %v", err)
	}
	// Null arrays, which no walked array may be.
	nullTopics := []byte{0, 0, 0, 9, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 5}
	if _, _, err := ResponseThrottle(keyProduce, 8, nullTopics, true); !errors.Is(err, ErrNotKafka) {
		t.Errorf("Produce v8, null topics: %v, want ErrNotKafka", err)
	}
	nullCompact := []byte{0, 0, 0, 9, 0, 0, 0, 0, 0, 5, 0}
	if _, _, err := ResponseThrottle(keyProduce, 9, nullCompact, true); !errors.Is(err, ErrNotKafka) {
		t.Errorf("Produce v9, null topics: %v, want ErrNotKafka", err)
	}
	for _, k := range []int16{-1, 4, 17, 36, 38, 95, 1000} {
		if ThrottleAfter(k, 5) {
			t.Errorf("key %d: ThrottleAfter", k)
		}
	}
}

func TestResponseThrottleAllocs(t *testing.T) {
	b := kmsgResponse(t, keyProduce, 11, 250)
	if n := testing.AllocsPerRun(100, func() { _, _, _ = ResponseThrottle(keyProduce, 11, b, true) }); n != 0 {
		t.Errorf("%v allocations", n)
	}
}

func FuzzResponseThrottle(f *testing.F) {
	f.Add(int16(0), int16(11), []byte{0, 0, 0, 1, 0, 2, 2, 'a', 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add(int16(18), int16(3), []byte{0, 0, 0, 1, 0, 0, 2, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 9})
	f.Add(int16(1), int16(12), []byte{0, 0, 0, 9, 0, 0, 0, 0x01, 0xf4, 0, 0})
	f.Fuzz(func(t *testing.T, key, version int16, b []byte) {
		ms, need, err := ResponseThrottle(key, version, b, true)
		if err == nil && (need != 0 || ms < 0) {
			t.Fatalf("complete: ms %d need %d", ms, need)
		}
		ms2, need2, err2 := ResponseThrottle(key, version, b, false)
		if need2 > MaxThrottleWindow {
			t.Fatalf("need %d past the window", need2)
		}
		if err2 == nil && need2 == 0 && (err != nil || ms2 != ms) {
			t.Fatalf("incomplete read %d, complete %d, %v", ms2, ms, err)
		}
		if need2 > 0 && need2 <= len(b) {
			t.Fatalf("need %d with %d bytes", need2, len(b))
		}
	})
}
