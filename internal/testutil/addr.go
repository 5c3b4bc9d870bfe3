package testutil

import (
	"errors"
	"net"
	"sync"
	"testing"
)

// ClosedAddr returns a loopback address (127.0.0.1:port) that nothing
// listens on: a port the kernel has just handed out and taken back. A dial
// to it is refused; a test may listen on it itself (a proxy's listener, an
// admin server), as nothing else on the machine holds it unless another
// process picks the same port in between.
func ClosedAddr(t testing.TB) string {
	t.Helper()
	addr, err := PickClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	return addr
}

// PickClosedAddr is ClosedAddr for a program (the bench).
//
// No two calls in one process return the same address: a port closed
// again is free for the kernel to hand out at the next bind, and two
// picks made one after the other (a proxy's listener and its admin
// server) came back the same in a CI run. A port handed out before is
// held open while the kernel is asked again, so it gives another.
func PickClosedAddr() (string, error) {
	var held []net.Listener
	defer func() {
		for _, ln := range held {
			_ = ln.Close()
		}
	}()
	for range 64 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return "", err
		}
		held = append(held, ln)
		if addr := ln.Addr().String(); picked.take(addr) {
			return addr, nil
		}
	}
	return "", errors.New("64 loopback ports in a row were handed out before")
}

// picked remembers the last pickedMax addresses PickClosedAddr returned.
var picked = pickedSet{seen: map[string]bool{}}

const pickedMax = 4096

type pickedSet struct {
	mu    sync.Mutex
	seen  map[string]bool
	order []string
}

// take records addr and reports whether it was not handed out before.
func (p *pickedSet) take(addr string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.seen[addr] {
		return false
	}
	if len(p.order) == pickedMax {
		delete(p.seen, p.order[0])
		p.order = p.order[1:]
	}
	p.seen[addr] = true
	p.order = append(p.order, addr)
	return true
}
