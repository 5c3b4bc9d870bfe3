package pinotwire_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/internal/pinotwire"
)

const msec = time.Millisecond

// result is one final answer of ParseRequest.
type result struct {
	r   pinotwire.Request
	err error
}

// parseIncrementally feeds ParseRequest prefixes of p as a proxy does: the
// first start bytes, then each time the prefix it asks for (or the whole
// payload, marked complete, when it asks for more than there is). It
// returns the final answer and the largest need it saw.
func parseIncrementally(t testing.TB, p []byte, start int) (result, int) {
	t.Helper()
	k, maxNeed := min(start, len(p)), 0
	for {
		r, need, err := pinotwire.ParseRequest(p[:k], k == len(p))
		if need == 0 {
			return result{r, err}, maxNeed
		}
		if need <= k || need > pinotwire.MaxRequestPrefix || err != nil || r != (pinotwire.Request{}) {
			t.Fatalf("prefix %d of %d: need %d, %+v, %v", k, len(p), need, r, err)
		}
		maxNeed = max(maxNeed, need)
		k = min(need, len(p))
	}
}

// sameAnswer reports whether a prefix's answer agrees with the whole
// payload's. A prefix may only know that the answer lies beyond
// MaxRequestPrefix where the whole payload shows its lengths point past its
// end (ErrTooLong against a truncation error).
func sameAnswer(prefix, full result) bool {
	if prefix == full {
		return true
	}
	return prefix.err == pinotwire.ErrTooLong && errors.Is(full.err, pinotwire.ErrNotRequest)
}

// checkRequestPrefixes checks the need protocol on every prefix of p (every
// one up to 600 bytes, then a sample): an answer from a prefix is the whole
// payload's answer; a request for more is beyond the prefix and within the
// limit, and comes with a zero Request; feeding what it asks for until it
// answers gives the whole payload's answer; the whole payload never asks
// for more.
func checkRequestPrefixes(t testing.TB, p []byte) {
	t.Helper()
	r, need, err := pinotwire.ParseRequest(p, true)
	if need != 0 {
		t.Fatalf("complete payload of %d bytes asks for %d", len(p), need)
	}
	full := result{r, err}
	// final[k] is the answer reached from prefix k by following the needs
	// (memoized: the chain from k goes through need(k)).
	final := make([]result, len(p)+1)
	known := make([]bool, len(p)+1)
	final[len(p)], known[len(p)] = full, true
	var from func(k int) result
	from = func(k int) result {
		if known[k] {
			return final[k]
		}
		r, need, err := pinotwire.ParseRequest(p[:k], false)
		var res result
		if need == 0 {
			res = result{r, err}
			if !sameAnswer(res, full) {
				t.Fatalf("prefix %d of %d answers %+v, the payload %+v", k, len(p), res, full)
			}
		} else {
			if need <= k || need > pinotwire.MaxRequestPrefix || err != nil || r != (pinotwire.Request{}) {
				t.Fatalf("prefix %d of %d: need %d, %+v, %v", k, len(p), need, r, err)
			}
			res = from(min(need, len(p)))
		}
		final[k], known[k] = res, true
		return res
	}
	step := 1
	for k := 0; k <= len(p); k += step {
		if k > 600 {
			step = max(1, len(p)/97)
		}
		if got := from(k); !sameAnswer(got, full) {
			t.Fatalf("from prefix %d of %d: %+v, the payload %+v", k, len(p), got, full)
		}
	}
}

func TestParseRequestSimulator(t *testing.T) {
	segs := pinotsim.SegmentsFor("t_REALTIME", 100<<10) // about 100 KB of segment names
	for _, tc := range []struct {
		name string
		req  pinotsim.Request
		want pinotwire.Request
	}{
		{"with timeout", pinotsim.Request{ID: 1234567890000000001, Table: "t_OFFLINE", TimeoutMs: 2500, BrokerID: "b", CID: "c"},
			pinotwire.Request{ID: 1234567890000000001, Timeout: 2500 * msec, HasTimeout: true}},
		{"without timeout", pinotsim.Request{ID: 1234567890000000001, Table: "t_OFFLINE", BrokerID: "b"},
			pinotwire.Request{ID: 1234567890000000001}},
		{"segments and timeout", pinotsim.Request{ID: 5, Table: "t_REALTIME", TimeoutMs: 10_000, Segments: segs, Trace: true},
			pinotwire.Request{ID: 5, Timeout: 10 * time.Second, HasTimeout: true}},
		{"segments, no timeout", pinotsim.Request{ID: 6, Table: "t_REALTIME", Segments: segs},
			pinotwire.Request{ID: 6}},
		{"simulator fields", pinotsim.Request{ID: 7, Table: "t", TimeoutMs: 3, SentAt: time.Now(), Deadline: time.Now()},
			pinotwire.Request{ID: 7, Timeout: 3 * msec, HasTimeout: true}},
		{"zero id", pinotsim.Request{TimeoutMs: 1}, pinotwire.Request{Timeout: msec, HasTimeout: true}},
		{"id -1", pinotsim.Request{ID: -1, TimeoutMs: 1}, pinotwire.Request{ID: -1, Timeout: msec, HasTimeout: true}},
		{"min id", pinotsim.Request{ID: math.MinInt64, TimeoutMs: 1}, pinotwire.Request{ID: math.MinInt64, Timeout: msec, HasTimeout: true}},
		{"max id", pinotsim.Request{ID: math.MaxInt64, TimeoutMs: 1}, pinotwire.Request{ID: math.MaxInt64, Timeout: msec, HasTimeout: true}},
		{"huge timeout", pinotsim.Request{ID: 1, TimeoutMs: math.MaxInt64}, pinotwire.Request{ID: 1, Timeout: math.MaxInt64, HasTimeout: true}},
		{"negative timeout", pinotsim.Request{ID: 1, TimeoutMs: -5}, pinotwire.Request{ID: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pinotsim.AppendRequest(nil, &tc.req)
			r, need, err := pinotwire.ParseRequest(p, true)
			if err != nil || need != 0 || r != tc.want {
				t.Fatalf("ParseRequest = %+v, %d, %v; want %+v", r, need, err, tc.want)
			}
			checkRequestPrefixes(t, p)
			// The answer is in the first bytes, whatever the segments.
			_, maxNeed := parseIncrementally(t, p, 0)
			limit := 60 + len(tc.req.Table)
			if maxNeed > limit {
				t.Fatalf("asked for %d bytes of %d; the BrokerRequest ends before %d", maxNeed, len(p), limit)
			}
			// The simulator's own decoder agrees.
			back, err := pinotsim.ParseRequest(p)
			wantMs := int64(0)
			if tc.want.HasTimeout {
				wantMs = tc.want.Timeout.Milliseconds()
			}
			if err != nil || back.ID != tc.req.ID || back.TimeoutMs != wantMs || len(back.Segments) != len(tc.req.Segments) {
				t.Fatalf("pinotsim.ParseRequest = %+v, %v", back, err)
			}
		})
	}
}

// For a request with a timeout, the need sequence from an empty prefix
// asks, last, for exactly the end of the timeoutMs value.
func TestParseRequestNeedIsExact(t *testing.T) {
	p := pinotsim.AppendRequest(nil, &pinotsim.Request{ID: 1234567890000000001, Table: "t_OFFLINE", TimeoutMs: 2500,
		Segments: []string{"s0"}, BrokerID: "b"})
	end := bytes.Index(p, []byte("2500")) + 4
	_, maxNeed := parseIncrementally(t, p, 0)
	if maxNeed != end {
		t.Fatalf("largest need %d, the value ends at %d", maxNeed, end)
	}
	// One byte short of the value, it asks for exactly the value.
	if _, need, err := pinotwire.ParseRequest(p[:end-1], false); need != end || err != nil {
		t.Fatalf("one short: need %d, %v", need, err)
	}
	// Within the requestId varint it asks for one more byte at a time.
	if _, need, _ := pinotwire.ParseRequest(p[:3], false); need != 4 {
		t.Fatalf("inside the id: need %d, want 4", need)
	}
	if _, need, _ := pinotwire.ParseRequest(nil, false); need != 1 {
		t.Fatalf("empty: need %d, want 1", need)
	}
}

// appendHeader appends a field header with the compact writer's rule.
func appendHeader(b []byte, last *int16, typ byte, id int16) []byte {
	if d := id - *last; d > 0 && d <= 15 {
		b = append(b, byte(d)<<4|typ)
	} else {
		b = binary.AppendVarint(append(b, typ), int64(id))
	}
	*last = id
	return b
}

// req builds "0x16 id, field 2 BrokerRequest{brokerFields}, STOP".
func req(id int64, broker ...byte) []byte {
	b := binary.AppendVarint([]byte{0x16}, id)
	b = append(b, 0x1c)
	b = append(b, broker...)
	return append(b, 0, 0)
}

// pq wraps PinotQuery fields as BrokerRequest field 17, with a long-form
// header (0x0c, zigzag 17) so that it may follow any field.
func pq(fields ...[]byte) []byte {
	return cat([]byte{0x0c, 0x22}, cat(fields...), []byte{0})
}

// opts builds a queryOptions map<string,string> value.
func opts(kvs ...string) []byte {
	b := binary.AppendUvarint(nil, uint64(len(kvs)/2))
	if len(kvs) > 0 {
		b = append(b, 0x88)
	}
	for _, s := range kvs {
		b = append(binary.AppendUvarint(b, uint64(len(s))), s...)
	}
	return b
}

func cat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

func TestParseRequestTimeoutValues(t *testing.T) {
	for _, tc := range []struct {
		v    string
		want time.Duration
		ok   bool
	}{
		{"0", 0, true},
		{"1", msec, true},
		{"+7", 7 * msec, true},
		{"-0", 0, true},
		{"000000000000000000000000000042", 42 * msec, true},
		{"9223372036854", 9223372036854 * msec, true},
		{"9223372036855", math.MaxInt64, true}, // beyond a Duration: clamped
		{"9223372036854775807", math.MaxInt64, true},
		{"9223372036854775808", 0, false}, // beyond a long
		{"99999999999999999999999", 0, false},
		{"-1", 0, false},
		{"-9223372036854775808", 0, false},
		{"", 0, false},
		{"+", 0, false},
		{"-", 0, false},
		{"12a", 0, false},
		{"abc", 0, false},
		{" 12", 0, false},
		{"1.5", 0, false},
		{"1e3", 0, false},
		{"١٢", 0, false}, // non-ASCII digits
	} {
		p := req(3, pq([]byte{0xbb}, opts("timeoutMs", tc.v))...)
		r, need, err := pinotwire.ParseRequest(p, true)
		want := pinotwire.Request{ID: 3, Timeout: tc.want, HasTimeout: tc.ok}
		if err != nil || need != 0 || r != want {
			t.Errorf("timeoutMs %q: %+v, %d, %v; want %+v", tc.v, r, need, err, want)
		}
		checkRequestPrefixes(t, p)
	}
}

func TestParseRequestOptionMaps(t *testing.T) {
	var last int16
	long := appendHeader(nil, &last, 0x0b, 11) // field 11 after 0: short form
	last = 13
	longForm := appendHeader(nil, &last, 0x0b, 11) // after 13: long form 0x0b 0x16
	if !bytes.Equal(longForm, []byte{0x0b, 0x16}) {
		t.Fatalf("long form header %x", longForm)
	}
	for _, tc := range []struct {
		name string
		p    []byte
		want pinotwire.Request
	}{
		{"keys before", req(1, pq(cat(long, opts("a", "b", "timeoutMx", "1", "timeoutMsX", "2", "TIMEOUTMS", "3", "timeoutMs", "44", "z", "z")))...),
			pinotwire.Request{ID: 1, Timeout: 44 * msec, HasTimeout: true}},
		{"first wins", req(1, pq(cat(long, opts("timeoutMs", "1", "timeoutMs", "2")))...),
			pinotwire.Request{ID: 1, Timeout: msec, HasTimeout: true}},
		{"invalid decides", req(1, cat([]byte{0xeb}, opts("timeoutMs", "5"), pq(cat(long, opts("timeoutMs", "x"))))...),
			pinotwire.Request{ID: 1}},
		{"empty map", req(1, pq(cat(long, opts()))...), pinotwire.Request{ID: 1}},
		{"long-form header", req(1, pq(cat([]byte{0xd5, 0x02}, longForm, opts("timeoutMs", "8")))...),
			pinotwire.Request{ID: 1, Timeout: 8 * msec, HasTimeout: true}},
		{"legacy 14", req(1, cat([]byte{0xeb}, opts("timeoutMs", "5"))...),
			pinotwire.Request{ID: 1, Timeout: 5 * msec, HasTimeout: true}},
		{"legacy after query", req(1, cat(pq(cat(long, opts("k", "v"))), []byte{0x0b, 0x1c}, opts("timeoutMs", "6"))...),
			pinotwire.Request{ID: 1, Timeout: 6 * msec, HasTimeout: true}},
		{"query beats legacy", req(1, cat([]byte{0xeb}, opts("timeoutMs", "5"), []byte{0x3c}, long, opts("timeoutMs", "7"), []byte{0})...),
			pinotwire.Request{ID: 1, Timeout: 7 * msec, HasTimeout: true}},
		{"first legacy wins", req(1, cat([]byte{0xeb}, opts("timeoutMs", "5"), []byte{0x0b, 0x1c}, opts("timeoutMs", "6"))...),
			pinotwire.Request{ID: 1, Timeout: 5 * msec, HasTimeout: true}},
		{"debugOptions ignored", req(1, cat([]byte{0xdb}, opts("timeoutMs", "5"))...), pinotwire.Request{ID: 1}},
		{"not string to string", req(1, pq(cat(long, []byte{1, 0x85, 9}, []byte("timeoutMs"), []byte{10}))...),
			pinotwire.Request{ID: 1}},
		{"field 11 not a map", req(1, pq(cat([]byte{0xb8}, []byte{9}, []byte("timeoutMs")))...), pinotwire.Request{ID: 1}},
		{"field 17 not a struct", req(1, cat([]byte{0x0b, 0x22}, opts("timeoutMs", "5"))...), pinotwire.Request{ID: 1}},
		{"short-form 17 after 2", req(1, cat([]byte{0x2c, 0x18, 1, 't', 0, 0xfc, 0xbb}, opts("timeoutMs", "4"), []byte{0})...),
			pinotwire.Request{ID: 1, Timeout: 4 * msec, HasTimeout: true}},
		{"short-form 15 is not 17", req(1, cat([]byte{0xfc, 0xbb}, opts("timeoutMs", "4"), []byte{0})...), pinotwire.Request{ID: 1}},
		{"other map in PinotQuery", req(1, pq(cat([]byte{0xab}, opts("timeoutMs", "5")))...), pinotwire.Request{ID: 1}},
		{"nested PinotQuery", req(1, pq(cat([]byte{0x2c, 0x2c}, long, opts("timeoutMs", "5"), []byte{0, 0}))...),
			pinotwire.Request{ID: 1}},
		{"no BrokerRequest fields", req(1), pinotwire.Request{ID: 1}},
		// libthrift reads lengths with readVarint32: the low 32 bits count.
		{"length beyond 32 bits", req(1, cat([]byte{0x18}, binary.AppendUvarint(nil, 1<<32+1), []byte{'x'})...), pinotwire.Request{ID: 1}},
		// and varints of 10 bytes whose bits run past 64 are read, not refused.
		{"overflowing 10-byte varint", req(1, cat([]byte{0x16}, bytes.Repeat([]byte{0xff}, 9), []byte{0x7f})...), pinotwire.Request{ID: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, need, err := pinotwire.ParseRequest(tc.p, true)
			if err != nil || need != 0 || r != tc.want {
				t.Fatalf("ParseRequest(%x) = %+v, %d, %v; want %+v", tc.p, r, need, err, tc.want)
			}
			checkRequestPrefixes(t, tc.p)
		})
	}
}

// Every value type of the compact protocol is skipped where it may appear,
// bool fields with no value bytes, bools in containers with one.
func TestParseRequestSkipsEveryType(t *testing.T) {
	var f []byte
	var last int16
	f = appendHeader(f, &last, 0x1, 1) // bool true field: no value
	f = appendHeader(f, &last, 0x2, 2) // bool false field
	f = appendHeader(f, &last, 0x3, 3)
	f = append(f, 0xff)
	f = appendHeader(f, &last, 0x4, 4)
	f = binary.AppendVarint(f, -300)
	f = appendHeader(f, &last, 0x5, 5)
	f = binary.AppendVarint(f, math.MinInt32)
	f = appendHeader(f, &last, 0x6, 6)
	f = binary.AppendVarint(f, math.MinInt64)
	f = appendHeader(f, &last, 0x7, 7)
	f = append(f, 1, 2, 3, 4, 5, 6, 7, 8)
	f = appendHeader(f, &last, 0x8, 8)
	f = append(f, 3, 'a', 'b', 'c')
	f = appendHeader(f, &last, 0x9, 9)
	f = append(f, 0x31, 1, 2, 1) // list<bool> of 3, one byte each
	f = appendHeader(f, &last, 0xa, 10)
	f = append(f, 0x27) // set<double> of 2
	f = append(f, make([]byte, 16)...)
	f = appendHeader(f, &last, 0x9, 12)
	f = append(f, 0xf8, 15) // list<string> of 15, long form
	for range 15 {
		f = append(f, 1, 'x')
	}
	f = appendHeader(f, &last, 0xb, 13)
	f = append(f, 2, 0x1c, 1, 0x11, 0, 2, 0x00) // map<bool,struct>{true:{f1 true}, false:{}}
	f = appendHeader(f, &last, 0xd, 14)
	f = append(f, make([]byte, 16)...) // uuid
	f = appendHeader(f, &last, 0x9, 15)
	f = append(f, 0x2d) // list<uuid> of 2
	f = append(f, make([]byte, 32)...)
	f = appendHeader(f, &last, 0xb, 16)
	f = append(f, 0) // empty map: no type byte
	f = appendHeader(f, &last, 0x9, 17)
	f = append(f, 0x00)                      // empty list of type 0
	f = appendHeader(f, &last, 0xc, 100)     // long form
	f = append(f, 0x19, 0x1c, 0x15, 4, 0, 0) // struct{list<struct{i32}>}
	f = appendHeader(f, &last, 0x6, -5)      // negative id
	f = append(f, 0)
	f = appendHeader(f, &last, 0xb, 11) // and now, long form, the options
	f = append(f, opts("timeoutMs", "77")...)
	p := req(99, pq(f)...)
	r, need, err := pinotwire.ParseRequest(p, true)
	if want := (pinotwire.Request{ID: 99, Timeout: 77 * msec, HasTimeout: true}); err != nil || need != 0 || r != want {
		t.Fatalf("ParseRequest = %+v, %d, %v", r, need, err)
	}
	checkRequestPrefixes(t, p)
}

func TestParseRequestErrors(t *testing.T) {
	deep := func(open, close []byte, n int) []byte {
		return cat(bytes.Repeat(open, n), close)
	}
	for _, tc := range []struct {
		name string
		p    []byte
		want error
	}{
		{"empty", nil, pinotwire.ErrNotRequest},
		{"wrong first byte", []byte{0x18, 2, 'a', 'b'}, pinotwire.ErrNotRequest},
		{"zero first byte", []byte{0, 0x16, 2}, pinotwire.ErrNotRequest},
		{"i32 id", []byte{0x15, 2, 0x1c, 0, 0}, pinotwire.ErrNotRequest},
		{"id truncated", []byte{0x16, 0x80, 0x80}, pinotwire.ErrNotRequest},
		{"id overlong", cat([]byte{0x16}, bytes.Repeat([]byte{0xff}, 10), []byte{1}), pinotwire.ErrNotRequest},
		{"only the id", []byte{0x16, 2}, pinotwire.ErrNotRequest},
		{"stop after id", []byte{0x16, 2, 0}, pinotwire.ErrNotRequest},
		{"field 2 not a struct", []byte{0x16, 2, 0x18, 1, 'x', 0}, pinotwire.ErrNotRequest},
		{"field 3 after id", []byte{0x16, 2, 0x29, 0x18, 1, 'x', 0}, pinotwire.ErrNotRequest},
		{"unterminated BrokerRequest", []byte{0x16, 2, 0x1c, 0x2c, 0x18, 1, 'x', 0}, pinotwire.ErrNotRequest},
		{"unknown type", req(1, 0x1e), pinotwire.ErrNotRequest},
		{"unknown type 15", req(1, 0x1f), pinotwire.ErrNotRequest},
		{"unknown element type", req(1, 0x19, 0x1e, 0), pinotwire.ErrNotRequest},
		{"element type 0, not empty", req(1, 0x19, 0x10), pinotwire.ErrNotRequest},
		{"unknown map key type", req(1, 0x1b, 1, 0xe8, 0), pinotwire.ErrNotRequest},
		{"unknown map value type", req(1, 0x1b, 1, 0x8f, 0), pinotwire.ErrNotRequest},
		{"unknown option value type", req(1, pq([]byte{0xbb, 1, 0x8e, 0})...), pinotwire.ErrNotRequest},
		{"overlong varint skipped", req(1, cat([]byte{0x16}, bytes.Repeat([]byte{0x80}, 10), []byte{0})...), pinotwire.ErrNotRequest},
		{"string past the end", req(1, 0x18, 100, 'a'), pinotwire.ErrNotRequest},
		{"huge string", req(1, cat([]byte{0x18}, binary.AppendUvarint(nil, math.MaxInt32))...), pinotwire.ErrNotRequest},
		{"option value past the end", []byte{0x16, 2, 0x1c, 0x0c, 0x22, 0xbb, 1, 0x88, 9, 't', 'i', 'm', 'e', 'o', 'u', 't', 'M', 's', 5, '1'}, pinotwire.ErrNotRequest},
		{"option key past the end", []byte{0x16, 2, 0x1c, 0x0c, 0x22, 0xbb, 1, 0x88, 9, 't', 'i', 'm', 'e'}, pinotwire.ErrNotRequest},
		{"huge list of doubles", req(1, cat([]byte{0x19, 0xf7}, binary.AppendUvarint(nil, math.MaxInt32))...), pinotwire.ErrNotRequest},
		{"huge map of bytes", req(1, cat([]byte{0x1b}, binary.AppendUvarint(nil, math.MaxInt32), []byte{0x33})...), pinotwire.ErrNotRequest},
		{"huge list of strings", req(1, cat([]byte{0x19, 0xf8}, binary.AppendUvarint(nil, math.MaxInt32), []byte{0, 0})...), pinotwire.ErrNotRequest},
		{"negative string length", req(1, cat([]byte{0x18}, binary.AppendUvarint(nil, 1<<32-1))...), pinotwire.ErrNotRequest},
		{"negative list size", req(1, cat([]byte{0x19, 0xf8}, binary.AppendUvarint(nil, 1<<31))...), pinotwire.ErrNotRequest},
		{"negative map size", req(1, cat([]byte{0x1b}, binary.AppendUvarint(nil, 1<<32-1), []byte{0x88})...), pinotwire.ErrNotRequest},
		{"negative option key length", req(1, pq(cat([]byte{0xbb, 1, 0x88}, binary.AppendUvarint(nil, 1<<32-9)))...), pinotwire.ErrNotRequest},
		{"lists too deep", req(1, cat([]byte{0x19}, deep([]byte{0x19}, []byte{0x00}, 70))...), pinotwire.ErrNotRequest},
		{"structs too deep", req(1, cat(deep([]byte{0x1c}, nil, 70), bytes.Repeat([]byte{0}, 70))...), pinotwire.ErrNotRequest},
		{"maps too deep", req(1, cat([]byte{0x1b}, deep([]byte{1, 0xbb}, []byte{0}, 70))...), pinotwire.ErrNotRequest},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, need, err := pinotwire.ParseRequest(tc.p, true)
			if !errors.Is(err, tc.want) || need != 0 || r != (pinotwire.Request{}) {
				t.Fatalf("ParseRequest(%x) = %+v, %d, %v; want %v", tc.p, r, need, err, tc.want)
			}
			if errors.Is(err, pinotwire.ErrTooLong) {
				t.Fatalf("%v is also ErrTooLong", err)
			}
			checkRequestPrefixes(t, tc.p)
		})
	}
}

// Malformed input is rejected from a prefix too, as soon as it shows.
func TestParseRequestErrorsEarly(t *testing.T) {
	for _, p := range [][]byte{
		{0x17},
		{0x16, 2, 0x29},
		{0x16, 2, 0x1c, 0x1e},
		cat([]byte{0x16, 2, 0x1c}, bytes.Repeat([]byte{0x1c}, 70)),
	} {
		if _, need, err := pinotwire.ParseRequest(p, false); !errors.Is(err, pinotwire.ErrNotRequest) || need != 0 {
			t.Errorf("ParseRequest(%x, false) = %d, %v", p, need, err)
		}
	}
}

func TestParseRequestTooLong(t *testing.T) {
	big := strings.Repeat("x", pinotwire.MaxRequestPrefix)
	for _, tc := range []struct {
		name string
		p    []byte
	}{
		{"filler before PinotQuery", req(8, cat([]byte{0x18}, binary.AppendUvarint(nil, uint64(len(big))), []byte(big), pq([]byte{0xbb, 1, 0x88, 9, 't'}))...)},
		{"long option value", req(8, pq(cat([]byte{0xbb}, opts("timeoutMs", big)))...)},
		{"huge string", req(8, cat([]byte{0x18}, binary.AppendUvarint(nil, math.MaxInt32))...)},
		{"huge list of doubles", req(8, cat([]byte{0x19, 0xf7}, binary.AppendUvarint(nil, math.MaxInt32))...)},
		{"huge map of bools", req(8, cat([]byte{0x1b}, binary.AppendUvarint(nil, math.MaxInt32), []byte{0x11})...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Short of the whole payload, the reader cannot tell a length
			// beyond the limit from one beyond the payload's end.
			r, need, err := pinotwire.ParseRequest(tc.p[:len(tc.p)-1], false)
			if err != pinotwire.ErrTooLong || need != 0 || r != (pinotwire.Request{ID: 8}) {
				t.Fatalf("prefix: %+v, %d, %v; want ErrTooLong with the id", r, need, err)
			}
			r, need, err = pinotwire.ParseRequest(tc.p, true)
			if len(tc.p) > pinotwire.MaxRequestPrefix {
				if err != pinotwire.ErrTooLong || need != 0 || r != (pinotwire.Request{ID: 8}) {
					t.Fatalf("whole: %+v, %d, %v; want ErrTooLong with the id", r, need, err)
				}
			} else if !errors.Is(err, pinotwire.ErrNotRequest) || need != 0 {
				t.Fatalf("whole: %+v, %d, %v; want a truncation error", r, need, err)
			}
			if _, maxNeed := parseIncrementally(t, tc.p, 0); maxNeed > pinotwire.MaxRequestPrefix {
				t.Fatalf("asked for %d", maxNeed)
			}
		})
	}
	// An answer right at the limit, in a payload longer than it.
	val := strings.Repeat("0", pinotwire.MaxRequestPrefix-40) + "5"
	p := req(8, pq(cat([]byte{0xbb}, opts("timeoutMs", val)))...)
	p = append(p, big...)
	want := result{pinotwire.Request{ID: 8, Timeout: 5 * msec, HasTimeout: true}, nil}
	if res, maxNeed := parseIncrementally(t, p, 0); res != want || maxNeed > pinotwire.MaxRequestPrefix {
		t.Fatalf("at the limit: %+v, max need %d", res, maxNeed)
	}
	if r, need, err := pinotwire.ParseRequest(p, true); (result{r, err}) != want || need != 0 {
		t.Fatalf("at the limit, whole: %+v, %d, %v", r, need, err)
	}
}

// The whole payload, marked complete, never asks for more; its proper
// prefixes, marked complete, are either answered the same or rejected.
func TestParseRequestTruncatedComplete(t *testing.T) {
	p := pinotsim.AppendRequest(nil, &pinotsim.Request{ID: 1 << 60, Table: "t_OFFLINE", TimeoutMs: 1234, Segments: []string{"a", "b"}})
	full, _, _ := pinotwire.ParseRequest(p, true)
	for k := range len(p) {
		r, need, err := pinotwire.ParseRequest(p[:k], true)
		if need != 0 {
			t.Fatalf("prefix %d complete: need %d", k, need)
		}
		if err == nil && r != full {
			t.Fatalf("prefix %d complete: %+v, want %+v", k, r, full)
		}
		if err != nil && !errors.Is(err, pinotwire.ErrNotRequest) {
			t.Fatalf("prefix %d complete: %v", k, err)
		}
	}
}

func TestParseRequestAllocs(t *testing.T) {
	withTimeout := pinotsim.AppendRequest(nil, &pinotsim.Request{ID: 1234567890000000001, Table: "t_OFFLINE", TimeoutMs: 2500,
		Segments: pinotsim.SegmentsFor("t", 8<<10), BrokerID: "b"})
	realistic := thriftCases()["modern"].bytes(t)
	noOptions := thriftCases()["no options"].bytes(t)
	tooLong := req(8, cat([]byte{0x18}, binary.AppendUvarint(nil, math.MaxInt32))...)
	for name, call := range map[string]func(){
		"timeout":    func() { _, _, _ = pinotwire.ParseRequest(withTimeout, true) },
		"realistic":  func() { _, _, _ = pinotwire.ParseRequest(realistic, true) },
		"no options": func() { _, _, _ = pinotwire.ParseRequest(noOptions, false) },
		"need":       func() { _, _, _ = pinotwire.ParseRequest(realistic[:900], false) },
		"bad":        func() { _, _, _ = pinotwire.ParseRequest([]byte{0x16, 2, 0x1e}, true) },
		"truncated":  func() { _, _, _ = pinotwire.ParseRequest(realistic[:900], true) },
		"too long":   func() { _, _, _ = pinotwire.ParseRequest(tooLong, false) },
	} {
		if n := testing.AllocsPerRun(100, call); n != 0 {
			t.Errorf("%s: %v allocations per call", name, n)
		}
	}
}

func BenchmarkParseRequest(b *testing.B) {
	p := thriftCases()["modern"].bytes(b)
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := pinotwire.ParseRequest(p, true); err != nil {
			b.Fatal(err)
		}
	}
}
