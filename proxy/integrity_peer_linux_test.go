package proxy

import (
	"crypto/sha256"
	"errors"
	"hash"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// integServer is TestDataPlaneIntegrity's upstream: it names each
// connection from its first bytes, checks every byte the client sent
// against the connection's plan, and answers as the plan says.
type integServer struct {
	ln       net.Listener
	codec    integCodec
	plans    map[uint32]*integPlan // read only once clients run
	deadline time.Time
	// fault is what the server gets wrong (the test's check of itself).
	fault integFault

	mu   sync.Mutex
	res  map[uint32]*integSrvResult
	anon []string // ends of connections never named (the client reset first)
	wg   sync.WaitGroup
}

// integSrvResult is what the server saw of one connection.
type integSrvResult struct {
	up        *integVerifier // the client's bytes, checked
	upEnd     string         // how the client's stream ended (sawFin, ...)
	downBytes int64          // bytes written
	downHash  []byte
	order     []int // answers written, in order (the last one cut short if cutLast)
	cutLast   bool
	reset     bool // the server reset the connection itself
}

func startIntegServer(t *testing.T, addr string, codec integCodec, buffer int, deadline time.Time) *integServer {
	t.Helper()
	lc := net.ListenConfig{}
	if buffer > 0 {
		lc.Control = func(_, _ string, c syscall.RawConn) error {
			return c.Control(func(fd uintptr) {
				_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, buffer)
				_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF, buffer)
			})
		}
	}
	ln, err := lc.Listen(t.Context(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	s := &integServer{ln: ln, codec: codec, plans: map[uint32]*integPlan{}, deadline: deadline, res: map[uint32]*integSrvResult{}}
	s.wg.Go(s.accept)
	return s
}

func (s *integServer) accept() {
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.wg.Go(func() { s.serve(c.(*net.TCPConn)) })
	}
}

// close stops accepting and waits for every connection to end.
func (s *integServer) close() {
	_ = s.ln.Close()
	s.wg.Wait()
}

// serve names the connection and serves it by its plan.
func (s *integServer) serve(c *net.TCPConn) {
	defer c.Close()
	_ = c.SetDeadline(s.deadline)
	first, err := s.first(c)
	var p *integPlan
	if err == nil {
		if id, ierr := s.codec.connOf(first); ierr == nil {
			p = s.plans[id]
		}
	}
	if p == nil {
		// Never named: the client reset before its first frame was
		// through, or something is wrong; what matters is how it ended.
		for err == nil {
			_, err = io.Copy(io.Discard, c)
			if err == nil {
				err = io.EOF
			}
		}
		s.mu.Lock()
		s.anon = append(s.anon, integEndOf(c, err, new(atomic.Bool), func() error { return nil }))
		s.mu.Unlock()
		return
	}
	sc := &integSrvConn{s: s, c: c, p: p, r: rand.New(rand.NewPCG(p.seed, 2)), res: &integSrvResult{}, down: sha256.New()}
	sc.run(first)
	sc.res.downHash = sc.down.Sum(nil)
	s.mu.Lock()
	s.res[p.id] = sc.res
	s.mu.Unlock()
}

// first reads the hello, or the first request frame.
func (s *integServer) first(c *net.TCPConn) ([]byte, error) {
	if n := s.codec.helloLen(); n > 0 {
		b := make([]byte, n)
		_, err := io.ReadFull(c, b)
		return b, err
	}
	b := make([]byte, s.codec.hdrLen())
	if _, err := io.ReadFull(c, b); err != nil {
		return nil, err
	}
	n := s.codec.frameLen(b)
	if n < len(b) || n > 64<<20 {
		return b, errors.New("not a frame")
	}
	b = append(b, make([]byte, n-len(b))...)
	_, err := io.ReadFull(c, b[s.codec.hdrLen():])
	return b, err
}

// integSrvConn is one connection the server serves.
type integSrvConn struct {
	s   *integServer
	c   *net.TCPConn
	p   *integPlan
	r   *rand.Rand // under wmu once answers run
	res *integSrvResult

	wmu      sync.Mutex // one answer written at a time; guards what follows
	down     hash.Hash
	resetNow bool  // the server reset the connection: nothing more is written
	writeErr error // the first failed write: nothing more is written
	writes   int
	shut     atomic.Bool // the server sent its FIN

	pending sync.WaitGroup // answers due and not yet written
	workers sync.WaitGroup // the goroutines that write
	finOnce sync.Once
	finDone chan struct{}
	eof     chan struct{} // closed when the client's stream ended
}

// run reads and checks the client's stream, answering as the plan says.
func (sc *integSrvConn) run(first []byte) {
	p, codec := sc.p, sc.s.codec
	sc.finDone, sc.eof = make(chan struct{}), make(chan struct{})
	var ans *integAnswerer
	if p.stream {
		sc.res.up = newIntegVerifier(integStreamPieces(p, 0, p.upLen, codec.hello(p)))
		sc.workers.Go(sc.streamDown)
	} else {
		sc.res.up = newIntegVerifier(integPieces(codec, p))
		ans = newIntegAnswerer(sc)
	}
	finAt := -1 // requests read before the server's FIN goes out (after their answers)
	switch {
	case p.stream:
	case p.end == endServerFin:
		finAt = p.finAfter
	case p.end == endBothFin:
		finAt = p.n
	}
	if finAt == 0 {
		go sc.fin()
	}
	err := sc.readAll(first, ans, finAt)
	sc.res.upEnd = integEndOf(sc.c, err, &sc.shut, func() error {
		sc.wmu.Lock()
		defer sc.wmu.Unlock()
		return sc.writeErr
	})
	close(sc.eof)
	if ans != nil {
		ans.stop()
	}
	if sc.res.upEnd == sawFin && !p.stream {
		sc.fin()
	}
	sc.workers.Wait()
	sc.finOnce.Do(func() { close(sc.finDone) })
	<-sc.finDone
}

// readAll reads the client's stream to its end, shaped by the plan, and
// hands each whole request to ans; after finAt requests it sends the FIN.
func (sc *integSrvConn) readAll(first []byte, ans *integAnswerer, finAt int) error {
	p, v := sc.p, sc.res.up
	hello := sc.s.codec.helloLen() > 0 && !p.stream
	seen := 0
	took := func(b []byte) bool {
		if f := sc.s.fault; f >= faultFlipUp && f <= faultSwapUp {
			b = f.apply(b)
		}
		for range v.feed(b) {
			if hello {
				hello = false
				continue
			}
			if ans != nil {
				ans.dispatch(seen)
			}
			if seen++; seen == finAt {
				go sc.fin()
			}
		}
		if p.end == endServerReset && p.resetOnRead && v.n >= p.resetAt {
			sc.reset()
			return false
		}
		return v.err == nil
	}
	if !took(first) {
		return net.ErrClosed
	}
	buf := make([]byte, max(p.serverRead.buf, 1))
	var paused time.Duration
	for reads := 1; ; reads++ {
		if reads == 4096 && len(buf) < 64<<10 {
			buf = make([]byte, 64<<10) // a slow reader still ends
		}
		n, err := sc.c.Read(buf)
		if n > 0 && !took(buf[:n]) {
			return net.ErrClosed
		}
		if err != nil {
			return err
		}
		if sh := p.serverRead; sh.pauseEvery > 0 && reads%sh.pauseEvery == 0 && paused < sh.budget {
			time.Sleep(sh.pause)
			paused += sh.pause
		}
	}
}

// fin sends the server's FIN (or, under endServerReset, its reset) once
// the answers given so far are written, after the plan's pause; under
// endClientFin and the reset ends, only once the client's FIN came.
func (sc *integSrvConn) fin() {
	sc.finOnce.Do(func() {
		defer close(sc.finDone)
		if e := sc.p.end; e == endClientFin || e.resets() {
			<-sc.eof
		}
		sc.pending.Wait()
		time.Sleep(sc.p.finDelay)
		if sc.s.fault == faultLostFin {
			<-sc.eof
			time.Sleep(time.Until(sc.s.deadline)) // no FIN, the connection held open until the round's end
			return
		}
		sc.wmu.Lock()
		defer sc.wmu.Unlock()
		switch {
		case sc.resetNow || sc.writeErr != nil:
		case sc.p.end == endServerReset || sc.s.fault == faultResetForFin:
			sc.resetLocked()
		default:
			sc.shut.Store(true)
			_ = sc.c.CloseWrite()
		}
	})
}

// reset resets the connection now.
func (sc *integSrvConn) reset() {
	sc.wmu.Lock()
	defer sc.wmu.Unlock()
	sc.resetLocked()
}

func (sc *integSrvConn) resetLocked() {
	if !sc.resetNow {
		sc.resetNow, sc.res.reset = true, true
		integReset(sc.c)
	}
}

// writeLocked writes b (an answer, or a piece of the stream), in writes of
// random sizes; under endServerReset it cuts the stream at resetAt and
// resets. It reports whether all of b went out; wmu is held.
func (sc *integSrvConn) writeLocked(b []byte) bool {
	if f := sc.s.fault; f >= faultFlipDown && f <= faultSwapDown {
		b = f.apply(b)
	}
	for len(b) > 0 && !sc.resetNow && sc.writeErr == nil {
		most := sc.p.serverWrite
		if sc.writes++; sc.writes > 2048 {
			most = max(most, 256<<10) // a slow writer still ends
		}
		k := 1 + sc.r.IntN(min(len(b), most))
		cut := sc.p.end == endServerReset && !sc.p.resetOnRead && sc.res.downBytes+int64(k) >= sc.p.resetAt
		if cut {
			k = int(sc.p.resetAt - sc.res.downBytes)
		}
		n, err := sc.c.Write(b[:k])
		sc.down.Write(b[:n])
		sc.res.downBytes += int64(n)
		b = b[n:]
		if err != nil {
			sc.writeErr = err
			return false
		}
		if cut {
			sc.resetLocked()
			return len(b) == 0
		}
	}
	return len(b) == 0
}

// streamDown writes the plan's duplex stream toward the client, then its
// FIN (see fin).
func (sc *integSrvConn) streamDown() {
	next := integStreamPieces(sc.p, 1, sc.p.downLen, nil)
	for b := next(); b != nil; b = next() {
		sc.wmu.Lock()
		ok := sc.writeLocked(b)
		sc.wmu.Unlock()
		if !ok {
			return
		}
	}
	sc.fin()
}

// integAnswerer answers a connection's requests: in order, one at a time
// (a Kafka broker, length_field), or each on its own after its pause, in
// the order they finish (a Pinot server).
type integAnswerer struct {
	sc *integSrvConn
	ch chan int // ordered: the requests to answer, in order
}

func newIntegAnswerer(sc *integSrvConn) *integAnswerer {
	a := &integAnswerer{sc: sc}
	if sc.s.codec.ordered() {
		a.ch = make(chan int, sc.p.n)
		sc.workers.Go(func() {
			for seq := range a.ch {
				a.answer(seq)
			}
		})
	}
	return a
}

// dispatch answers request seq, unless the plan's server half-closes
// before it.
func (a *integAnswerer) dispatch(seq int) {
	if p := a.sc.p; p.end == endServerFin && seq >= p.finAfter || !a.sc.s.codec.answers(p, seq) {
		return
	}
	a.sc.pending.Add(1)
	if a.ch != nil {
		a.ch <- seq
		return
	}
	a.sc.workers.Go(func() { a.answer(seq) })
}

// answer writes the answer to seq after its pause.
func (a *integAnswerer) answer(seq int) {
	sc := a.sc
	defer sc.pending.Done()
	select {
	case <-time.After(sc.p.delay[seq]):
	case <-sc.eof:
		if sc.res.upEnd != sawFin {
			return // reset: nothing more goes out
		}
		time.Sleep(sc.p.delay[seq])
	}
	b := sc.s.codec.response(sc.p, seq)
	sc.wmu.Lock()
	defer sc.wmu.Unlock()
	if sc.resetNow || sc.writeErr != nil {
		return
	}
	sc.res.order = append(sc.res.order, seq)
	sc.res.cutLast = !sc.writeLocked(b)
}

// stop ends the ordered answerer once it has answered what it was given.
func (a *integAnswerer) stop() {
	if a.ch != nil {
		close(a.ch)
	}
}

// integFault is what the server gets wrong in the test's check of itself.
type integFault int8

const (
	faultNone        integFault = iota
	faultFlipDown               // a bit of every answer flipped
	faultDropDown               // a byte of every answer left out
	faultSwapDown               // two bytes of every answer swapped
	faultFlipUp                 // a bit of every read flipped, as if it came so
	faultDropUp                 // a byte of every read left out
	faultSwapUp                 // two bytes of every read swapped
	faultLostFin                // the server's FIN never sent (the connection held open)
	faultResetForFin            // a reset instead of the server's FIN
)

func (f integFault) String() string {
	return [...]string{"none", "flip_down", "drop_down", "swap_down", "flip_up", "drop_up", "swap_up", "lost_fin", "reset_for_fin"}[f]
}

// apply does the fault to a copy of b, in its middle.
func (f integFault) apply(b []byte) []byte {
	if len(b) == 0 {
		return b
	}
	c := append([]byte(nil), b...)
	i := len(c) / 2
	switch f {
	case faultFlipDown, faultFlipUp:
		c[i] ^= 0x10
	case faultDropDown, faultDropUp:
		c = append(c[:i], c[i+1:]...)
	case faultSwapDown, faultSwapUp:
		for i = 0; i+1 < len(c) && c[i] == c[i+1]; i++ {
		}
		if i+1 < len(c) {
			c[i], c[i+1] = c[i+1], c[i]
		}
	}
	return c
}
