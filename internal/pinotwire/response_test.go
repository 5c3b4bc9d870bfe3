package pinotwire_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/internal/pinotwire"
)

// idResult is one final answer of ResponseID.
type idResult struct {
	id    int64
	found bool
	err   error
}

func sameID(prefix, full idResult) bool {
	if prefix == full {
		return true
	}
	return prefix.err == pinotwire.ErrTooLong && errors.Is(full.err, pinotwire.ErrNotDataTable)
}

// checkIDPrefixes is checkRequestPrefixes for ResponseID on a metadata
// section m.
func checkIDPrefixes(t testing.TB, m []byte) idResult {
	t.Helper()
	id, found, need, err := pinotwire.ResponseID(m, true)
	if need != 0 {
		t.Fatalf("complete section of %d bytes asks for %d", len(m), need)
	}
	full := idResult{id, found, err}
	final := make([]idResult, len(m)+1)
	known := make([]bool, len(m)+1)
	final[len(m)], known[len(m)] = full, true
	var from func(k int) idResult
	from = func(k int) idResult {
		if known[k] {
			return final[k]
		}
		id, found, need, err := pinotwire.ResponseID(m[:k], false)
		var res idResult
		if need == 0 {
			res = idResult{id, found, err}
			if !sameID(res, full) {
				t.Fatalf("prefix %d of %d answers %+v, the section %+v", k, len(m), res, full)
			}
		} else {
			if need <= k || need > pinotwire.MaxMetadataPrefix || err != nil || found || id != 0 {
				t.Fatalf("prefix %d of %d: need %d, %d, %v, %v", k, len(m), need, id, found, err)
			}
			res = from(min(need, len(m)))
		}
		final[k], known[k] = res, true
		return res
	}
	step := 1
	for k := 0; k <= len(m); k += step {
		if k > 600 {
			step = max(1, len(m)/97)
		}
		if got := from(k); !sameID(got, full) {
			t.Fatalf("from prefix %d of %d: %+v, the section %+v", k, len(m), got, full)
		}
	}
	return full
}

// idIncrementally follows ResponseID's needs from an empty prefix and
// returns the answer and the largest need.
func idIncrementally(t testing.TB, m []byte) (idResult, int) {
	t.Helper()
	k, maxNeed := 0, 0
	for {
		id, found, need, err := pinotwire.ResponseID(m[:k], k == len(m))
		if need == 0 {
			return idResult{id, found, err}, maxNeed
		}
		maxNeed = max(maxNeed, need)
		k = min(need, len(m))
	}
}

// metadata returns the metadata section of a whole payload p, found as the
// proxy finds it: from the 52-byte header alone.
func metadata(t testing.TB, p []byte) []byte {
	t.Helper()
	off, err := pinotwire.MetadataOffset(p[:pinotwire.ResponseHeaderLen])
	if err != nil || off > int64(len(p)) {
		t.Fatalf("MetadataOffset = %d, %v (payload %d bytes)", off, err, len(p))
	}
	return p[off:]
}

// entries is a realistic set of metadata a Pinot server writes, every
// value type, with REQUEST_ID among them.
func entries(id int64) []pinotsim.Metadata {
	return []pinotsim.Metadata{
		{Key: 41, Value: "cid-123"},             // queryId
		{Key: 40, Value: "primary"},             // workloadName
		{Key: 1, Value: "airlineStats_OFFLINE"}, // table
		{Key: 2, Value: "123456"},               // numDocsScanned
		{Key: 3, Value: "99"},                   // numEntriesScannedInFilter
		{Key: 5, Value: "12"},                   // numSegmentsQueried
		{Key: 6, Value: "12"},                   // numSegmentsProcessed
		{Key: 10, Value: "987654321"},           // totalDocs
		{Key: 11, Value: "false"},               // numGroupsLimitReached (a STRING)
		{Key: 12, Value: "3"},                   // timeUsedMs
		{Key: 13, Value: `[{"0":[{"x":1}]}]`},   // traceInfo
		{Key: pinotwire.KeyRequestID, Value: strconv.FormatInt(id, 10)},
		{Key: 17, Value: "1000000"}, // threadCpuTimeNs
		{Key: 20, Value: "0"},       // numSegmentsPrunedByServer
		{Key: 29, Value: "10"},      // numRows
		{Key: 31, Value: "op-1"},    // operatorId
		{Key: 37, Value: "-1"},
		{Key: 38, Value: "true"}, // a BOOLEAN
		{Key: 44, Value: ""},     // an empty STRING
	}
}

// withIDAt moves the REQUEST_ID entry of es to index i.
func withIDAt(es []pinotsim.Metadata, i int) []pinotsim.Metadata {
	var id pinotsim.Metadata
	var rest []pinotsim.Metadata
	for _, e := range es {
		if e.Key == pinotwire.KeyRequestID {
			id = e
		} else {
			rest = append(rest, e)
		}
	}
	out := append([]pinotsim.Metadata(nil), rest[:i]...)
	out = append(out, id)
	return append(out, rest[i:]...)
}

func TestResponseIDOrders(t *testing.T) {
	const id = 1234567890000000001
	base := entries(id)
	n := len(base) - 1
	rng := rand.New(rand.NewPCG(1, 2))
	orders := map[string][]pinotsim.Metadata{
		"first":               withIDAt(base, 0),
		"last":                withIDAt(base, n),
		"after strings":       withIDAt(base, 3), // queryId, workloadName, table
		"middle":              withIDAt(base, n/2),
		"only":                {{Key: pinotwire.KeyRequestID, Value: "-7"}},
		"after a long string": append([]pinotsim.Metadata{{Key: 13, Value: strings.Repeat("t", 5000)}}, withIDAt(base, 0)...),
		"after 40 entries":    append(manyEntries(40), withIDAt(base, n)...),
		"second":              withIDAt(base, 1),
	}
	for i := range 5 {
		es := append([]pinotsim.Metadata(nil), base...)
		rng.Shuffle(len(es), func(a, b int) { es[a], es[b] = es[b], es[a] })
		orders["shuffled "+strconv.Itoa(i)] = es
	}
	for name, es := range orders {
		t.Run(name, func(t *testing.T) {
			p, err := pinotsim.AppendDataTable(nil, es)
			if err != nil {
				t.Fatal(err)
			}
			want := int64(id)
			if name == "only" {
				want = -7
			}
			m := metadata(t, p)
			if got := checkIDPrefixes(t, m); got != (idResult{want, true, nil}) {
				t.Fatalf("ResponseID = %+v, want %d", got, want)
			}
			// It reads up to the id's last byte and no further.
			_, maxNeed := idIncrementally(t, m)
			var idEnd int
			for _, e := range es {
				idEnd += 4 + valueLen(e)
				if e.Key == pinotwire.KeyRequestID {
					break
				}
			}
			if maxNeed != 8+idEnd {
				t.Fatalf("largest need %d, the id ends at %d", maxNeed, 8+idEnd)
			}
			if got, err := pinotsim.ResponseID(p); err != nil || got != want {
				t.Fatalf("pinotsim.ResponseID = %d, %v", got, err)
			}
		})
	}
}

// manyEntries is n metadata entries of every type, without REQUEST_ID.
func manyEntries(n int) []pinotsim.Metadata {
	keys := []int32{0, 2, 5, 38, 41, 16, 21, 13}
	var out []pinotsim.Metadata
	for i := range n {
		k := keys[i%len(keys)]
		v := "1"
		switch pinotwire.MetadataKeyType(k) {
		case pinotwire.MetadataString:
			v = strings.Repeat("s", i)
		case pinotwire.MetadataBoolean:
			v = "false"
		}
		out = append(out, pinotsim.Metadata{Key: k, Value: v})
	}
	return out
}

func valueLen(e pinotsim.Metadata) int {
	switch pinotwire.MetadataKeyType(e.Key) {
	case pinotwire.MetadataLong:
		return 8
	case pinotwire.MetadataInt:
		return 4
	case pinotwire.MetadataBoolean:
		return 1
	}
	return 4 + len(e.Value)
}

// Sections of megabytes before the metadata: the offset comes from the
// header alone, and the id from a few bytes at the end.
func TestResponseIDAfterLargeSections(t *testing.T) {
	dict := make([]string, 2000)
	for i := range dict {
		dict[i] = "value_" + strconv.Itoa(i)
	}
	tbl := pinotsim.DataTable{
		NumRows: 100000, NumColumns: 3,
		Exceptions: []pinotsim.Exception{{Code: 250, Message: strings.Repeat("timeout ", 100)}, {Code: 200, Message: "x"}},
		Dictionary: dict,
		Schema:     bytes.Repeat([]byte{1, 2, 3}, 1000),
		Fixed:      bytes.Repeat([]byte{0xab}, 1<<20),
		Variable:   bytes.Repeat([]byte{0xcd}, 3<<20),
		Metadata:   withIDAt(entries(42), 7),
	}
	p, err := tbl.Append(nil)
	if err != nil {
		t.Fatal(err)
	}
	off, err := pinotwire.MetadataOffset(p[:pinotwire.ResponseHeaderLen])
	mdLen := int(binary.BigEndian.Uint32(p[off:]))
	if err != nil || int(off)+4+mdLen != len(p) || off < 4<<20 {
		t.Fatalf("MetadataOffset = %d, %v; payload %d, metadata %d", off, err, len(p), mdLen)
	}
	m := p[off:]
	if got := checkIDPrefixes(t, m); got != (idResult{42, true, nil}) {
		t.Fatalf("ResponseID = %+v", got)
	}
	if id, err := pinotsim.ResponseID(p); err != nil || id != 42 {
		t.Fatalf("pinotsim.ResponseID = %d, %v", id, err)
	}
	// Only a zero-length section may start anywhere (Java does not seek to it).
	for _, sec := range []int{5, 7} { // dictionary, schema
		bad := bytes.Clone(p[:pinotwire.ResponseHeaderLen])
		binary.BigEndian.PutUint32(bad[4*sec:], binary.BigEndian.Uint32(bad[4*sec:])+1)
		if _, err := pinotwire.MetadataOffset(bad); !errors.Is(err, pinotwire.ErrNotDataTable) {
			t.Fatalf("section %d moved: %v", sec, err)
		}
	}
}

// raw builds a metadata section by hand: metadataLen (the real length
// unless given), numEntries, then the entry bytes.
func raw(numEntries int32, ents ...[]byte) []byte {
	body := binary.BigEndian.AppendUint32(nil, uint32(numEntries))
	for _, e := range ents {
		body = append(body, e...)
	}
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
}

func ent(key int32, value ...byte) []byte {
	return append(binary.BigEndian.AppendUint32(nil, uint32(key)), value...)
}

func long(v int64) []byte      { return binary.BigEndian.AppendUint64(nil, uint64(v)) }
func int4(v int32) []byte      { return binary.BigEndian.AppendUint32(nil, uint32(v)) }
func str4(s string) []byte     { return append(int4(int32(len(s))), s...) }
func cat4(bs ...[]byte) []byte { return bytes.Join(bs, nil) }

func TestResponseIDCases(t *testing.T) {
	for _, tc := range []struct {
		name string
		m    []byte
		want idResult
	}{
		{"unknown key before", raw(2, ent(45, 1, 2, 3, 4), ent(14, long(5)...)), idResult{}},
		{"negative key before", raw(2, ent(-1), ent(14, long(5)...)), idResult{}},
		{"huge key before", raw(2, ent(1<<30), ent(14, long(5)...)), idResult{}},
		{"unknown key after", raw(2, ent(14, long(5)...), ent(45, 1)), idResult{5, true, nil}},
		{"no REQUEST_ID", raw(3, ent(2, long(1)...), ent(5, int4(2)...), ent(0, str4("x")...)), idResult{}},
		{"no entries", raw(0), idResult{}},
		{"negative count", raw(-1, ent(14, long(5)...)), idResult{}},
		{"count short of the id", raw(1, ent(2, long(1)...), ent(14, long(5)...)), idResult{}},
		{"first REQUEST_ID wins", raw(2, ent(14, long(5)...), ent(14, long(6)...)), idResult{5, true, nil}},
		{"metadataLen 0", cat4(int4(0), int4(1), ent(14, long(5)...)), idResult{}},
		{"metadataLen ignored otherwise", cat4(int4(1), int4(1), ent(14, long(-5)...)), idResult{-5, true, nil}},
		{"negative metadataLen", cat4(int4(-3), int4(1), ent(14, long(9)...)), idResult{9, true, nil}},
		{"empty string", raw(2, ent(0, str4("")...), ent(14, long(5)...)), idResult{5, true, nil}},
		{"boolean", raw(2, ent(38, 1), ent(14, long(5)...)), idResult{5, true, nil}},
		{"min id", raw(1, ent(14, long(math.MinInt64)...)), idResult{math.MinInt64, true, nil}},
		{"trailing bytes", cat4(raw(1, ent(14, long(5)...)), []byte{1, 2, 3}), idResult{5, true, nil}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := checkIDPrefixes(t, tc.m); got != tc.want {
				t.Fatalf("ResponseID(%x) = %+v, want %+v", tc.m, got, tc.want)
			}
		})
	}
}

func TestResponseIDNeedIsExact(t *testing.T) {
	m := metadata(t, pinotsim.AppendResponse(nil, 1234567890000000001))
	for _, tc := range []struct{ k, need int }{{0, 4}, {3, 4}, {4, 8}, {7, 8}, {8, 12}, {11, 12}, {12, 20}, {19, 20}} {
		if _, _, need, err := pinotwire.ResponseID(m[:tc.k], false); need != tc.need || err != nil {
			t.Errorf("prefix %d: need %d, %v; want %d", tc.k, need, err, tc.need)
		}
	}
	// A string is skipped without its bytes: the need jumps past it.
	s := raw(2, ent(13, str4(strings.Repeat("t", 1000))...), ent(14, long(5)...))
	if _, _, need, _ := pinotwire.ResponseID(s[:16], false); need != 16+1000+4 {
		t.Fatalf("after a string length: need %d, want %d", need, 16+1000+4)
	}
	// A skipped value at the end must be there before the answer is final.
	end := raw(1, ent(2, long(1)...))
	if _, _, need, _ := pinotwire.ResponseID(end[:13], false); need != 20 {
		t.Fatalf("last value skipped: need %d, want 20", need)
	}
}

func TestResponseIDErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		m    []byte
		want error
	}{
		{"empty", nil, pinotwire.ErrNotDataTable},
		{"no count", int4(12), pinotwire.ErrNotDataTable},
		{"no key", cat4(int4(12), int4(1)), pinotwire.ErrNotDataTable},
		{"short id", cat4(int4(12), int4(1), ent(14, 1, 2, 3)), pinotwire.ErrNotDataTable},
		{"short string length", cat4(int4(12), int4(2), ent(0, 0, 0)), pinotwire.ErrNotDataTable},
		{"string past the end", cat4(int4(12), int4(2), ent(0, str4("abc")[:5]...)), pinotwire.ErrNotDataTable},
		{"last value short", cat4(int4(12), int4(1), ent(5, 1, 2)), pinotwire.ErrNotDataTable},
		{"negative string length", raw(2, ent(0, int4(-1)...), ent(14, long(5)...)), pinotwire.ErrNotDataTable},
		{"huge string length", raw(2, ent(0, int4(math.MaxInt32)...), ent(14, long(5)...)), pinotwire.ErrNotDataTable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, found, need, err := pinotwire.ResponseID(tc.m, true)
			if !errors.Is(err, tc.want) || err == pinotwire.ErrTooLong || need != 0 || found || id != 0 {
				t.Fatalf("ResponseID(%x) = %d, %v, %d, %v; want %v", tc.m, id, found, need, err, tc.want)
			}
			checkIDPrefixes(t, tc.m)
		})
	}
}

func TestResponseIDTooLong(t *testing.T) {
	trace := strings.Repeat("t", pinotwire.MaxMetadataPrefix)
	m := raw(2, ent(13, str4(trace)...), ent(14, long(5)...))
	for _, tc := range []struct {
		b        []byte
		complete bool
	}{{m, true}, {m, false}, {m[:100], false}, {m[:pinotwire.MaxMetadataPrefix], false}} {
		if id, found, need, err := pinotwire.ResponseID(tc.b, tc.complete); err != pinotwire.ErrTooLong || need != 0 || found || id != 0 {
			t.Fatalf("%d bytes, complete %v: %d, %v, %d, %v", len(tc.b), tc.complete, id, found, need, err)
		}
	}
	if res, maxNeed := idIncrementally(t, m); res.err != pinotwire.ErrTooLong || maxNeed > pinotwire.MaxMetadataPrefix {
		t.Fatalf("incrementally: %+v, max need %d", res, maxNeed)
	}
	// Just under the limit, it is found.
	m = raw(2, ent(13, str4(trace[:pinotwire.MaxMetadataPrefix-28])...), ent(14, long(5)...))
	if len(m) != pinotwire.MaxMetadataPrefix {
		t.Fatalf("section of %d bytes", len(m))
	}
	if got := checkIDPrefixes(t, m); got != (idResult{5, true, nil}) {
		t.Fatalf("at the limit: %+v", got)
	}
}

func TestMetadataOffset(t *testing.T) {
	minimal := pinotsim.AppendResponse(nil, 1)
	if off, err := pinotwire.MetadataOffset(minimal); off != 56 || err != nil {
		t.Fatalf("minimal table: %d, %v", off, err)
	}
	if off, err := pinotwire.MetadataOffset(minimal[:52]); off != 56 || err != nil {
		t.Fatalf("header alone: %d, %v", off, err)
	}
	hdr := func(lens [5]int32, edit func(h []byte)) []byte {
		h := binary.BigEndian.AppendUint32(nil, 4)
		h = append(h, 0, 0, 0, 0, 0, 0, 0, 0)
		start := int64(52)
		for _, l := range lens {
			h = binary.BigEndian.AppendUint32(h, uint32(start))
			h = binary.BigEndian.AppendUint32(h, uint32(l))
			start += int64(l)
		}
		if edit != nil {
			edit(h)
		}
		return h
	}
	set := func(i int, v uint32) func([]byte) {
		return func(h []byte) { binary.BigEndian.PutUint32(h[4*i:], v) }
	}
	for _, tc := range []struct {
		name string
		h    []byte
		want int64
	}{
		{"all sections", hdr([5]int32{10, 20, 30, 40, 50}, nil), 52 + 150},
		{"empty sections start anywhere", hdr([5]int32{4, 0, 0, 8, 0}, func(h []byte) {
			binary.BigEndian.PutUint32(h[4*5:], 0)
			binary.BigEndian.PutUint32(h[4*7:], 0xffffffff)
			binary.BigEndian.PutUint32(h[4*11:], 7)
		}), 52 + 12},
		{"largest", hdr([5]int32{math.MaxInt32 - 52 - 4, 0, 0, 0, 0}, nil), math.MaxInt32 - 4},
		{"rows and columns are not read", hdr([5]int32{4, 0, 0, 0, 0}, func(h []byte) { set(1, 0xffffffff)(h); set(2, 0x80000000)(h) }), 56},
	} {
		if off, err := pinotwire.MetadataOffset(tc.h); off != tc.want || err != nil {
			t.Errorf("%s: %d, %v; want %d", tc.name, off, err, tc.want)
		}
	}
	for _, tc := range []struct {
		name string
		h    []byte
	}{
		{"empty", nil},
		{"short header", minimal[:51]},
		{"version 3", hdr([5]int32{4}, set(0, 3))},
		{"version 5", hdr([5]int32{4}, set(0, 5))},
		{"version 2^32-1", hdr([5]int32{4}, set(0, 0xffffffff))},
		{"negative exceptions", hdr([5]int32{-4}, nil)},
		{"negative dictionary", hdr([5]int32{4, -1}, nil)},
		{"negative schema", hdr([5]int32{4, 0, -1}, nil)},
		{"negative fixed", hdr([5]int32{4, 0, 0, math.MinInt32}, nil)},
		{"negative variable", hdr([5]int32{4, 0, 0, 0, -1}, nil)},
		{"exceptions not at 52", hdr([5]int32{4}, set(3, 0))},
		{"overlapping sections", hdr([5]int32{4, 8}, set(5, 52))},
		{"gap between sections", hdr([5]int32{4, 0, 0, 0, 8}, set(11, 100))},
		{"no room for the length", hdr([5]int32{math.MaxInt32 - 52 - 3}, nil)},
		{"sum beyond int32", hdr([5]int32{math.MaxInt32 - 52, 10}, set(5, 0))},
	} {
		if off, err := pinotwire.MetadataOffset(tc.h); !errors.Is(err, pinotwire.ErrNotDataTable) || off != 0 {
			t.Errorf("%s: %d, %v; want ErrNotDataTable", tc.name, off, err)
		}
	}
}

func TestMetadataKeyType(t *testing.T) {
	want := map[pinotwire.MetadataValueType][]int32{
		pinotwire.MetadataLong:    {2, 3, 4, 9, 10, 12, 14, 16, 17, 18, 19, 30, 32, 33, 36, 37},
		pinotwire.MetadataInt:     {5, 6, 7, 8, 15, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29},
		pinotwire.MetadataBoolean: {38},
		pinotwire.MetadataString:  {0, 1, 11, 13, 31, 34, 35, 39, 40, 41, 42, 43, 44},
	}
	seen := 0
	for typ, keys := range want {
		for _, k := range keys {
			if got := pinotwire.MetadataKeyType(k); got != typ {
				t.Errorf("key %d: %d, want %d", k, got, typ)
			}
			seen++
		}
	}
	if seen != 45 {
		t.Fatalf("table covers %d keys, want 45", seen)
	}
	for _, k := range []int32{-1, 45, 46, 1000, math.MaxInt32, math.MinInt32} {
		if got := pinotwire.MetadataKeyType(k); got != pinotwire.MetadataUnknown {
			t.Errorf("key %d: %d, want unknown", k, got)
		}
	}
}

func TestResponseIDAllocs(t *testing.T) {
	p, err := pinotsim.AppendDataTable(nil, withIDAt(entries(1), 12))
	if err != nil {
		t.Fatal(err)
	}
	m := metadata(t, p)
	none := raw(2, ent(45, 1), ent(14, long(5)...))
	for name, call := range map[string]func(){
		"offset":    func() { _, _ = pinotwire.MetadataOffset(p) },
		"found":     func() { _, _, _, _ = pinotwire.ResponseID(m, true) },
		"need":      func() { _, _, _, _ = pinotwire.ResponseID(m[:30], false) },
		"not found": func() { _, _, _, _ = pinotwire.ResponseID(none, true) },
		"truncated": func() { _, _, _, _ = pinotwire.ResponseID(m[:30], true) },
		"bad":       func() { _, _ = pinotwire.MetadataOffset(m) },
	} {
		if n := testing.AllocsPerRun(100, call); n != 0 {
			t.Errorf("%s: %v allocations per call", name, n)
		}
	}
}

func BenchmarkResponseID(b *testing.B) {
	p, err := pinotsim.AppendDataTable(nil, withIDAt(entries(1), 12))
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		off, err := pinotwire.MetadataOffset(p)
		if err != nil {
			b.Fatal(err)
		}
		if _, found, _, err := pinotwire.ResponseID(p[off:], true); !found || err != nil {
			b.Fatal(found, err)
		}
	}
}
