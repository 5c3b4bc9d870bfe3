package testutil

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"
)

// ClosedAddr is a loopback address whose dial is refused, and one a test
// can then listen on itself.
func TestClosedAddr(t *testing.T) {
	addr := ClosedAddr(t)
	ap, err := netip.ParseAddrPort(addr)
	if err != nil || !ap.Addr().IsLoopback() || ap.Port() == 0 {
		t.Fatalf("ClosedAddr() = %q (%v), want a loopback address with a port", addr, err)
	}
	if c, err := net.Dial("tcp", addr); !errors.Is(err, syscall.ECONNREFUSED) {
		if c != nil {
			c.Close()
		}
		t.Fatalf("dial %s: %v, want connection refused", addr, err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("listen on %s: %v", addr, err)
	}
	ln.Close()
}
