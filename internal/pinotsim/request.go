package pinotsim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"
)

// Compact protocol type ids (TCompactProtocol).
const (
	ctBoolTrue  = 1
	ctBoolFalse = 2
	ctByte      = 3
	ctI16       = 4
	ctI32       = 5
	ctI64       = 6
	ctDouble    = 7
	ctBinary    = 8
	ctList      = 9
	ctSet       = 10
	ctMap       = 11
	ctStruct    = 12
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

// Request is the part of Pinot's InstanceRequest the simulators use.
type Request struct {
	// ID is field 1, the requestId the response must carry back.
	ID int64
	// Table is BrokerRequest.querySource.tableName (field 2.2.1).
	Table string
	// Segments is searchSegments (field 3); omitted when empty. It is also
	// how a request is made large: real requests carry 40–70 B per segment.
	Segments []string
	// Trace is enableTrace (field 4), always written, as Pinot does.
	Trace bool
	// BrokerID (field 5) and CID (field 7) are omitted when empty.
	BrokerID string
	CID      string
	// SentAt (field 9) and Deadline (field 10) are simulator-only fields,
	// omitted when zero. Real Pinot sends the remaining budget as the query
	// option timeoutMs inside PinotQuery; an absolute deadline lets the
	// simulated server tell stale work without parsing a query.
	SentAt   time.Time
	Deadline time.Time
}

// AppendRequest appends the compact-Thrift encoding of r to dst. The
// payload starts with 0x16 followed by the zigzag varint of r.ID (PINOT.md
// §3); with SentAt and Deadline zero it is byte-identical to what
// apache/thrift's TCompactProtocol writes for the same InstanceRequest.
func AppendRequest(dst []byte, r *Request) []byte {
	w := compactWriter{b: dst}
	w.field(ctI64, fieldRequestID)
	w.i64(r.ID)

	w.field(ctStruct, fieldQuery) // BrokerRequest
	w.push()
	w.field(ctStruct, 2) // QuerySource
	w.push()
	w.field(ctBinary, 1)
	w.str(r.Table)
	w.pop()
	w.field(ctStruct, 17) // PinotQuery: empty here
	w.push()
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

// ErrNotRequest reports a payload that is not an InstanceRequest.
var ErrNotRequest = errors.New("pinotsim: not an InstanceRequest")

// RequestID extracts the requestId the way a proxy would (PINOT.md §3):
// p[0] must be 0x16, then a uvarint u, id = int64(u>>1) ^ -int64(u&1).
func RequestID(p []byte) (int64, error) {
	if len(p) < 2 || p[0] != 0x16 {
		return 0, ErrNotRequest
	}
	u, n := binary.Uvarint(p[1:])
	if n <= 0 {
		return 0, fmt.Errorf("%w: bad requestId varint", ErrNotRequest)
	}
	return int64(u>>1) ^ -int64(u&1), nil
}

// ParseRequest decodes an InstanceRequest payload. Fields it does not know
// are skipped, as TCompactProtocol does; field 1 is required.
func ParseRequest(p []byte) (Request, error) { return parseRequest(p, true) }

// parseRequest decodes p; without keepSegments the segment list is
// skipped, which spares the simulated server an allocation per segment.
func parseRequest(p []byte, keepSegments bool) (Request, error) {
	var r Request
	rd := compactReader{b: p}
	haveID := false
	var last int16
	for {
		typ, id, err := rd.fieldHeader(&last)
		if err != nil {
			return r, err
		}
		if typ == 0 {
			break
		}
		switch {
		case id == fieldRequestID && typ == ctI64:
			r.ID, err = rd.i64()
			haveID = err == nil
		case id == fieldQuery && typ == ctStruct:
			r.Table, err = rd.brokerRequestTable()
		case id == fieldSearchSegments && typ == ctList && keepSegments:
			r.Segments, err = rd.stringList()
		case id == fieldEnableTrace && (typ == ctBoolTrue || typ == ctBoolFalse):
			r.Trace = typ == ctBoolTrue
		case id == fieldBrokerID && typ == ctBinary:
			r.BrokerID, err = rd.str()
		case id == fieldCID && typ == ctBinary:
			r.CID, err = rd.str()
		case (id == fieldSentAt || id == fieldDeadline) && typ == ctI64:
			var ns int64
			if ns, err = rd.i64(); err == nil {
				if id == fieldSentAt {
					r.SentAt = time.Unix(0, ns)
				} else {
					r.Deadline = time.Unix(0, ns)
				}
			}
		default:
			err = rd.skip(typ, 0)
		}
		if err != nil {
			return r, err
		}
	}
	if !haveID {
		return r, fmt.Errorf("%w: no requestId", ErrNotRequest)
	}
	return r, nil
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

func (w *compactWriter) listHeader(elem byte, n int) {
	if n < 15 {
		w.b = append(w.b, byte(n)<<4|elem)
		return
	}
	w.b = append(w.b, 0xf0|elem)
	w.b = binary.AppendUvarint(w.b, uint64(n))
}

// compactReader reads TCompactProtocol structs, bounds-checked.
type compactReader struct {
	b   []byte
	off int
}

var errShort = fmt.Errorf("%w: truncated", ErrNotRequest)

// maxDepth bounds struct/list nesting when skipping.
const maxDepth = 32

func (r *compactReader) byte1() (byte, error) {
	if r.off >= len(r.b) {
		return 0, errShort
	}
	c := r.b[r.off]
	r.off++
	return c, nil
}

func (r *compactReader) uvarint() (uint64, error) {
	u, n := binary.Uvarint(r.b[r.off:])
	if n <= 0 {
		return 0, errShort
	}
	r.off += n
	return u, nil
}

func (r *compactReader) i64() (int64, error) {
	v, n := binary.Varint(r.b[r.off:])
	if n <= 0 {
		return 0, errShort
	}
	r.off += n
	return v, nil
}

func (r *compactReader) bytesN() ([]byte, error) {
	n, err := r.uvarint()
	if err != nil {
		return nil, err
	}
	if n > uint64(len(r.b)-r.off) {
		return nil, errShort
	}
	s := r.b[r.off : r.off+int(n)]
	r.off += int(n)
	return s, nil
}

func (r *compactReader) str() (string, error) {
	b, err := r.bytesN()
	return string(b), err
}

// fieldHeader returns the type and id of the next field; type 0 is STOP.
func (r *compactReader) fieldHeader(last *int16) (byte, int16, error) {
	c, err := r.byte1()
	if err != nil {
		return 0, 0, err
	}
	typ := c & 0x0f
	if typ == 0 {
		return 0, 0, nil
	}
	if d := c >> 4; d != 0 {
		*last += int16(d)
	} else {
		v, err := r.i64()
		if err != nil {
			return 0, 0, err
		}
		*last = int16(v)
	}
	return typ, *last, nil
}

func (r *compactReader) listHeader() (byte, int, error) {
	c, err := r.byte1()
	if err != nil {
		return 0, 0, err
	}
	n := int(c >> 4)
	if n == 15 {
		u, err := r.uvarint()
		if err != nil {
			return 0, 0, err
		}
		if u > uint64(len(r.b)) { // each element takes at least a byte
			return 0, 0, errShort
		}
		n = int(u)
	}
	return c & 0x0f, n, nil
}

func (r *compactReader) stringList() ([]string, error) {
	elem, n, err := r.listHeader()
	if err != nil {
		return nil, err
	}
	if elem != ctBinary {
		return nil, fmt.Errorf("%w: searchSegments element type %d", ErrNotRequest, elem)
	}
	out := make([]string, 0, n)
	for range n {
		s, err := r.str()
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}

// brokerRequestTable reads a BrokerRequest struct and returns
// querySource.tableName, skipping everything else.
func (r *compactReader) brokerRequestTable() (string, error) {
	var table string
	var last int16
	for {
		typ, id, err := r.fieldHeader(&last)
		if err != nil {
			return "", err
		}
		if typ == 0 {
			return table, nil
		}
		if id != 2 || typ != ctStruct {
			if err := r.skip(typ, 1); err != nil {
				return "", err
			}
			continue
		}
		var qlast int16
		for {
			qt, qid, err := r.fieldHeader(&qlast)
			if err != nil {
				return "", err
			}
			if qt == 0 {
				break
			}
			if qid == 1 && qt == ctBinary {
				if table, err = r.str(); err != nil {
					return "", err
				}
			} else if err := r.skip(qt, 2); err != nil {
				return "", err
			}
		}
	}
}

// skip consumes one value of type typ (a field's value; a bool field has
// none). Inside a list a bool is one byte: see skipElem.
func (r *compactReader) skip(typ byte, depth int) error {
	if typ == ctBoolTrue || typ == ctBoolFalse {
		return nil
	}
	return r.skipElem(typ, depth)
}

func (r *compactReader) skipElem(typ byte, depth int) error {
	if depth > maxDepth {
		return fmt.Errorf("%w: nested too deep", ErrNotRequest)
	}
	var err error
	switch typ {
	case ctBoolTrue, ctBoolFalse, ctByte:
		_, err = r.byte1()
	case ctI16, ctI32, ctI64:
		_, err = r.i64()
	case ctDouble:
		if len(r.b)-r.off < 8 {
			return errShort
		}
		r.off += 8
	case ctBinary:
		_, err = r.bytesN()
	case ctList, ctSet:
		var elem byte
		var n int
		if elem, n, err = r.listHeader(); err != nil {
			return err
		}
		for range n {
			if err := r.skipElem(elem, depth+1); err != nil {
				return err
			}
		}
	case ctMap:
		var n uint64
		if n, err = r.uvarint(); err != nil || n == 0 {
			return err
		}
		if n > uint64(len(r.b)) {
			return errShort
		}
		kv, err := r.byte1()
		if err != nil {
			return err
		}
		for range n {
			if err := r.skipElem(kv>>4, depth+1); err != nil {
				return err
			}
			if err := r.skipElem(kv&0x0f, depth+1); err != nil {
				return err
			}
		}
	case ctStruct:
		var last int16
		for {
			ft, _, err := r.fieldHeader(&last)
			if err != nil {
				return err
			}
			if ft == 0 {
				return nil
			}
			if err := r.skip(ft, depth+1); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("%w: unknown compact type %d", ErrNotRequest, typ)
	}
	return err
}
