//go:build linux

package netns

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// ErrClosed is returned by NS methods called after Close.
var ErrClosed = errors.New("netns: namespace closed")

// commandTimeout bounds every command run by NS.Run, NFT and Veth.
const commandTimeout = 30 * time.Second

// NS is an additional network namespace held by a single OS thread of the
// current process; no holder process is involved.
//
// New starts a goroutine that calls runtime.LockOSThread and
// unshare(CLONE_NEWNET) (never on the process's main thread, which the
// runtime cannot destroy), brings lo up, and then runs the functions passed
// to Do on that thread, one at a time. Consequently:
//   - sockets created synchronously inside Do (net.Listen, net.Dial, ...)
//     belong to the namespace and stay there after Do returns; they can be
//     used from any goroutine;
//   - os/exec commands started inside Do run in the namespace, because the
//     fork happens on the locked thread (see Run, Start, NFT);
//   - goroutines started inside Do do NOT run in the namespace.
//
// Close ends the goroutine without runtime.UnlockOSThread, so the Go runtime
// destroys the thread and, once sockets and processes in it are gone, the
// kernel destroys the namespace.
//
// Creating an NS needs CAP_SYS_ADMIN over the current user namespace: inside
// a Reexec child that is always the case, even when the test runs
// unprivileged.
type NS struct {
	path string
	tid  int

	reqs      chan request
	quit      chan struct{}
	done      chan struct{}
	closeOnce sync.Once
}

type request struct {
	f   func() error
	res chan error // buffered(1)
}

// New creates a network namespace held by a dedicated, locked OS thread.
// The caller must Close it. Tests should prefer NewNS.
func New() (*NS, error) {
	ns := &NS{
		reqs: make(chan request),
		quit: make(chan struct{}),
		done: make(chan struct{}),
	}
	ready := make(chan error, 1)
	go ns.start(ready)
	if err := <-ready; err != nil {
		<-ns.done
		return nil, err
	}
	return ns, nil
}

// NewNS creates a namespace with New and closes it in t.Cleanup. Failure to
// create it calls testutil.SkipOrFail: it means the environment lacks a
// capability, not that the code under test is wrong.
func NewNS(t testing.TB) *NS {
	t.Helper()
	ns, err := New()
	if err != nil {
		testutil.SkipOrFail(t, "netns: %v (call netns.Reexec first when not root)", err)
	}
	t.Cleanup(func() {
		if err := ns.Close(); err != nil {
			t.Errorf("netns: closing %s: %v", ns.Path(), err)
		}
	})
	return ns
}

// start runs the namespace goroutine (serve) on a thread other than the
// main one. The runtime never destroys the main thread: a goroutine exiting
// while locked to it only wedges it, which would keep the namespace alive
// until the process exits and make /proc/<pid>/ns/net (the thread group
// leader's namespace) point at it. So if start lands on the main thread it
// keeps that thread locked, and thus busy, until serve has started on another
// one, and then releases it unchanged.
func (ns *NS) start(ready chan<- error) {
	runtime.LockOSThread()
	if !onMainThread() {
		ns.serve(ready) // returns with the thread still locked: it is destroyed
		return
	}
	inner := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		ns.serve(inner)
	}()
	err := <-inner
	runtime.UnlockOSThread() // nothing was changed on this thread
	ready <- err
}

func onMainThread() bool { return unix.Gettid() == unix.Getpid() }

// serve is the namespace goroutine. It must be called with the OS thread
// locked and never unlocks it.
func (ns *NS) serve(ready chan<- error) {
	defer close(ns.done)
	if onMainThread() { // cannot happen, see start
		runtime.UnlockOSThread()
		ready <- errors.New("netns: namespace goroutine landed on the main thread")
		return
	}
	// Deliberately no UnlockOSThread: returning while locked makes the
	// runtime terminate this thread, which must not be reused by other
	// goroutines after its namespace was changed.
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		ready <- fmt.Errorf("unshare(CLONE_NEWNET): %w", err)
		return
	}
	ns.tid = unix.Gettid()
	ns.path = fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), ns.tid)
	if err := linkUp("lo"); err != nil {
		ready <- fmt.Errorf("bringing lo up in the new namespace: %w", err)
		return
	}
	ready <- nil
	for {
		select {
		case r := <-ns.reqs:
			call(r)
		case <-ns.quit:
			return
		}
	}
}

// call runs r.f and always answers on r.res, even if f panics (the panic is
// turned into an error) or calls runtime.Goexit (e.g. via t.FailNow, which
// must not be called inside Do: it also ends the namespace goroutine).
func call(r request) {
	completed := false
	defer func() {
		if completed {
			return
		}
		if p := recover(); p != nil {
			r.res <- fmt.Errorf("netns: panic in NS.Do: %v\n%s", p, debug.Stack())
			return
		}
		r.res <- errors.New("netns: runtime.Goexit (t.FailNow?) called inside NS.Do; the namespace is gone")
	}()
	err := r.f()
	completed = true
	r.res <- err
}

// Path returns the namespace's nsfs path, /proc/<pid>/task/<tid>/ns/net,
// usable with "ip link set DEV netns PATH", nsenter --net=PATH or setns(2)
// while the namespace is open.
func (ns *NS) Path() string { return ns.path }

// Do runs f on the namespace's thread and returns its error. f must not call
// Do on the same NS (deadlock), block indefinitely, or call t.FailNow.
// Do returns ErrClosed after Close.
func (ns *NS) Do(f func() error) error {
	r := request{f: f, res: make(chan error, 1)}
	select {
	case ns.reqs <- r:
		return <-r.res
	case <-ns.done:
		return ErrClosed
	}
}

// Close ends the namespace goroutine (destroying its thread) and waits for
// it to exit. The namespace itself lives on while sockets or processes still
// reference it. Close is idempotent.
func (ns *NS) Close() error {
	ns.closeOnce.Do(func() { close(ns.quit) })
	<-ns.done
	return nil
}

// Listen is net.Listen inside the namespace.
func (ns *NS) Listen(network, address string) (net.Listener, error) {
	return ns.ListenConfig(context.Background(), &net.ListenConfig{}, network, address)
}

// ListenConfig is lc.Listen inside the namespace (lc.Control can set socket
// options such as small buffers).
func (ns *NS) ListenConfig(ctx context.Context, lc *net.ListenConfig, network, address string) (net.Listener, error) {
	var ln net.Listener
	err := ns.Do(func() error {
		var err error
		ln, err = lc.Listen(ctx, network, address)
		return err
	})
	return ln, err
}

// DialContext is d.DialContext inside the namespace: the socket belongs to
// the namespace, the connection can be used anywhere.
func (ns *NS) DialContext(ctx context.Context, d *net.Dialer, network, address string) (net.Conn, error) {
	var c net.Conn
	err := ns.Do(func() error {
		var err error
		c, err = d.DialContext(ctx, network, address)
		return err
	})
	return c, err
}

// Start starts cmd inside the namespace (the fork happens on the
// namespace's thread). The caller owns the process: it must Wait for it, and
// kill it by PID (cmd.Process.Kill) if needed. The process keeps the
// namespace alive after Close.
func (ns *NS) Start(cmd *exec.Cmd) error {
	return ns.Do(cmd.Start)
}

// Run runs the command name with args inside the namespace, feeding it
// stdin (may be empty), and returns its combined output. A non-zero exit is
// an error that includes the output. Run is bounded by a 30s timeout.
func (ns *NS) Run(stdin string, name string, args ...string) ([]byte, error) {
	var cmd *exec.Cmd
	var out bytes.Buffer
	cancel, err := prepare(&cmd, &out, stdin, name, args...)
	if err != nil {
		return nil, err
	}
	defer cancel()
	if err := ns.Start(cmd); err != nil {
		return nil, fmt.Errorf("%s: %w", cmd, err)
	}
	return finish(cmd, &out)
}

// NFT applies an nft script (nft -f -) inside the namespace, e.g. a table
// of drop rules for one connection:
//
//	table inet lpfault {
//		chain in  { type filter hook input  priority 0; policy accept; tcp dport 9000 tcp sport 40000 drop; }
//		chain out { type filter hook output priority 0; policy accept; tcp sport 9000 tcp dport 40000 drop; }
//	}
//
// Tables live as long as the namespace; "delete table inet lpfault" heals.
func (ns *NS) NFT(script string) error {
	_, err := ns.Run(script, "nft", "-f", "-")
	return err
}

// LocalNFT applies an nft script in the current process's namespace. It
// refuses to run outside a Reexec child. Remember that a drop in the local
// output chain does not behave like a remote blackhole; prefer NS.NFT on the
// peer namespace.
func LocalNFT(script string) error {
	_, err := runLocal(script, "nft", "-f", "-")
	return err
}

// runLocal runs a command in the current process's network namespace,
// refusing outside a Reexec child so the host's network is never modified.
func runLocal(stdin string, name string, args ...string) ([]byte, error) {
	if !Inside() {
		return nil, fmt.Errorf("netns: refusing to run %s %s outside a Reexec child (host namespace)",
			name, strings.Join(args, " "))
	}
	var cmd *exec.Cmd
	var out bytes.Buffer
	cancel, err := prepare(&cmd, &out, stdin, name, args...)
	if err != nil {
		return nil, err
	}
	defer cancel()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: %w", cmd, err)
	}
	return finish(cmd, &out)
}

func prepare(cmdp **exec.Cmd, out *bytes.Buffer, stdin, name string, args ...string) (context.CancelFunc, error) {
	path, err := testutil.LookCommand(name)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Stdin = strings.NewReader(stdin)
	cmd.Stdout = out
	cmd.Stderr = out
	cmd.WaitDelay = time.Second
	*cmdp = cmd
	return cancel, nil
}

func finish(cmd *exec.Cmd, out *bytes.Buffer) ([]byte, error) {
	err := cmd.Wait()
	b := out.Bytes()
	if err != nil {
		return b, fmt.Errorf("%s: %w: %s", cmd, err, strings.TrimSpace(string(b)))
	}
	return b, nil
}
