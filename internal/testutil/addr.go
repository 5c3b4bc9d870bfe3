package testutil

import (
	"net"
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
func PickClosedAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	addr := ln.Addr().String()
	return addr, ln.Close()
}
