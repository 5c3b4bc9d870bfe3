//go:build linux

package testutil

import (
	"net"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// WaitTCPState waits up to 5 s until the kernel has c in TCP state want
// (unix.BPF_TCP_*: CLOSE_WAIT once the peer's FIN is in, CLOSE once a
// reset is), and fails the test otherwise.
func WaitTCPState(t testing.TB, c *net.TCPConn, want uint8) {
	t.Helper()
	waitSock(t, c, "in TCP state", int(want), func(fd int) int {
		if ti, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			return int(ti.State)
		}
		return -1
	})
}

// WaitUnread waits up to 5 s until c's receive queue holds n bytes
// (SIOCINQ), and fails the test otherwise.
func WaitUnread(t testing.TB, c *net.TCPConn, n int) {
	t.Helper()
	waitSock(t, c, "with bytes unread", n, func(fd int) int {
		if v, err := unix.IoctlGetInt(fd, unix.SIOCINQ); err == nil {
			return v
		}
		return -1
	})
}

// waitSock waits up to 5 s until probe of c's descriptor says want (-1:
// the kernel did not say), and fails the test otherwise.
func waitSock(t testing.TB, c *net.TCPConn, what string, want int, probe func(fd int) int) {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		got := -1
		_ = rc.Control(func(fd uintptr) { got = probe(int(fd)) })
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("socket %s %d after 5 s, want %d", what, got, want)
		}
		time.Sleep(time.Millisecond)
	}
}

// ResetBehind has c send last and then a reset right behind it: once s
// holds last unread, c closes with SO_LINGER 0, and the call returns once
// the reset is in at s (TCP state CLOSE), last still queued there.
func ResetBehind(t testing.TB, c, s *net.TCPConn, last []byte) {
	t.Helper()
	if _, err := c.Write(last); err != nil {
		t.Fatal(err)
	}
	WaitUnread(t, s, len(last))
	_ = c.SetLinger(0)
	_ = c.Close()
	WaitTCPState(t, s, unix.BPF_TCP_CLOSE)
}

// SendUrgent sends before, then the byte mark as urgent data (MSG_OOB),
// then after (when not empty), in one segment (corked), so that all of it
// is in the peer's receive queue before its reader's next read: that read
// stops short at the urgent mark, with after behind it.
func SendUrgent(t testing.TB, c syscall.Conn, before string, mark byte, after string) {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	_ = rc.Control(func(fd uintptr) {
		if serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_CORK, 1); serr != nil {
			return
		}
		if serr = unix.Send(int(fd), append([]byte(before), mark), unix.MSG_OOB); serr != nil {
			return
		}
		if after != "" {
			if _, serr = unix.Write(int(fd), []byte(after)); serr != nil {
				return
			}
		}
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_CORK, 0)
	})
	if serr != nil {
		t.Fatal(serr)
	}
}
