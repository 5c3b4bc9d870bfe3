package kafkawire

import (
	"bytes"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"
)

// payload builds a request payload by hand: the 8 fixed header bytes, then
// rest (client_id, tags and body, as the case needs).
func payload(key, version int16, corr int32, rest ...[]byte) []byte {
	b := binary.BigEndian.AppendUint16(nil, uint16(key))
	b = binary.BigEndian.AppendUint16(b, uint16(version))
	b = binary.BigEndian.AppendUint32(b, uint32(corr))
	for _, r := range rest {
		b = append(b, r...)
	}
	return b
}

func i16(v int16) []byte { return binary.BigEndian.AppendUint16(nil, uint16(v)) }
func i32(v int32) []byte { return binary.BigEndian.AppendUint32(nil, uint32(v)) }

// str is a STRING / NULLABLE_STRING with an INT16 length.
func str(s string) []byte { return append(i16(int16(len(s))), s...) }

var (
	noTags   = []byte{0}
	nullStr  = i16(-1)
	clientID = str("app")
)

// TestErrors checks every error path with hand-built payloads, whole
// (complete) and as the caller would see them (not complete).
func TestErrors(t *testing.T) {
	cases := []struct {
		name string
		b    []byte
		err  error
	}{
		// The fixed header.
		{"negative api_key", payload(-1, 0, 1), ErrNotKafka},
		{"negative api_version", payload(3, -1, 1), ErrNotKafka},
		{"min api_version", payload(1, -32768, 1), ErrNotKafka},

		// client_id, for each API whose header is read.
		{"Produce client_id -2", payload(0, 3, 1, i16(-2), nullStr, i16(1), i32(1000)), ErrNotKafka},
		{"Fetch client_id -2", payload(1, 4, 1, i16(-2), i32(-1), i32(500)), ErrNotKafka},
		{"Fetch v12 client_id -32768", payload(1, 12, 1, i16(-32768), noTags, i32(-1), i32(500)), ErrNotKafka},
		{"JoinGroup client_id -2", payload(11, 1, 1, i16(-2), str("g"), i32(1), i32(2)), ErrNotKafka},
		{"UpdateFeatures client_id -2", payload(57, 0, 1, i16(-2), noTags, i32(1)), ErrNotKafka},

		// Produce transactional_id.
		{"Produce v3 transactional_id -2", payload(0, 3, 1, clientID, i16(-2), i16(1), i32(1000)), ErrNotKafka},
		{"Produce v9 transactional_id 0x8000 bytes", payload(0, 9, 1, clientID, noTags, []byte{0x81, 0x80, 0x02}), ErrNotKafka},
		{"Produce v9 transactional_id varint of 6 bytes", payload(0, 9, 1, clientID, noTags, []byte{0x81, 0x80, 0x80, 0x80, 0x80, 0x00}), ErrNotKafka},
		{"Produce v9 transactional_id length over MaxInt32", payload(0, 9, 1, clientID, noTags, []byte{0x81, 0x80, 0x80, 0x80, 0x08}), ErrNotKafka},

		// JoinGroup group_id is not nullable.
		{"JoinGroup v1 null group_id", payload(11, 1, 1, clientID, nullStr, i32(1), i32(2)), ErrNotKafka},
		{"JoinGroup v0 group_id -3", payload(11, 0, 1, clientID, i16(-3), i32(1)), ErrNotKafka},
		{"JoinGroup v6 null group_id", payload(11, 6, 1, clientID, noTags, []byte{0}, i32(1), i32(2)), ErrNotKafka},
		{"JoinGroup v6 group_id 0x8000 bytes", payload(11, 6, 1, clientID, noTags, []byte{0x81, 0x80, 0x02}), ErrNotKafka},

		// Transactional ids: InitProducerId's is nullable, the others'
		// are not.
		{"InitProducerId v0 transactional_id -2", payload(22, 0, 1, clientID, i16(-2), i32(1000)), ErrNotKafka},
		{"InitProducerId v2 transactional_id 0x8000 bytes", payload(22, 2, 1, clientID, noTags, []byte{0x81, 0x80, 0x02}), ErrNotKafka},
		{"EndTxn v0 null transactional_id", payload(26, 0, 1, clientID, nullStr), ErrNotKafka},
		{"EndTxn v3 null transactional_id", payload(26, 3, 1, clientID, noTags, []byte{0}), ErrNotKafka},
		{"AddPartitionsToTxn v3 null transactional_id", payload(24, 3, 1, clientID, noTags, []byte{0}), ErrNotKafka},
		{"AddOffsetsToTxn v3 transactional_id 0x8000 bytes", payload(25, 3, 1, clientID, noTags, []byte{0x81, 0x80, 0x02}), ErrNotKafka},

		// Header tagged fields.
		{"tags out of order", payload(1, 15, 1, clientID, []byte{2, 1, 0, 0, 0}, i32(500)), ErrNotKafka},
		{"tags repeated", payload(1, 15, 1, clientID, []byte{2, 1, 0, 1, 0}, i32(500)), ErrNotKafka},
		{"tag varint over 32 bits", payload(1, 15, 1, clientID, []byte{1, 0xff, 0xff, 0xff, 0xff, 0x10, 0}, i32(500)), ErrNotKafka},
		{"tag size too large", payload(1, 15, 1, clientID, []byte{1, 0, 0xff, 0xff, 0x7f}), ErrTooLong},

		// Unknown Produce versions.
		{"Produce v14", payload(0, 14, 1, clientID, noTags, []byte{0}, i16(1), i32(1000)), ErrUnknownVersion},
		{"Produce v32767", payload(0, 32767, 1), ErrUnknownVersion},
	}
	for _, c := range cases {
		// Padding, so that not-complete calls have the bytes that a
		// well-formed request would have after the bad field and decide
		// too; no case is decided by it.
		b := append(c.b, make([]byte, 64)...)
		for _, complete := range []bool{true, false} {
			r, need, err := ParseRequest(b, complete)
			want := Request{}
			if c.err == ErrUnknownVersion {
				want = Request{APIKey: int16(binary.BigEndian.Uint16(c.b)), APIVersion: int16(binary.BigEndian.Uint16(c.b[2:])), CorrelationID: 1}
			}
			if err != c.err || need != 0 || r != want {
				t.Errorf("%s (complete=%v): %+v, %d, %v; want %+v, 0, %v", c.name, complete, r, need, err, want, c.err)
			}
			if !errors.Is(err, c.err) {
				t.Errorf("%s: errors.Is(%v, %v) false", c.name, err, c.err)
			}
		}
	}
}

// TestTruncated checks that a complete payload that ends before the fields it
// must contain is ErrNotKafka, and the same bytes not complete ask for more.
func TestTruncated(t *testing.T) {
	cases := []struct {
		name string
		b    []byte
		need int
	}{
		{"empty", nil, 8},
		{"7 bytes", payload(3, 12, 1)[:7], 8},
		{"Fetch v4 without client_id", payload(1, 4, 1), 8 + 2 + 8},
		{"Fetch v4 without max_wait", payload(1, 4, 1, clientID, i32(-1)), 8 + 5 + 8},
		{"Fetch v15 client_id cut", payload(1, 15, 1, i16(10), []byte("abc")), 8 + 2 + 10 + 1 + 4},
		{"Fetch v15 tag data cut", payload(1, 15, 1, clientID, []byte{1, 0, 20, 'x'}), 8 + 5 + 3 + 20 + 4},
		{"Fetch v15 two tags, the first cut", payload(1, 15, 1, clientID, []byte{2, 0, 20, 'x'}), 8 + 5 + 3 + 20 + 2 + 4},
		{"Fetch v15 tag count in the middle of a varint", payload(1, 15, 1, clientID, []byte{0x81}), 8 + 5 + 2 + 4},
		{"Produce v9 transactional_id cut", payload(0, 9, 1, clientID, noTags, []byte{0x81, 0x01}, []byte("tt")), 8 + 5 + 1 + 2 + 128 + 6},
		{"JoinGroup v5 group_id cut", payload(11, 5, 1, clientID, str("group")[:4]), 8 + 5 + 2 + 5 + 8},
		{"JoinGroup v0 group_id, no session timeout", payload(11, 0, 1, clientID, str("group")), 8 + 5 + 2 + 5 + 4},
		{"InitProducerId v1 no transaction timeout", payload(22, 1, 1, clientID, str("tx")), 8 + 5 + 4 + 4},
		{"InitProducerId v1 null transactional_id, no transaction timeout", payload(22, 1, 1, clientID, nullStr), 8 + 5 + 2 + 4},
		{"EndTxn v3 transactional_id cut", payload(26, 3, 1, clientID, noTags, []byte{3}, []byte("t")), 8 + 5 + 1 + 1 + 2},
		{"ListPartitionReassignments no timeout", payload(46, 0, 1, clientID, noTags, []byte{0, 0}), 8 + 5 + 1 + 4},
	}
	for _, c := range cases {
		if r, need, err := ParseRequest(c.b, true); err != ErrNotKafka || need != 0 || r != (Request{}) {
			t.Errorf("%s (complete): %+v, %d, %v; want ErrNotKafka", c.name, r, need, err)
		}
		if r, need, err := ParseRequest(c.b, false); err != nil || need != c.need || r != (Request{}) {
			t.Errorf("%s: %+v, %d, %v; want need %d", c.name, r, need, err, c.need)
		}
	}
}

// TestMaxPrefix checks the ErrTooLong boundary: a request whose fields end
// exactly at MaxPrefix parses; one byte more is ErrTooLong, whether or not
// the payload is complete and however many bytes are present.
func TestMaxPrefix(t *testing.T) {
	build := func(size int) []byte {
		// Fetch v15 (header v2, max_wait_ms first) with one header tag
		// of size bytes (a 3-byte varint) and empty client_id.
		tag := []byte{1, 0, byte(size&0x7f | 0x80), byte(size>>7&0x7f | 0x80), byte(size >> 14)}
		b := payload(1, 15, 1, str(""), tag, make([]byte, size), i32(700))
		return append(b, make([]byte, 1000)...) // rest of the body
	}
	// 8 + 2 + 5 (count, tag, size) + size + 4 = MaxPrefix
	size := MaxPrefix - 19
	b := build(size)
	want := Request{APIKey: 1, APIVersion: 15, CorrelationID: 1, Hold: 700 * time.Millisecond}
	for _, complete := range []bool{true, false} {
		if r, need, err := ParseRequest(b, complete); err != nil || need != 0 || r != want {
			t.Errorf("fields ending at MaxPrefix (complete=%v): %+v, %d, %v", complete, r, need, err)
		}
	}
	if _, need, err := ParseRequest(b[:20], false); err != nil || need != MaxPrefix {
		t.Errorf("fields ending at MaxPrefix, from 20 bytes: need %d, %v; want %d", need, err, MaxPrefix)
	}

	b = build(size + 1)
	for _, n := range []int{20, MaxPrefix, len(b)} {
		for _, complete := range []bool{true, false} {
			if r, need, err := ParseRequest(b[:n], complete); err != ErrTooLong || need != 0 || r != (Request{}) {
				t.Errorf("fields ending at MaxPrefix+1, %d bytes (complete=%v): %+v, %d, %v; want ErrTooLong", n, complete, r, need, err)
			}
		}
	}

	// Many small tags, fed in pieces, must also stop at MaxPrefix.
	var tags []byte
	tags = append(tags, 0xff, 0xff, 0x03) // 65535 fields
	for i := 0; len(tags) < MaxPrefix; i++ {
		tags = append(tags, byte(i&0x7f|0x80), byte(i>>7&0x7f|0x80), byte(i>>14), 0)
	}
	b = payload(1, 15, 1, str(""), tags)
	if _, _, err := ParseRequest(b, false); err != ErrTooLong {
		t.Errorf("65535 tags: %v, want ErrTooLong", err)
	}
}

// TestNotReadPastCorrelationID checks that APIs whose body is not needed are
// decided from the 8 fixed bytes, whatever follows (here, a client_id length
// that would be invalid).
func TestNotReadPastCorrelationID(t *testing.T) {
	for _, key := range []int16{3, 8, 14, 17, 18, 19, 36, 68, 78} {
		b := payload(key, 0, 42, i16(-2))
		for _, n := range []int{8, len(b)} {
			r, need, err := ParseRequest(b[:n], n == len(b))
			if err != nil || need != 0 || r.APIKey != key || r.CorrelationID != 42 {
				t.Errorf("key %d from %d bytes: %+v, %d, %v", key, n, r, need, err)
			}
		}
	}
}

func TestResponseCorrelationID(t *testing.T) {
	for n := 0; n < 4; n++ {
		if id, ok := ResponseCorrelationID(make([]byte, n)); ok || id != 0 {
			t.Errorf("%d bytes: %d, %v; want 0, false", n, id, ok)
		}
	}
	cases := []struct {
		b  []byte
		id int32
	}{
		{[]byte{0, 0, 0, 0}, 0},
		{[]byte{0x01, 0x02, 0x03, 0x04, 0xff}, 0x01020304},
		{[]byte{0xff, 0xff, 0xff, 0xff, 0}, -1},
		{[]byte{0x7f, 0xff, 0xff, 0xf8}, 2147483640},
		{[]byte{0x80, 0, 0, 0}, -2147483648},
	}
	for _, c := range cases {
		if id, ok := ResponseCorrelationID(c.b); !ok || id != c.id {
			t.Errorf("% x: %d, %v; want %d", c.b, id, ok, c.id)
		}
	}

	// A response kmsg encodes, after the header franz-go reads: the
	// correlation id comes first in both response header versions.
	resp := kmsg.NewPtrFetchResponse()
	resp.SetVersion(17)
	resp.ThrottleMillis = 3
	p := append(i32(-77), 0) // header v1: correlation_id, no tags
	p = resp.AppendTo(p)
	if id, ok := ResponseCorrelationID(p); !ok || id != -77 {
		t.Errorf("Fetch v17 response: %d, %v; want -77", id, ok)
	}
}

// clientHello returns the first n bytes a crypto/tls client writes on a new
// connection.
func clientHello(t *testing.T, n int, cfg *tls.Config) []byte {
	t.Helper()
	client, server := net.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- tls.Client(client, cfg).Handshake()
	}()
	b := make([]byte, n)
	_, err := io.ReadFull(server, b)
	server.Close()
	client.Close()
	if herr := <-done; herr == nil {
		t.Fatal("handshake succeeded with no server")
	}
	if err != nil {
		t.Fatalf("reading the ClientHello: %v", err)
	}
	return b
}

func TestLooksLikeTLS(t *testing.T) {
	for _, cfg := range []*tls.Config{
		{ServerName: "kafka-0", MinVersion: tls.VersionTLS12},
		{ServerName: "kafka-0", MinVersion: tls.VersionTLS12, MaxVersion: tls.VersionTLS12},
		{ServerName: "kafka-0", MinVersion: tls.VersionTLS13},
	} {
		hello := clientHello(t, 16, cfg)
		if !LooksLikeTLS(hello) || !LooksLikeTLS(hello[:3]) {
			t.Errorf("ClientHello % x not recognised", hello)
		}
		if LooksLikeTLS(hello[:2]) {
			t.Errorf("2 bytes recognised")
		}
	}

	for _, b := range [][]byte{nil, {0x16}, {0x16, 0x03}, {0x16, 0x03, 0x05}, {0x16, 0x02, 0x01}, {0x15, 0x03, 0x01}, {0, 0, 0, 0x20}} {
		if LooksLikeTLS(b) {
			t.Errorf("% x recognised as TLS", b)
		}
	}
	// No Kafka frame looks like TLS, including one with a 32 000-byte
	// client id.
	for _, cid := range clientIDs {
		for _, req := range []kmsg.Request{kmsg.NewPtrApiVersionsRequest(), kmsg.NewPtrMetadataRequest(), kmsg.NewPtrSASLHandshakeRequest()} {
			f := &kmsg.RequestFormatter{}
			if cid != nil {
				f = kmsg.NewRequestFormatter(kmsg.FormatterClientID(*cid))
			}
			if frame := f.AppendRequest(nil, req, 0); LooksLikeTLS(frame) {
				t.Errorf("%T frame % x recognised as TLS", req, frame[:8])
			}
		}
	}
}

// hotPayloads are the requests a proxy sees most: a Fetch v17 and a Produce
// v11 as franz-go writes them.
func hotPayloads(t testing.TB) map[string][]byte {
	cid := kmsg.StringPtr("kgo")
	fetch := kmsg.NewPtrFetchRequest()
	fetch.SetVersion(17)
	fetch.MaxWaitMillis = 500
	fetch.MinBytes = 1
	topic := kmsg.NewFetchRequestTopic()
	topic.TopicID = [16]byte{1}
	topic.Partitions = append(topic.Partitions, kmsg.NewFetchRequestTopicPartition())
	fetch.Topics = append(fetch.Topics, topic)

	produce := kmsg.NewPtrProduceRequest()
	produce.SetVersion(11)
	produce.Acks = -1
	produce.TimeoutMillis = 30_000
	produce.TransactionID = kmsg.StringPtr("txn-1")
	ptopic := kmsg.NewProduceRequestTopic()
	ptopic.Topic = "events"
	part := kmsg.NewProduceRequestTopicPartition()
	part.Records = bytes.Repeat([]byte{'r'}, 1000)
	ptopic.Partitions = append(ptopic.Partitions, part)
	produce.Topics = append(produce.Topics, ptopic)

	return map[string][]byte{
		"Fetch-v17":   encode(t, fetch, cid, 100),
		"Produce-v11": encode(t, produce, cid, 101),
	}
}

func TestParseRequestAllocs(t *testing.T) {
	cases := hotPayloads(t)
	cases["Metadata"] = payload(3, 12, 1, clientID, noTags)
	cases["ErrNotKafka"] = payload(3, -1, 1)
	cases["ErrUnknownVersion"] = payload(0, 14, 1)
	cases["need"] = cases["Fetch-v17"][:12]
	for name, p := range cases {
		for _, complete := range []bool{false, true} {
			var sink Request
			allocs := testing.AllocsPerRun(1000, func() {
				r, _, _ := ParseRequest(p, complete)
				sink = r
			})
			if allocs != 0 {
				t.Errorf("%s (complete=%v): %v allocs per call, want 0", name, complete, allocs)
			}
			_ = sink
		}
	}
}

func BenchmarkParseRequest(b *testing.B) {
	for name, p := range hotPayloads(b) {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, need, err := ParseRequest(p, false); need != 0 || err != nil {
					b.Fatal(need, err)
				}
			}
		})
	}
}
