package demo

import (
	"net"
	"sync"

	"github.com/livenessproxy/livenessproxy/internal/relay"
)

// flapRelay stands in for the network between the clients (the direct
// broker, the proxy) and the server: each accepted connection is forwarded
// to the server's address on a connection of its own. Stall is the node
// flap's drop rule: from then on nothing more is forwarded on the
// connections open at that moment, in either direction, and nothing is
// closed: not a FIN, not a reset, whatever either end does. Connections
// accepted after Stall are forwarded normally (new connections reach the
// restarted server).
type flapRelay struct {
	r    *relay.Relay
	done chan struct{} // closed by close: stalled pumps may end
	once sync.Once

	mu    sync.Mutex
	conns []*relayConn
}

type relayConn struct {
	mu      sync.Mutex
	stalled bool
}

func (c *relayConn) isStalled() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stalled
}

func newRelay(target string) (*flapRelay, error) {
	fr := &flapRelay{done: make(chan struct{})}
	r, err := relay.Start(target, 0, fr.forward)
	if err != nil {
		return nil, err
	}
	fr.r = r
	return fr, nil
}

func (fr *flapRelay) addr() string { return fr.r.Addr() }

// forward pumps both directions of one relayed connection until both end.
func (fr *flapRelay) forward(down, up net.Conn) {
	c := &relayConn{}
	fr.mu.Lock()
	fr.conns = append(fr.conns, c)
	fr.mu.Unlock()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); fr.pump(c, down, up) }()
	go func() { defer wg.Done(); fr.pump(c, up, down) }()
	wg.Wait()
}

// pump copies src to dst until either fails. Once the connection is
// stalled it forwards nothing more, not even an error or an EOF: it waits,
// holding both sockets open, until the relay closes.
func (fr *flapRelay) pump(c *relayConn, src, dst net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if c.isStalled() {
			<-fr.done
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
func (fr *flapRelay) stall() int {
	fr.mu.Lock()
	defer fr.mu.Unlock()
	for _, c := range fr.conns {
		c.mu.Lock()
		c.stalled = true
		c.mu.Unlock()
	}
	return len(fr.conns)
}

// close stops accepting, closes every connection and waits for the
// relay's goroutines.
func (fr *flapRelay) close() {
	fr.once.Do(func() {
		close(fr.done)
		fr.r.Close()
	})
}
