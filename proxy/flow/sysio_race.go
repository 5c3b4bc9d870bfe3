//go:build race && unix

package flow

import "syscall"

// For the race detector, syscall.Write and syscall.Read say that a write
// to a descriptor happens before a read that follows it (a global of
// syscall's own), which the raw calls (SysWrite, SysRead, readInq)
// bypass: a test that reads what the proxy wrote and then looks at the
// proxy's state would be reported as racing with it. Built only with
// -race, these make the same annotations by calling syscall.Write and
// syscall.Read with nothing to move: a socket's read of 0 bytes returns 0
// at once without looking at the socket (sock_read_iter), and a write of
// 0 bytes sends nothing (an error it may return is of no interest here:
// the annotation comes before the call).

func raceReleaseIO(fd int) { _, _ = syscall.Write(fd, nil) }

func raceAcquireIO(fd int) { _, _ = syscall.Read(fd, nil) }
