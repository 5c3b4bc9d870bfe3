package pinotsim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/pinotwire"
)

// Compact protocol type ids: pinotwire's, under the writer's short names.
const (
	ctBoolTrue  = pinotwire.CompactBoolTrue
	ctBoolFalse = pinotwire.CompactBoolFalse
	ctByte      = pinotwire.CompactByte
	ctI16       = pinotwire.CompactI16
	ctI32       = pinotwire.CompactI32
	ctI64       = pinotwire.CompactI64
	ctDouble    = pinotwire.CompactDouble
	ctBinary    = pinotwire.CompactBinary
	ctList      = pinotwire.CompactList
	ctSet       = pinotwire.CompactSet
	ctMap       = pinotwire.CompactMap
	ctStruct    = pinotwire.CompactStruct
)

// InstanceRequest field ids. 1–8 are Pinot's (request.thrift); 9 and 10
// exist only in the simulator. A real server's TDeserializer skips unknown
// fields, so a payload carrying them still deserializes.
const (
	fieldRequestID      = 1
	fieldQuery          = 2
	fieldSearchSegments = 3
	fieldEnableTrace    = 4
	fieldBrokerID       = 5
	fieldCID            = 7
	fieldSentAt         = 9  // i64 unix nanoseconds: when the broker sent it
	fieldDeadline       = 10 // i64 unix nanoseconds: when the broker gives up
)

// BrokerRequest and PinotQuery field ids (request.thrift, query.thrift).
const (
	brokerQuerySource = 2
	brokerPinotQuery  = 17
	querySourceTable  = 1
	pinotQueryFilter  = 4
	pinotQueryOptions = 11
)

// Request is the part of Pinot's InstanceRequest the simulators use.
type Request struct {
	// ID is field 1, the requestId the response must carry back.
	ID int64
	// Table is BrokerRequest.querySource.tableName (field 2.2.1).
	Table string
	// TimeoutMs is the query option timeoutMs, the broker's remaining
	// budget in milliseconds, which a real broker writes in
	// BrokerRequest.pinotQuery.queryOptions (field 2.17.11) as a decimal
	// string. 0: omitted (the server then applies its own default).
	TimeoutMs int64
	// Filter is that many bytes in PinotQuery's field 4 (filterExpression,
	// before the query options), written as a binary field that readers
	// skip: a real query's filter with a long IN list makes a request long
	// there, ahead of its timeoutMs.
	Filter int
	// Segments is searchSegments (field 3); omitted when empty. It is also
	// how a request is made large: real requests carry 40–70 B per segment.
	Segments []string
	// Trace is enableTrace (field 4), always written, as Pinot does.
	Trace bool
	// BrokerID (field 5) and CID (field 7) are omitted when empty.
	BrokerID string
	CID      string
	// SentAt (field 9) and Deadline (field 10) are simulator-only fields,
	// omitted when zero. Real Pinot sends only the relative budget
	// (TimeoutMs); an absolute deadline lets the simulated server tell
	// stale work without trusting its own clock's view of send time.
	SentAt   time.Time
	Deadline time.Time
}

// AppendRequest appends the compact-Thrift encoding of r to dst. The
// payload starts with 0x16 followed by the zigzag varint of r.ID, as every
// InstanceRequest a Pinot broker sends does; with SentAt and Deadline zero
// it is byte-identical to what apache/thrift's TCompactProtocol writes for
// the same InstanceRequest (PinotQuery holding nothing but the timeoutMs
// option, when TimeoutMs is not 0).
func AppendRequest(dst []byte, r *Request) []byte {
	w := compactWriter{b: dst}
	w.field(ctI64, fieldRequestID)
	w.i64(r.ID)

	w.field(ctStruct, fieldQuery) // BrokerRequest
	w.push()
	w.field(ctStruct, brokerQuerySource) // QuerySource
	w.push()
	w.field(ctBinary, querySourceTable)
	w.str(r.Table)
	w.pop()
	w.field(ctStruct, brokerPinotQuery) // PinotQuery
	w.push()
	if r.Filter > 0 {
		w.field(ctBinary, pinotQueryFilter)
		w.str(strings.Repeat("x", r.Filter))
	}
	if r.TimeoutMs != 0 {
		w.field(ctMap, pinotQueryOptions) // map<string,string>
		w.b = binary.AppendUvarint(w.b, 1)
		w.b = append(w.b, ctBinary<<4|ctBinary)
		w.str(pinotwire.TimeoutOptionKey)
		var digits [20]byte
		w.bytes(strconv.AppendInt(digits[:0], r.TimeoutMs, 10))
	}
	w.pop()
	w.pop()

	if len(r.Segments) > 0 {
		w.field(ctList, fieldSearchSegments)
		w.listHeader(ctBinary, len(r.Segments))
		for _, s := range r.Segments {
			w.str(s)
		}
	}
	if r.Trace {
		w.field(ctBoolTrue, fieldEnableTrace)
	} else {
		w.field(ctBoolFalse, fieldEnableTrace)
	}
	if r.BrokerID != "" {
		w.field(ctBinary, fieldBrokerID)
		w.str(r.BrokerID)
	}
	if r.CID != "" {
		w.field(ctBinary, fieldCID)
		w.str(r.CID)
	}
	if !r.SentAt.IsZero() {
		w.field(ctI64, fieldSentAt)
		w.i64(r.SentAt.UnixNano())
	}
	if !r.Deadline.IsZero() {
		w.field(ctI64, fieldDeadline)
		w.i64(r.Deadline.UnixNano())
	}
	w.stop()
	return w.b
}

// ErrNotRequest reports a payload that is not an InstanceRequest; it is
// pinotwire.ErrNotRequest, so errors.Is matches either name.
var ErrNotRequest = pinotwire.ErrNotRequest

// RequestID extracts the requestId as the proxy does, with
// pinotwire.ParseRequest: the payload must start with 0x16 and the zigzag
// varint id, and be well-formed up to the end of its BrokerRequest.
func RequestID(p []byte) (int64, error) {
	r, _, err := pinotwire.ParseRequest(p, true)
	if err != nil && !errors.Is(err, pinotwire.ErrTooLong) {
		return 0, err
	}
	return r.ID, nil
}

// ParseRequest decodes an InstanceRequest payload. ID and TimeoutMs are
// what pinotwire.ParseRequest (the proxy's reader) finds; the other fields
// are read with pinotwire's compact reader. Fields it does not know are
// skipped, as TCompactProtocol does; field 1 must come first and field 2
// follow it, as Pinot's generated InstanceRequest.write() puts them.
func ParseRequest(p []byte) (Request, error) { return parseRequest(p, true) }

// parseRequest decodes p; without keepSegments the segment list is
// skipped, which spares the simulated server an allocation per segment.
func parseRequest(p []byte, keepSegments bool) (Request, error) {
	var r Request
	wr, _, err := pinotwire.ParseRequest(p, true)
	if err != nil && !errors.Is(err, pinotwire.ErrTooLong) {
		return r, err
	}
	r.ID = wr.ID
	if wr.HasTimeout {
		r.TimeoutMs = wr.Timeout.Milliseconds()
	}
	rd := pinotwire.NewCompactReader(p)
	var last int16
	for {
		typ, id, err := rd.Field(&last)
		if err != nil {
			return r, err
		}
		if typ == 0 {
			return r, nil
		}
		switch {
		case id == fieldQuery && typ == ctStruct:
			r.Table, err = brokerRequestTable(&rd)
		case id == fieldSearchSegments && typ == ctList && keepSegments:
			r.Segments, err = stringList(&rd)
		case id == fieldEnableTrace && (typ == ctBoolTrue || typ == ctBoolFalse):
			r.Trace = typ == ctBoolTrue
		case id == fieldBrokerID && typ == ctBinary:
			r.BrokerID, err = str(&rd)
		case id == fieldCID && typ == ctBinary:
			r.CID, err = str(&rd)
		case (id == fieldSentAt || id == fieldDeadline) && typ == ctI64:
			var ns int64
			if ns, err = rd.I64(); err == nil {
				if id == fieldSentAt {
					r.SentAt = time.Unix(0, ns)
				} else {
					r.Deadline = time.Unix(0, ns)
				}
			}
		default:
			err = rd.Skip(typ) // requestId too: pinotwire read it
		}
		if err != nil {
			return r, err
		}
	}
}

func str(rd *pinotwire.CompactReader) (string, error) {
	b, err := rd.Binary()
	return string(b), err
}

func stringList(rd *pinotwire.CompactReader) ([]string, error) {
	elem, n, err := rd.List()
	if err != nil {
		return nil, err
	}
	if elem != ctBinary {
		return nil, errSegmentsType
	}
	out := make([]string, 0, n)
	for range n {
		s, err := str(rd)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}

var errSegmentsType = fmt.Errorf("%w: searchSegments is not a list<string>", ErrNotRequest)

// brokerRequestTable reads a BrokerRequest struct and returns
// querySource.tableName, skipping everything else.
func brokerRequestTable(rd *pinotwire.CompactReader) (string, error) {
	var table string
	var last int16
	for {
		typ, id, err := rd.Field(&last)
		if err != nil {
			return "", err
		}
		if typ == 0 {
			return table, nil
		}
		if id != brokerQuerySource || typ != ctStruct {
			if err := rd.Skip(typ); err != nil {
				return "", err
			}
			continue
		}
		var qlast int16
		for {
			qt, qid, err := rd.Field(&qlast)
			if err != nil {
				return "", err
			}
			if qt == 0 {
				break
			}
			if qid == querySourceTable && qt == ctBinary {
				if table, err = str(rd); err != nil {
					return "", err
				}
			} else if err := rd.Skip(qt); err != nil {
				return "", err
			}
		}
	}
}

// compactWriter writes TCompactProtocol structs.
type compactWriter struct {
	b     []byte
	last  int16
	stack []int16
}

func (w *compactWriter) field(typ byte, id int16) {
	if d := id - w.last; d > 0 && d <= 15 {
		w.b = append(w.b, byte(d)<<4|typ)
	} else {
		w.b = append(w.b, typ)
		w.b = binary.AppendVarint(w.b, int64(id)) // zigzag i16
	}
	w.last = id
}

func (w *compactWriter) push() { w.stack = append(w.stack, w.last); w.last = 0 }

// pop ends a nested struct.
func (w *compactWriter) pop() {
	w.stop()
	w.last = w.stack[len(w.stack)-1]
	w.stack = w.stack[:len(w.stack)-1]
}

func (w *compactWriter) stop()        { w.b = append(w.b, 0) }
func (w *compactWriter) i64(v int64)  { w.b = binary.AppendVarint(w.b, v) }
func (w *compactWriter) str(s string) { w.b = append(binary.AppendUvarint(w.b, uint64(len(s))), s...) }
func (w *compactWriter) bytes(p []byte) {
	w.b = append(binary.AppendUvarint(w.b, uint64(len(p))), p...)
}

func (w *compactWriter) listHeader(elem byte, n int) {
	if n < 15 {
		w.b = append(w.b, byte(n)<<4|elem)
		return
	}
	w.b = append(w.b, 0xf0|elem)
	w.b = binary.AppendUvarint(w.b, uint64(n))
}
