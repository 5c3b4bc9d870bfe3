package demo

import (
	"net"
	"sync"
)

// relay stands in for the network between the clients (the direct broker,
// the proxy) and the server: each accepted connection is forwarded to the
// server's address on a connection of its own. Stall is the node flap's
// drop rule: from then on nothing more is forwarded on the connections open
// at that moment, in either direction, and nothing is closed: not a FIN,
// not a reset, whatever either end does. Connections accepted after Stall
// are forwarded normally (new connections reach the restarted server).
type relay struct {
	ln     net.Listener
	target string
	done   chan struct{} // closed by close: stalled pumps may end
	wg     sync.WaitGroup

	mu     sync.Mutex
	conns  []*relayConn
	closed bool
}

type relayConn struct {
	down, up net.Conn
	mu       sync.Mutex
	stalled  bool
}

func (c *relayConn) isStalled() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stalled
}

func newRelay(target string) (*relay, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &relay{ln: ln, target: target, done: make(chan struct{})}
	r.wg.Add(1)
	go r.accept()
	return r, nil
}

func (r *relay) addr() string { return r.ln.Addr().String() }

func (r *relay) accept() {
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

func (r *relay) serve(down net.Conn) {
	defer r.wg.Done()
	up, err := net.Dial("tcp", r.target)
	if err != nil {
		// The server is not there: look refused, as the server's own
		// address would.
		if tc, ok := down.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		_ = down.Close()
		return
	}
	c := &relayConn{down: down, up: up}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		_ = up.Close()
		_ = down.Close()
		return
	}
	r.conns = append(r.conns, c)
	r.mu.Unlock()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); r.pump(c, c.down, c.up) }()
	go func() { defer wg.Done(); r.pump(c, c.up, c.down) }()
	wg.Wait()
	_ = up.Close()
	_ = down.Close()
}

// pump copies src to dst until either fails. Once the connection is
// stalled it forwards nothing more, not even an error or an EOF: it waits,
// holding both sockets open, until the relay closes.
func (r *relay) pump(c *relayConn, src, dst net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if c.isStalled() {
			<-r.done
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				err = werr
			}
		}
		if err != nil {
			_ = src.Close()
			_ = dst.Close()
			return
		}
	}
}

// stall stops forwarding on every connection open now and returns how
// many there were.
func (r *relay) stall() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.conns {
		c.mu.Lock()
		c.stalled = true
		c.mu.Unlock()
	}
	return len(r.conns)
}

// close stops accepting, closes every connection and waits for the
// relay's goroutines.
func (r *relay) close() {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	cs := append([]*relayConn(nil), r.conns...)
	r.mu.Unlock()
	close(r.done)
	_ = r.ln.Close()
	for _, c := range cs {
		_ = c.down.Close()
		_ = c.up.Close()
	}
	r.wg.Wait()
}
