//go:build race && unix

package flow

import (
	"runtime"
	"syscall"
	"unsafe"
)

// For the race detector, syscall.Write and syscall.Read say that a write
// happens before a read that follows it (through a global of syscall's
// own), and that the buffer was read or written. The raw calls (SysRead,
// SysWrite, SysWritev) bypass both: a test that reads what the
// proxy wrote and then looks at the proxy's state would be reported as
// racing with it, and a chunk used after it went back to its pool would go
// unseen. Built only with -race, these make the same annotations: the
// ordering by a 0-byte syscall.Write or syscall.Read of /dev/null (never
// of the socket: a 0-byte write to a TCP socket still takes its pending
// error and can raise SIGPIPE, which would make a -race run behave
// otherwise than production), the ranges with runtime.RaceReadRange and
// RaceWriteRange.

var devNull = func() int {
	fd, err := syscall.Open("/dev/null", syscall.O_RDWR|syscall.O_CLOEXEC, 0)
	if err != nil {
		panic("race build: open /dev/null: " + err.Error())
	}
	return fd
}()

// raceReleaseIO: what follows (the write) happens before a read that sees it.
func raceReleaseIO() { _, _ = syscall.Write(devNull, nil) }

// raceAcquireIO: what a read saw happened before what follows.
func raceAcquireIO() { _, _ = syscall.Read(devNull, nil) }

// raceRead: the call reads p.
func raceRead(p []byte) {
	if len(p) > 0 {
		runtime.RaceReadRange(unsafe.Pointer(&p[0]), len(p))
	}
}

// raceWrote: the call wrote p.
func raceWrote(p []byte) {
	if len(p) > 0 {
		runtime.RaceWriteRange(unsafe.Pointer(&p[0]), len(p))
	}
}
