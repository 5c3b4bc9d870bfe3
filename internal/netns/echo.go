package netns

import (
	"io"
	"net"
	"sync"
	"testing"
)

// Echo serves an echo server inside ns on address until the test ends and
// returns its address. t.Cleanup closes the listener and every accepted
// connection and waits for every goroutine it started.
func Echo(t testing.TB, ns *NS, address string) net.Addr {
	t.Helper()
	ln, err := ns.Listen("tcp", address)
	if err != nil {
		t.Fatalf("echo server in the namespace on %s: %v", address, err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return // the listener closed
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, _ = io.Copy(c, c) // ends when c is closed
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr()
}
