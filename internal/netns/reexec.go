//go:build linux

// Package netns lets Go tests inject real network faults (blackholes, resets,
// loss) without root.
//
// A test calls Reexec first. The test binary then re-executes itself, running
// only that test, inside a fresh user namespace (where it is uid 0 and holds
// CAP_NET_ADMIN) and a fresh network namespace with only an "up" loopback:
//
//	func TestSomething(t *testing.T) {
//		if !netns.Reexec(t) {
//			return // the parent: the child already ran (and reported) the test
//		}
//		peer := netns.NewNS(t)                                        // second netns for the server side
//		link := netns.Veth(t, peer, "10.231.0.1/24", "10.231.0.2/24") // wire the two together
//		ln, _ := peer.Listen("tcp", link.PeerIP().String()+":0")      // the socket lives in peer
//		_ = peer.NFT("table inet lpfault { ... drop ... }")           // faults go in the peer's netns
//	}
//
// Everything the child creates (namespaces, veths, nft tables) belongs to
// namespaces that die with the child process, so nothing leaks to the host
// even if the test crashes. Drop rules belong in the peer namespace: a drop
// in the local OUTPUT chain keeps data unsent rather than simulating a
// remote blackhole.
package netns

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// ChildEnv is the environment variable set in a re-executed child. Its value
// is the full name (t.Name()) of the test the child was started for.
const ChildEnv = "LIVENESSPROXY_NETNS_CHILD"

const (
	// defaultChildTimeout bounds the child when the parent has no deadline
	// (go test -timeout 0).
	defaultChildTimeout = 10 * time.Minute
	// waitDelay bounds how long the parent keeps reading the child's output
	// after the child exited (or was killed), in case a grandchild still
	// holds the pipe.
	waitDelay = 5 * time.Second
)

// Inside reports whether this process is a child started by Reexec, i.e.
// whether it runs in a private user and network namespace. Helpers that
// change network configuration (Veth, LocalNFT) refuse to run otherwise so
// that they can never touch the host's network.
func Inside() bool { return os.Getenv(ChildEnv) != "" }

// Reexec runs the current test in a new user and network namespace.
//
// In the child process that Reexec started for this test (or for one of its
// ancestor tests) it makes sure lo is up and returns true: the caller then
// runs the test body. Otherwise it re-executes /proc/self/exe with
// -test.run=^<this test>$ -test.v -test.count=1 (plus -test.short and a
// -test.timeout slightly below the parent's remaining time) under
// CLONE_NEWUSER|CLONE_NEWNET, mapping uid/gid 0 in the child to the caller's
// uid/gid. The child's output is streamed to t.Output(), prefixed with
// "child| ". The parent test fails if the child fails or ran no test, is
// skipped if the child skipped, and Reexec returns false so that the caller
// returns without running the body a second time.
//
// If the namespaces cannot be created (EPERM, EINVAL, ENOSPC, ...) the test is
// skipped, or failed under LIVENESSPROXY_REQUIRE_ALL=1 (testutil.SkipOrFail).
//
// Reexec must be called first thing in the test, from the test goroutine.
// Nested calls (a subtest of a re-executed test calling Reexec again) simply
// return true and share the namespace of the ancestor's child. The child
// always runs with -test.v so that its verdict can be parsed; its race
// detector exit delay is disabled (GORACE=atexit_sleep_ms=0) unless GORACE
// already sets it.
//
// In the child, Reexec also requires each of commands
// (testutil.RequireCommand) before it returns true.
func Reexec(t *testing.T, commands ...string) (inside bool) {
	t.Helper()
	name := t.Name()
	if env := os.Getenv(ChildEnv); env != "" && (env == name || strings.HasPrefix(name, env+"/")) {
		if err := linkUp("lo"); err != nil {
			testutil.SkipOrFail(t, "netns: bringing lo up in the child namespace: %v", err)
		}
		for _, c := range commands {
			testutil.RequireCommand(t, c)
		}
		return true
	}

	// /proc/self/exe is the running binary even if the file was replaced or
	// removed since (go test deletes its temporary binaries eagerly).
	const exe = "/proc/self/exe"

	timeout := defaultChildTimeout
	if d, ok := t.Deadline(); ok {
		timeout = time.Until(d)
	}
	// Let the child time out (and dump its goroutines) before we kill it,
	// and kill it before the parent's own deadline panics.
	childTimeout := timeout * 85 / 100
	killAfter := timeout * 95 / 100
	if childTimeout < time.Second {
		t.Fatalf("netns: not enough time left to re-execute the test (%v)", timeout)
	}

	args := []string{
		"-test.run=" + runPattern(name),
		"-test.v",
		"-test.count=1",
		"-test.timeout=" + childTimeout.String(),
	}
	if testing.Short() {
		args = append(args, "-test.short")
	}

	ctx, cancel := context.WithTimeout(context.Background(), killAfter)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe, args...)
	cmd.Env = append(os.Environ(), ChildEnv+"="+name)
	if g := os.Getenv("GORACE"); !strings.Contains(g, "atexit_sleep_ms") {
		// The race runtime sleeps 1s at exit by default; the parent's own
		// exit still does, so nothing is lost by skipping it in the child.
		cmd.Env = append(cmd.Env, strings.TrimSpace("GORACE="+g+" atexit_sleep_ms=0"))
	}
	out := &childOutput{t: t, name: name}
	cmd.Stdout = out
	cmd.Stderr = out
	cmd.WaitDelay = waitDelay
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWNET,
		UidMappings: []syscall.SysProcIDMap{
			{ContainerID: 0, HostID: os.Getuid(), Size: 1},
		},
		GidMappings: []syscall.SysProcIDMap{
			{ContainerID: 0, HostID: os.Getgid(), Size: 1},
		},
		// If this thread/process dies the child must not outlive it.
		Pdeathsig: syscall.SIGKILL,
	}

	start := time.Now()
	if err := cmd.Start(); err != nil {
		testutil.SkipOrFail(t, "netns: cannot create user+network namespaces (%v); "+
			"unprivileged user namespaces may be disabled (user.max_user_namespaces, "+
			"kernel.unprivileged_userns_clone, AppArmor)", err)
	}
	waitErr := cmd.Wait()
	out.flush()
	elapsed := time.Since(start).Round(time.Millisecond)

	res := out.result()
	switch {
	case ctx.Err() != nil:
		t.Errorf("netns: child for %s killed after %v (deadline): %v", name, elapsed, waitErr)
	case waitErr != nil:
		t.Errorf("netns: child for %s failed after %v: %v (result line: %q)", name, elapsed, waitErr, res)
	case res == "PASS":
		t.Logf("netns: child for %s passed in %v", name, elapsed)
	case res == "SKIP":
		t.Skipf("netns: child skipped %s: %s", name, out.lastLog())
	case res == "FAIL":
		t.Errorf("netns: child reported FAIL for %s but exited 0", name)
	default:
		t.Errorf("netns: child ran no test matching %s (exit 0 after %v); "+
			"was Reexec called from a test with a non-unique name?", runPattern(name), elapsed)
	}
	return false
}

// runPattern returns a -test.run pattern matching exactly the test name
// (which may contain '/'-separated subtest elements).
func runPattern(name string) string {
	parts := strings.Split(name, "/")
	for i, p := range parts {
		parts[i] = "^" + regexp.QuoteMeta(p) + "$"
	}
	return strings.Join(parts, "/")
}

// childOutput forwards the child's combined output line by line to the
// parent test's output and remembers the child's verdict for the test.
// os/exec calls Write from at most one goroutine at a time because Stdout and
// Stderr are the same writer; the mutex also orders flush/result after Wait.
type childOutput struct {
	t    *testing.T
	name string

	mu      sync.Mutex
	partial []byte
	verdict string   // "PASS", "FAIL", "SKIP" or ""
	logs    []string // last few indented log lines, for the skip reason
}

func (c *childOutput) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.partial = append(c.partial, p...)
	for {
		i := strings.IndexByte(string(c.partial), '\n')
		if i < 0 {
			break
		}
		c.line(string(c.partial[:i]))
		c.partial = c.partial[i+1:]
	}
	return len(p), nil
}

// flush forwards a trailing line without newline, if any.
func (c *childOutput) flush() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.partial) > 0 {
		c.line(string(c.partial))
		c.partial = nil
	}
}

// line handles one complete line. The "child| " prefix keeps the child's
// "=== RUN"/"--- PASS" lines from being mistaken for the parent's own
// events by go test or test2json.
func (c *childOutput) line(l string) {
	fmt.Fprintf(c.t.Output(), "child| %s\n", l)
	trimmed := strings.TrimSpace(l)
	for _, v := range []string{"PASS", "FAIL", "SKIP"} {
		if strings.HasPrefix(trimmed, "--- "+v+": "+c.name+" (") {
			c.verdict = v
		}
	}
	if strings.HasPrefix(l, " ") && strings.Contains(trimmed, ".go:") {
		c.logs = append(c.logs, trimmed)
		if len(c.logs) > 4 {
			c.logs = c.logs[1:]
		}
	}
}

func (c *childOutput) result() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.verdict
}

func (c *childOutput) lastLog() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.logs) == 0 {
		return "(no reason logged)"
	}
	return c.logs[len(c.logs)-1]
}

// linkUp sets IFF_UP on the named interface of the calling thread's network
// namespace.
func linkUp(name string) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socket: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("SIOCGIFFLAGS %s: %w", name, err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("SIOCSIFFLAGS %s: %w", name, err)
	}
	return nil
}
