package pinotsim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
)

// DataTable V4 layout constants (PINOT.md §4).
const (
	dataTableVersion = 4
	dataTableHeader  = 52 // 13 int32
	// KeyRequestID is the metadata key id of REQUEST_ID (a LONG).
	KeyRequestID = 14
	// MinimalResponseLen is the payload length of AppendResponse's table.
	MinimalResponseLen = 76
)

// Metadata value types, by key id (DataTable.MetadataKey, ids 0–44).
const (
	metaUnknown = iota
	metaLong
	metaInt
	metaBool
	metaString
)

func metaType(key int32) int {
	switch {
	case key == 2 || key == 3 || key == 4 || key == 9 || key == 10 || key == 12 || key == 14 ||
		(key >= 16 && key <= 19) || key == 30 || key == 32 || key == 33 || key == 36 || key == 37:
		return metaLong
	case (key >= 5 && key <= 8) || key == 15 || (key >= 20 && key <= 29):
		return metaInt
	case key == 38:
		return metaBool
	case key == 0 || key == 1 || key == 11 || key == 13 || key == 31 || key == 34 || key == 35 ||
		(key >= 39 && key <= 44):
		return metaString
	}
	return metaUnknown
}

// Metadata is one DataTable metadata entry. As in Pinot's
// Map<String,String>, the value is a string, serialized by the key's type:
// LONG and INT parsed as decimal, BOOLEAN as "true"/"false", STRING as is.
type Metadata struct {
	Key   int32
	Value string
}

// AppendResponse appends the minimal DataTable V4 payload (76 bytes: an
// empty table with no exceptions and only REQUEST_ID in its metadata) for
// requestID to dst; framed it is the 80-byte example of PINOT.md §4.
func AppendResponse(dst []byte, requestID int64) []byte {
	b, _ := AppendDataTable(dst, []Metadata{{Key: KeyRequestID, Value: strconv.FormatInt(requestID, 10)}})
	return b
}

// AppendDataTable appends an empty DataTable V4 payload whose metadata
// holds meta, in the given order (Pinot's HashMap order is arbitrary, so a
// parser must not assume one). An unknown key or a value that does not
// parse as the key's type is an error.
func AppendDataTable(dst []byte, meta []Metadata) ([]byte, error) {
	var md []byte
	md = binary.BigEndian.AppendUint32(md, uint32(len(meta)))
	for _, m := range meta {
		md = binary.BigEndian.AppendUint32(md, uint32(m.Key))
		switch metaType(m.Key) {
		case metaLong:
			v, err := strconv.ParseInt(m.Value, 10, 64)
			if err != nil {
				return dst, fmt.Errorf("pinotsim: metadata key %d: %w", m.Key, err)
			}
			md = binary.BigEndian.AppendUint64(md, uint64(v))
		case metaInt:
			v, err := strconv.ParseInt(m.Value, 10, 32)
			if err != nil {
				return dst, fmt.Errorf("pinotsim: metadata key %d: %w", m.Key, err)
			}
			md = binary.BigEndian.AppendUint32(md, uint32(v))
		case metaBool:
			v, err := strconv.ParseBool(m.Value)
			if err != nil {
				return dst, fmt.Errorf("pinotsim: metadata key %d: %w", m.Key, err)
			}
			if v {
				md = append(md, 1)
			} else {
				md = append(md, 0)
			}
		case metaString:
			md = binary.BigEndian.AppendUint32(md, uint32(len(m.Value)))
			md = append(md, m.Value...)
		default:
			return dst, fmt.Errorf("pinotsim: unknown metadata key %d", m.Key)
		}
	}
	const exceptionsLen = 4 // int32 count 0
	end := uint32(dataTableHeader + exceptionsLen)
	hdr := [13]uint32{
		dataTableVersion, 0, 0, // version, numRows, numColumns
		dataTableHeader, exceptionsLen, // exceptions
		end, 0, // dictionary
		end, 0, // schema
		end, 0, // fixed-size data
		end, 0, // variable-size data
	}
	for _, v := range hdr {
		dst = binary.BigEndian.AppendUint32(dst, v)
	}
	dst = binary.BigEndian.AppendUint32(dst, 0) // exceptions: count 0
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(md)))
	return append(dst, md...), nil
}

// Errors of ResponseID.
var (
	ErrNotDataTable = errors.New("pinotsim: not a DataTable V4")
	ErrNoRequestID  = errors.New("pinotsim: no REQUEST_ID in DataTable metadata")
)

// ResponseID extracts REQUEST_ID (metadata key 14) from a DataTable V4
// payload as PINOT.md §9 describes: check the version, skip the five
// sections whose lengths the header gives, then walk the metadata entries
// by key type. An unknown key cannot be skipped, so the walk stops there.
func ResponseID(p []byte) (int64, error) {
	be32 := func(off int) (uint32, bool) {
		if off < 0 || off+4 > len(p) {
			return 0, false
		}
		return binary.BigEndian.Uint32(p[off:]), true
	}
	if v, ok := be32(0); !ok || len(p) < dataTableHeader || v != dataTableVersion {
		return 0, ErrNotDataTable
	}
	off := int64(dataTableHeader)
	for _, i := range []int{4, 6, 8, 10, 12} {
		n, _ := be32(4 * i)
		off += int64(n)
	}
	if off+8 > int64(len(p)) {
		return 0, fmt.Errorf("%w: sections overrun the payload", ErrNotDataTable)
	}
	o := int(off) + 4 // skip metaLen
	n, _ := be32(o)
	o += 4
	for range n {
		k, ok := be32(o)
		if !ok {
			break
		}
		o += 4
		key := int32(k)
		switch metaType(key) {
		case metaLong:
			if o+8 > len(p) {
				return 0, fmt.Errorf("%w: truncated metadata", ErrNotDataTable)
			}
			if key == KeyRequestID {
				return int64(binary.BigEndian.Uint64(p[o:])), nil
			}
			o += 8
		case metaInt:
			o += 4
		case metaBool:
			o++
		case metaString:
			l, ok := be32(o)
			if !ok {
				return 0, fmt.Errorf("%w: truncated metadata", ErrNotDataTable)
			}
			o += 4 + int(l)
		default:
			return 0, fmt.Errorf("%w: unknown metadata key %d before it", ErrNoRequestID, key)
		}
		if o > len(p) {
			return 0, fmt.Errorf("%w: truncated metadata", ErrNotDataTable)
		}
	}
	return 0, ErrNoRequestID
}
