package proxy

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"fmt"
	"hash"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// integClient is one client connection of TestDataPlaneIntegrity: a
// writer that sends the plan's requests (or stream) in writes of random
// sizes, within its pipelining depth, and a reader that checks every
// answer byte for byte.
type integClient struct {
	codec integCodec
	p     *integPlan
	c     *net.TCPConn
	res   integClientResult

	wmu      sync.Mutex // held by each write and while its error is recorded
	shut     atomic.Bool
	mu       sync.Mutex
	cond     sync.Cond
	recv     int  // answers received whole
	readDone bool // the reader saw the stream's end
	lost     bool // the reader found the answers wrong: the depth no longer holds
	// the writer's: the next request to send, how many of those sent
	// have an answer coming
	seq, withAnswer int
}

// integClientResult is what the client saw of its connection.
type integClientResult struct {
	local     string
	dialErr   error
	upBytes   int64 // bytes written
	upHash    []byte
	writeErr  error
	reset     bool // the client reset the connection itself
	downBytes int64
	downHash  []byte
	down      *integVerifier // stream mode
	order     []int          // answers received whole, in order
	partial   []byte         // bytes of an answer cut short
	downErr   error          // an answer not as it should be
	downEnd   string         // how the answers ended (sawFin, ...)
}

// runIntegClient runs plan p against the proxy at addr.
func runIntegClient(addr string, codec integCodec, p *integPlan, deadline time.Time, rcvbuf int) *integClientResult {
	d := net.Dialer{Deadline: deadline}
	if rcvbuf > 0 {
		d.Control = func(_, _ string, c syscall.RawConn) error {
			return c.Control(func(fd uintptr) { _ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, rcvbuf) })
		}
	}
	nc, err := d.Dial("tcp", addr)
	if err != nil {
		return &integClientResult{dialErr: err}
	}
	ic := &integClient{codec: codec, p: p, c: nc.(*net.TCPConn)}
	ic.cond.L = &ic.mu
	ic.res.local = nc.LocalAddr().String()
	_ = nc.SetDeadline(deadline)
	var wg sync.WaitGroup
	wg.Go(ic.write)
	ic.read()
	wg.Wait()
	_ = nc.Close()
	return &ic.res
}

// fill returns the bytes of the next requests the pipelining depth lets
// go out, waiting for room when block is set; nil once all are sent (or
// there is no room and block is not set).
func (ic *integClient) fill(block bool) []byte {
	p := ic.p
	if p.stream {
		return nil
	}
	ic.mu.Lock()
	defer ic.mu.Unlock()
	var b []byte
	for ic.seq < p.n {
		if ic.withAnswer-ic.recv >= p.depth && !ic.readDone && !ic.lost {
			if !block || b != nil {
				break
			}
			ic.cond.Wait()
			continue
		}
		b = append(b, ic.codec.request(p, ic.seq)...)
		if ic.codec.answers(p, ic.seq) {
			ic.withAnswer++
		}
		ic.seq++
	}
	return b
}

// write sends the hello and the requests (or the stream), then ends the
// stream as the plan says.
func (ic *integClient) write() {
	p, r := ic.p, rand.New(rand.NewPCG(ic.p.seed, 1))
	h := sha256.New()
	defer func() { ic.res.upHash = h.Sum(nil) }()
	var pending []byte
	next := func() []byte { return nil }
	if p.stream {
		next = integStreamPieces(p, 0, p.upLen, ic.codec.hello(p))
	} else {
		pending = ic.codec.hello(p)
	}
	for writes := 0; ; writes++ {
		if len(pending) < 64<<10 {
			pending = append(pending, ic.fill(len(pending) == 0)...)
		}
		if len(pending) == 0 {
			if pending = next(); pending == nil {
				break
			}
		}
		if !ic.writeSome(r, h, &pending, writes) {
			return
		}
	}
	ic.finish()
}

// writeSome writes part of *pending; under endClientReset it resets at
// resetAt. It reports false when the writer is done.
func (ic *integClient) writeSome(r *rand.Rand, h hash.Hash, pending *[]byte, writes int) bool {
	p := ic.p
	most := p.clientWrite
	if writes > 2048 {
		most = max(most, 256<<10) // a slow writer still ends
	}
	k := 1 + r.IntN(min(len(*pending), most))
	cut := p.end == endClientReset && ic.res.upBytes+int64(k) >= p.resetAt
	if cut {
		k = int(p.resetAt - ic.res.upBytes)
	}
	ic.wmu.Lock()
	n, err := ic.c.Write((*pending)[:k])
	if err != nil {
		ic.res.writeErr = err
	}
	ic.wmu.Unlock()
	h.Write((*pending)[:n])
	ic.res.upBytes += int64(n)
	*pending = (*pending)[n:]
	switch {
	case err != nil:
		return false
	case cut:
		ic.res.reset = true
		integReset(ic.c)
		return false
	}
	return true
}

// finish ends the client's stream once all of it is written: a FIN (under
// endServerFin once the server's came), or the reset of endClientReset
// when its offset is the stream's end.
func (ic *integClient) finish() {
	switch ic.p.end {
	case endClientReset:
		ic.res.reset = true
		integReset(ic.c)
		return
	case endServerFin:
		ic.mu.Lock()
		for !ic.readDone {
			ic.cond.Wait()
		}
		ic.mu.Unlock()
	}
	ic.shut.Store(true)
	if err := ic.c.CloseWrite(); err != nil {
		ic.wmu.Lock()
		ic.res.writeErr = err
		ic.wmu.Unlock()
	}
}

// read reads the answers (or the stream) to their end, shaped by the
// plan, and checks them.
func (ic *integClient) read() {
	p := ic.p
	h := sha256.New()
	if p.stream {
		ic.res.down = newIntegVerifier(integStreamPieces(p, 1, p.downLen, nil))
	}
	buf := make([]byte, max(p.clientRead.buf, 1))
	var acc []byte
	var paused time.Duration
	for reads := 1; ; reads++ {
		if reads == 4096 && len(buf) < 64<<10 {
			buf = make([]byte, 64<<10) // a slow reader still ends
		}
		n, err := ic.c.Read(buf)
		h.Write(buf[:n])
		ic.res.downBytes += int64(n)
		if ic.res.down != nil {
			ic.res.down.feed(buf[:n])
		} else {
			acc = ic.answers(append(acc, buf[:n]...))
		}
		if err != nil {
			ic.res.downEnd = integEndOf(ic.c, err, &ic.shut, func() error {
				ic.wmu.Lock()
				defer ic.wmu.Unlock()
				return ic.res.writeErr
			})
			break
		}
		if sh := p.clientRead; sh.pauseEvery > 0 && reads%sh.pauseEvery == 0 && paused < sh.budget {
			time.Sleep(sh.pause)
			paused += sh.pause
		}
	}
	ic.res.partial, ic.res.downHash = acc, h.Sum(nil)
	ic.mu.Lock()
	ic.readDone = true
	ic.cond.Broadcast()
	ic.mu.Unlock()
}

// answers checks the whole answers at the head of acc and returns what
// is left of it. After an answer that is wrong it goes on counting
// answers (the writer's depth waits for them), checking no more.
func (ic *integClient) answers(acc []byte) []byte {
	hl := ic.codec.hdrLen()
	for len(acc) >= hl {
		fl := ic.codec.frameLen(acc[:hl])
		if fl < hl || fl > 64<<20 || ic.lost && len(acc) < fl {
			ic.res.downErr = cmp.Or(ic.res.downErr, fmt.Errorf("an answer frame of %d bytes, after answers %v", fl, ic.res.order))
			ic.mu.Lock()
			ic.lost = true
			ic.cond.Broadcast()
			ic.mu.Unlock()
			return nil
		}
		if len(acc) < fl {
			break
		}
		if err := ic.answer(acc[:fl]); err != nil && ic.res.downErr == nil {
			ic.res.downErr = err
			ic.mu.Lock()
			ic.lost = true
			ic.cond.Broadcast()
			ic.mu.Unlock()
		}
		acc = acc[:copy(acc, acc[fl:])]
	}
	return acc
}

// answer checks one whole answer frame, and counts it.
func (ic *integClient) answer(frame []byte) error {
	defer func() {
		ic.mu.Lock()
		ic.recv++
		ic.cond.Broadcast()
		ic.mu.Unlock()
	}()
	if ic.res.downErr != nil {
		return nil
	}
	p, codec := ic.p, ic.codec
	seq, err := codec.respSeq(frame)
	if err != nil || seq < 0 || seq >= p.n {
		return fmt.Errorf("answer %d after %v: request %d, %v", len(ic.res.order), ic.res.order, seq, err)
	}
	if codec.ordered() {
		want := 0
		if k := len(ic.res.order); k > 0 {
			want = ic.res.order[k-1] + 1
		}
		for want < p.n && !codec.answers(p, want) {
			want++
		}
		if seq != want {
			return fmt.Errorf("answer to request %d where %d's was due (after %d answers)", seq, want, len(ic.res.order))
		}
	}
	if slices.Contains(ic.res.order, seq) {
		return fmt.Errorf("a second answer to request %d", seq)
	}
	if want := codec.response(p, seq); !bytes.Equal(frame, want) {
		return fmt.Errorf("the answer to request %d (%d bytes, want %d) differs from byte %d", seq, len(frame), len(want), integDiff(frame, want))
	}
	ic.res.order = append(ic.res.order, seq)
	return nil
}

// integDiff is the first offset where a and b differ.
func integDiff(a, b []byte) int {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return i
}
