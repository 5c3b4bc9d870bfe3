// Package relay is a TCP relay on loopback that stands in for the network
// in front of a target: each connection it accepts becomes one connection
// of its own to the target, and a handler moves the bytes. The demo's
// node-flap relay and the incident replays' measuring tap are relays with
// handlers of their own.
package relay

import (
	"net"
	"sync"
	"time"
)

// Handler moves the bytes of one relayed connection: down is the accepted
// connection, up the one dialled to the target. It runs in the relay's
// goroutine for that connection and returns once it is done with both;
// the relay then closes both. Close closes both too, so a handler blocked
// reading either returns.
type Handler func(down, up net.Conn)

// Relay accepts on a loopback port and relays each connection to target.
// A failed dial resets the accepted connection, so a target that refuses
// still looks refused through the relay.
type Relay struct {
	ln      net.Listener
	target  string
	dial    time.Duration
	handler Handler
	wg      sync.WaitGroup

	mu     sync.Mutex
	conns  []net.Conn
	closed bool
}

// Start listens on 127.0.0.1:0 and relays to target, dialling with
// dialTimeout (0: none) and handing each pair to handler. The caller owns
// it: Close ends every goroutine.
func Start(target string, dialTimeout time.Duration, handler Handler) (*Relay, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &Relay{ln: ln, target: target, dial: dialTimeout, handler: handler}
	r.wg.Add(1)
	go r.accept()
	return r, nil
}

// Addr is the relay's listening address: what clients dial.
func (r *Relay) Addr() string { return r.ln.Addr().String() }

func (r *Relay) accept() {
	defer r.wg.Done()
	for {
		down, err := r.ln.Accept()
		if err != nil {
			return
		}
		r.wg.Add(1)
		go r.serve(down)
	}
}

func (r *Relay) serve(down net.Conn) {
	defer r.wg.Done()
	up, err := net.DialTimeout("tcp", r.target, r.dial)
	if err != nil {
		if tc, ok := down.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		_ = down.Close()
		return
	}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		_ = up.Close()
		_ = down.Close()
		return
	}
	r.conns = append(r.conns, down, up)
	r.mu.Unlock()
	r.handler(down, up)
	_ = up.Close()
	_ = down.Close()
}

// Close stops accepting, closes every relayed connection and waits for
// the relay's goroutines (the handlers included). Idempotent.
func (r *Relay) Close() {
	r.mu.Lock()
	r.closed = true
	cs := r.conns
	r.conns = nil
	r.mu.Unlock()
	_ = r.ln.Close()
	for _, c := range cs {
		_ = c.Close()
	}
	r.wg.Wait()
}
