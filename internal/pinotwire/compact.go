package pinotwire

import (
	"errors"
	"fmt"
)

// TCompactProtocol type ids, as they appear in the low nibble of a field
// header and in list and map headers (libthrift's TCompactProtocol.Types).
// A bool field carries its value in the type (BoolTrue or BoolFalse) and has
// no value bytes; a bool inside a list, set or map is one byte.
const (
	CompactStop      = 0x0
	CompactBoolTrue  = 0x1
	CompactBoolFalse = 0x2
	CompactByte      = 0x3
	CompactI16       = 0x4
	CompactI32       = 0x5
	CompactI64       = 0x6
	CompactDouble    = 0x7
	CompactBinary    = 0x8 // string or binary: uvarint length, then the bytes
	CompactList      = 0x9
	CompactSet       = 0xA
	CompactMap       = 0xB
	CompactStruct    = 0xC
	CompactUUID      = 0xD // 16 bytes (newer libthrift; Pinot's IDL has none)
)

// maxDepth bounds the nesting of structs, lists, sets and maps the reader
// descends into, as libthrift's DEFAULT_RECURSION_DEPTH (64) bounds its
// skip, so that a hostile payload cannot exhaust the stack.
const maxDepth = 64

// Errors of the compact reader. Each wraps ErrNotRequest: a payload that a
// TCompactProtocol reader cannot get through is not an InstanceRequest a
// Pinot server would answer (its InstanceRequestHandler drops it).
var (
	errTruncated = fmt.Errorf("%w: payload ends inside a value", ErrNotRequest)
	errVarint    = fmt.Errorf("%w: varint longer than 10 bytes", ErrNotRequest)
	errType      = fmt.Errorf("%w: unknown compact type", ErrNotRequest)
	errDepth     = fmt.Errorf("%w: nested deeper than 64", ErrNotRequest)
	errSize      = fmt.Errorf("%w: negative length or size", ErrNotRequest)
)

// errShort is the reader's internal signal that it ran out of bytes in a
// prefix that is not the whole payload; reader.need says how many it needs.
// It never leaves the package.
var errShort = errors.New("pinotwire: need more bytes")

// reader reads TCompactProtocol from b, the first bytes of a payload, by
// offsets: nothing is copied and nothing allocated.
//
// Bytes that are skipped rather than looked at are not required to be in b:
// a skip moves off forward, possibly past len(b), and only the next read
// asks for the bytes up to where it reads. need is therefore exact: the
// smallest prefix that lets the reader take its next step.
type reader struct {
	b        []byte
	off      int  // next byte; may exceed len(b) after a skip (at most max+1)
	complete bool // b is the whole payload: running out is an error
	max      int  // never ask for a prefix longer than this (ErrTooLong)
	need     int  // with errShort: the prefix length the next step needs
}

// short reports that the next step needs the first p bytes.
func (r *reader) short(p int) error {
	if r.complete {
		return errTruncated
	}
	if p > r.max {
		return ErrTooLong
	}
	r.need = p
	return errShort
}

// advance skips n bytes without looking at them. An offset beyond max is
// kept at max+1: whatever reads next asks for more than max bytes.
func (r *reader) advance(n uint64) {
	if n > uint64(r.max) || r.off+int(n) > r.max {
		r.off = r.max + 1
		return
	}
	r.off += int(n)
}

func (r *reader) byte1() (byte, error) {
	if r.off >= len(r.b) {
		return 0, r.short(r.off + 1)
	}
	c := r.b[r.off]
	r.off++
	return c, nil
}

// uvarint reads a varint as libthrift's TCompactProtocol.readVarint64 does:
// at most 10 bytes, bits beyond 64 dropped.
func (r *reader) uvarint() (uint64, error) {
	var u uint64
	for i := range 10 {
		p := r.off + i
		if p >= len(r.b) { // one more byte says whether it goes on
			return 0, r.short(p + 1)
		}
		c := r.b[p]
		u |= uint64(c&0x7f) << (7 * i)
		if c < 0x80 {
			r.off = p + 1
			return u, nil
		}
	}
	return 0, errVarint
}

// size reads a string length or container size, a varint that libthrift
// truncates to an int32 (readVarint32) and rejects when negative.
func (r *reader) size() (uint64, error) {
	u, err := r.uvarint()
	if err != nil {
		return 0, err
	}
	if int32(u) < 0 {
		return 0, errSize
	}
	return uint64(uint32(u)), nil
}

// varint reads a zigzag varint (i16, i32 and i64 alike).
func (r *reader) varint() (int64, error) {
	u, err := r.uvarint()
	return int64(u>>1) ^ -int64(u&1), err
}

// take returns the offset of the next n bytes, which the caller looks at,
// and moves past them.
func (r *reader) take(n uint64) (int, error) {
	if r.off > len(r.b) || n > uint64(len(r.b)-r.off) {
		p := r.max + 1
		if n <= uint64(r.max) && r.off+int(n) <= r.max {
			p = r.off + int(n)
		}
		return 0, r.short(p)
	}
	s := r.off
	r.off += int(n)
	return s, nil
}

// field reads a field header and returns the field's type and id; type
// CompactStop ends the struct. last is the previous field id of the same
// struct (0 at its start): the short form carries the id as a delta 1..15
// from it, the long form (delta nibble 0) as a zigzag i16 after the byte.
func (r *reader) field(last *int16) (typ byte, id int16, err error) {
	c, err := r.byte1()
	if err != nil {
		return 0, 0, err
	}
	typ = c & 0x0f
	if typ == CompactStop {
		return CompactStop, 0, nil
	}
	if d := c >> 4; d != 0 {
		*last += int16(d)
	} else {
		v, err := r.varint()
		if err != nil {
			return 0, 0, err
		}
		*last = int16(v) // as readI16: zigzag of the low 32 bits, truncated
	}
	if typ > CompactUUID {
		return 0, 0, errType
	}
	return typ, *last, nil
}

// listHeader reads a list or set header: (n<<4)|elem for n < 15, else
// 0xF0|elem followed by uvarint n.
func (r *reader) listHeader() (elem byte, n uint64, err error) {
	c, err := r.byte1()
	if err != nil {
		return 0, 0, err
	}
	elem, n = c&0x0f, uint64(c>>4)
	if n == 15 {
		if n, err = r.size(); err != nil {
			return 0, 0, err
		}
	}
	if !elemType(elem, n) {
		return 0, 0, errType
	}
	return elem, n, nil
}

// elemType reports whether t may be the type of n container elements.
// libthrift maps nibble 0 to STOP, which no value has: only an empty
// container gets away with it.
func elemType(t byte, n uint64) bool {
	return (t >= CompactBoolTrue && t <= CompactUUID) || (t == CompactStop && n == 0)
}

// fixedSize is the size of a container element of type t that has one.
func fixedSize(t byte) uint64 {
	switch t {
	case CompactBoolTrue, CompactBoolFalse, CompactByte:
		return 1
	case CompactDouble:
		return 8
	case CompactUUID:
		return 16
	}
	return 0
}

// skip skips the value of a field of type typ (a bool field has none).
// depth counts the containers the value sits in.
func (r *reader) skip(typ byte, depth int) error {
	if typ == CompactBoolTrue || typ == CompactBoolFalse {
		return nil
	}
	return r.skipElem(typ, depth)
}

// skipElem skips one value of type typ as a container element, where a
// bool is one byte.
func (r *reader) skipElem(typ byte, depth int) error {
	if depth > maxDepth {
		return errDepth
	}
	switch typ {
	case CompactBoolTrue, CompactBoolFalse, CompactByte, CompactDouble, CompactUUID:
		r.advance(fixedSize(typ))
		return nil
	case CompactI16, CompactI32, CompactI64:
		_, err := r.uvarint()
		return err
	case CompactBinary:
		n, err := r.size()
		if err == nil {
			r.advance(n)
		}
		return err
	case CompactList, CompactSet:
		elem, n, err := r.listHeader()
		if err != nil {
			return err
		}
		return r.skipElems(n, elem, CompactStop, depth+1)
	case CompactMap:
		n, err := r.size()
		if err != nil || n == 0 {
			return err
		}
		kv, err := r.byte1()
		if err != nil {
			return err
		}
		if !elemType(kv>>4, n) || !elemType(kv&0x0f, n) {
			return errType
		}
		return r.skipElems(n, kv>>4, kv&0x0f, depth+1)
	case CompactStruct:
		return r.skipStruct(depth + 1)
	}
	return errType
}

// skipElems skips n container elements of type k, or n map entries of key
// type k and value type v (v != CompactStop).
func (r *reader) skipElems(n uint64, k, v byte, depth int) error {
	if depth > maxDepth {
		return errDepth
	}
	// Elements of fixed size are skipped in one step: n may be huge, and
	// skipping them one by one would read nothing that could stop the loop.
	if ks, vs := fixedSize(k), fixedSize(v); ks != 0 && (v == CompactStop || vs != 0) {
		if n > uint64(r.max) {
			r.advance(n) // past max whatever the element size
		} else {
			r.advance(n * (ks + vs))
		}
		return nil
	}
	// Otherwise every element reads at least one byte, so running out of
	// bytes ends the loop.
	for range n {
		if err := r.skipElem(k, depth); err != nil {
			return err
		}
		if v != CompactStop {
			if err := r.skipElem(v, depth); err != nil {
				return err
			}
		}
	}
	return nil
}

// skipStruct skips the fields of a struct through its STOP.
func (r *reader) skipStruct(depth int) error {
	if depth > maxDepth {
		return errDepth
	}
	var last int16
	for {
		typ, _, err := r.field(&last)
		if err != nil {
			return err
		}
		if typ == CompactStop {
			return nil
		}
		if err := r.skip(typ, depth); err != nil {
			return err
		}
	}
}

// CompactReader reads TCompactProtocol values from a whole payload with the
// code ParseRequest uses, so that a decoder of the fields the proxy does not
// need (the simulator's) cannot drift from it. It does not copy: a slice it
// returns aliases the payload. Errors wrap ErrNotRequest.
type CompactReader struct{ r reader }

// NewCompactReader returns a reader at the start of payload p.
func NewCompactReader(p []byte) CompactReader {
	return CompactReader{r: reader{b: p, complete: true, max: len(p)}}
}

// Field reads a field header: its type (CompactStop at the end of the
// struct) and id. last is the previous field id of the same struct, 0 at
// the start of each struct; Field updates it.
func (c *CompactReader) Field(last *int16) (typ byte, id int16, err error) { return c.r.field(last) }

// I64 reads an i64 (also i32 or i16) value.
func (c *CompactReader) I64() (int64, error) { return c.r.varint() }

// Binary reads a string or binary value.
func (c *CompactReader) Binary() ([]byte, error) {
	n, err := c.r.size()
	if err != nil {
		return nil, err
	}
	s, err := c.r.take(n)
	if err != nil {
		return nil, err
	}
	return c.r.b[s:c.r.off], nil
}

// List reads a list or set header: the element type and count. The count
// is at most the bytes left, as every element takes at least one.
func (c *CompactReader) List() (elem byte, n int, err error) {
	elem, u, err := c.r.listHeader()
	if err != nil {
		return 0, 0, err
	}
	if u > uint64(len(c.r.b)-c.r.off) {
		return 0, 0, errTruncated
	}
	return elem, int(u), nil
}

// Skip skips the value of a field of type typ.
func (c *CompactReader) Skip(typ byte) error { return c.r.skip(typ, 0) }
