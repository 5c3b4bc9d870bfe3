package main

import (
	"bytes"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/policy"
)

// On a terminal (a pseudo-terminal here) the console format is coloured;
// on anything else it is not.
func TestConsoleColourOnlyOnATerminal(t *testing.T) {
	ptmx, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pseudo-terminals here: %v", err)
	}
	defer ptmx.Close()
	if err := unix.IoctlSetPointerInt(int(ptmx.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Skipf("unlockpt: %v", err)
	}
	n, err := unix.IoctlGetInt(int(ptmx.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Skipf("ptsname: %v", err)
	}
	pts, err := os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("open the pseudo-terminal: %v", err)
	}
	defer pts.Close()

	if !isTerminal(pts) || isTerminal(&bytes.Buffer{}) {
		t.Fatalf("isTerminal: pts %v, buffer %v", isTerminal(pts), isTerminal(&bytes.Buffer{}))
	}
	log := newLogger(policy.Log{Level: "info", Format: "console"}, "", pts)
	log.Error().Str("k", "v").Msg("coloured")
	_ = ptmx.SetReadDeadline(time.Now().Add(2 * time.Second))
	var got []byte
	buf := make([]byte, 4096)
	for !bytes.Contains(got, []byte("coloured")) || !bytes.Contains(got, []byte("\n")) {
		n, err := ptmx.Read(buf)
		got = append(got, buf[:n]...)
		if err != nil {
			break
		}
	}
	if !strings.Contains(string(got), "coloured") || !strings.Contains(string(got), "\x1b[") {
		t.Fatalf("console output on a terminal %q: want colour", got)
	}
}
