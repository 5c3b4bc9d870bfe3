package proxy

import (
	"errors"
	"fmt"
	"math"

	"github.com/livenessproxy/livenessproxy/policy"
)

// frameSpec locates frame boundaries the way Netty's
// LengthFieldBasedFrameDecoder does. The proxy forwards bytes unchanged:
// the spec only says where each frame ends.
//
// A frame is lengthFieldOffset bytes, the length field, and then
// value + lengthAdjustment more bytes (Netty's "frameLength = value +
// adjustment + lengthFieldEndOffset").
type frameSpec struct {
	offset    int   // length_field_offset
	length    int   // length_field_length: 1, 2, 3, 4 or 8
	adjust    int64 // length_adjustment
	strip     int   // initial_bytes_to_strip (checked against each frame, not applied)
	bigEndian bool
	max       int64 // max_frame_length, whole frame in bytes
}

// newFrameSpec returns the spec for a validated framing config, or nil for
// opaque mode.
func newFrameSpec(f policy.Framing) *frameSpec {
	if f.Type != policy.FramingLengthField {
		return nil
	}
	return &frameSpec{
		offset:    f.LengthFieldOffset,
		length:    f.LengthFieldLength,
		adjust:    int64(f.LengthAdjustment),
		strip:     f.InitialBytesToStrip,
		bigEndian: f.ByteOrder != policy.ByteOrderLittle,
		max:       int64(f.MaxFrameLength),
	}
}

// headerLen is how many bytes must be seen before a frame's length is known.
func (f *frameSpec) headerLen() int { return f.offset + f.length }

// errBadFrame marks a frame the link cannot continue after.
var errBadFrame = errors.New("bad frame")

// errTruncated is a stream that ended inside a frame.
var errTruncated = fmt.Errorf("%w: stream ended inside a frame", errBadFrame)

// frameLength returns the whole frame's length from its header bytes.
func (f *frameSpec) frameLength(hdr []byte) (int64, error) {
	field := hdr[f.offset : f.offset+f.length]
	var v uint64
	if f.bigEndian {
		for _, b := range field {
			v = v<<8 | uint64(b)
		}
	} else {
		for i := len(field) - 1; i >= 0; i-- {
			v = v<<8 | uint64(field[i])
		}
	}
	value := int64(v) // 8-byte fields are signed, as in Netty
	if f.length == 8 && value < 0 {
		return 0, fmt.Errorf("%w: negative length field %d", errBadFrame, value)
	}
	// Guard the sum against overflow; the limit proper is checked on the
	// adjusted total, as Netty does.
	if value > math.MaxInt64/2 {
		return 0, fmt.Errorf("%w: length field %d exceeds max_frame_length %d", errBadFrame, value, f.max)
	}
	total := value + f.adjust + int64(f.headerLen())
	switch {
	case total < int64(f.headerLen()):
		return 0, fmt.Errorf("%w: length field %d with adjustment %d gives a frame shorter than its header", errBadFrame, value, f.adjust)
	case total > f.max:
		return 0, fmt.Errorf("%w: frame of %d bytes exceeds max_frame_length %d", errBadFrame, total, f.max)
	case total < int64(f.strip):
		return 0, fmt.Errorf("%w: frame of %d bytes is shorter than initial_bytes_to_strip %d", errBadFrame, total, f.strip)
	}
	return total, nil
}

// frameScanner follows frame boundaries across reads. It never buffers
// a body: only up to headerLen bytes of a header that straddles reads.
// Its cost is per frame, not per byte.
type frameScanner struct {
	spec      *frameSpec
	hdr       []byte // headerLen bytes
	hdrN      int    // header bytes collected for the current frame
	remaining int64  // body bytes left in the current frame once its length is known
	inBody    bool
}

func newFrameScanner(spec *frameSpec) *frameScanner {
	return &frameScanner{spec: spec, hdr: make([]byte, spec.headerLen())}
}

// scan walks p. It returns the number of frames that start in p and the
// number that end in p. A bad frame is an error; the link must close.
func (s *frameScanner) scan(p []byte) (starts, ends int, err error) {
	hl := s.spec.headerLen()
	for len(p) > 0 {
		if s.inBody {
			if int64(len(p)) < s.remaining {
				s.remaining -= int64(len(p))
				return starts, ends, nil
			}
			p = p[s.remaining:]
			s.remaining, s.inBody = 0, false
			ends++
			continue
		}
		if s.hdrN == 0 {
			starts++
		}
		n := copy(s.hdr[s.hdrN:hl], p)
		s.hdrN += n
		p = p[n:]
		if s.hdrN < hl {
			return starts, ends, nil
		}
		total, ferr := s.spec.frameLength(s.hdr[:hl])
		if ferr != nil {
			return starts, ends, ferr
		}
		s.hdrN = 0
		s.remaining = total - int64(hl)
		if s.remaining == 0 {
			ends++
			continue
		}
		s.inBody = true
	}
	return starts, ends, nil
}

// midFrame reports whether the stream stopped inside a frame.
func (s *frameScanner) midFrame() bool { return s.inBody || s.hdrN > 0 }
