// Package faultpeer provides real upstream peers for tests: servers on
// loopback that misbehave in the ways the incidents need (never read, read
// slowly, answer nothing, reset), switchable between connections.
package faultpeer

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Behavior is what the peer does with a connection it accepts. A
// connection keeps the behaviour current when it was accepted.
type Behavior int

const (
	// Echo writes back every byte it reads; on EOF it half-closes.
	Echo Behavior = iota
	// NeverRead accepts and never reads: with small buffers the sender's
	// window closes after a few KiB while the socket stays ESTABLISHED.
	NeverRead
	// HashOnEOF reads everything (slowly, if ReadDelay is set) and on EOF
	// answers the SHA-256 of what it read, then closes.
	HashOnEOF
	// ReadNoAnswer reads and discards everything and never writes.
	ReadNoAnswer
	// Reset resets the connection (SO_LINGER 0) as soon as it is accepted.
	Reset
	// CloseAtOnce closes the connection cleanly (FIN) as soon as it is accepted.
	CloseAtOnce
	// HoldAfterEOF reads until EOF and then keeps its side open, silent.
	HoldAfterEOF
	// Framed reads 4-byte big-endian length-prefixed frames and answers
	// each with the same frame, after the delay SetAnswer's policy gives
	// it (or not at all), in completion order.
	Framed
	// Paced reads steadily at SetRate's bytes per second per connection
	// (unpaced at 0), up to 64 KiB a read; on EOF it answers the count of
	// bytes it read, in decimal and a newline, then closes.
	Paced
	// Serial reads 4-byte big-endian length-prefixed frames one at a
	// time and answers each with the same frame before it reads the
	// next: a server that handles one request per connection at a time
	// (a thread per connection, a Kafka broker's muted channel), which
	// stops reading while it cannot send. It writes each answer at
	// SetRate's bytes per second (unpaced at 0), and stops mid-answer,
	// neither sending nor reading any more, once Freeze is called.
	Serial
)

// AnswerPolicy decides, for the n-th request frame the server reads
// (counting from 1 across connections), whether and after how long it is
// answered.
type AnswerPolicy func(n int64) (delay time.Duration, answer bool)

// Server is a fault peer listening on loopback.
type Server struct {
	ln        net.Listener
	behavior  atomic.Int32
	readDelay atomic.Int64 // pause between reads for HashOnEOF, nanoseconds
	rate      atomic.Int64 // bytes per second per connection for Paced
	bytesRead atomic.Int64 // bytes Paced connections read
	startHold atomic.Int64 // pause before the first read for HashOnEOF
	accepted  atomic.Int64
	requests  atomic.Int64
	answers   atomic.Int64
	policy    atomic.Pointer[AnswerPolicy]
	frozen    atomic.Bool  // Serial connections stop mid-answer (Freeze)
	lastWrite atomic.Int64 // when a Serial answer's latest bytes were written, Unix nanoseconds

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	held  chan struct{} // non-nil: Paced connections wait for it to close before their first read (HoldReads)
	wg    sync.WaitGroup
	stop  chan struct{}
	once  sync.Once
}

// Options for New.
type Options struct {
	// Buffer, when positive, sets SO_RCVBUF and SO_SNDBUF on the listener
	// (accepted sockets inherit them; the kernel doubles the value).
	Buffer int
	// Addr is the address to listen on; empty: 127.0.0.1:0.
	Addr string
}

// New starts a peer with the given initial behaviour; it is closed when the
// test ends.
func New(t testing.TB, b Behavior, o Options) *Server {
	t.Helper()
	lc := net.ListenConfig{}
	if o.Buffer > 0 {
		lc.Control = func(_, _ string, c syscall.RawConn) error {
			var serr error
			err := c.Control(func(fd uintptr) {
				if serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, o.Buffer); serr == nil {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF, o.Buffer)
				}
			})
			if err != nil {
				return err
			}
			return serr
		}
	}
	addr := o.Addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ln, err := lc.Listen(context.Background(), "tcp", addr)
	if err != nil {
		t.Fatalf("faultpeer: listen: %v", err)
	}
	s := &Server{ln: ln, conns: make(map[net.Conn]struct{}), stop: make(chan struct{})}
	s.behavior.Store(int32(b))
	s.wg.Add(1)
	go s.acceptLoop()
	t.Cleanup(s.Close)
	return s
}

// Addr is the peer's address.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Set changes the behaviour for connections accepted from now on.
func (s *Server) Set(b Behavior) { s.behavior.Store(int32(b)) }

// Freeze makes Serial connections stop where they are in an answer:
// they send no more of it and read nothing, until the peer closes (a
// server whose process hangs mid-answer).
func (s *Server) Freeze() { s.frozen.Store(true) }

// LastWrite is when a Serial connection last handed answer bytes to its
// socket (the zero time: never).
func (s *Server) LastWrite() time.Time {
	if n := s.lastWrite.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// SetReadDelay makes HashOnEOF connections pause before the first read
// (hold) and between reads (each).
func (s *Server) SetReadDelay(hold, each time.Duration) {
	s.startHold.Store(int64(hold))
	s.readDelay.Store(int64(each))
}

// SetAnswer sets the answer policy of Framed connections (default:
// answer every request at once).
func (s *Server) SetAnswer(p AnswerPolicy) { s.policy.Store(&p) }

// SetRate sets the rate, in bytes per second, at which Paced connections
// accepted from now on read, and Serial ones write the rest of their
// answers; 0: as fast as they can.
func (s *Server) SetRate(bytesPerSecond int64) { s.rate.Store(bytesPerSecond) }

// HoldReads makes Paced connections wait before their first read until
// ReleaseReads; their pace counts from then. A test fills the sender's
// queue to a point its own accounting shows, whatever the machine's
// speed, before the reader starts.
func (s *Server) HoldReads() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held == nil {
		s.held = make(chan struct{})
	}
}

// ReleaseReads lets the connections HoldReads held read.
func (s *Server) ReleaseReads() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held != nil {
		close(s.held)
		s.held = nil
	}
}

// waitRelease waits while reads are held, or until the peer closes.
func (s *Server) waitRelease() {
	s.mu.Lock()
	held := s.held
	s.mu.Unlock()
	if held != nil {
		select {
		case <-held:
		case <-s.stop:
		}
	}
}

// BytesRead returns the bytes every Paced connection read so far.
func (s *Server) BytesRead() int64 { return s.bytesRead.Load() }

// Requests is the number of request frames Framed connections have read.
func (s *Server) Requests() int64 { return s.requests.Load() }

// Answers is the number of answers Framed connections have written.
func (s *Server) Answers() int64 { return s.answers.Load() }

// Accepted is the number of connections accepted so far.
func (s *Server) Accepted() int64 { return s.accepted.Load() }

// Close stops the peer and closes every connection.
func (s *Server) Close() {
	s.once.Do(func() {
		close(s.stop)
		_ = s.ln.Close()
		s.mu.Lock()
		for c := range s.conns {
			_ = c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
}

func (s *Server) acceptLoop() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.accepted.Add(1)
		s.mu.Lock()
		select {
		case <-s.stop:
			s.mu.Unlock()
			_ = c.Close()
			return
		default:
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serveConn(c.(*net.TCPConn), Behavior(s.behavior.Load()))
	}
}

func (s *Server) serveConn(c *net.TCPConn, b Behavior) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		_ = c.Close()
	}()
	switch b {
	case Echo:
		if _, err := io.Copy(c, c); err == nil {
			_ = c.CloseWrite()
		}
		_, _ = io.Copy(io.Discard, c)
	case NeverRead:
		<-s.stop
	case HashOnEOF:
		s.sleep(time.Duration(s.startHold.Load()))
		h := sha256.New()
		buf := make([]byte, 8<<10)
		for {
			n, err := c.Read(buf)
			h.Write(buf[:n])
			if err == io.EOF {
				_, _ = c.Write(h.Sum(nil))
				return
			}
			if err != nil {
				return
			}
			s.sleep(time.Duration(s.readDelay.Load()))
		}
	case ReadNoAnswer:
		_, _ = io.Copy(io.Discard, c)
		<-s.stop
	case Reset:
		_ = c.SetLinger(0)
	case CloseAtOnce:
	case HoldAfterEOF:
		_, _ = io.Copy(io.Discard, c)
		<-s.stop
	case Framed:
		s.serveFramed(c)
	case Paced:
		s.servePaced(c, s.rate.Load())
	case Serial:
		s.serveSerial(c)
	}
}

// servePaced reads c at rate bytes per second on average (0: unpaced),
// and on EOF answers how many bytes it read.
func (s *Server) servePaced(c *net.TCPConn, rate int64) {
	buf := make([]byte, 64<<10)
	var total int64
	s.waitRelease()
	began := time.Now()
	for {
		n, err := c.Read(buf)
		total += int64(n)
		s.bytesRead.Add(int64(n))
		if err == io.EOF {
			_, _ = fmt.Fprintf(c, "%d\n", total)
			return
		}
		if err != nil {
			return
		}
		if rate > 0 {
			s.sleep(time.Until(began.Add(time.Duration(float64(total) / float64(rate) * float64(time.Second)))))
		}
	}
}

// readFrame reads one 4-byte big-endian length-prefixed frame of up to
// 16 MiB, its length field included.
func readFrame(c *net.TCPConn) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > 16<<20 {
		return nil, fmt.Errorf("frame of %d bytes", n)
	}
	frame := make([]byte, 4+n)
	copy(frame, hdr[:])
	if _, err := io.ReadFull(c, frame[4:]); err != nil {
		return nil, err
	}
	return frame, nil
}

func (s *Server) serveFramed(c *net.TCPConn) {
	var wmu sync.Mutex
	for {
		frame, err := readFrame(c)
		if err != nil {
			return
		}
		seq := s.requests.Add(1)
		delay, answer := time.Duration(0), true
		if p := s.policy.Load(); p != nil {
			delay, answer = (*p)(seq)
		}
		if !answer {
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.sleep(delay)
			wmu.Lock()
			defer wmu.Unlock()
			if _, err := c.Write(frame); err == nil {
				s.answers.Add(1)
			}
		}()
	}
}

// serveSerial answers each frame before it reads the next (see Serial).
func (s *Server) serveSerial(c *net.TCPConn) {
	for {
		frame, err := readFrame(c)
		if err != nil {
			return
		}
		s.requests.Add(1)
		if !s.writePaced(c, frame) {
			return
		}
		s.answers.Add(1)
	}
}

// writePaced writes b to c at SetRate's bytes per second (at once at 0),
// in pieces a twentieth of a second apart, until Freeze; it reports
// whether all of b was written.
func (s *Server) writePaced(c *net.TCPConn, b []byte) bool {
	began := time.Now()
	for off := 0; off < len(b); {
		rate := s.rate.Load()
		n := len(b) - off
		if rate > 0 {
			n = min(n, max(int(rate/20), 1))
		}
		if s.frozen.Load() {
			<-s.stop
			return false
		}
		if _, err := c.Write(b[off : off+n]); err != nil {
			return false
		}
		s.lastWrite.Store(time.Now().UnixNano())
		off += n
		if rate > 0 && off < len(b) {
			s.sleep(time.Until(began.Add(time.Duration(float64(off) / float64(rate) * float64(time.Second)))))
		}
	}
	return true
}

func (s *Server) sleep(d time.Duration) {
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-s.stop:
	}
}
