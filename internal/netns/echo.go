//go:build linux

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
	ServeEcho(t, ln)
	return ln.Addr()
}

// ServeEcho echoes every connection ln accepts until stop, or the test's
// end: stop closes ln and every accepted connection (a server process
// going away) and waits for every goroutine it started. Closing ln alone
// leaves the connections it accepted open.
func ServeEcho(t testing.TB, ln net.Listener) (stop func()) {
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
	var once sync.Once
	stop = func() {
		once.Do(func() {
			_ = ln.Close()
			mu.Lock()
			for _, c := range conns {
				_ = c.Close()
			}
			mu.Unlock()
			wg.Wait()
		})
	}
	t.Cleanup(stop)
	return stop
}
