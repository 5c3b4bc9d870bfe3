package flow

import (
	"bytes"
	"errors"
	"testing"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// refFrames decodes a whole stream at once, the obvious way, and returns
// the end offset of every complete frame and whether a bad frame was met.
func refFrames(spec *FrameSpec, data []byte) (ends []int, bad bool) {
	pos := 0
	for pos+spec.headerLen() <= len(data) {
		total, err := spec.frameLength(data[pos : pos+spec.headerLen()])
		if err != nil {
			return ends, true
		}
		if int64(len(data)-pos) < total {
			return ends, false
		}
		pos += int(total)
		ends = append(ends, pos)
	}
	return ends, false
}

// scanSplit feeds data to a scanner in pieces cut at the given sizes.
func scanSplit(spec *FrameSpec, data []byte, cuts []byte) (ends int, err error) {
	s := NewFrameScanner(spec)
	i := 0
	for len(data) > 0 {
		n := len(data)
		if i < len(cuts) {
			n = int(cuts[i])%len(data) + 1
			i++
		}
		_, e, err := s.Scan(data[:n])
		ends += e
		if err != nil {
			return ends, err
		}
		data = data[n:]
	}
	return ends, nil
}

func pinotSpec() *FrameSpec {
	return &FrameSpec{offset: 0, length: 4, bigEndian: true, max: 256 << 20}
}

func TestFrameScannerCountsAcrossReads(t *testing.T) {
	var stream []byte
	for i := range 50 {
		stream = append(stream, testutil.LengthPrefixed(make([]byte, i*37))...)
	}
	for _, chunk := range []int{1, 3, 4, 5, 64, 1 << 20} {
		s := NewFrameScanner(pinotSpec())
		starts, ends := 0, 0
		for p := stream; len(p) > 0; {
			n := min(chunk, len(p))
			st, e, err := s.Scan(p[:n])
			if err != nil {
				t.Fatal(err)
			}
			starts, ends = starts+st, ends+e
			p = p[n:]
		}
		if starts != 50 || ends != 50 || s.MidFrame() {
			t.Fatalf("chunk %d: %d starts, %d ends, mid=%v; want 50, 50, false", chunk, starts, ends, s.MidFrame())
		}
	}
}

func TestFrameScannerRejectsBadFrames(t *testing.T) {
	for _, tc := range []struct {
		name string
		spec FrameSpec
		hdr  []byte
	}{
		{"oversized", FrameSpec{length: 4, bigEndian: true, max: 1024}, []byte{0, 0, 4, 1}},
		{"unsigned 4-byte above max", FrameSpec{length: 4, bigEndian: true, max: 256 << 20}, []byte{0xff, 0xff, 0xff, 0xff}},
		{"negative 8-byte", FrameSpec{length: 8, bigEndian: true, max: 1 << 30}, []byte{0x80, 0, 0, 0, 0, 0, 0, 1}},
		{"negative after adjustment", FrameSpec{length: 2, bigEndian: true, adjust: -10, max: 1 << 20}, []byte{0, 3}},
		{"shorter than strip", FrameSpec{length: 1, strip: 8, max: 1 << 20}, []byte{2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewFrameScanner(&tc.spec)
			_, _, err := s.Scan(tc.hdr)
			if !errors.Is(err, errBadFrame) {
				t.Fatalf("scan = %v, want a bad frame", err)
			}
		})
	}
}

func TestFrameScannerOffsetLittleEndianAdjustment(t *testing.T) {
	// 2 bytes of magic, a 2-byte little-endian length that counts the
	// whole frame (Netty: adjustment -4 with the field ending at 4).
	spec := &FrameSpec{offset: 2, length: 2, adjust: -4, max: 1 << 16}
	f := []byte{0xCA, 0xFE, 10, 0, 1, 2, 3, 4, 5, 6}
	stream := append(append([]byte{}, f...), f...)
	ends, err := scanSplit(spec, stream, []byte{2, 5, 1})
	if err != nil || ends != 2 {
		t.Fatalf("ends %d, err %v; want 2, nil", ends, err)
	}
}

// FuzzFrameScanner checks the streaming scanner against the whole-stream
// reference for any spec, stream and way of cutting it into reads, and
// that it never panics or allocates what a header announces.
func FuzzFrameScanner(f *testing.F) {
	f.Add(uint8(0), uint8(4), int16(0), true, testutil.LengthPrefixed([]byte("hello")), []byte{1, 2, 3})
	f.Add(uint8(2), uint8(2), int16(-4), false, []byte{0xCA, 0xFE, 10, 0, 1, 2, 3, 4, 5, 6}, []byte{0})
	f.Add(uint8(0), uint8(8), int16(0), true, []byte{0x80, 0, 0, 0, 0, 0, 0, 1}, []byte{})
	f.Add(uint8(1), uint8(3), int16(5), true, []byte{9, 0, 0, 2, 7, 7, 7, 7, 7, 7, 7}, []byte{4})
	f.Fuzz(func(t *testing.T, offset, length uint8, adjust int16, big bool, data, cuts []byte) {
		lengths := []int{1, 2, 3, 4, 8}
		spec := &FrameSpec{
			offset:    int(offset % 16),
			length:    lengths[int(length)%len(lengths)],
			adjust:    int64(adjust),
			bigEndian: big,
			max:       4096,
		}
		want, bad := refFrames(spec, data)
		got, err := scanSplit(spec, data, cuts)
		if bad != (err != nil) {
			t.Fatalf("reference bad=%v, scanner err=%v", bad, err)
		}
		if got != len(want) {
			t.Fatalf("scanner found %d frame ends, reference %d", got, len(want))
		}
	})
}

// scriptReader asks each frame for a fixed script of windows (a first
// one, a larger one at the same base, one further on) and records what it
// was given, to check the scanner's windows against the payload itself.
type scriptReader struct {
	n     int64
	step  int
	got   [][]byte // every window's bytes, in order
	bases []int64
	ends  []int64
}

func (r *scriptReader) script(step int) Window {
	switch step {
	case 0:
		return Window{base: 0, Need: 3}
	case 1:
		return Window{base: 0, Need: 9}
	case 2:
		return Window{base: 20, Need: 7}
	}
	return Window{}
}

// clip is what the scanner does to a window at the end of a payload.
func clip(w Window, n int64) Window {
	if w.Need > 0 && int64(w.Need) > n-w.base {
		w.Need = int(max(n-w.base, 0))
	}
	return w
}

func (r *scriptReader) Begin(n int64) Window {
	r.n, r.step = n, 0
	return r.script(0)
}

func (r *scriptReader) Read(b []byte) Window {
	w := clip(r.script(r.step), r.n)
	r.got = append(r.got, append([]byte(nil), b...))
	r.bases = append(r.bases, w.base)
	r.step++
	return r.script(r.step)
}

func (r *scriptReader) End(off int64) { r.ends = append(r.ends, off) }

// refWindows is what scriptReader must see on the whole stream.
func refWindows(spec *FrameSpec, data []byte) (got [][]byte, ends []int64) {
	pos := 0
	for pos+spec.headerLen() <= len(data) {
		total, err := spec.frameLength(data[pos : pos+spec.headerLen()])
		if err != nil {
			return got, ends
		}
		// A frame cut short by the end of the stream still gets the
		// windows whose bytes are all there.
		payload := data[pos+spec.headerLen() : min(pos+int(total), len(data))]
		var r scriptReader
		r.n = total - int64(spec.headerLen())
		for step := 0; ; step++ {
			w := clip(r.script(step), r.n)
			if w.Need == 0 || w.base+int64(w.Need) > int64(len(payload)) {
				break
			}
			got = append(got, payload[w.base:w.base+int64(w.Need)])
		}
		if int64(len(data)-pos) < total {
			return got, ends
		}
		pos += int(total)
		ends = append(ends, int64(pos))
	}
	return got, ends
}

func TestFrameScannerWindowsAcrossReads(t *testing.T) {
	spec := pinotSpec()
	var stream []byte
	for i := range 40 {
		p := make([]byte, i*3)
		for j := range p {
			p[j] = byte(i*7 + j)
		}
		stream = append(stream, testutil.LengthPrefixed(p)...)
	}
	wantGot, wantEnds := refWindows(spec, stream)
	for _, chunk := range []int{1, 2, 5, 8, 13, 64, 1 << 20} {
		s := NewFrameScanner(spec)
		r := &scriptReader{}
		s.Rd = r
		for p := stream; len(p) > 0; {
			n := min(chunk, len(p))
			if _, _, err := s.Scan(p[:n]); err != nil {
				t.Fatal(err)
			}
			p = p[n:]
		}
		if len(r.got) != len(wantGot) || len(r.ends) != len(wantEnds) {
			t.Fatalf("chunk %d: %d windows and %d ends, want %d and %d", chunk, len(r.got), len(r.ends), len(wantGot), len(wantEnds))
		}
		for i := range wantGot {
			if !bytes.Equal(r.got[i], wantGot[i]) {
				t.Fatalf("chunk %d: window %d = %x, want %x", chunk, i, r.got[i], wantGot[i])
			}
		}
		for i := range wantEnds {
			if r.ends[i] != wantEnds[i] {
				t.Fatalf("chunk %d: frame %d ended at %d, want %d", chunk, i, r.ends[i], wantEnds[i])
			}
		}
	}
}

// FuzzFrameScannerWindows checks the windows a reader is given against
// the payloads themselves, for any stream and any way of cutting it.
func FuzzFrameScannerWindows(f *testing.F) {
	f.Add(append(testutil.LengthPrefixed(bytes.Repeat([]byte("ab"), 30)), testutil.LengthPrefixed([]byte("x"))...), []byte{1, 2, 3})
	f.Add(testutil.LengthPrefixed(nil), []byte{0})
	f.Fuzz(func(t *testing.T, data, cuts []byte) {
		spec := &FrameSpec{length: 4, bigEndian: true, max: 4096}
		wantGot, wantEnds := refWindows(spec, data)
		s := NewFrameScanner(spec)
		r := &scriptReader{}
		s.Rd = r
		i := 0
		for p := data; len(p) > 0; {
			n := len(p)
			if i < len(cuts) {
				n = int(cuts[i])%len(p) + 1
				i++
			}
			if _, _, err := s.Scan(p[:n]); err != nil {
				break
			}
			p = p[n:]
		}
		if len(r.ends) != len(wantEnds) {
			t.Fatalf("%d frame ends, reference %d", len(r.ends), len(wantEnds))
		}
		if len(r.got) != len(wantGot) {
			t.Fatalf("%d windows, reference %d", len(r.got), len(wantGot))
		}
		for i := range r.got {
			if !bytes.Equal(r.got[i], wantGot[i]) {
				t.Fatalf("window %d = %x, reference %x", i, r.got[i], wantGot[i])
			}
		}
	})
}

// bigWindowReader asks each frame for one window of need bytes at its
// start and records what it was given.
type bigWindowReader struct {
	need    int
	got     []int // the length of each window read
	ended   int
	dropped int
}

func (r *bigWindowReader) Dropped() { r.dropped++ }

func (r *bigWindowReader) Begin(int64) Window   { return Window{Need: r.need} }
func (r *bigWindowReader) Read(b []byte) Window { r.got = append(r.got, len(b)); return Window{} }
func (r *bigWindowReader) End(int64)            { r.ended++ }

// A window that straddles reads holds its bytes until the reader has them
// all: what it holds beyond freeWindow is counted in the memory budget
// while it is collected, and given back when the frame ends (or the
// scanner is released with its link). Without room in the budget the
// window is dropped: the frame is read no further, and nothing is held.
func TestFrameScannerWindowCountedInTheBudget(t *testing.T) {
	const need = 64 << 10
	frame := testutil.LengthPrefixed(bytes.Repeat([]byte{7}, 100<<10))
	feed := func(s *FrameScanner, p []byte) {
		for len(p) > 0 {
			n := min(1<<10, len(p))
			if _, _, err := s.Scan(p[:n]); err != nil {
				t.Fatal(err)
			}
			p = p[n:]
		}
	}

	var b Budget
	b.Limit.Store(1 << 20)
	s := NewFrameScanner(pinotSpec())
	r := &bigWindowReader{need: need}
	s.Rd, s.Budget = r, &b
	feed(s, frame[:4+10<<10]) // the header and 10 KiB of the window
	if got, want := b.Used(), int64(need-freeWindow); got != want {
		t.Fatalf("budget used %d while the window is collected, want %d", got, want)
	}
	feed(s, frame[4+10<<10:])
	if len(r.got) != 1 || r.got[0] != need || r.ended != 1 {
		t.Fatalf("windows %v, %d frames ended; want one of %d, one", r.got, r.ended, need)
	}
	if got := b.Used(); got != 0 {
		t.Fatalf("budget used %d after the frame ended, want 0", got)
	}

	// Released with its link, mid-window.
	s = NewFrameScanner(pinotSpec())
	s.Rd, s.Budget = &bigWindowReader{need: need}, &b
	feed(s, frame[:4+10<<10])
	s.Release()
	if got := b.Used(); got != 0 {
		t.Fatalf("budget used %d after the scanner's release, want 0", got)
	}

	// No room: the window is dropped, nothing held, the frame still ends.
	var small Budget
	small.Limit.Store(16 << 10)
	s = NewFrameScanner(pinotSpec())
	r = &bigWindowReader{need: need}
	s.Rd, s.Budget = r, &small
	feed(s, frame[:4+10<<10])
	if got := small.Used(); got != 0 || cap(s.wbuf) != 0 {
		t.Fatalf("budget used %d, window buffer %d bytes, with no room in the budget; want none", got, cap(s.wbuf))
	}
	feed(s, frame[4+10<<10:])
	if len(r.got) != 0 || r.ended != 1 || r.dropped != 1 {
		t.Fatalf("windows %v, %d frames ended, told of %d drops; want none read, one ended, one drop", r.got, r.ended, r.dropped)
	}
}
