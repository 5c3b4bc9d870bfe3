//go:build linux

package testutil

import (
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// WaitTCPState waits up to 5 s until the kernel has c in TCP state want
// (unix.BPF_TCP_*: CLOSE_WAIT once the peer's FIN is in, CLOSE once a
// reset is), and fails the test otherwise.
func WaitTCPState(t testing.TB, c *net.TCPConn, want uint8) {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		var state uint8
		_ = rc.Control(func(fd uintptr) {
			if ti, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
				state = ti.State
			}
		})
		if state == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("socket in TCP state %d after 5 s, want %d", state, want)
		}
		time.Sleep(time.Millisecond)
	}
}
