package pinotwire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// ResponseHeaderLen is the size of the DataTable V4 header: 13 big-endian
// int32 (DataTableImplV4.HEADER_SIZE).
const ResponseHeaderLen = 52

// MaxMetadataPrefix is the most ResponseID ever asks for, counted from the
// start of the metadata section. Pinot servers write 15–25 metadata entries,
// under 1 KB, unless a trace makes TRACE_INFO large.
const MaxMetadataPrefix = 64 << 10

// DataTableVersion is the only version Pinot's DataTableFactory accepts.
const DataTableVersion = 4

// KeyRequestID is the id of metadata key REQUEST_ID (DataTable.MetadataKey),
// a LONG: the requestId of the InstanceRequest being answered.
const KeyRequestID = 14

// ErrNotDataTable reports a response payload that Pinot's DataTableImplV4
// could not read.
var ErrNotDataTable = errors.New("pinotwire: not a DataTable V4")

var (
	errShortHeader = fmt.Errorf("%w: shorter than the 52-byte header", ErrNotDataTable)
	errVersion     = fmt.Errorf("%w: version is not 4", ErrNotDataTable)
	errNegative    = fmt.Errorf("%w: negative section length", ErrNotDataTable)
	errLayout      = fmt.Errorf("%w: section does not start where the one before it ends", ErrNotDataTable)
	errOverflow    = fmt.Errorf("%w: sections longer than a frame can carry", ErrNotDataTable)
	errMetaShort   = fmt.Errorf("%w: payload ends inside the metadata", ErrNotDataTable)
	errMetaString  = fmt.Errorf("%w: negative metadata string length", ErrNotDataTable)
)

// MetadataValueType is how a metadata value is serialized, by key
// (DataTable.MetadataValueType).
type MetadataValueType uint8

// Metadata value types.
const (
	// MetadataUnknown: not a key of DataTable.MetadataKey. Its value cannot
	// be skipped: DataTableImplV4.deserializeMetadata skips the key id but
	// not the value, and reads on from there.
	MetadataUnknown MetadataValueType = iota
	MetadataLong                      // 8 bytes, big-endian
	MetadataInt                       // 4 bytes, big-endian
	MetadataBoolean                   // 1 byte, 1 for true
	MetadataString                    // int32 length, then UTF-8
)

// metadataTypes is DataTable.MetadataKey's id → value type, ids 0–44.
var metadataTypes = [...]MetadataValueType{
	0: MetadataString, 1: MetadataString,
	2: MetadataLong, 3: MetadataLong, 4: MetadataLong,
	5: MetadataInt, 6: MetadataInt, 7: MetadataInt, 8: MetadataInt,
	9: MetadataLong, 10: MetadataLong, 11: MetadataString, 12: MetadataLong,
	13: MetadataString, 14: MetadataLong, 15: MetadataInt,
	16: MetadataLong, 17: MetadataLong, 18: MetadataLong, 19: MetadataLong,
	20: MetadataInt, 21: MetadataInt, 22: MetadataInt, 23: MetadataInt, 24: MetadataInt,
	25: MetadataInt, 26: MetadataInt, 27: MetadataInt, 28: MetadataInt, 29: MetadataInt,
	30: MetadataLong, 31: MetadataString, 32: MetadataLong, 33: MetadataLong,
	34: MetadataString, 35: MetadataString, 36: MetadataLong, 37: MetadataLong,
	38: MetadataBoolean,
	39: MetadataString, 40: MetadataString, 41: MetadataString, 42: MetadataString,
	43: MetadataString, 44: MetadataString,
}

// MetadataKeyType returns the value type of metadata key id key, as
// DataTable.MetadataKey.getById(key).getValueType() gives it, or
// MetadataUnknown for an id it does not know.
func MetadataKeyType(key int32) MetadataValueType {
	if key < 0 || int(key) >= len(metadataTypes) {
		return MetadataUnknown
	}
	return metadataTypes[key]
}

// MetadataOffset reads hdr, the first ResponseHeaderLen bytes of a response
// payload (a DataTable V4, as DataTableImplV4.toBytes writes it), and
// returns the payload offset of the metadata section, which starts with its
// int32 length: 52 + h[4] + h[6] + h[8] + h[10] + h[12], the header (13
// int32 h[0..12]) followed by the exceptions, dictionary, schema,
// fixed-size and variable-size sections. The metadata section comes last,
// so the proxy can find the REQUEST_ID of a response of any size by
// counting, without buffering it.
//
// It returns ErrNotDataTable for a short hdr, a version h[0] other than 4, a
// negative section length, a section of non-zero length whose start h[3],
// h[5], h[7], h[9] or h[11] is not where the sections before it end (the
// layout writeLeadingSections writes; the Java reader would look elsewhere),
// or an offset that leaves no room for the metadata length within a frame's
// 2^31-1 bytes. The caller checks off against the payload length.
func MetadataOffset(hdr []byte) (off int64, err error) {
	if len(hdr) < ResponseHeaderLen {
		return 0, errShortHeader
	}
	if binary.BigEndian.Uint32(hdr) != DataTableVersion {
		return 0, errVersion
	}
	off = ResponseHeaderLen
	for i := 3; i < 13; i += 2 {
		start := int32(binary.BigEndian.Uint32(hdr[4*i:]))
		n := int32(binary.BigEndian.Uint32(hdr[4*i+4:]))
		if n < 0 {
			return 0, errNegative
		}
		if n != 0 && int64(start) != off {
			return 0, errLayout
		}
		off += int64(n)
	}
	if off > math.MaxInt32-4 {
		return 0, errOverflow
	}
	return off, nil
}

// ResponseID reads b, the first bytes of a DataTable V4 metadata section
// (from the offset MetadataOffset returns: int32 metadataLen, int32
// numEntries, then per entry an int32 key id and a value whose size the
// key's type gives), and returns the REQUEST_ID entry's value. complete
// reports whether b runs to the end of the payload.
//
// It walks the entries as DataTableImplV4.deserializeMetadata does: a
// metadataLen of 0 means no metadata at all; otherwise the entries are read
// from the payload, not bounded by metadataLen. found is false when the
// metadata has no REQUEST_ID, or when a key id that DataTable.MetadataKey
// does not know comes before it: the Java reader skips such a key but not
// its value, so nothing after it can be trusted. The first REQUEST_ID wins
// (a server writes its metadata from a map, each key once).
//
// The need protocol is ParseRequest's, counted from the start of the
// metadata section: need > len(b) asks for that many bytes, never more
// than MaxMetadataPrefix (ErrTooLong instead, and bytes of b beyond it are
// ignored); with complete set it never asks for more and a payload that
// ends inside an entry it reads or skips is ErrNotDataTable, as is a
// negative string length. It does not allocate and does not panic.
func ResponseID(b []byte, complete bool) (id int64, found bool, need int, err error) {
	if len(b) > MaxMetadataPrefix {
		b, complete = b[:MaxMetadataPrefix], false
	}
	short := func(p int) (int64, bool, int, error) {
		switch {
		case complete:
			return 0, false, 0, errMetaShort
		case p > MaxMetadataPrefix:
			return 0, false, 0, ErrTooLong
		}
		return 0, false, p, nil
	}
	if len(b) < 4 {
		return short(4)
	}
	if binary.BigEndian.Uint32(b) == 0 {
		return 0, false, 0, nil // metadataLength 0: no metadata
	}
	if len(b) < 8 {
		return short(8)
	}
	n := int32(binary.BigEndian.Uint32(b[4:]))
	off := 8 // may pass len(b) when a value is skipped; at most max+1
	skip := func(k int64) {
		off = int(min(int64(off)+k, MaxMetadataPrefix+1))
	}
	for range max(n, 0) {
		if off+4 > len(b) {
			return short(off + 4)
		}
		key := int32(binary.BigEndian.Uint32(b[off:]))
		off += 4
		switch MetadataKeyType(key) {
		case MetadataLong:
			if key == KeyRequestID {
				if off+8 > len(b) {
					return short(off + 8)
				}
				return int64(binary.BigEndian.Uint64(b[off:])), true, 0, nil
			}
			skip(8)
		case MetadataInt:
			skip(4)
		case MetadataBoolean:
			skip(1)
		case MetadataString:
			if off+4 > len(b) {
				return short(off + 4)
			}
			l := int32(binary.BigEndian.Uint32(b[off:]))
			if l < 0 {
				return 0, false, 0, errMetaString
			}
			skip(4 + int64(l))
		default:
			return 0, false, 0, nil
		}
	}
	if off > len(b) { // the last value skipped must be there
		return short(off)
	}
	return 0, false, 0, nil
}
