package proxy

import (
	"fmt"
	"os"
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// epollSet is the parker's epoll instance. Its descriptor is itself
// registered in the Go runtime's poller (os.NewFile of a non-blocking
// descriptor), and run waits in a RawConn.Read callback on it, as
// test/bench/floor's loop does: no OS thread ever blocks in epoll_wait.
type epollSet struct {
	fd     int
	f      *os.File
	rc     syscall.RawConn
	wake   func(key uint64)
	events [64]unix.EpollEvent
	err    error
}

func newEpollSet() (*epollSet, error) {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("epoll_create1", err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		_ = unix.Close(fd)
		return nil, os.NewSyscallError("fcntl", err)
	}
	s := &epollSet{fd: fd, f: os.NewFile(uintptr(fd), "parker-epoll")}
	if s.rc, err = s.f.SyscallConn(); err != nil {
		_ = s.f.Close()
		return nil, err
	}
	return s, nil
}

// run hands each socket that became ready to wake, until close.
//
// No wake-up is lost: an event that arrives after the callback's last
// epoll_wait puts its socket on this set's ready list, which makes the
// set's descriptor readable, an edge the runtime's epoll records for it;
// RawConn.Read clears the recorded readiness only once, when it starts,
// so its wait after the callback returns false sees that edge and calls
// the callback again at once.
func (s *epollSet) run(wake func(key uint64)) error {
	s.wake = wake
	err := s.rc.Read(s.poll)
	runtime.KeepAlive(s.f)
	if err != nil {
		return fmt.Errorf("waiting on the epoll set: %w", err)
	}
	return s.err
}

// poll is run's RawConn.Read callback.
func (s *epollSet) poll(uintptr) bool {
	for {
		r, _, e := syscall.RawSyscall6(syscall.SYS_EPOLL_PWAIT, uintptr(s.fd),
			uintptr(unsafe.Pointer(&s.events[0])), uintptr(len(s.events)), 0, 0, 0)
		if e == syscall.EINTR {
			continue
		}
		if e != 0 {
			s.err = os.NewSyscallError("epoll_pwait", e)
			return true
		}
		for i := range int(r) {
			ev := &s.events[i]
			s.wake(uint64(uint32(ev.Pad))<<32 | uint64(uint32(ev.Fd)))
		}
		if int(r) < len(s.events) {
			return false
		}
	}
}

// watch waits once for fd to be readable (or to have a FIN or an error),
// reported with key: one-shot and level-triggered, so that what is in the
// receive queue already is reported at once. fd stays in the set,
// disarmed, after its event (the next watch re-arms it) and leaves it
// when it is closed.
func (s *epollSet) watch(fd int, key uint64) error {
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLONESHOT,
		Fd: int32(uint32(key)), Pad: int32(uint32(key >> 32))}
	err := unix.EpollCtl(s.fd, unix.EPOLL_CTL_MOD, fd, &ev)
	if err == unix.ENOENT {
		err = unix.EpollCtl(s.fd, unix.EPOLL_CTL_ADD, fd, &ev)
	}
	if err != nil {
		return os.NewSyscallError("epoll_ctl", err)
	}
	return nil
}

// watchEnd waits once for fd's end (the peer's FIN, EPOLLRDHUP; an
// error or a shutdown both ways, EPOLLERR and EPOLLHUP, which epoll
// reports whatever else is asked) or for urgent data (EPOLLPRI), reported
// with key: one-shot, level-triggered (what is there already is reported
// at once), and nothing for bytes. fd leaves the set when it is closed.
func (s *epollSet) watchEnd(fd int, key uint64) error {
	ev := unix.EpollEvent{Events: unix.EPOLLRDHUP | unix.EPOLLPRI | unix.EPOLLONESHOT, Fd: int32(uint32(key)), Pad: int32(uint32(key >> 32))}
	if err := unix.EpollCtl(s.fd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		return os.NewSyscallError("epoll_ctl", err)
	}
	return nil
}

// close ends run.
func (s *epollSet) close() { _ = s.f.Close() }
