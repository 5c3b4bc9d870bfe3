package mesh

import (
	"encoding/binary"
	"errors"
	"net"
	"sync"
	"sync/atomic"

	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// meshGuard sits between a session's connection and yamux, and reads the
// yamux frames both ways (spec: a 12-byte header, version, type, flags,
// stream id, length; a data frame's body is length bytes):
//
//   - Pings: the guard answers the peer's pings itself and sends the
//     heartbeat's, each put in at the next frame boundary, ahead of the
//     frames waiting in yamux's send queue: on a congested path a ping
//     and its answer wait for one frame, not for the whole queue. (yamux
//     would also start a goroutine for every ping it receives: a peer
//     that sends pings and never reads would grow the process without
//     bound.) Answers not yet written are at most maxPendingPings (12
//     bytes each); a peer that has more waiting is flooding, and its
//     session is cut. A yamux ping (a probe's) and its answer pass
//     through; the guard's own pings carry ids with the top bit set.
//   - Streams the peer opens: a SYN the owner's admit refuses (its
//     session or the ingress carries as many streams as it may) never
//     reaches yamux; the peer gets a reset for it, and its body is
//     dropped. Refusals not yet written (these, and the owner's through
//     Session.RefuseStream) are at most the streams the peer may hold
//     and refusalMargin more: a peer that has more waiting opens streams
//     past its limits and does not read, and its session is cut (the
//     heartbeat never would: its bytes keep arriving).
//   - Resets: yamux has no stream reset in its API. reset queues a reset
//     frame (a window update with RST) toward the peer and one toward the
//     local yamux; each is put in at a frame boundary. The peer's yamux
//     ends the stream as reset (its reads fail, they do not read an end),
//     and so does the local one (it frees the stream).
//
// yamux's receive loop is the guard's only reader, its send loop and the
// guard's flusher its writers.
type meshGuard struct {
	Conn net.Conn // the session's connection: the TCP one, or TLS over it
	tcp  *net.TCPConn
	last *atomic.Int64 // mono: when a byte last arrived
	// admit reports whether a stream the peer opens may be taken; it
	// is called on yamux's receive loop.
	admit func() bool
	// hit counts a limit hit (a refused stream, a ping flood).
	hit func(limit string)
	// maxRefusals bounds the refusals in outQ.
	maxRefusals int

	// Read side (yamux's receive loop only).
	raw            [4096]byte
	rawOff, rawEnd int
	rerr           error
	hdr            [YamuxHeaderLen]byte
	hdrN           int
	pend           []byte // a header to pass on
	pendBuf        [YamuxHeaderLen]byte
	body           uint32 // body bytes of the current frame still to pass (or drop)
	dropBody       bool
	linkBody       bool // the current frame is data of a link's stream
	// linkIn counts the bytes of data of the links' streams as they
	// arrive (Session.LinkBytesIn).
	linkIn atomic.Int64

	mu          sync.Mutex
	inQ         []byte // frames for the local yamux
	outQ        []byte // frames for the peer
	pendingAcks int    // ping answers in outQ
	refusals    int    // resets of streams the peer opened and was refused, in outQ
	flooded     bool   // refusals reached maxRefusals: the session is being cut
	pingQueued  bool   // a ping of the heartbeat is in outQ
	pingID      uint32
	inReady     atomic.Bool

	// Write side, under wmu.
	wmu   sync.Mutex
	wHdr  [YamuxHeaderLen]byte
	wHdrN int
	wBody uint32
	kick  chan struct{}
}

// yamux's frame format.
const (
	YamuxHeaderLen        = 12
	yamuxTypeData         = 0
	yamuxTypeWindowUpdate = 1
	YamuxTypePing         = 2
	YamuxFlagSYN          = 1
	yamuxFlagACK          = 2
	yamuxFlagRST          = 8
	// maxPendingPings is how many answers to the peer's pings may wait
	// to be written: a heartbeat sends one a ping interval, so that many
	// wait only behind a write that has not moved for minutes.
	maxPendingPings = 1024
	// refusalMargin is how many more refusals than the streams the peer
	// may hold may wait to be written. An egress has fewer: a stream it
	// opened counts against its own limit until the reset refusing it
	// arrives, and its yamux waits once 256 of its opens (the accept
	// backlog) are unanswered. The margin covers those and the moment
	// the two sides' counts differ; the count starts again at every
	// write, so more wait only behind a write that does not move.
	refusalMargin = 1024
	// guardPingID marks the guard's own pings' ids.
	guardPingID = 1 << 31
)

// Mesh limits, the limit label of mesh_limits_total.
const (
	LimitPings             = "pings"
	LimitRefusals          = "refusals" // the peer's refused streams' resets wait unwritten beyond the bound: its session cut
	LimitStreamsPerSession = "streams_per_session"
	LimitStreams           = "streams"
	LimitLinks             = "links" // a stream whose header named a served port, refused at max_links (the process's or the listener's)
	LimitSessionsPerPeer   = "sessions_per_peer"
	LimitSessions          = "sessions"
	LimitPeerNotAllowed    = "peer_not_allowed"
	LimitHandshakes        = "handshakes"
	LimitTLS               = "tls" // a TLS handshake failed: no valid certificate, or not one of mesh.tls.peers
)

var (
	errPingFlood    = errors.New("mesh: the peer's pings wait for answers beyond the bound (a ping flood): session closed")
	errRefusalFlood = errors.New("mesh: the resets of the peer's refused streams wait to be written beyond the bound (it opens streams and does not read): session closed")
)

func newMeshGuard(c net.Conn, tcp *net.TCPConn, last *atomic.Int64, adm Admission, hit func(string)) *meshGuard {
	return &meshGuard{Conn: c, tcp: tcp, last: last, admit: adm.Admit, hit: hit, kick: make(chan struct{}, 1),
		maxRefusals: max(adm.Streams, 0) + refusalMargin}
}

func yamuxFrame(typ byte, flags uint16, id, length uint32) []byte {
	var h [YamuxHeaderLen]byte
	h[1] = typ
	binary.BigEndian.PutUint16(h[2:], flags)
	binary.BigEndian.PutUint32(h[4:], id)
	binary.BigEndian.PutUint32(h[8:], length)
	return h[:]
}

func rstFrame(id uint32) []byte { return yamuxFrame(yamuxTypeWindowUpdate, yamuxFlagRST, id, 0) }

// ping sends the heartbeat's ping, unless the last one is still waiting
// to be written.
func (g *meshGuard) ping() {
	g.mu.Lock()
	if !g.pingQueued {
		g.pingQueued = true
		g.pingID++
		g.outQ = append(g.outQ, yamuxFrame(YamuxTypePing, YamuxFlagSYN, 0, guardPingID|g.pingID)...)
	}
	g.mu.Unlock()
	g.wake()
}

// answer queues the answer to the peer's ping id; false: too many wait.
func (g *meshGuard) answer(id uint32) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.pendingAcks >= maxPendingPings {
		return false
	}
	g.pendingAcks++
	g.outQ = append(g.outQ, yamuxFrame(YamuxTypePing, yamuxFlagACK, 0, id)...)
	return true
}

// reset ends stream id as reset on both sides.
func (g *meshGuard) reset(id uint32) {
	f := rstFrame(id)
	g.mu.Lock()
	g.outQ = append(g.outQ, f...)
	g.inQ = append(g.inQ, f...)
	g.mu.Unlock()
	g.inReady.Store(true)
	g.wake()
}

// refuse resets stream id, one the peer opened, toward the peer, and
// toward the local yamux too if local (it took the stream). False, with
// nothing queued, when maxRefusals wait to be written already: the
// session must be cut. The first such refusal counts the limit.
func (g *meshGuard) refuse(id uint32, local bool) bool {
	f := rstFrame(id)
	g.mu.Lock()
	if g.refusals >= g.maxRefusals {
		first := !g.flooded
		g.flooded = true
		g.mu.Unlock()
		if first {
			g.hit(LimitRefusals)
		}
		return false
	}
	g.refusals++
	g.outQ = append(g.outQ, f...)
	if local {
		g.inQ = append(g.inQ, f...)
	}
	g.mu.Unlock()
	if local {
		g.inReady.Store(true)
	}
	g.wake()
	return true
}

func (g *meshGuard) wake() {
	select {
	case g.kick <- struct{}{}:
	default:
	}
}

// flusher writes the queued frames toward the peer when yamux writes
// nothing (the send loop writes them itself at its next frame boundary).
// It ends when done is closed.
func (g *meshGuard) flusher(done <-chan struct{}) {
	for {
		select {
		case <-g.kick:
		case <-done:
			return
		}
		g.wmu.Lock()
		err := g.flushLocked()
		g.wmu.Unlock()
		if err != nil {
			return
		}
	}
}

// flushLocked writes the queued frames at a frame boundary (wmu held).
func (g *meshGuard) flushLocked() error {
	if g.wHdrN != 0 || g.wBody != 0 {
		return nil
	}
	g.mu.Lock()
	q := g.outQ
	g.outQ, g.pendingAcks, g.refusals, g.pingQueued = nil, 0, 0, false
	g.mu.Unlock()
	if len(q) == 0 {
		return nil
	}
	_, err := g.Conn.Write(q)
	return err
}

func (g *meshGuard) Write(b []byte) (int, error) {
	g.wmu.Lock()
	defer g.wmu.Unlock()
	if err := g.flushLocked(); err != nil {
		return 0, err
	}
	g.scanOut(b)
	n, err := g.Conn.Write(b)
	if err != nil {
		return n, err
	}
	return n, g.flushLocked()
}

// scanOut follows the frames yamux writes: where they end.
func (g *meshGuard) scanOut(b []byte) {
	for len(b) > 0 {
		if g.wBody > 0 {
			k := min(uint32(len(b)), g.wBody)
			g.wBody -= k
			b = b[k:]
			continue
		}
		k := copy(g.wHdr[g.wHdrN:], b)
		g.wHdrN += k
		b = b[k:]
		if g.wHdrN < YamuxHeaderLen {
			return
		}
		g.wHdrN = 0
		if g.wHdr[1] == yamuxTypeData {
			g.wBody = binary.BigEndian.Uint32(g.wHdr[8:])
		}
	}
}

// atBoundary reports whether the bytes passed to yamux end at a frame's
// end.
func (g *meshGuard) atBoundary() bool { return g.hdrN == 0 && g.body == 0 && len(g.pend) == 0 }

func (g *meshGuard) Read(p []byte) (int, error) {
	for {
		if g.atBoundary() && g.inReady.Load() {
			g.mu.Lock()
			n := copy(p, g.inQ)
			g.inQ = g.inQ[n:]
			if len(g.inQ) == 0 {
				g.inQ = nil
				g.inReady.Store(false)
			}
			g.mu.Unlock()
			if n > 0 {
				return n, nil
			}
		}
		if g.rawOff == g.rawEnd && len(g.pend) == 0 {
			if g.rerr != nil {
				return 0, g.rerr
			}
			if g.body > 0 && !g.dropBody {
				// Inside a data frame's body: straight into p, as large a
				// read as yamux asks for (a bulk transfer does not pay a
				// read and a copy per 4 KiB).
				n, err := g.Conn.Read(p[:min(len(p), int(min(g.body, 1<<30)))])
				if n > 0 {
					g.last.Store(flow.Mono())
					g.body -= uint32(n)
					g.passed(n)
				}
				if n > 0 || err != nil {
					return n, err
				}
				continue
			}
			n, err := g.Conn.Read(g.raw[:])
			if n > 0 {
				g.last.Store(flow.Mono())
			}
			g.rawOff, g.rawEnd, g.rerr = 0, n, err
			continue
		}
		n, err := g.filter(p)
		if n > 0 || err != nil {
			return n, err
		}
	}
}

// filter passes the buffered bytes on into p, frame by frame, holding
// back what the guard refuses. It stops at a frame boundary when a frame
// waits to be put in.
func (g *meshGuard) filter(p []byte) (int, error) {
	out := 0
	for out < len(p) {
		if len(g.pend) > 0 {
			k := copy(p[out:], g.pend)
			g.pend = g.pend[k:]
			out += k
			continue
		}
		if g.rawOff == g.rawEnd || (g.atBoundary() && g.inReady.Load()) {
			break
		}
		avail := g.raw[g.rawOff:g.rawEnd]
		if g.body > 0 {
			k := min(uint32(len(avail)), g.body)
			if !g.dropBody {
				k = uint32(copy(p[out:], avail[:k]))
				out += int(k)
				g.passed(int(k))
			}
			g.body -= k
			g.rawOff += int(k)
			continue
		}
		k := copy(g.hdr[g.hdrN:], avail)
		g.hdrN += k
		g.rawOff += k
		if g.hdrN < YamuxHeaderLen {
			continue
		}
		g.hdrN = 0
		keep, err := g.inbound()
		if err != nil {
			return out, err
		}
		if keep {
			g.pend = g.pendBuf[:]
			copy(g.pend, g.hdr[:])
		}
	}
	return out, nil
}

// passed counts n body bytes passed on to yamux.
func (g *meshGuard) passed(n int) {
	if g.linkBody {
		g.linkIn.Add(int64(n))
	}
}

// inbound judges a frame header from the peer: whether it is passed on.
func (g *meshGuard) inbound() (bool, error) {
	h := g.hdr[:]
	typ, flags := h[1], binary.BigEndian.Uint16(h[2:])
	id, length := binary.BigEndian.Uint32(h[4:]), binary.BigEndian.Uint32(h[8:])
	if h[0] != 0 {
		return true, nil // yamux refuses the version itself
	}
	g.dropBody = false
	if typ == yamuxTypeData {
		g.body = length
		// The egress (yamux's client: odd ids) opens the links' streams,
		// the ingress only its status stream.
		g.linkBody = id%2 == 1
	}
	switch {
	case typ == YamuxTypePing && flags&YamuxFlagSYN != 0:
		if !g.answer(length) {
			g.hit(LimitPings)
			return false, errPingFlood
		}
		g.wake()
		return false, nil
	case typ == YamuxTypePing && flags&yamuxFlagACK != 0 && length&guardPingID != 0:
		return false, nil // the answer to the heartbeat's ping: its bytes were life
	case (typ == yamuxTypeData || typ == yamuxTypeWindowUpdate) && flags&YamuxFlagSYN != 0:
		if g.admit != nil && !g.admit() {
			g.dropBody = true
			if !g.refuse(id, false) {
				return false, errRefusalFlood
			}
			return false, nil
		}
	}
	return true, nil
}

// Close closes the TCP connection: over TLS, no close_notify, which could
// wait on a path that is dead.
func (g *meshGuard) Close() error { return g.tcp.Close() }
