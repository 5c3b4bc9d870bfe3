//go:build linux

package proxy

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/dnstest"
	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
)

// A pool link still connecting when its member leaves the pool is the
// member's link for the drain: it is evicted (removed) once drain_timeout
// has passed, like the member's open links. Before, the drain counted
// only links that had connected: the member was forgotten at once, and
// the link attached later to an endpoint no one knew (never evicted,
// never judged, out of the admin API's reach).
func TestDiallingLinkOfALeavingMemberIsDrained(t *testing.T) {
	port := commonPort(t, "127.0.0.2", "127.0.0.3")
	faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: fmt.Sprintf("127.0.0.3:%d", port)})
	// 127.0.0.2:port drops SYNs: a backlog of 0, its queue filled.
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrInet4{Port: port, Addr: [4]byte{127, 0, 0, 2}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	member := fmt.Sprintf("127.0.0.2:%d", port)
	for range 2 {
		if c, err := net.DialTimeout("tcp", member, 200*time.Millisecond); err == nil {
			defer c.Close()
		}
	}

	dns := dnstest.Start(t)
	setRecords(dns, "127.0.0.2")
	h := startPool(t, policy.Pool{DNS: fmt.Sprintf("pods.svc:%d", port), Refresh: policy.Duration(50 * time.Millisecond)}, dns.Resolver(),
		func(s *policy.Settings) { s.ConnectTimeout = policy.Duration(2 * time.Second) })
	h.p.drain.Store(int64(300 * time.Millisecond))
	h.waitMembers([]string{member}, 3*time.Second)

	c := h.dial() // its link connects to 127.0.0.2, whose SYNs are dropped
	ep := h.p.lookupEndpoint(member)
	for deadline := time.Now().Add(3 * time.Second); ep.linksOf(h.p.listeners[0]) != 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the dialling link is not counted as the member's")
		}
	}
	setRecords(dns, "127.0.0.3") // the member leaves while the link connects
	h.waitMembers([]string{fmt.Sprintf("127.0.0.3:%d", port)}, 3*time.Second)
	// The drain (300ms) closes the client; the link ends once its connect
	// gives up (connect_timeout, 2s: an abort does not cut a connect short).
	if err, _ := waitClosed(t, c, 3*time.Second); !isCloseSignal(err) {
		t.Fatalf("the client of the dialling link saw %v, want it closed by the drain", err)
	}
	st := h.linkEnd(5 * time.Second)
	if st.Reason != CloseEvicted {
		t.Fatalf("the dialling link of the member that left ended %s, want evicted", st.Reason)
	}
	if got := h.removedEvictions(); got != 1 {
		t.Fatalf("evictions{cause=removed} = %v, want 1", got)
	}
}

// An operator's drain outlives its endpoint for drainKeptFor: a pool
// member drained, then gone from the pool's records and forgotten, is
// still drained when the records have it again within that time (a DNS
// answer that left it out), and starts afresh after it (a new pod with
// the address). Drains of addresses the proxy no longer knows are
// dropped once that time has passed.
func TestDrainOutlivesTheForgottenEndpointForAWhile(t *testing.T) {
	h, dns, _, addrs := dnsPool(t, []string{"127.0.0.2", "127.0.0.3"}, []string{"127.0.0.2", "127.0.0.3"})
	h.p.drain.Store(0)
	h.waitMembers(addrs, 3*time.Second)
	if _, _, err := h.p.Drain(addrs[0]); err != nil {
		t.Fatal(err)
	}
	leaveAndReturn := func() bool {
		setRecords(dns, "127.0.0.3") // the drained pod goes away
		h.waitMembers(addrs[1:], 3*time.Second)
		for deadline := time.Now().Add(3 * time.Second); h.p.lookupEndpoint(addrs[0]) != nil; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("left member not forgotten")
			}
		}
		setRecords(dns, "127.0.0.2", "127.0.0.3") // and comes back
		h.waitMembers(addrs, 3*time.Second)
		for _, ep := range h.p.Endpoints() {
			if ep.Endpoint == addrs[0] {
				return ep.Draining
			}
		}
		t.Fatalf("%s not listed", addrs[0])
		return false
	}
	if !leaveAndReturn() {
		t.Fatalf("%s came back within drainKeptFor and is not drained", addrs[0])
	}

	old := drainKeptFor.Swap(int64(100 * time.Millisecond))
	defer drainKeptFor.Store(old)
	setRecords(dns, "127.0.0.3")
	h.waitMembers(addrs[1:], 3*time.Second)
	for deadline := time.Now().Add(3 * time.Second); h.p.lookupEndpoint(addrs[0]) != nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("left member not forgotten")
		}
	}
	time.Sleep(200 * time.Millisecond)
	h.p.forgetDrain("") // the sweep any forgetting makes
	if _, ok := h.p.drained.Load(addrs[0]); ok {
		t.Errorf("the drain of %s, forgotten past drainKeptFor, is still kept", addrs[0])
	}
	setRecords(dns, "127.0.0.2", "127.0.0.3") // a new pod gets the address
	h.waitMembers(addrs, 3*time.Second)
	for _, ep := range h.p.Endpoints() {
		if ep.Endpoint == addrs[0] && ep.Draining {
			t.Fatalf("%s came back after drainKeptFor and is still drained (state %s): not a fresh start", ep.Endpoint, ep.State)
		}
	}
}

// A mesh peer holds the endpoints it reached only while the proxy knows
// them: a member forgotten and back, again and again, with the same peer
// sidecar, leaves at most its live endpoint with the peer. Before, the
// peer's set was pruned only when a new peer was made, and grew by one
// endpoint per cycle.
func TestMeshPeerForgetsForgottenEndpoints(t *testing.T) {
	_, addrs := peersOn(t, faultpeer.Echo, "127.0.0.2", "127.0.0.3")
	port := netip.MustParseAddrPort(addrs[0]).Port()
	closed, err := net.Listen("tcp", "127.0.0.2:0") // a mesh port nobody serves
	if err != nil {
		t.Fatal(err)
	}
	meshPort := closed.Addr().(*net.TCPAddr).Port
	closed.Close()
	dns := dnstest.Start(t)
	setRecords(dns, "127.0.0.2")
	h := startPool(t, policy.Pool{DNS: fmt.Sprintf("pods.svc:%d", port), Refresh: policy.Duration(50 * time.Millisecond)}, dns.Resolver(),
		func(s *policy.Settings) {
			s.Mesh.Port = meshPort
			s.Mesh.Fallback = policy.MeshFallbackRefuse
		})
	h.p.drain.Store(0)
	const rounds = 4
	for i := range rounds {
		setRecords(dns, "127.0.0.2")
		h.waitMembers(addrs[:1], 3*time.Second)
		c := h.dialWhenReadmitted(3 * time.Second)
		_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
		_, _ = c.Read(make([]byte, 1)) // the link tries the mesh port: refused
		c.Close()
		setRecords(dns, "127.0.0.3")
		h.waitMembers(addrs[1:], 3*time.Second)
		for deadline := time.Now().Add(3 * time.Second); h.p.lookupEndpoint(addrs[0]) != nil; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: left member not forgotten", i)
			}
		}
	}
	h.p.meshMu.Lock()
	pr := h.p.peers[net.JoinHostPort("127.0.0.2", fmt.Sprint(meshPort))]
	h.p.meshMu.Unlock()
	if pr == nil {
		t.Fatal("no mesh peer: the links did not try the mesh")
	}
	pr.mu.Lock()
	n := len(pr.endpoints)
	pr.mu.Unlock()
	if n != 0 {
		t.Fatalf("the mesh peer keeps %d endpoint(s) after %d forget/return cycles of one address, all forgotten (want 0)", n, rounds)
	}
}

// queueFull is a listening socket on addr:port whose accept queue is full
// (one connection in it, backlog 0): the SYNs of further connects are
// dropped until its descriptor fd accepts one. It is closed at the test's
// end, as is the connection that fills it.
func queueFull(t *testing.T, addr [4]byte, port int) (fd int, hostPort string) {
	return queueFullOf(t, addr, port, 0)
}

// queueFullOf is queueFull with room for backlog connections, all
// taken (backlog+1 in the queue); port 0 is one the kernel picks. It
// returns once the listener counts them in its queue (a listening
// socket's tcpi_unacked).
func queueFullOf(t *testing.T, addr [4]byte, port, backlog int) (fd int, hostPort string) {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Port: port, Addr: addr}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, backlog); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	hostPort = fmt.Sprintf("%d.%d.%d.%d:%d", addr[0], addr[1], addr[2], addr[3], sa.(*syscall.SockaddrInet4).Port)
	for range backlog + 1 {
		fill, err := net.Dial("tcp", hostPort)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = fill.Close() })
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		ti, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
		if err != nil {
			t.Fatal(err)
		}
		if int(ti.Unacked) > backlog {
			return fd, hostPort
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d connections in the accept queue after 10s", ti.Unacked, backlog+1)
		}
	}
}

// dialConnectingTo dials h, a pool of a (whose SYNs are dropped: see
// queueFull) and b (an echo), until a link is connecting to a, and
// returns its client, which has written "x". Where a link went is the
// proxy's own accounting: a pool link is a's from the start of its connect
// (a accepts none, so a's links are the ones connecting), or b's peer
// accepted it. Round robin sends one of the first two to a; links that
// went to b are closed.
func dialConnectingTo(t *testing.T, h *harness, a string, b *faultpeer.Server) *net.TCPConn {
	t.Helper()
	ep := h.p.lookupEndpoint(a)
	if ep == nil {
		t.Fatalf("no endpoint %s", a)
	}
	for range 3 {
		atA, atB := ep.liveLinks(), b.Accepted()
		c := h.dial()
		if _, err := c.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 5*time.Second, "the link to connect to a member", func() bool {
			return ep.liveLinks() > atA || b.Accepted() > atB
		})
		if ep.liveLinks() > atA {
			return c
		}
		_ = c.Close()
	}
	t.Fatal("no link of three went to A (round robin over two members)")
	return nil
}

// A pool link whose connect to a member completes after the operator
// disabled the member does not stay there: the disable evicted the
// member's links, and this one, still connecting, was not among them.
// It has carried no byte, so it moves on to the other member, and the
// disabled member's connection ends without a byte (a FIN). Its twin: the
// same slow connect to a member still enabled stays there, and the
// client's byte reaches it. (The connect is slow because the member's
// accept queue is full until the test makes room: the SYN is dropped and
// the kernel's retransmission a second later completes the handshake.)
func TestLinkConnectedToAMemberDisabledMeanwhileMovesOn(t *testing.T) {
	for _, disable := range []bool{true, false} {
		name := "disabled meanwhile"
		if !disable {
			name = "still enabled"
		}
		t.Run(name, func(t *testing.T) {
			port := commonPort(t, "127.0.0.2", "127.0.0.3")
			fd, a := queueFull(t, [4]byte{127, 0, 0, 2}, port)
			b := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: fmt.Sprintf("127.0.0.3:%d", port)})
			h := startPool(t, policy.Pool{Endpoints: []string{a, b.Addr()}}, nil, func(s *policy.Settings) {
				s.ConnectTimeout = policy.Duration(5 * time.Second) // past the SYN's retransmission
			})
			c := dialConnectingTo(t, h, a, b)
			if disable {
				if _, err := h.p.Disable(a); err != nil {
					t.Fatal(err)
				}
			}
			// Room in A's queue: fill's connection taken off it.
			nfd, _, err := syscall.Accept(fd)
			if err != nil {
				t.Fatal(err)
			}
			_ = syscall.Close(nfd)
			// The link's connection, once the retransmitted SYN is in.
			lfd, _, err := syscall.Accept(fd)
			if err != nil {
				t.Fatal(err)
			}
			defer syscall.Close(lfd)
			tv := syscall.Timeval{Sec: 6}
			_ = syscall.SetsockoptTimeval(lfd, syscall.SOL_SOCKET, syscall.SO_RCVTIMEO, &tv)
			buf := make([]byte, 8)
			n, rerr := syscall.Read(lfd, buf)
			if !disable {
				if rerr != nil || string(buf[:max(n, 0)]) != "x" {
					t.Fatalf("the enabled member got %q, %v; want the client's byte", buf[:max(n, 0)], rerr)
				}
				return
			}
			if rerr != nil || n != 0 {
				t.Fatalf("the disabled member's connection: %d bytes, %v; want its end without a byte", n, rerr)
			}
			_ = c.SetReadDeadline(time.Now().Add(6 * time.Second))
			if _, err := io.ReadFull(c, buf[:1]); err != nil || buf[0] != 'x' {
				t.Fatalf("client: %q, %v; want its byte back from the other member", buf[:1], err)
			}
		})
	}
}

// A pool link still connecting to a member that is disabled (or excluded)
// meanwhile is not evicted with the member's links: its connect times out
// and it fails over to the other member (one whose connect succeeds moves
// on too: TestLinkConnectedToAMemberDisabledMeanwhileMovesOn). (Only a leaving member's drain
// ends a link still connecting: TestDiallingLinkOfALeavingMemberIsDrained.)
func TestDiallingLinkFailsOverWhenItsMemberIsDisabled(t *testing.T) {
	port := commonPort(t, "127.0.0.2", "127.0.0.3")
	_, a := queueFull(t, [4]byte{127, 0, 0, 2}, port) // A: SYNs are dropped
	b := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: fmt.Sprintf("127.0.0.3:%d", port)})
	h := startPool(t, policy.Pool{Endpoints: []string{a, b.Addr()}}, nil, nil)
	c := dialConnectingTo(t, h, a, b)
	if _, err := h.p.Disable(a); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(6 * time.Second))
	buf := make([]byte, 1)
	if _, err := io.ReadFull(c, buf); err != nil {
		t.Fatalf("client of a pool link dialling a member disabled meanwhile: %v, want its byte back from the other member", err)
	}
}
