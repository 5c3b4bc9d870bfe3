package pinotwire_test

// Payloads written with apache/thrift's own TCompactProtocol (the Go port of
// the library Pinot's broker uses), following Pinot's request.thrift and
// query.thrift field by field, so that the readers are checked against the
// real encoder rather than against the simulator's.

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/apache/thrift/lib/go/thrift"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/internal/pinotwire"
)

// tw writes TCompactProtocol with apache/thrift. A write error (there are
// none with a memory buffer) fails the test.
type tw struct {
	t   testing.TB
	ctx context.Context
	buf *thrift.TMemoryBuffer
	p   *thrift.TCompactProtocol
}

func newTW(t testing.TB) *tw {
	buf := thrift.NewTMemoryBuffer()
	return &tw{t: t, ctx: context.Background(), buf: buf, p: thrift.NewTCompactProtocolConf(buf, nil)}
}

func (w *tw) ok(err error) {
	w.t.Helper()
	if err != nil {
		w.t.Fatal(err)
	}
}

func (w *tw) bytes() []byte {
	w.ok(w.p.Flush(w.ctx))
	return bytes.Clone(w.buf.Bytes())
}

// structBegin/field/structEnd: a field is written by its header, then fn
// writes the value.
func (w *tw) structBegin()                     { w.ok(w.p.WriteStructBegin(w.ctx, "")) }
func (w *tw) structEnd()                       { w.ok(w.p.WriteFieldStop(w.ctx)); w.ok(w.p.WriteStructEnd(w.ctx)) }
func (w *tw) field(typ thrift.TType, id int16) { w.ok(w.p.WriteFieldBegin(w.ctx, "", typ, id)) }
func (w *tw) i32(id int16, v int32)            { w.field(thrift.I32, id); w.ok(w.p.WriteI32(w.ctx, v)) }
func (w *tw) i64(id int16, v int64)            { w.field(thrift.I64, id); w.ok(w.p.WriteI64(w.ctx, v)) }
func (w *tw) str(id int16, v string)           { w.field(thrift.STRING, id); w.ok(w.p.WriteString(w.ctx, v)) }
func (w *tw) boolean(id int16, v bool)         { w.field(thrift.BOOL, id); w.ok(w.p.WriteBool(w.ctx, v)) }

func (w *tw) strct(id int16, fn func()) {
	w.field(thrift.STRUCT, id)
	w.structBegin()
	fn()
	w.structEnd()
}

func (w *tw) strList(id int16, vs []string) {
	w.field(thrift.LIST, id)
	w.ok(w.p.WriteListBegin(w.ctx, thrift.STRING, len(vs)))
	for _, v := range vs {
		w.ok(w.p.WriteString(w.ctx, v))
	}
}

// kv is one map entry, in write order.
type kv struct{ k, v string }

func (w *tw) strMap(id int16, m []kv) {
	w.field(thrift.MAP, id)
	w.ok(w.p.WriteMapBegin(w.ctx, thrift.STRING, thrift.STRING, len(m)))
	for _, e := range m {
		w.ok(w.p.WriteString(w.ctx, e.k))
		w.ok(w.p.WriteString(w.ctx, e.v))
	}
}

// Expressions (query.thrift: Expression{1: ExpressionType, 2: Function,
// 3: Literal, 4: Identifier}).
func (w *tw) exprList(id int16, es []func()) {
	w.field(thrift.LIST, id)
	w.ok(w.p.WriteListBegin(w.ctx, thrift.STRUCT, len(es)))
	for _, e := range es {
		w.structBegin()
		e()
		w.structEnd()
	}
}

func (w *tw) identifier(name string) func() {
	return func() {
		w.i32(1, 1) // IDENTIFIER
		w.strct(4, func() { w.str(1, name) })
	}
}

func (w *tw) literal(fn func()) func() {
	return func() {
		w.i32(1, 0) // LITERAL
		w.strct(3, fn)
	}
}

func (w *tw) function(op string, operands ...func()) func() {
	return func() {
		w.i32(1, 2) // FUNCTION
		w.strct(2, func() {
			w.str(1, op)
			w.exprList(2, operands)
		})
	}
}

// pinotQuery describes the PinotQuery a test writes.
type pinotQuery struct {
	columns  int  // selectList identifiers: how long fields 1..10 get
	options  []kv // field 11; nil: absent
	tail     bool // fields 12..14 after the options
	outOfOrd bool // write 13 before 11, so 11 takes a long-form header
}

// write writes the fields of a PinotQuery as a real broker fills them,
// using every compact type Pinot's IDL has on the way.
func (q pinotQuery) write(w *tw) {
	w.i32(1, 1) // version
	w.strct(2, func() { w.str(1, "airlineStats_OFFLINE") })
	cols := make([]func(), q.columns)
	for i := range cols {
		cols[i] = w.identifier(fmt.Sprintf("someRatherLongColumnName_%04d_withSuffix", i))
	}
	w.exprList(3, cols)
	w.strct(4, w.function("AND", // filterExpression
		w.function("EQUALS", w.identifier("Carrier"), w.literal(func() { w.str(7, "AA") })),
		w.function("GREATER_THAN", w.identifier("ArrDelay"), w.literal(func() {
			w.field(thrift.DOUBLE, 6)
			w.ok(w.p.WriteDouble(w.ctx, 12.5))
		})),
		w.function("IN", w.identifier("Year"), w.literal(func() {
			w.field(thrift.LIST, 13) // longArrayValue
			w.ok(w.p.WriteListBegin(w.ctx, thrift.I64, 20))
			for i := range 20 {
				w.ok(w.p.WriteI64(w.ctx, int64(1990+i)))
			}
		})),
		w.function("EQUALS", w.identifier("Cancelled"), w.literal(func() { w.boolean(1, false) })),
		w.function("EQUALS", w.identifier("Flags"), w.literal(func() {
			w.field(thrift.BYTE, 2)
			w.ok(w.p.WriteByte(w.ctx, -3))
		})),
		w.function("EQUALS", w.identifier("Gate"), w.literal(func() {
			w.field(thrift.I16, 3)
			w.ok(w.p.WriteI16(w.ctx, -300))
		})),
		w.function("IN", w.identifier("Ratio"), w.literal(func() {
			w.field(thrift.LIST, 15) // doubleArrayValue: 20 doubles, a long-form list
			w.ok(w.p.WriteListBegin(w.ctx, thrift.DOUBLE, 20))
			for i := range 20 {
				w.ok(w.p.WriteDouble(w.ctx, float64(i)/7))
			}
		})),
		w.function("EQUALS", w.identifier("Blob"), w.literal(func() {
			w.field(thrift.STRING, 8) // binaryValue
			w.ok(w.p.WriteBinary(w.ctx, bytes.Repeat([]byte{0xff, 0x00}, 40)))
		})),
		w.function("IS_NULL", w.identifier("Tail"), w.literal(func() { w.boolean(9, true) })),
	))
	w.exprList(5, []func(){w.identifier("Carrier"), w.identifier("Origin")})
	w.exprList(6, []func(){w.function("DESC", w.function("COUNT", w.identifier("*")))})
	w.strct(7, func() { // havingExpression is a struct field, not a list
		w.function("GREATER_THAN", w.function("COUNT", w.identifier("*")),
			w.literal(func() { w.i64(5, 100) }))()
	})
	w.i32(8, 10)
	w.i32(9, 0)
	hints := func() {
		w.field(thrift.MAP, 13) // expressionOverrideHints: map<Expression,Expression>
		w.ok(w.p.WriteMapBegin(w.ctx, thrift.STRUCT, thrift.STRUCT, 1))
		w.structBegin()
		w.identifier("timeoutMs")() // a decoy: an identifier, not an option
		w.structEnd()
		w.structBegin()
		w.function("ADD", w.identifier("a"), w.literal(func() { w.str(7, "timeoutMs") }))()
		w.structEnd()
	}
	if q.outOfOrd {
		hints()
	}
	if q.options != nil {
		w.strMap(11, q.options)
	}
	if q.tail {
		w.boolean(12, false)
		if !q.outOfOrd {
			hints()
		}
		w.field(thrift.LIST, 14) // arrayJoinList
		w.ok(w.p.WriteListBegin(w.ctx, thrift.STRUCT, 1))
		w.structBegin()
		w.i32(1, 0)
		w.exprList(2, []func(){func() { w.strct(1, w.identifier("arr")); w.str(2, "alias") }})
		w.structEnd()
	}
}

// instance describes an InstanceRequest a test writes.
type instance struct {
	id       int64
	legacy   []kv        // BrokerRequest field 14 (older request.thrift); nil: absent
	debug    []kv        // BrokerRequest field 13, debugOptions; nil: absent
	query    *pinotQuery // BrokerRequest field 17; nil: absent
	queryTyp bool        // BrokerRequest field 1 (QueryType) and 5 (FilterQuery), as old brokers wrote
	segments int         // searchSegments (3), optionalSegments (6) and tableSegmentsInfoList (8)
}

func (in instance) bytes(t testing.TB) []byte {
	w := newTW(t)
	w.structBegin()
	w.i64(1, in.id)
	w.strct(2, func() {
		if in.queryTyp {
			w.strct(1, func() {
				w.boolean(1, true)
				w.boolean(2, true)
				w.boolean(3, false)
			})
		}
		w.strct(2, func() { w.str(1, "airlineStats_OFFLINE") })
		if in.queryTyp {
			w.strct(5, func() {
				w.i32(1, 0)
				w.str(2, "Carrier")
				w.strList(3, []string{"AA", "timeoutMs"})
				w.i32(4, 2)
				w.field(thrift.LIST, 5)
				w.ok(w.p.WriteListBegin(w.ctx, thrift.I32, 2))
				w.ok(w.p.WriteI32(w.ctx, 1))
				w.ok(w.p.WriteI32(w.ctx, 2))
			})
			w.boolean(11, true)
		}
		if in.debug != nil {
			w.strMap(13, in.debug)
		}
		if in.legacy != nil {
			w.strMap(14, in.legacy)
		}
		if in.query != nil {
			w.strct(17, func() { in.query.write(w) })
		}
	})
	segs := pinotsim.SegmentsFor("airlineStats_OFFLINE", in.segments*60)
	if len(segs) > 0 {
		w.strList(3, segs)
	}
	w.boolean(4, false)
	w.str(5, "Broker_host_8099")
	if len(segs) > 0 {
		w.strList(6, segs[:len(segs)/2])
	}
	w.str(7, "cid-1")
	if len(segs) > 0 {
		w.field(thrift.LIST, 8)
		w.ok(w.p.WriteListBegin(w.ctx, thrift.STRUCT, 1))
		w.structBegin()
		w.str(1, "airlineStats_OFFLINE")
		w.strList(2, segs)
		w.structEnd()
	}
	w.structEnd()
	return w.bytes()
}

// The simulator's request is byte for byte what apache/thrift writes for
// the same InstanceRequest, with and without the timeoutMs option.
func TestAppendRequestMatchesThrift(t *testing.T) {
	for _, tc := range []pinotsim.Request{
		{ID: 1234567890000000001, Table: "t_OFFLINE", Segments: []string{"s0", "s1"}, BrokerID: "Broker_h_8099", CID: "c1"},
		{ID: 1234567890000000001, Table: "t_OFFLINE", TimeoutMs: 9_987, Segments: []string{"s0", "s1"}, BrokerID: "Broker_h_8099", CID: "c1"},
		{ID: -5, Table: "t_REALTIME", TimeoutMs: 1, Trace: true},
		{ID: 1 << 62, Table: strings.Repeat("t", 300), TimeoutMs: 1<<63 - 1,
			Segments: pinotsim.SegmentsFor("t", 4096), BrokerID: "b"},
		{ID: 7, Table: "t", TimeoutMs: -20}, // written as given; the reader rejects it
	} {
		w := newTW(t)
		w.structBegin()
		w.i64(1, tc.ID)
		w.strct(2, func() {
			w.strct(2, func() { w.str(1, tc.Table) })
			w.strct(17, func() {
				if tc.TimeoutMs != 0 {
					w.strMap(11, []kv{{"timeoutMs", fmt.Sprint(tc.TimeoutMs)}})
				}
			})
		})
		if len(tc.Segments) > 0 {
			w.strList(3, tc.Segments)
		}
		w.boolean(4, tc.Trace)
		if tc.BrokerID != "" {
			w.str(5, tc.BrokerID)
		}
		if tc.CID != "" {
			w.str(7, tc.CID)
		}
		w.structEnd()
		want := w.bytes()
		if got := pinotsim.AppendRequest(nil, &tc); !bytes.Equal(got, want) {
			t.Fatalf("TimeoutMs %d:\n got %x\nwant %x", tc.TimeoutMs, got, want)
		}
		// And the real library's reader gets through it to the end.
		rp := thrift.NewTCompactProtocolConf(thrift.NewStreamTransportR(bytes.NewReader(want)), nil)
		if err := thrift.SkipDefaultDepth(context.Background(), rp, thrift.STRUCT); err != nil {
			t.Fatalf("thrift cannot read it back: %v", err)
		}
	}
}

// The thrift-built requests of these tests are themselves valid: the real
// library reads each to its end, and nothing is left over.
func TestThriftPayloadsAreValid(t *testing.T) {
	for name, in := range thriftCases() {
		p := in.bytes(t)
		r := bytes.NewReader(p)
		rp := thrift.NewTCompactProtocolConf(thrift.NewStreamTransportR(r), nil)
		if err := thrift.SkipDefaultDepth(context.Background(), rp, thrift.STRUCT); err != nil || r.Len() != 0 {
			t.Fatalf("%s: thrift skip: %v, %d bytes left", name, err, r.Len())
		}
	}
}

// thriftCases are realistic requests, named, with what ParseRequest must
// find in each.
func thriftCases() map[string]instance {
	opts := []kv{{"trace", "false"}, {"timeoutMx", "1"}, {"timeoutMsX", "2"}, {"enableNullHandling", "true"}, {"timeoutMs", "9876"}, {"x", "y"}}
	return map[string]instance{
		"modern": {id: 1234567890000000001, query: &pinotQuery{columns: 150, options: opts, tail: true}, segments: 400},
		"out of order fields": {id: 42, query: &pinotQuery{columns: 3, options: opts, tail: true, outOfOrd: true},
			segments: 3},
		"no options": {id: -1, query: &pinotQuery{columns: 40, tail: true}, segments: 50},
		"options without timeout": {id: 1 << 62, query: &pinotQuery{columns: 5, options: opts[:4], tail: true},
			segments: 10},
		"legacy only": {id: 9, legacy: []kv{{"timeoutMs", "1500"}}, queryTyp: true, debug: []kv{{"timeoutMs", "1"}},
			segments: 20},
		"legacy and query": {id: 10, legacy: []kv{{"timeoutMs", "1500"}}, queryTyp: true,
			query: &pinotQuery{columns: 5, options: opts}, segments: 20},
		"legacy fallback": {id: 11, legacy: []kv{{"a", "b"}, {"timeoutMs", "1500"}},
			query: &pinotQuery{columns: 5, options: []kv{{"trace", "true"}}, tail: true}, segments: 20},
		"debug options only": {id: 12, debug: []kv{{"timeoutMs", "1"}}, queryTyp: true,
			query: &pinotQuery{columns: 2}},
	}
}

func TestParseRequestThrift(t *testing.T) {
	want := map[string]pinotwire.Request{
		"modern":                  {ID: 1234567890000000001, Timeout: 9876 * msec, HasTimeout: true},
		"out of order fields":     {ID: 42, Timeout: 9876 * msec, HasTimeout: true},
		"no options":              {ID: -1},
		"options without timeout": {ID: 1 << 62},
		"legacy only":             {ID: 9, Timeout: 1500 * msec, HasTimeout: true},
		"legacy and query":        {ID: 10, Timeout: 9876 * msec, HasTimeout: true},
		"legacy fallback":         {ID: 11, Timeout: 1500 * msec, HasTimeout: true},
		"debug options only":      {ID: 12},
	}
	for name, in := range thriftCases() {
		t.Run(name, func(t *testing.T) {
			p := in.bytes(t)
			r, need, err := pinotwire.ParseRequest(p, true)
			if err != nil || need != 0 || r != want[name] {
				t.Fatalf("ParseRequest = %+v, %d, %v; want %+v", r, need, err, want[name])
			}
			checkRequestPrefixes(t, p)
			// It stops where the answer is: at the timeoutMs value, or at the
			// end of the BrokerRequest, never in the segment lists.
			_, maxNeed := parseIncrementally(t, p, 1)
			if stop := decisionPoint(t, p); maxNeed > stop {
				t.Fatalf("asked for %d bytes, the answer ends at %d", maxNeed, stop)
			}
		})
	}
}

// decisionPoint is the prefix length at which ParseRequest first answers.
func decisionPoint(t *testing.T, p []byte) int {
	t.Helper()
	for k := range len(p) + 1 {
		if _, need, _ := pinotwire.ParseRequest(p[:k], k == len(p)); need == 0 {
			return k
		}
	}
	t.Fatal("no prefix decides")
	return 0
}

// A PinotQuery whose fields before the options run past MaxRequestPrefix:
// ErrTooLong, with the id.
func TestParseRequestThriftTooLong(t *testing.T) {
	in := instance{id: 77, query: &pinotQuery{columns: 1500, options: []kv{{"timeoutMs", "5"}}}}
	p := in.bytes(t)
	if len(p) < pinotwire.MaxRequestPrefix {
		t.Fatalf("payload only %d bytes", len(p))
	}
	r, need, err := pinotwire.ParseRequest(p, true)
	if err != pinotwire.ErrTooLong || need != 0 || r != (pinotwire.Request{ID: 77}) {
		t.Fatalf("ParseRequest = %+v, %d, %v", r, need, err)
	}
	res, maxNeed := parseIncrementally(t, p, 0)
	if res != (result{pinotwire.Request{ID: 77}, pinotwire.ErrTooLong}) || maxNeed > pinotwire.MaxRequestPrefix {
		t.Fatalf("incrementally: %+v, max need %d", res, maxNeed)
	}
}
