package proxy

import (
	"crypto/aes"
	"crypto/cipher"
	"encoding/binary"
	"math/rand/v2"
	"time"
)

// The plans of TestDataPlaneIntegrity: what each connection of a round
// sends, how its server answers and how both ends finish. A plan is all a
// connection's bytes are made from (integBytes), so that each end can make
// the other's again and compare what it received, byte for byte.

// integEnd is how a connection of the test finishes.
type integEnd int8

const (
	// endClientFin: the client half-closes once it has sent everything;
	// the server answers what is left, then half-closes.
	endClientFin integEnd = iota
	// endServerFin: the server half-closes after finAfter answers; the
	// client keeps sending until its last request, reads the FIN, then
	// half-closes.
	endServerFin
	// endBothFin: each side half-closes as soon as it is done, racing.
	endBothFin
	// endClientReset: the client resets (SO_LINGER 0) after sending
	// resetAt bytes (in the middle of a frame as likely as not).
	endClientReset
	// endServerReset: the server resets after writing resetAt bytes, or
	// reading them (resetOnRead), or at the client's FIN.
	endServerReset
)

func (e integEnd) String() string {
	return [...]string{"client_fin", "server_fin", "both_fin", "client_reset", "server_reset"}[e]
}

// resets reports whether a side of the connection resets it.
func (e integEnd) resets() bool { return e == endClientReset || e == endServerReset }

// integShape is how one end reads: buffer size, and a pause every so many
// reads while its pause budget lasts (a slow reader, bounded in time).
type integShape struct {
	buf        int
	pauseEvery int
	pause      time.Duration
	budget     time.Duration
}

// integPlan is one connection of a round.
type integPlan struct {
	id   uint32
	seed uint64
	// stream: opaque duplex streams of upLen and downLen bytes instead of
	// requests and answers (opaque profile only).
	stream         bool
	upLen, downLen int64

	n                 int             // requests
	reqSize, respSize []int           // payload sizes, by request
	kind              []int8          // the codec's choice of request, by request
	delay             []time.Duration // the server's pause before each answer
	depth             int             // requests in flight at most
	end               integEnd
	finAfter          int   // endServerFin: requests answered before the FIN
	resetAt           int64 // the reset's byte offset (see integEnd)
	resetOnRead       bool
	finDelay          time.Duration // the server's pause before its FIN
	clientWrite       int           // largest client write
	serverWrite       int           // largest server write
	clientRead        integShape
	serverRead        integShape
}

// integBytes is n bytes of content a, b of the plan with seed: the same
// for both ends of a connection.
func integBytes(seed uint64, a, b uint64, n int) []byte {
	p := make([]byte, n)
	integKeyStream(seed, a, b, 0x5a).XORKeyStream(p, p)
	return p
}

// integStream is a plan's duplex stream in one direction (dir 0 up, 1
// down), read in order in pieces of any size (XORKeyStream over zeros).
func integStream(p *integPlan, dir uint64) cipher.Stream {
	return integKeyStream(p.seed, uint64(p.id), dir, 0xa5)
}

// integKeyStream is AES-CTR keyed by its arguments: fast under the race
// detector (assembly, not instrumented), unlike a generator in Go.
func integKeyStream(seed, a, b uint64, tag byte) cipher.Stream {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[0:], seed)
	binary.LittleEndian.PutUint64(key[8:], a)
	binary.LittleEndian.PutUint64(key[16:], b)
	key[24] = tag
	blk, err := aes.NewCipher(key[:])
	if err != nil {
		panic(err)
	}
	return cipher.NewCTR(blk, make([]byte, aes.BlockSize))
}

// integSize draws a payload size: mostly small, sometimes up to several
// MiB (capped at max).
func integSize(r *rand.Rand, max int) int {
	var n int
	switch x := r.IntN(100); {
	case x < 60:
		n = 1 + r.IntN(300)
	case x < 85:
		n = 1 + r.IntN(16<<10)
	case x < 97:
		n = 1 + r.IntN(256<<10)
	default:
		n = 256<<10 + r.IntN(4<<20)
	}
	return min(n, max)
}

// integReadShape draws how an end reads: slow in about a third of the
// connections, within a pause budget.
func integReadShape(r *rand.Rand) integShape {
	s := integShape{buf: []int{1, 7, 512, 4 << 10, 64 << 10, 256 << 10}[r.IntN(6)]}
	if r.IntN(3) == 0 {
		s.pauseEvery = 1 + r.IntN(8)
		s.pause = time.Duration(1+r.IntN(15)) * time.Millisecond
		s.budget = time.Duration(50+r.IntN(450)) * time.Millisecond
	}
	return s
}

// integLimits bound one round's traffic.
type integLimits struct {
	conns     int   // connections
	perConn   int64 // bytes each way per connection, at most (about)
	maxFrame  int   // the codec's largest payload
	reqs      int   // requests per connection, at most
	streaming bool  // duplex stream connections allowed (opaque)
	// answerFirst: the server ends a connection (its FIN, its reset) only
	// once it has answered on it: under a protocol profile a server that
	// closes before it answers anything is not taken at its word, and
	// its requests are judged (README, "Requests of links that ended
	// still count"): a healthy server answers.
	answerFirst bool
}

// newIntegPlan draws connection id's plan.
func newIntegPlan(r *rand.Rand, id uint32, lim integLimits, c integCodec) *integPlan {
	p := &integPlan{id: id, seed: r.Uint64(), end: integEnd(r.IntN(5)),
		clientWrite: []int{1, 3, 100, 4 << 10, 64 << 10, 1 << 20, 8 << 20}[r.IntN(7)],
		serverWrite: []int{1, 5, 1 << 10, 64 << 10, 1 << 20, 8 << 20}[r.IntN(6)],
		clientRead:  integReadShape(r), serverRead: integReadShape(r),
		finDelay: time.Duration(r.IntN(3)*r.IntN(60)) * time.Millisecond}
	if lim.streaming && r.IntN(3) == 0 {
		p.stream = true
		p.upLen, p.downLen = int64(integSize(r, int(lim.perConn))), int64(integSize(r, int(lim.perConn)))
		if r.IntN(4) == 0 {
			p.upLen = 0
		}
		p.resetAt = r.Int64N(max(p.upLen, p.downLen) + 1)
		p.resetOnRead = r.IntN(2) == 0
		return p
	}
	integRequests(r, p, lim, c)
	return p
}

// integRequests draws a plan's requests, their answers and its end.
func integRequests(r *rand.Rand, p *integPlan, lim integLimits, c integCodec) {
	p.n = 1 + r.IntN(lim.reqs)
	p.depth = []int{1, 1, 2, 8, 64, 300}[r.IntN(6)]
	var up, down, delays int64
	for range p.n {
		req, resp := integSize(r, lim.maxFrame), integSize(r, lim.maxFrame)
		if up+int64(req) > lim.perConn {
			req = 1 + r.IntN(64)
		}
		if down+int64(resp) > lim.perConn {
			resp = 1 + r.IntN(64)
		}
		up, down = up+int64(req), down+int64(resp)
		p.reqSize, p.respSize = append(p.reqSize, req), append(p.respSize, resp)
		p.kind = append(p.kind, int8(r.IntN(16)))
		var d time.Duration
		if r.IntN(10) == 0 && delays < int64(time.Second) {
			d = time.Duration(1+r.IntN(300)) * time.Millisecond
			delays += int64(d)
		}
		p.delay = append(p.delay, d)
	}
	p.finAfter = r.IntN(p.n + 1)
	switch p.end {
	case endClientReset:
		p.resetAt = r.Int64N(up + 1)
	case endServerReset:
		p.resetOnRead = r.IntN(2) == 0
		p.resetAt = r.Int64N(max(up, down) + 1)
	}
	if lim.answerFirst {
		first := 0
		for first < p.n && !c.answers(p, first) {
			first++
		}
		switch {
		case first == p.n && (p.end == endServerFin || p.end == endServerReset):
			p.end = endClientFin
		case p.end == endServerFin:
			p.finAfter = max(p.finAfter, first+1)
		case p.end == endServerReset:
			p.resetOnRead, p.resetAt = false, max(p.resetAt, 1)
		}
	}
}
