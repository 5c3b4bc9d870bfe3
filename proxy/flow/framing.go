package flow

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/livenessproxy/livenessproxy/policy"
)

// FrameSpec locates frame boundaries the way Netty's
// LengthFieldBasedFrameDecoder does. The proxy forwards bytes unchanged:
// the spec only says where each frame ends.
//
// A frame is lengthFieldOffset bytes, the length field, and then
// value + lengthAdjustment more bytes (Netty's "frameLength = value +
// adjustment + lengthFieldEndOffset").
type FrameSpec struct {
	offset    int   // length_field_offset
	length    int   // length_field_length: 1, 2, 3, 4 or 8
	adjust    int64 // length_adjustment
	strip     int   // initial_bytes_to_strip (checked against each frame, not applied)
	bigEndian bool
	max       int64 // max_frame_length, whole frame in bytes
}

// NewFrameSpec returns the spec for a validated framing config, or nil for
// opaque mode. The protocol profiles (kafka, pinot) use a 4-byte
// big-endian length that counts the bytes after it.
func NewFrameSpec(f policy.Framing) *FrameSpec {
	if policy.IsProfile(f.Type) {
		return &FrameSpec{length: 4, bigEndian: true, max: int64(f.MaxFrameLength)}
	}
	if f.Type != policy.FramingLengthField {
		return nil
	}
	return &FrameSpec{
		offset:    f.LengthFieldOffset,
		length:    f.LengthFieldLength,
		adjust:    int64(f.LengthAdjustment),
		strip:     f.InitialBytesToStrip,
		bigEndian: f.ByteOrder != policy.ByteOrderLittle,
		max:       int64(f.MaxFrameLength),
	}
}

// headerLen is how many bytes must be seen before a frame's length is known.
func (f *FrameSpec) headerLen() int { return f.offset + f.length }

// errBadFrame marks a frame the link cannot continue after.
var errBadFrame = errors.New("bad frame")

// ErrTruncated is a stream that ended inside a frame.
var ErrTruncated = fmt.Errorf("%w: stream ended inside a frame", errBadFrame)

// frameLength returns the whole frame's length from its header bytes.
func (f *FrameSpec) frameLength(hdr []byte) (int64, error) {
	field := hdr[f.offset : f.offset+f.length]
	var v uint64
	switch {
	case f.length == 4 && f.bigEndian:
		v = uint64(binary.BigEndian.Uint32(field)) // the profiles' and the usual length_field's
	case f.bigEndian:
		for _, b := range field {
			v = v<<8 | uint64(b)
		}
	default:
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

// Window asks a FrameReader's caller for payload bytes [base, base+need)
// of the current frame, where the payload is what follows the length
// field. need 0: nothing more from this frame.
type Window struct {
	base int64
	Need int
}

// FrameReader reads what a protocol profile needs from the frames of one
// direction. The scanner hands it windows of payload bytes: straight out
// of the read buffer when a window lies within one read, copied into a
// small buffer only when it straddles reads.
type FrameReader interface {
	// Begin starts a frame with n payload bytes and returns the first
	// window it wants.
	Begin(n int64) Window
	// Read is given payload bytes [w.base, w.base+len(b)) of the window it
	// asked for, cut short only by the end of the frame, and returns the
	// next window. A next window starts at or after the previous one's
	// base; starting at the same base with a larger need re-reads the
	// same bytes plus more. b is valid only during the call.
	Read(b []byte) Window
	// End is called when the frame's last byte has been scanned; off is
	// the stream offset just past it.
	End(off int64)
}

// WindowDropper is a FrameReader that is told when the scanner stops
// reading a frame for want of room in the memory budget (see
// FrameScanner.Budget), so that what it does with the frame's end can
// say why.
type WindowDropper interface {
	Dropped()
}

// maxWindow bounds the bytes a reader may ask for at once.
const maxWindow = 128 << 10

// FrameScanner follows frame boundaries across reads. It never buffers
// a body: only up to headerLen bytes of a header that straddles reads,
// and, for a reader, a window that straddles reads. Its cost is per frame,
// not per byte.
type FrameScanner struct {
	spec      *FrameSpec
	Rd        FrameReader // nil: frames are only counted
	hdr       []byte      // headerLen bytes
	hdrN      int         // header bytes collected for the current frame
	remaining int64       // body bytes left in the current frame once its length is known
	inBody    bool
	scanned   int64 // stream offset of the next byte to scan

	payload int64  // payload length of the current frame
	pos     int64  // payload offset of the next byte to scan
	w       Window // what rd wants next
	wbuf    []byte // window bytes collected across reads: [w.base, w.base+len(wbuf))

	// Budget, when set, counts the capacity of wbuf beyond freeWindow: a
	// window that straddles reads holds its bytes until the reader has
	// them all (up to maxWindow, for a frame whose head stops mid-way for
	// as long as its sender likes), and a link's two scanners are not in
	// the per-link overhead that max_links is derived from. Without room
	// the window is dropped, as one whose bytes were not kept: the frame
	// is read no further (a request's link goes untracked, a response's
	// throttle unread), and nothing waits.
	Budget *Budget
	held   int64 // bytes of wbuf's capacity counted in Budget
}

// freeWindow is the window buffer a scanner holds without counting it:
// the buffer kept from frame to frame (see endFrame).
const freeWindow = 4 << 10

func NewFrameScanner(spec *FrameSpec) *FrameScanner {
	return &FrameScanner{spec: spec, hdr: make([]byte, spec.headerLen())}
}

// Scan walks p. It returns the number of frames that start in p and the
// number that end in p. A bad frame is an error: the scanner cannot
// follow the stream any further.
func (s *FrameScanner) Scan(p []byte) (starts, ends int, err error) {
	hl := s.spec.headerLen()
	for len(p) > 0 {
		if s.inBody {
			n := int64(len(p))
			if s.Rd != nil && s.w.Need > 0 {
				n = s.feed(p)
			}
			if n < s.remaining {
				s.remaining -= n
				s.pos += n
				s.scanned += n
				p = p[n:]
				continue
			}
			p = p[s.remaining:]
			s.scanned += s.remaining
			s.remaining, s.inBody = 0, false
			ends++
			s.endFrame()
			continue
		}
		if s.hdrN == 0 {
			starts++
		}
		n := copy(s.hdr[s.hdrN:hl], p)
		s.hdrN += n
		s.scanned += int64(n)
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
		s.beginFrame()
		if s.remaining == 0 {
			ends++
			s.endFrame()
			continue
		}
		s.inBody = true
	}
	return starts, ends, nil
}

func (s *FrameScanner) beginFrame() {
	if s.Rd == nil {
		return
	}
	s.payload, s.pos = s.remaining, 0
	s.wbuf = s.wbuf[:0]
	s.setWindow(s.Rd.Begin(s.payload))
	if s.w.Need > 0 && s.payload == 0 {
		s.setWindow(s.Rd.Read(nil))
	}
}

func (s *FrameScanner) endFrame() {
	if s.Rd == nil {
		return
	}
	s.Rd.End(s.scanned)
	s.w = Window{}
	if cap(s.wbuf) > freeWindow {
		s.Release() // a large window's buffer is not kept for later frames
	}
}

// reserve makes wbuf's capacity at least n, counting what lies beyond
// freeWindow in the budget; false when the budget has no room.
func (s *FrameScanner) reserve(n int) bool {
	if cap(s.wbuf) >= n {
		return true
	}
	if more := int64(n-freeWindow) - s.held; s.Budget != nil && more > 0 {
		if !s.Budget.takeFor(&s.Budget.Windows, more) {
			return false
		}
		s.held += more
	}
	s.wbuf = append(make([]byte, 0, n), s.wbuf...)
	return true
}

// Release gives back the window's buffer and what the budget counts of
// it: at the end of a frame whose window was large, and when the link
// ends (its pumps have stopped: the scanner is used no more).
func (s *FrameScanner) Release() {
	s.wbuf = nil
	if s.held > 0 {
		s.Budget.giveFor(&s.Budget.Windows, s.held)
		s.held = 0
	}
}

// dropWindow stops reading the frame for want of room in the budget.
func (s *FrameScanner) dropWindow() {
	s.w = Window{}
	s.Release()
	if d, ok := s.Rd.(WindowDropper); ok {
		d.Dropped()
	}
}

// setWindow takes the reader's next window, clipped to the frame, and
// keeps whatever collected bytes it still covers.
func (s *FrameScanner) setWindow(w Window) {
	if w.Need > maxWindow {
		w.Need = maxWindow
	}
	if left := s.payload - w.base; w.Need > 0 && int64(w.Need) > left {
		w.Need = int(max(left, 0))
	}
	if len(s.wbuf) > 0 {
		if drop := w.base - s.w.base; w.Need > 0 && drop >= 0 && drop < int64(len(s.wbuf)) {
			s.wbuf = s.wbuf[:copy(s.wbuf, s.wbuf[drop:])]
		} else {
			s.wbuf = s.wbuf[:0]
		}
	}
	s.w = w
}

// feed serves the reader's windows out of p, whose first byte is at
// payload offset s.pos, and returns how many bytes of p the scanner may
// move past: every byte of the frame that is in p. Window bytes that lie
// in p are handed over in place; a window that straddles reads is
// collected in wbuf.
func (s *FrameScanner) feed(p []byte) int64 {
	avail := min(int64(len(p)), s.remaining) // frame bytes in p
	for s.w.Need > 0 {
		if len(s.wbuf) == 0 {
			start := s.w.base - s.pos // the window's first byte, as an index into p
			switch {
			case start < 0:
				// Bytes of an earlier read, which were not kept: a reader
				// may only move forward. Stop reading this frame.
				s.w = Window{}
				return avail
			case start >= avail:
				return avail // the window starts in a later read
			case start+int64(s.w.Need) <= avail:
				s.setWindow(s.Rd.Read(p[start : start+int64(s.w.Need)]))
				continue
			}
			if !s.reserve(s.w.Need) {
				s.dropWindow()
				return avail
			}
			s.wbuf = append(s.wbuf, p[start:avail]...)
			return avail
		}
		// Collecting: wbuf holds [w.base, w.base+len(wbuf)); the next byte
		// needed is the one just after it.
		if len(s.wbuf) < s.w.Need {
			idx := s.w.base + int64(len(s.wbuf)) - s.pos
			if idx < 0 || idx >= avail {
				return avail
			}
			take := min(int64(s.w.Need-len(s.wbuf)), avail-idx)
			if !s.reserve(s.w.Need) {
				s.dropWindow()
				return avail
			}
			s.wbuf = append(s.wbuf, p[idx:idx+take]...)
			if len(s.wbuf) < s.w.Need {
				return avail
			}
		}
		s.setWindow(s.Rd.Read(s.wbuf[:s.w.Need]))
	}
	return avail
}

// MidFrame reports whether the stream stopped inside a frame.
func (s *FrameScanner) MidFrame() bool { return s.inBody || s.hdrN > 0 }
