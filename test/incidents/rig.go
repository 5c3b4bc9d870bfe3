//go:build linux

package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/harness"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// mainChildEnv marks the process that `go run ./test/incidents` re-executed
// into a new user and network namespace (the main's equivalent of
// netns.Reexec for tests).
const mainChildEnv = "LIVENESSPROXY_INCIDENTS_NETNS"

// insideOwnNamespace reports whether this process runs in a network
// namespace of its own (a netns.Reexec test child or the main's child): only
// there may a replay change network configuration.
func insideOwnNamespace() bool { return netns.Inside() || os.Getenv(mainChildEnv) != "" }

// rig is what a replay runs with: a log and the things to undo at the end.
// The tests build it from a *testing.T, the main from stderr.
type rig struct {
	logf func(format string, args ...any)

	mu       sync.Mutex
	cleanups []func()
}

func newRig(logf func(string, ...any)) *rig { return &rig{logf: logf} }

// cleanup registers f to run at close, in reverse order.
func (r *rig) cleanup(f func()) {
	r.mu.Lock()
	r.cleanups = append(r.cleanups, f)
	r.mu.Unlock()
}

// close runs the cleanups, last registered first.
func (r *rig) close() {
	for {
		r.mu.Lock()
		if len(r.cleanups) == 0 {
			r.mu.Unlock()
			return
		}
		f := r.cleanups[len(r.cleanups)-1]
		r.cleanups = r.cleanups[:len(r.cleanups)-1]
		r.mu.Unlock()
		f()
	}
}

// errMissing is a missing capability (a command): tests skip on it (or fail
// under LIVENESSPROXY_REQUIRE_ALL=1), the main reports it.
type errMissing struct{ err error }

func (e errMissing) Error() string { return e.err.Error() }

// requireCommands checks that the commands a namespace replay runs exist.
func requireCommands(names ...string) error {
	for _, n := range names {
		if _, err := testutil.LookCommand(n); err != nil {
			return errMissing{err}
		}
	}
	return nil
}

// run runs a command in this process's network namespace, bounded by 30 s.
// It refuses outside a namespace of our own so that the host's network is
// never touched.
func run(stdin string, name string, args ...string) ([]byte, error) {
	if !insideOwnNamespace() {
		return nil, fmt.Errorf("refusing to run %s %s outside a namespace of our own", name, strings.Join(args, " "))
	}
	path, err := testutil.LookCommand(name)
	if err != nil {
		return nil, errMissing{err}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Stdin = strings.NewReader(stdin)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = time.Second
	if err := cmd.Run(); err != nil {
		return out.Bytes(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return out.Bytes(), nil
}

// topo is a peer network namespace (the server's node) wired to ours by a
// veth pair: 10.232.<n>.1 here, 10.232.<n>.2 there. Faults (drop rules) go
// in the peer namespace, as a remote blackhole does: a drop in our own
// OUTPUT chain would only keep data unsent, which is a different fault.
type topo struct {
	peer    *netns.NS
	localIP string
	peerIP  string
}

// newTopo creates the peer namespace and the veth pair; both are removed
// by the rig's cleanup (the namespace dies with its last socket and
// process).
func newTopo(r *rig, n int) (*topo, error) {
	if err := requireCommands("ip", "nft", "ss"); err != nil {
		return nil, err
	}
	if !insideOwnNamespace() {
		return nil, errors.New("network replays must run in a namespace of their own (netns.Reexec or the main's re-exec)")
	}
	peer, err := netns.New()
	if err != nil {
		return nil, errMissing{fmt.Errorf("peer network namespace: %w", err)}
	}
	r.cleanup(func() { _ = peer.Close() })
	t := &topo{peer: peer, localIP: fmt.Sprintf("10.232.%d.1", n), peerIP: fmt.Sprintf("10.232.%d.2", n)}
	local, remote := fmt.Sprintf("lpi%dl", n), fmt.Sprintf("lpi%dp", n)
	if _, err := run("", "ip", "link", "add", local, "type", "veth", "peer", "name", remote, "netns", peer.Path()); err != nil {
		return nil, err
	}
	r.cleanup(func() { _, _ = run("", "ip", "link", "del", local) })
	steps := [][]string{
		{"addr", "add", t.localIP + "/24", "dev", local},
		{"link", "set", local, "up"},
	}
	for _, s := range steps {
		if _, err := run("", "ip", s...); err != nil {
			return nil, err
		}
	}
	for _, s := range [][]string{{"addr", "add", t.peerIP + "/24", "dev", remote}, {"link", "set", remote, "up"}} {
		if _, err := peer.Run("", "ip", s...); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// addr is host:port on the peer.
func (t *topo) addr(port int) string { return net.JoinHostPort(t.peerIP, fmt.Sprint(port)) }

// waitReachable dials addr until it answers (a fresh veth may take a
// moment).
func waitReachable(addr string) error { return harness.WaitReachable(addr, 5*time.Second) }

// establishedFrom lists the client ports of the TCP connections
// established from our side to the given ports of the peer, as the peer's
// kernel sees them.
func (t *topo) establishedFrom(ports ...int) ([]string, error) {
	var filter []string
	for _, p := range ports {
		filter = append(filter, fmt.Sprintf("sport = :%d", p))
	}
	out, err := t.peer.Run("", "ss", "-Htn", "state", "established", "( "+strings.Join(filter, " or ")+" )")
	if err != nil {
		return nil, err
	}
	var clients []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		host, port, err := net.SplitHostPort(f[len(f)-1])
		if err == nil && host == t.localIP {
			clients = append(clients, port)
		}
	}
	return clients, nil
}

// dropFlows drops, in the peer namespace, every packet of the connections
// from our side whose client port is in clientPorts, both directions, as
// a dead node or a broken path does. New connections still pass. The table
// is named name; heal deletes it.
func (t *topo) dropFlows(name string, clientPorts []string) error {
	if len(clientPorts) == 0 {
		return errors.New("no connection to drop")
	}
	set := strings.Join(clientPorts, ", ")
	return t.peer.NFT(fmt.Sprintf(`table inet %[1]s {
	chain in  { type filter hook input  priority 0; policy accept; ip saddr %[2]s tcp sport { %[3]s } counter drop; }
	chain out { type filter hook output priority 0; policy accept; ip daddr %[2]s tcp dport { %[3]s } counter drop; }
}
`, name, t.localIP, set))
}

// heal deletes the drop table name.
func (t *topo) heal(name string) error {
	_, err := t.peer.Run("", "nft", "delete", "table", "inet", name)
	return err
}
