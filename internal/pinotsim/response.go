package pinotsim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"

	"github.com/livenessproxy/livenessproxy/internal/pinotwire"
)

// DataTable V4 layout constants (DataTableImplV4).
const (
	dataTableVersion = pinotwire.DataTableVersion
	dataTableHeader  = pinotwire.ResponseHeaderLen // 13 int32
	// KeyRequestID is the metadata key id of REQUEST_ID (a LONG).
	KeyRequestID = pinotwire.KeyRequestID
	// MinimalResponseLen is the payload length of AppendResponse's table.
	MinimalResponseLen = 76
)

// Metadata is one DataTable metadata entry. As in Pinot's
// Map<String,String>, the value is a string, serialized by the key's type:
// LONG and INT parsed as decimal, BOOLEAN as "true"/"false", STRING as is.
type Metadata struct {
	Key   int32
	Value string
}

// AppendResponse appends the minimal DataTable V4 payload (76 bytes: an
// empty table with no exceptions and only REQUEST_ID in its metadata) for
// requestID to dst; framed, it is 80 bytes.
func AppendResponse(dst []byte, requestID int64) []byte {
	b, _ := AppendDataTable(dst, []Metadata{{Key: KeyRequestID, Value: strconv.FormatInt(requestID, 10)}})
	return b
}

// AppendDataTable appends an empty DataTable V4 payload whose metadata
// holds meta, in the given order (Pinot's HashMap order is arbitrary, so a
// parser must not assume one). An unknown key or a value that does not
// parse as the key's type is an error.
func AppendDataTable(dst []byte, meta []Metadata) ([]byte, error) {
	return (&DataTable{Metadata: meta}).Append(dst)
}

// Exception is one entry of a DataTable's exceptions section.
type Exception struct {
	Code    int32 // a QueryErrorCode
	Message string
}

// DataTable is the content of a DataTable V4 response. The simulator does
// not interpret rows: Schema, Fixed and Variable are written as given, which
// is enough to give a response the size and layout of a real one.
type DataTable struct {
	NumRows, NumColumns int32
	Exceptions          []Exception
	Dictionary          []string // the string dictionary section; nil: none
	Schema              []byte   // DataSchema.toBytes output; nil: none
	Fixed, Variable     []byte   // the fixed- and variable-size data sections
	Metadata            []Metadata
}

// Append appends t serialized as DataTableImplV4.toBytes does: the 13-int32
// header, the exceptions, dictionary, schema, fixed-size and variable-size
// sections back to back, then the metadata length and the metadata. An
// unknown metadata key or a value that does not parse as the key's type is
// an error.
func (t *DataTable) Append(dst []byte) ([]byte, error) {
	var md []byte
	md = binary.BigEndian.AppendUint32(md, uint32(len(t.Metadata)))
	for _, m := range t.Metadata {
		md = binary.BigEndian.AppendUint32(md, uint32(m.Key))
		switch pinotwire.MetadataKeyType(m.Key) {
		case pinotwire.MetadataLong:
			v, err := strconv.ParseInt(m.Value, 10, 64)
			if err != nil {
				return dst, fmt.Errorf("pinotsim: metadata key %d: %w", m.Key, err)
			}
			md = binary.BigEndian.AppendUint64(md, uint64(v))
		case pinotwire.MetadataInt:
			v, err := strconv.ParseInt(m.Value, 10, 32)
			if err != nil {
				return dst, fmt.Errorf("pinotsim: metadata key %d: %w", m.Key, err)
			}
			md = binary.BigEndian.AppendUint32(md, uint32(v))
		case pinotwire.MetadataBoolean:
			v, err := strconv.ParseBool(m.Value)
			if err != nil {
				return dst, fmt.Errorf("pinotsim: metadata key %d: %w", m.Key, err)
			}
			if v {
				md = append(md, 1)
			} else {
				md = append(md, 0)
			}
		case pinotwire.MetadataString:
			md = appendString(md, m.Value)
		default:
			return dst, fmt.Errorf("pinotsim: unknown metadata key %d", m.Key)
		}
	}

	// Exceptions are always written (a count, then code and message each);
	// the dictionary only when there is one.
	exc := binary.BigEndian.AppendUint32(nil, uint32(len(t.Exceptions)))
	for _, e := range t.Exceptions {
		exc = appendString(binary.BigEndian.AppendUint32(exc, uint32(e.Code)), e.Message)
	}
	var dict []byte
	if t.Dictionary != nil {
		dict = binary.BigEndian.AppendUint32(dict, uint32(len(t.Dictionary)))
		for _, s := range t.Dictionary {
			dict = appendString(dict, s)
		}
	}
	sections := [5][]byte{exc, dict, t.Schema, t.Fixed, t.Variable}
	dst = binary.BigEndian.AppendUint32(dst, dataTableVersion)
	dst = binary.BigEndian.AppendUint32(dst, uint32(t.NumRows))
	dst = binary.BigEndian.AppendUint32(dst, uint32(t.NumColumns))
	off := dataTableHeader
	for _, s := range sections { // start and length of each
		dst = binary.BigEndian.AppendUint32(dst, uint32(off))
		dst = binary.BigEndian.AppendUint32(dst, uint32(len(s)))
		off += len(s)
	}
	for _, s := range sections {
		dst = append(dst, s...)
	}
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(md)))
	return append(dst, md...), nil
}

// appendString appends s as DataTableUtils.decodeString reads it: an int32
// length, then the UTF-8 bytes.
func appendString(dst []byte, s string) []byte {
	return append(binary.BigEndian.AppendUint32(dst, uint32(len(s))), s...)
}

// Errors of ResponseID. ErrNotDataTable is pinotwire.ErrNotDataTable, so
// errors.Is matches either name.
var (
	ErrNotDataTable = pinotwire.ErrNotDataTable
	ErrNoRequestID  = errors.New("pinotsim: no REQUEST_ID in DataTable metadata")
)

var errOverrun = fmt.Errorf("%w: sections overrun the payload", ErrNotDataTable)

// ResponseID extracts REQUEST_ID (metadata key 14) from a whole DataTable V4
// payload the way the proxy does: pinotwire.MetadataOffset on the header,
// then pinotwire.ResponseID on the metadata section. An unknown key before
// REQUEST_ID stops the walk (ErrNoRequestID), as it would Pinot's reader.
func ResponseID(p []byte) (int64, error) {
	off, err := pinotwire.MetadataOffset(p)
	if err != nil {
		return 0, err
	}
	if off > int64(len(p)) {
		return 0, errOverrun
	}
	id, found, _, err := pinotwire.ResponseID(p[off:], true)
	if err != nil {
		return 0, err
	}
	if !found {
		return 0, ErrNoRequestID
	}
	return id, nil
}
