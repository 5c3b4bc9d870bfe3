package testutil

import (
	"errors"
	"os"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// FillDescriptors brings the process to its descriptor limit but leave
// free descriptor numbers: it lowers RLIMIT_NOFILE to a little above the
// descriptors open, opens /dev/null until EMFILE, then closes leave of
// them. restore closes the rest and puts the limit back; t.Cleanup calls
// it too. Nothing else of the test may open a descriptor meanwhile (an
// exec, a log file) or it fails for want of one.
func FillDescriptors(t testing.TB, leave int) (restore func()) {
	t.Helper()
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	top := 0
	for _, e := range ents {
		var fd int
		for _, c := range e.Name() {
			fd = fd*10 + int(c-'0')
		}
		top = max(top, fd)
	}
	low := lim
	low.Cur = uint64(top + 16 + leave)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	var fds []int
	var once sync.Once
	restore = func() {
		once.Do(func() {
			for _, fd := range fds {
				_ = unix.Close(fd)
			}
			_ = unix.Setrlimit(unix.RLIMIT_NOFILE, &lim)
		})
	}
	t.Cleanup(restore)
	for {
		fd, err := unix.Open(os.DevNull, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.EMFILE) {
			break
		}
		if err != nil || len(fds) > int(low.Cur) {
			restore()
			t.Fatalf("filling descriptors: %v after %d", err, len(fds))
		}
		fds = append(fds, fd)
	}
	for range min(leave, len(fds)) {
		_ = unix.Close(fds[len(fds)-1])
		fds = fds[:len(fds)-1]
	}
	return restore
}
