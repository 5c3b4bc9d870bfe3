package testutil

import "encoding/binary"

// LengthPrefixed is payload as one frame of the 4-byte big-endian length
// framing (the pinot profile's, and the default length_field's).
func LengthPrefixed(payload []byte) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(payload)))
	return append(b, payload...)
}
