package pinotwire

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// MaxRequestPrefix is the most ParseRequest ever asks for. Pinot requests
// are 0.3–2 KB plus 40–70 B per segment name, and the parts it reads (the
// requestId and the BrokerRequest) come before the segment lists.
const MaxRequestPrefix = 64 << 10

// TimeoutOptionKey is the query option that carries a request's remaining
// budget in milliseconds, as a decimal string (Pinot's
// CommonConstants.Broker.Request.QueryOptionKey.TIMEOUT_MS).
const TimeoutOptionKey = "timeoutMs"

// Errors of ParseRequest and ResponseID.
var (
	// ErrNotRequest: the payload is not an InstanceRequest a Pinot server
	// can deserialize (it does not start with field 1, requestId, or is not
	// well-formed TCompactProtocol up to the end of its BrokerRequest).
	ErrNotRequest = errors.New("pinotwire: not an InstanceRequest")
	// ErrTooLong: the reader would need more than its prefix limit
	// (MaxRequestPrefix, MaxMetadataPrefix) to decide. A payload whose
	// lengths point beyond its own end can give ErrTooLong rather than a
	// truncation error when the reader is not told it has the whole payload.
	ErrTooLong = errors.New("pinotwire: needs more than the prefix limit")
)

var (
	errEmpty   = fmt.Errorf("%w: empty payload", ErrNotRequest)
	errFirst   = fmt.Errorf("%w: does not start with 0x16 (field 1, requestId, i64)", ErrNotRequest)
	errNoQuery = fmt.Errorf("%w: field 2 (BrokerRequest) does not follow the requestId", ErrNotRequest)
)

// Field ids from Pinot's pinot-common/src/thrift/request.thrift and
// query.thrift.
const (
	instanceRequestID    = 1  // InstanceRequest.requestId, i64
	instanceRequestQuery = 2  // InstanceRequest.query, BrokerRequest
	brokerQueryOptions   = 14 // BrokerRequest.queryOptions (older request.thrift)
	brokerPinotQuery     = 17 // BrokerRequest.pinotQuery, PinotQuery
	pinotQueryOptions    = 11 // PinotQuery.queryOptions, map<string,string>
)

// Request is what the proxy reads from one InstanceRequest payload.
type Request struct {
	// ID is InstanceRequest field 1, requestId: the id the server's
	// DataTable carries back as metadata REQUEST_ID.
	ID int64
	// Timeout is the query option timeoutMs, the budget the broker had left
	// when it sent the request (a value beyond what a Duration holds is
	// clamped to the largest Duration).
	Timeout time.Duration
	// HasTimeout reports that timeoutMs was present and parsed, as Java's
	// Long.parseLong does (ASCII digits after an optional sign), to a
	// non-negative value. Pinot's QueryOptionsUtils.getTimeoutMs itself
	// rejects 0; a 0 here means the budget was already spent.
	HasTimeout bool
}

// ParseRequest reads b, the first bytes of one request payload (a Thrift
// InstanceRequest, the bare struct that Pinot's ServerChannels.sendRequest
// serializes with TCompactProtocol); complete reports whether b is the
// whole payload.
//
// It reads the requestId, which the generated InstanceRequest.write() always
// writes first (so the payload starts with 0x16, field 1 of type i64, then
// the zigzag varint id), and then walks field 2, the BrokerRequest, for the
// query option timeoutMs: in PinotQuery (BrokerRequest field 17) field 11,
// queryOptions, or failing that in the BrokerRequest field 14 queryOptions
// of older request.thrift versions. Every other field is skipped by its
// compact type. It stops as soon as it has found timeoutMs in PinotQuery or
// has finished the BrokerRequest, and so never reads the segment lists
// (fields 3, 6 and 8) that can make a request 100 KB.
//
// When b ends before the answer, ParseRequest returns need > len(b), the
// length of the prefix it needs for its next step, and a zero Request; the
// caller calls again with at least that many payload bytes (or with the
// whole payload and complete set, if it is shorter). With complete set it
// never asks for more. It never asks for more than MaxRequestPrefix bytes:
// it returns ErrTooLong instead, with r.ID set (the id is always within the
// first 11 bytes) and no timeout. Bytes of b beyond MaxRequestPrefix are
// ignored, so every prefix of a payload gives the same answer or asks for
// more. Other errors wrap ErrNotRequest and come with a zero Request.
//
// It does not allocate and does not panic, whatever b holds.
func ParseRequest(b []byte, complete bool) (r Request, need int, err error) {
	if len(b) > MaxRequestPrefix {
		b, complete = b[:MaxRequestPrefix], false
	}
	if len(b) == 0 {
		if complete {
			return Request{}, 0, errEmpty
		}
		return Request{}, 1, nil
	}
	if b[0] != CompactI64|instanceRequestID<<4 {
		return Request{}, 0, errFirst
	}
	rd := reader{b: b, off: 1, complete: complete, max: MaxRequestPrefix}
	r, err = rd.request()
	switch {
	case err == nil:
		return r, 0, nil
	case err == errShort:
		return Request{}, rd.need, nil
	case err == ErrTooLong:
		return Request{ID: r.ID}, 0, ErrTooLong
	}
	return Request{}, 0, err
}

// request reads on from the requestId's varint.
func (rd *reader) request() (r Request, err error) {
	if r.ID, err = rd.varint(); err != nil {
		return r, err
	}
	last := int16(instanceRequestID)
	typ, id, err := rd.field(&last)
	if err != nil {
		return r, err
	}
	// The generated code writes the fields in id order and field 2 is
	// required: without it the server's TDeserializer fails validate().
	if typ != CompactStruct || id != instanceRequestQuery {
		return r, errNoQuery
	}
	var legacy options
	last = 0
	for { // BrokerRequest
		typ, id, err := rd.field(&last)
		if err != nil {
			return r, err
		}
		switch {
		case typ == CompactStop:
			r.Timeout, r.HasTimeout = legacy.timeout, legacy.valid
			return r, nil
		case id == brokerPinotQuery && typ == CompactStruct:
			o, err := rd.pinotQuery()
			if err != nil {
				return r, err
			}
			if o.found {
				r.Timeout, r.HasTimeout = o.timeout, o.valid
				return r, nil // PinotQuery's options are the ones the server reads
			}
		case id == brokerQueryOptions && typ == CompactMap && !legacy.found:
			if legacy, err = rd.options(2); err != nil {
				return r, err
			}
		default:
			if err := rd.skip(typ, 2); err != nil {
				return r, err
			}
		}
	}
}

// pinotQuery reads a PinotQuery struct up to timeoutMs in its queryOptions,
// or through its STOP when it has none.
func (rd *reader) pinotQuery() (options, error) {
	var last int16
	for {
		typ, id, err := rd.field(&last)
		if err != nil || typ == CompactStop {
			return options{}, err
		}
		if id == pinotQueryOptions && typ == CompactMap {
			o, err := rd.options(3)
			if err != nil || o.found {
				return o, err
			}
			continue
		}
		if err := rd.skip(typ, 3); err != nil {
			return options{}, err
		}
	}
}

// options is what a queryOptions map said about timeoutMs.
type options struct {
	found   bool // the key is there
	valid   bool // its value parsed
	timeout time.Duration
}

// options reads a queryOptions map (map<string,string>: uvarint size, then
// a key/value type byte 0x88 unless the size is 0, then the entries) up to
// the timeoutMs entry, or through its end when it has none. Keys are
// compared in place; only a key of the right length whose bytes so far
// match makes the reader ask for the rest of it. The first timeoutMs entry
// wins: a map a Java writer serialized has each key once.
func (rd *reader) options(depth int) (options, error) {
	n, err := rd.size()
	if err != nil || n == 0 {
		return options{}, err
	}
	kv, err := rd.byte1()
	if err != nil {
		return options{}, err
	}
	k, v := kv>>4, kv&0x0f
	if !elemType(k, n) || !elemType(v, n) {
		return options{}, errType
	}
	if k != CompactBinary || v != CompactBinary { // not map<string,string>
		return options{}, rd.skipElems(n, k, v, depth+1)
	}
	for range n {
		kl, err := rd.size()
		if err != nil {
			return options{}, err
		}
		match, err := rd.isTimeoutKey(kl)
		if err != nil {
			return options{}, err
		}
		vl, err := rd.size()
		if err != nil {
			return options{}, err
		}
		if !match {
			rd.advance(vl)
			continue
		}
		s, err := rd.take(vl)
		if err != nil {
			return options{}, err
		}
		t, ok := parseTimeoutMs(rd.b[s:rd.off])
		return options{found: true, valid: ok, timeout: t}, nil
	}
	return options{}, nil
}

// isTimeoutKey reports whether the next n bytes are "timeoutMs" and moves
// past them. It needs them only when n is 9 and the bytes at hand match.
func (rd *reader) isTimeoutKey(n uint64) (bool, error) {
	if n != uint64(len(TimeoutOptionKey)) {
		rd.advance(n)
		return false, nil
	}
	for i := range len(TimeoutOptionKey) {
		p := rd.off + i
		if p >= len(rd.b) {
			break
		}
		if rd.b[p] != TimeoutOptionKey[i] {
			rd.advance(n)
			return false, nil
		}
	}
	if _, err := rd.take(n); err != nil {
		return false, err
	}
	return true, nil
}

// parseTimeoutMs parses v as Java's Long.parseLong does for ASCII input (an
// optional sign, then at least one digit, within int64) and accepts a
// non-negative result, clamped to the largest Duration.
func parseTimeoutMs(v []byte) (time.Duration, bool) {
	neg := false
	if len(v) > 0 && (v[0] == '+' || v[0] == '-') {
		neg, v = v[0] == '-', v[1:]
	}
	if len(v) == 0 {
		return 0, false
	}
	var n uint64
	for _, c := range v {
		d := uint64(c) - '0'
		if d > 9 || n > (math.MaxUint64-9)/10 {
			return 0, false
		}
		n = n*10 + d
		if n > 1<<63 {
			return 0, false // beyond Long.MIN_VALUE's magnitude
		}
	}
	if neg && n != 0 || n > math.MaxInt64 {
		return 0, false // negative, or beyond Long.MAX_VALUE
	}
	if n > math.MaxInt64/uint64(time.Millisecond) {
		return math.MaxInt64, true
	}
	return time.Duration(n) * time.Millisecond, true
}
