//go:build linux

package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// child is a process the bench started. It is only ever signalled by its PID.
type child struct {
	name    string
	cmd     *exec.Cmd
	pid     int
	done    chan struct{} // closed when the process has exited
	waitErr error         // valid after done is closed
	logPath string        // its stdout/stderr (server: stderr only)
	stdin   io.WriteCloser
}

// startChild starts cmd with the given CPU affinity (nil: inherit). The
// child is started from an OS thread temporarily pinned to cpus, so it
// inherits the mask from its first instruction on (a Go child then sizes
// GOMAXPROCS from it); pinTasks re-applies it to every thread afterwards.
// Pdeathsig kills the child if the bench dies without stopping it.
func startChild(name string, cmd *exec.Cmd, cpus *unix.CPUSet, logPath string) (*child, error) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if logPath != "" {
		f, err := os.Create(logPath)
		if err != nil {
			return nil, err
		}
		defer f.Close() // the child has its own copy of the descriptor
		if cmd.Stdout == nil {
			cmd.Stdout = f
		}
		cmd.Stderr = f
	}
	if err := startWithAffinity(cmd, cpus); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c := &child{name: name, cmd: cmd, pid: cmd.Process.Pid, done: make(chan struct{}), logPath: logPath}
	go c.wait()
	if cpus != nil {
		if err := pinTasks(c.pid, cpus); err != nil {
			c.stop()
			return nil, fmt.Errorf("pin %s: %w", name, err)
		}
	}
	return c, nil
}

func startWithAffinity(cmd *exec.Cmd, cpus *unix.CPUSet) error {
	if cpus == nil {
		return cmd.Start()
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var old unix.CPUSet
	if err := unix.SchedGetaffinity(0, &old); err != nil {
		return err
	}
	if err := unix.SchedSetaffinity(0, cpus); err != nil {
		return err
	}
	err := cmd.Start()
	if rerr := unix.SchedSetaffinity(0, &old); rerr != nil {
		return errors.Join(err, rerr)
	}
	return err
}

// wait reaps the child; it runs on its own goroutine for the child's life.
func (c *child) wait() {
	c.waitErr = c.cmd.Wait()
	close(c.done)
}

func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// stop ends the child: EOF on stdin (the server's own signal to leave),
// then SIGTERM, then SIGKILL, each to c.pid only, each with a bounded wait.
func (c *child) stop() {
	if c.stdin != nil {
		_ = c.stdin.Close()
		if c.waitFor(2 * time.Second) {
			return
		}
	}
	if c.exited() {
		return
	}
	_ = syscall.Kill(c.pid, syscall.SIGTERM)
	if c.waitFor(3 * time.Second) {
		return
	}
	_ = syscall.Kill(c.pid, syscall.SIGKILL)
	c.waitFor(3 * time.Second)
}

func (c *child) waitFor(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-c.done:
		return true
	case <-t.C:
		return false
	}
}

// logTail returns the last lines of the child's output, for error messages.
func (c *child) logTail() string {
	if c.logPath == "" {
		return ""
	}
	b, _ := os.ReadFile(c.logPath)
	return tailLines(string(b), 5)
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

// pinTasks sets the affinity of every thread of pid (sched_setaffinity
// applies to one thread; threads created later inherit from their creator).
func pinTasks(pid int, cpus *unix.CPUSet) error {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return err
	}
	pinned := 0
	var firstErr error
	for _, e := range ents {
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if err := unix.SchedSetaffinity(tid, cpus); err != nil {
			if firstErr == nil && !errors.Is(err, unix.ESRCH) {
				firstErr = err
			}
			continue
		}
		pinned++
	}
	if pinned == 0 {
		return fmt.Errorf("no thread of pid %d pinned: %v", pid, firstErr)
	}
	return nil
}

// affinityOf reads back a process's affinity mask as a CPU list.
func affinityOf(pid int) string {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(pid, &set); err != nil {
		return "?"
	}
	return cpuList(&set)
}

func cpuList(set *unix.CPUSet) string {
	var parts []string
	for i := 0; i < 1024; i++ {
		if set.IsSet(i) {
			parts = append(parts, strconv.Itoa(i))
		}
	}
	return strings.Join(parts, ",")
}

// clockTicks is USER_HZ, the unit of utime/stime in /proc/PID/stat; Linux
// reports 100 on every architecture Go supports.
const clockTicks = 100

// cpuTime returns utime+stime of the whole process pid (all its threads).
func cpuTime(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may contain spaces; fields after it are
	// plain. After ")": state is field 3, utime field 14, stime field 15.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: too few fields", pid)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, err
	}
	return time.Duration(ut+st) * time.Second / clockTicks, nil
}

// startServer starts the bench server child and returns its address.
func startServer(ctx context.Context, tmp, port string, cpus *unix.CPUSet) (*child, string, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, "", err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), serverEnv+"=1", serverPortEnv+"="+port)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, "", err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, "", err
	}
	c, err := startChild("server", cmd, cpus, filepath.Join(tmp, "server.log"))
	if err != nil {
		return nil, "", err
	}
	c.stdin = stdin
	lines := make(chan string, 1)
	go readFirstLine(stdout, lines)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	select {
	case line := <-lines:
		addr, ok := strings.CutPrefix(line, "LISTEN ")
		if !ok {
			c.stop()
			return nil, "", fmt.Errorf("server: unexpected first line %q (%s)", line, c.logTail())
		}
		return c, addr, nil
	case <-ctx.Done():
		c.stop()
		return nil, "", fmt.Errorf("server did not report its address: %w (%s)", ctx.Err(), c.logTail())
	}
}

// readFirstLine sends the first line of r, then discards the rest until EOF
// so the writer never blocks.
func readFirstLine(r io.Reader, out chan<- string) {
	br := bufio.NewReader(r)
	line, _ := br.ReadString('\n')
	out <- strings.TrimSpace(line)
	_, _ = io.Copy(io.Discard, br)
}

// waitListening waits until addr accepts a connection, the child exits, or
// the timeout passes.
func waitListening(ctx context.Context, addr string, c *child, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		conn, err := dialer.DialContext(ctx, "tcp", addr)
		if err == nil {
			_ = conn.Close()
			return nil
		}
		if c.exited() {
			return fmt.Errorf("%s exited (%v) before listening on %s: %s", c.name, c.waitErr, addr, c.logTail())
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not listening on %s after %v: %v", c.name, addr, timeout, err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
