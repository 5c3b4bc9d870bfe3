// Package pinotsim simulates the two ends of Apache Pinot's single-stage
// broker→server transport closely enough to be byte-compatible on the wire:
// a length-prefixed framing, a compact-Thrift InstanceRequest whose payload
// starts with 0x16 and the zigzag varint requestId, and a DataTable V4
// response carrying the id as metadata key 14.
//
// The Server and Broker reproduce the behaviour that turned a path stall
// into an incident: the broker pipelines every query on one cached
// connection, times queries out without closing that connection, queues
// writes without bound and reconnects only when the connection is closed.
// The server answers from goroutines in completion order and can be wedged
// (Stall) so that its kernel keeps the sockets open while nothing is read.
package pinotsim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// HeaderLen is the size of the frame length prefix.
const HeaderLen = 4

// DefaultMaxFrame is the largest payload ReadFrame accepts when given a
// non-positive limit. Pinot itself accepts up to 2^31-1 bytes; a simulator
// has no use for frames this large and a smaller cap catches desync early.
const DefaultMaxFrame = 64 << 20

// ErrFrameLength reports a length prefix that is negative (as Netty reads
// it: a signed int32) or above the limit. It is fatal for the connection:
// the stream cannot be resynchronised.
var ErrFrameLength = errors.New("pinotsim: invalid frame length")

// ReadFrame reads one frame: a 4-byte big-endian length N (excluding the
// prefix itself) then N payload bytes. A length that is negative as an
// int32 or larger than max (DefaultMaxFrame if max <= 0) returns an error
// wrapping ErrFrameLength; the caller must close the connection. A stream
// that ends inside a frame returns io.ErrUnexpectedEOF; a stream that ends
// between frames returns io.EOF.
func ReadFrame(r io.Reader, max int) ([]byte, error) {
	if max <= 0 {
		max = DefaultMaxFrame
	}
	var hdr [HeaderLen]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := int32(binary.BigEndian.Uint32(hdr[:]))
	if n < 0 || int64(n) > int64(max) {
		return nil, fmt.Errorf("%w: %d (max %d)", ErrFrameLength, n, max)
	}
	p := make([]byte, n)
	if _, err := io.ReadFull(r, p); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return p, nil
}

// AppendFrame appends the frame of payload p (length prefix then p) to dst.
func AppendFrame(dst, p []byte) []byte {
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(p)))
	return append(dst, p...)
}

// WriteFrame writes the frame of payload p in one Write call.
func WriteFrame(w io.Writer, p []byte) error {
	if int64(len(p)) > 1<<31-1 {
		return fmt.Errorf("%w: %d", ErrFrameLength, len(p))
	}
	_, err := w.Write(AppendFrame(make([]byte, 0, HeaderLen+len(p)), p))
	return err
}
