package proxy

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// integVerifier compares a byte stream, fed in pieces of any size, with
// the stream it should be, made piece by piece (next; nil once there is no
// more), and hashes it.
type integVerifier struct {
	next   func() []byte
	cur    []byte
	off    int
	n      int64 // bytes matched
	pieces int   // pieces matched in full
	err    error // the first mismatch
	h      hash.Hash
	done   bool // next said there is no more
}

func newIntegVerifier(next func() []byte) *integVerifier {
	return &integVerifier{next: next, h: sha256.New()}
}

// feed matches b and returns how many pieces it completed.
func (v *integVerifier) feed(b []byte) int {
	v.h.Write(b)
	done := 0
	for len(b) > 0 && v.err == nil {
		for v.off == len(v.cur) && !v.done {
			if v.cur = v.next(); v.cur == nil {
				v.done = true
			}
			v.off = 0
		}
		if v.done {
			v.err = fmt.Errorf("%d bytes more than expected, after byte %d", len(b), v.n)
			break
		}
		k := min(len(b), len(v.cur)-v.off)
		if !bytes.Equal(b[:k], v.cur[v.off:v.off+k]) {
			i := 0
			for b[i] == v.cur[v.off+i] {
				i++
			}
			v.err = fmt.Errorf("byte %d (piece %d, offset %d) is %#x, want %#x", v.n+int64(i), v.pieces, v.off+i, b[i], v.cur[v.off+i])
			break
		}
		v.n += int64(k)
		v.off += k
		b = b[k:]
		if v.off == len(v.cur) {
			v.pieces++
			done++
		}
	}
	return done
}

// complete reports whether the whole expected stream was matched.
func (v *integVerifier) complete() bool {
	if v.err != nil {
		return false
	}
	for v.off == len(v.cur) && !v.done {
		if v.cur = v.next(); v.cur == nil {
			v.done = true
		}
		v.off = 0
	}
	return v.done
}

// Ends of a stream as its reader saw them.
const (
	sawFin     = "fin"     // EOF: the peer's FIN
	sawReset   = "reset"   // ECONNRESET (or EPIPE), at the read or at a write of the same end
	sawFinRst  = "fin+rst" // EOF, and a reset came after it: a FIN went out before the reset
	sawSelf    = "self"    // the reader's own side closed it
	sawTimeout = "timeout" // the round's deadline passed
)

// integEndOf classifies err, a read's terminal error on c. writeErr is
// the first error of the end's own writes (read once they could not
// consume the socket's error any more): after a reset the kernel reports
// ECONNRESET once, to whichever call comes first, and the reads then see
// EOF. shut: this end had sent its FIN before the read saw EOF (a socket
// whose FIN and the peer's crossed shows as closed, like a reset one).
func integEndOf(c *net.TCPConn, err error, shut *atomic.Bool, writeErr func() error) string {
	switch {
	case errors.Is(err, io.EOF):
		// The state before shut: a FIN this end sends once the peer's is
		// in closes the socket too, once acknowledged (LAST_ACK), and shut
		// is set before the FIN goes out.
		closed := integTCPState(c) == unix.BPF_TCP_CLOSE
		switch {
		case shut.Load():
			return sawFin
		case isResetErr(writeErr()):
			return sawReset
		case closed:
			return sawFinRst // a reset nobody took came after the FIN that ended the reads
		}
		return sawFin
	case isResetErr(err):
		return sawReset
	case errors.Is(err, net.ErrClosed):
		return sawSelf
	case errors.Is(err, os.ErrDeadlineExceeded):
		return sawTimeout
	}
	return "error: " + err.Error()
}

func isResetErr(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// integTCPState is c's TCP state (unix.BPF_TCP_*), -1 if unknown.
func integTCPState(c *net.TCPConn) int {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1
	}
	st := -1
	_ = rc.Control(func(fd uintptr) {
		if ti, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			st = int(ti.State)
		}
	})
	return st
}

// integReset resets c: SO_LINGER 0, then close.
func integReset(c *net.TCPConn) {
	_ = c.SetLinger(0)
	_ = c.Close()
}

// integPieces is the expected request stream of a plan: its hello, then
// each request in turn (limit: requests, -1 all).
func integPieces(c integCodec, p *integPlan) func() []byte {
	seq := -1
	return func() []byte {
		if seq == -1 {
			seq = 0
			if h := c.hello(p); h != nil {
				return h
			}
		}
		if seq >= p.n {
			return nil
		}
		seq++
		return c.request(p, seq-1)
	}
}

// integStreamPieces is the expected stream of n bytes of a plan's duplex
// stream in direction dir, after hello (nil: none).
func integStreamPieces(p *integPlan, dir uint64, n int64, hello []byte) func() []byte {
	src := integStream(p, dir)
	left := n
	return func() []byte {
		if hello != nil {
			h := hello
			hello = nil
			return h
		}
		if left == 0 {
			return nil
		}
		b := make([]byte, min(left, 64<<10))
		src.XORKeyStream(b, b)
		left -= int64(len(b))
		return b
	}
}
