package pinotsim

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// ServerConfig configures a simulated Pinot server.
type ServerConfig struct {
	// Addr is the listen address; empty means 127.0.0.1:0.
	Addr string
	// RecvBuffer, if positive, is SO_RCVBUF set on the listening socket
	// before bind; accepted connections inherit it (the kernel doubles
	// it). A small buffer makes a stall fill the peer's window quickly.
	RecvBuffer int
	// Delay is the initial per-request execution time (see SetDelay).
	Delay time.Duration
	// MaxFrame bounds a request frame; non-positive: DefaultMaxFrame.
	MaxFrame int
}

// ServerStats are the server's counters since it started.
type ServerStats struct {
	Accepted  int64 // connections accepted
	Executed  int64 // requests read and executed (answered or not)
	Stale     int64 // of Executed, those read after their Deadline
	Answered  int64 // responses written
	BadFrames int64 // frames that were not an InstanceRequest (no reply, as Pinot)
	// ByBroker splits Executed and Stale by the request's BrokerID.
	ByBroker map[string]BrokerCount
}

// BrokerCount is one broker's share of the server's work.
type BrokerCount struct {
	Executed int64
	Stale    int64
}

// Server is a simulated Pinot server: it reads InstanceRequest frames on
// every accepted connection and answers each, from its own goroutine after
// the current delay, with the minimal DataTable carrying the request's id.
// Responses therefore go out in completion order, not request order.
//
// Faults: Stall wedges the process (nothing is read or written, the kernel
// keeps the sockets open and ACKs until the windows fill; connections are
// still accepted, as Netty's acceptor is a separate thread pool), Resume
// undoes it, SetSilent makes it read and execute but never answer.
type Server struct {
	cfg  ServerConfig
	ln   net.Listener
	done chan struct{} // closed by Close

	delay  atomic.Int64 // nanoseconds
	silent atomic.Bool

	mu       sync.Mutex
	stalled  chan struct{} // non-nil while stalled; closed by Resume
	conns    map[net.Conn]struct{}
	closed   bool
	byBroker map[string]*BrokerCount

	wg sync.WaitGroup // accept loop, connection readers, request goroutines

	accepted, executed, stale, answered, bad atomic.Int64
	closeOnce                                sync.Once
}

// NewServer binds cfg.Addr and starts serving.
func NewServer(cfg ServerConfig) (*Server, error) {
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:0"
	}
	lc := net.ListenConfig{KeepAlive: -1}
	if cfg.RecvBuffer > 0 {
		lc.Control = rcvbufControl(cfg.RecvBuffer)
	}
	ln, err := lc.Listen(context.Background(), "tcp", cfg.Addr)
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg:      cfg,
		ln:       ln,
		done:     make(chan struct{}),
		conns:    make(map[net.Conn]struct{}),
		byBroker: make(map[string]*BrokerCount),
	}
	s.delay.Store(int64(cfg.Delay))
	s.wg.Add(1)
	go s.acceptLoop()
	return s, nil
}

// Addr is the address the server listens on.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// SetDelay sets how long each request executes before it is answered; it
// applies to requests read from now on.
func (s *Server) SetDelay(d time.Duration) { s.delay.Store(int64(d)) }

// SetSilent switches silent mode: requests are still read and executed but
// never answered (the broker's queries time out).
func (s *Server) SetSilent(on bool) { s.silent.Store(on) }

// Stall wedges the server: no connection is read or written until Resume.
// A read already waiting in the kernel may complete once more.
func (s *Server) Stall() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stalled == nil && !s.closed {
		s.stalled = make(chan struct{})
	}
}

// Resume ends a Stall: the server reads what its kernel buffered meanwhile
// and executes it, stale or not.
func (s *Server) Resume() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stalled != nil {
		close(s.stalled)
		s.stalled = nil
	}
}

// Stalled reports whether the server is stalled.
func (s *Server) Stalled() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stalled != nil
}

// Stats returns a snapshot of the counters.
func (s *Server) Stats() ServerStats {
	st := ServerStats{
		Accepted:  s.accepted.Load(),
		Executed:  s.executed.Load(),
		Stale:     s.stale.Load(),
		Answered:  s.answered.Load(),
		BadFrames: s.bad.Load(),
		ByBroker:  make(map[string]BrokerCount),
	}
	s.mu.Lock()
	for k, v := range s.byBroker {
		st.ByBroker[k] = *v
	}
	s.mu.Unlock()
	return st
}

// Close stops accepting, closes every connection, abandons pending
// answers and waits for every goroutine of the server. Idempotent.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true
		close(s.done)
		for c := range s.conns {
			_ = c.Close()
		}
		s.mu.Unlock()
		_ = s.ln.Close()
	})
	s.wg.Wait()
	return nil
}

// gate blocks while the server is stalled; it reports false once closed.
func (s *Server) gate() bool {
	for {
		s.mu.Lock()
		ch, closed := s.stalled, s.closed
		s.mu.Unlock()
		if closed {
			return false
		}
		if ch == nil {
			return true
		}
		select {
		case <-ch:
		case <-s.done:
			return false
		}
	}
}

func (s *Server) acceptLoop() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			select { // transient (EMFILE and the like)
			case <-time.After(10 * time.Millisecond):
				continue
			case <-s.done:
				return
			}
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			_ = c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		s.accepted.Add(1)
		sc := &serverConn{s: s, c: c}
		go sc.readLoop()
	}
}

// serverConn is one accepted connection.
type serverConn struct {
	s   *Server
	c   net.Conn
	wmu sync.Mutex // one response frame at a time
}

// Read makes the connection's reads wait while the server is stalled, so
// that a stall stops consuming the kernel's receive buffer.
func (sc *serverConn) Read(p []byte) (int, error) {
	if !sc.s.gate() {
		return 0, net.ErrClosed
	}
	return sc.c.Read(p)
}

func (sc *serverConn) readLoop() {
	s := sc.s
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, sc.c)
		s.mu.Unlock()
		_ = sc.c.Close()
	}()
	for {
		p, err := ReadFrame(sc, s.cfg.MaxFrame)
		if err != nil {
			return // EOF, reset, closed, or a fatal frame length
		}
		now := time.Now()
		req, err := parseRequest(p, false)
		if err != nil {
			s.bad.Add(1) // Pinot logs, meters and sends nothing
			continue
		}
		stale := !req.Deadline.IsZero() && now.After(req.Deadline)
		// Its execution time is the delay when it was read: set before it
		// is counted executed, so that a SetDelay after Stats shows it
		// does not change it.
		d := time.Duration(s.delay.Load())
		s.executed.Add(1)
		if stale {
			s.stale.Add(1)
		}
		s.mu.Lock()
		bc := s.byBroker[req.BrokerID]
		if bc == nil {
			bc = &BrokerCount{}
			s.byBroker[req.BrokerID] = bc
		}
		bc.Executed++
		if stale {
			bc.Stale++
		}
		closed := s.closed
		if !closed {
			s.wg.Add(1)
		}
		s.mu.Unlock()
		if closed {
			return
		}
		go sc.execute(req.ID, d)
	}
}

// execute waits out the request's execution time and answers it.
func (sc *serverConn) execute(id int64, d time.Duration) {
	s := sc.s
	defer s.wg.Done()
	if d > 0 {
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-s.done:
			t.Stop()
			return
		}
	}
	if s.silent.Load() || !s.gate() {
		return
	}
	frame := AppendFrame(make([]byte, 0, HeaderLen+MinimalResponseLen), AppendResponse(nil, id))
	sc.wmu.Lock()
	_, err := sc.c.Write(frame)
	sc.wmu.Unlock()
	if err == nil {
		s.answered.Add(1)
	}
}

var _ io.Reader = (*serverConn)(nil)
