//go:build linux

package main

import (
	"encoding/binary"
	"net"
	"sort"
	"sync"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/internal/relay"
)

// queryRecord and queryLoad are pinotsim's load generator.
type (
	queryRecord = pinotsim.Record
	queryLoad   = pinotsim.Load
)

// startLoad starts a load that the rig stops at cleanup.
func startLoad(r *rig, b *pinotsim.Broker, addr string, interval time.Duration, max int, maxDuration time.Duration) *queryLoad {
	l := pinotsim.StartLoad(b, addr, interval, max, maxDuration)
	r.cleanup(l.Stop)
	return l
}

// loads are the query loads of one path (one per connection).
type loads []*queryLoad

func (ls loads) records() []queryRecord {
	var out []queryRecord
	for _, l := range ls {
		out = append(out, l.Records()...)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Sent.Before(out[j].Sent) })
	return out
}

func (ls loads) waitOK(t0 time.Time, n int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for _, l := range ls {
		if !l.WaitOK(t0, n, time.Until(deadline)) {
			return false
		}
	}
	return true
}

func (ls loads) finish(wait time.Duration) { pinotsim.FinishAll(ls, wait) }

// tally, count, firstOK and recovery are pinotsim's accounting of a load's
// outcomes.
type tally = pinotsim.Tally

var (
	count    = pinotsim.Count
	firstOK  = pinotsim.FirstOK
	recovery = pinotsim.Recovery
)

// closeLog records the connection closes a broker reports.
type closeLog struct {
	mu     sync.Mutex
	closes []pinotsim.ConnClose
}

func (c *closeLog) add(cc pinotsim.ConnClose) {
	c.mu.Lock()
	c.closes = append(c.closes, cc)
	c.mu.Unlock()
}

func (c *closeLog) snapshot() []pinotsim.ConnClose {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]pinotsim.ConnClose(nil), c.closes...)
}

// newBroker returns an unmodified-Pinot-style broker, closed at the end.
func newBroker(r *rig, id string, timeout time.Duration, requestSize int, closes *closeLog) *pinotsim.Broker {
	cfg := pinotsim.BrokerConfig{ID: id, Timeout: timeout, RequestSize: requestSize}
	if closes != nil {
		cfg.OnClose = closes.add
	}
	b := pinotsim.NewBroker(cfg)
	r.cleanup(func() { _ = b.Close() })
	return b
}

// tap is a measuring relay in front of a target: each connection accepted
// becomes one connection dialled to the target, and the request frames
// (4-byte big-endian length prefix) forwarded on it are time-stamped. It
// tells which connection each query went out on, which a broker does not
// report. A failed dial resets the accepted connection, so a refused
// target still looks refused; a close on either side closes both.
type tap struct {
	r *relay.Relay

	mu    sync.Mutex
	conns []*tapConn
}

// tapConn is one relayed connection: Dialed is when the connection to the
// target was established, Frames when each request frame was forwarded.
type tapConn struct {
	Dialed time.Time
	down   net.Conn
	up     net.Conn

	mu     sync.Mutex
	frames []time.Time
}

func startTap(r *rig, target string) (*tap, error) {
	t := &tap{}
	rl, err := relay.Start(target, 2*time.Second, t.relay)
	if err != nil {
		return nil, err
	}
	t.r = rl
	r.cleanup(rl.Close)
	return t, nil
}

func (t *tap) addr() string { return t.r.Addr() }

// relay forwards one connection: responses copied as they are, requests
// stamped frame by frame.
func (t *tap) relay(down, up net.Conn) {
	tc := &tapConn{Dialed: time.Now(), down: down, up: up}
	t.mu.Lock()
	t.conns = append(t.conns, tc)
	t.mu.Unlock()
	done := make(chan struct{})
	go func() { // responses: copied as they are
		defer close(done)
		buf := make([]byte, 32<<10)
		for {
			n, err := up.Read(buf)
			if n > 0 {
				if _, werr := down.Write(buf[:n]); werr != nil {
					break
				}
			}
			if err != nil {
				break
			}
		}
		_ = down.Close()
		_ = up.Close()
	}()
	tc.forwardRequests()
	_ = down.Close()
	_ = up.Close()
	<-done
}

// forwardRequests copies the request direction, stamping each frame when
// the write that carries its first byte completed.
func (tc *tapConn) forwardRequests() {
	buf := make([]byte, 64<<10)
	var hdr [4]byte
	hdrN := 0      // header bytes of the current frame seen
	var body int64 // body bytes of the current frame still to come
	for {
		n, err := tc.down.Read(buf)
		if n > 0 {
			starts := 0
			for p := buf[:n]; len(p) > 0; {
				if body > 0 {
					k := min(int64(len(p)), body)
					body -= k
					p = p[k:]
					continue
				}
				if hdrN == 0 {
					starts++
				}
				k := copy(hdr[hdrN:], p)
				hdrN += k
				p = p[k:]
				if hdrN == 4 {
					body = int64(binary.BigEndian.Uint32(hdr[:]))
					hdrN = 0
				}
			}
			if _, werr := tc.up.Write(buf[:n]); werr != nil {
				return
			}
			if starts > 0 {
				now := time.Now()
				tc.mu.Lock()
				for range starts {
					tc.frames = append(tc.frames, now)
				}
				tc.mu.Unlock()
			}
		}
		if err != nil {
			return
		}
	}
}

// framesOnOlder counts the request frames forwarded at or after t0 on
// connections dialled before t0, and how many such connections carried
// them.
func (t *tap) framesOnOlder(t0 time.Time) (frames, conns int) {
	t.mu.Lock()
	cs := append([]*tapConn(nil), t.conns...)
	t.mu.Unlock()
	for _, c := range cs {
		if !c.Dialed.Before(t0) {
			continue
		}
		c.mu.Lock()
		n := 0
		for _, f := range c.frames {
			if !f.Before(t0) {
				n++
			}
		}
		c.mu.Unlock()
		frames += n
		if n > 0 {
			conns++
		}
	}
	return frames, conns
}
