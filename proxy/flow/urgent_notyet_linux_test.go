//go:build linux

package flow

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/netns"
)

// countingDeadliner counts the read deadlines a reader sets.
type countingDeadliner struct {
	c *net.TCPConn
	n atomic.Int64
}

func (d *countingDeadliner) SetReadDeadline(t time.Time) error {
	d.n.Add(1)
	return d.c.SetReadDeadline(t)
}

// countingSink takes every byte it is given.
type countingSink struct{ n atomic.Int64 }

func (*countingSink) Limit() int { return ChunkSize }
func (s *countingSink) Handle(_ *[]byte, n int) (Handled, error) {
	s.n.Add(int64(n))
	return HandledMore, nil
}

// A reader at an urgent mark whose byte has not arrived (the kernel has
// the urgent pointer, the byte's segment was lost: TCP_URG_NOTYET) waits
// for the byte's edge and sets no wake-up of its own; the read made again
// at the mark, and the wake-up after 64 of them, are for a byte that is
// there (a signal pending made the read return EAGAIN). Before, the
// wake-up came every millisecond for as long as the byte was missing (710
// wake-ups in a second, a quarter of a core). Once the byte arrives, the
// bytes behind it are read.
//
// In a namespace of the test's own, an nft rule drops the one segment that
// carries the urgent byte (MSS 200: the sender's last byte goes alone).
func TestUrgentByteNotYetArrivedIsWaitedFor(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	// The short segments that carry the urgent pointer: the urgent byte
	// (and what follows it); the segment of MSS bytes before it passes.
	if err := netns.LocalNFT(fmt.Sprintf(`table ip lpurg {
	chain out { type filter hook output priority 0; policy accept; tcp dport %d tcp flags & urg == urg ip length < 100 counter drop; }
}
`, port)); err != nil {
		t.Fatal(err)
	}
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { _ = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_MAXSEG, 200) })
	}}
	cc, err := d.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ac, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer ac.Close()
	c, s := cc.(*net.TCPConn), ac.(*net.TCPConn)
	crc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	mss := 0
	_ = crc.Control(func(fd uintptr) { mss, _ = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_MAXSEG) })

	var r SockReader
	if err := r.Init(s); err != nil {
		t.Fatal(err)
	}
	wake := &countingDeadliner{c: s}
	r.SetResetWatch(&fakeWatch{}, wake)
	r.reported.Store(true) // an earlier urgent byte on this socket was reported
	sink := &countingSink{}
	var wakeups atomic.Int64
	done := make(chan error, 1)
	go func() {
		for {
			_, _, err, werr := r.ReadEach(sink)
			if errors.Is(err, os.ErrDeadlineExceeded) { // as tcpEnd.park takes it: read on
				wakeups.Add(1)
				_ = s.SetReadDeadline(time.Time{})
				continue
			}
			done <- errors.Join(err, werr)
			return
		}
	}()
	var serr error
	_ = crc.Control(func(fd uintptr) { serr = unix.Send(int(fd), make([]byte, mss+1), unix.MSG_OOB) })
	if serr != nil {
		t.Fatal(serr)
	}
	if _, err := c.Write([]byte("zz")); err != nil { // behind the missing byte
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for sink.n.Load() < int64(mss) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := sink.n.Load(); got != int64(mss) {
		t.Fatalf("read %d bytes before the urgent mark, want %d", got, mss)
	}
	// The reader now waits at the mark, the byte missing: for a second,
	// no wake-up of its own.
	time.Sleep(time.Second)
	if n := wakeups.Load(); n != 0 {
		t.Fatalf("%d wake-ups while the urgent byte had not arrived (%d deadlines set), want none: its arrival is an edge", n, wake.n.Load())
	}
	// The byte comes (the sender retransmits it): the bytes behind it are
	// read, the urgent byte itself out of band.
	if err := netns.LocalNFT("delete table ip lpurg\n"); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); sink.n.Load() < int64(mss+2) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if got := sink.n.Load(); got != int64(mss+2) {
		t.Fatalf("read %d bytes after the urgent byte came, want %d (all but it)", got, mss+2)
	}
	_ = s.Close()
	<-done
}
