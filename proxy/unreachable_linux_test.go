package proxy

import (
	"bufio"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
)

// When the kernel gives up on a connection (tcp_user_timeout of
// unacknowledged data, keepalive), it reports the ICMP error it saw
// meanwhile, if any (tcp_write_err: sk_err_soft, else ETIMEDOUT): an
// upstream gone from its network, whose address no longer answers ARP,
// fails its links with EHOSTUNREACH at tcp_user_timeout, not ETIMEDOUT.
// That is the same verdict, the same evidence: the link ends
// upstream_timeout and the endpoint is excluded. Before, it ended
// upstream_error and the endpoint stayed healthy. The twin: the same
// ICMP error on a path that heals within tcp_user_timeout ends nothing.
func TestUnreachableAtUserTimeoutIsUpstreamTimeout(t *testing.T) {
	t.Run("path gone", func(t *testing.T) { unreachableUpstream(t, false) })
	t.Run("twin: path back before tcp_user_timeout", func(t *testing.T) { unreachableUpstream(t, true) })
}

func unreachableUpstream(t *testing.T, heals bool) {
	if !netns.Reexec(t, "ip") {
		return
	}
	peer := netns.NewNS(t)
	link := netns.Veth(t, peer, "10.231.29.1/24", "10.231.29.2/24")
	addr := netns.Echo(t, peer, net.JoinHostPort(link.PeerIP().String(), "9000"))
	// ARP gives up after three solicitations at this interval (1 s by
	// default): the host unreachable comes 300 ms after the first
	// retransmission needs the neighbour.
	if err := os.WriteFile("/proc/sys/net/ipv4/neigh/"+link.Local+"/retrans_time_ms", []byte("100"), 0o644); err != nil {
		t.Fatal(err)
	}
	ut := 2 * time.Second
	if heals {
		ut = 10 * time.Second // room for a slow machine to heal the path
	}
	h := start(t, addr.String(), func(s *policy.Settings) {
		s.TCPUserTimeout = policy.Duration(ut)
		// Keepalive off: the window guard keeps tcp_user_timeout itself on
		// the idle socket, not keepalive's deadline (IdleUserTimeout).
		s.Keepalive = policy.Keepalive{Idle: -1}
	})
	c := linkOverVeth(t, h, addr, ut)
	// The peer's address now routes through a neighbour that does not
	// answer ARP: the host is gone from the network.
	route := []string{"route", "add", link.PeerIP().String() + "/32", "via", "10.231.29.77", "dev", link.Local}
	ip(t, route...)
	unreach := icmpDestUnreachs(t)
	if _, err := c.Write([]byte("lost")); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(ut); icmpDestUnreachs(t) == unreach; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no ICMP destination unreachable within %v of the send", ut)
		}
	}
	if heals {
		route[0], route[1] = "route", "del"
		ip(t, route...)
		got := make([]byte, 4)
		_ = c.SetReadDeadline(time.Now().Add(ut - time.Second))
		if _, err := c.Read(got); err != nil || string(got) != "lost" {
			t.Fatalf("after the path healed: read %q, %v; want the echo", got, err)
		}
		h.noLinkEnded("an ICMP host unreachable on a path that healed before tcp_user_timeout")
		if ep := h.endpoint(); ep.State != "healthy" {
			t.Fatalf("endpoint %s (%s) after a path that healed", ep.State, ep.Reason)
		}
		t.Logf("host unreachable seen, path healed: the link lives, the endpoint is healthy")
		return
	}
	s := h.linkEnd(ut + 5*time.Second)
	ep := h.endpoint()
	t.Logf("upstream gone (ARP fails): link ended %s (%v); endpoint %s (%s)", s.Reason, s.Err, ep.State, ep.Reason)
	if s.Reason != CloseUpstreamTimeout || ep.State != "excluded" {
		t.Fatalf("the kernel gave up on the upstream at tcp_user_timeout (%v), but the link ended %s and the endpoint is %s: a dead upstream kept", s.Err, s.Reason, ep.State)
	}
}

// linkOverVeth is a link of h's to addr, over a veth, once the path is up,
// a round trip made, and the window guard has set tcp_user_timeout ut on
// the upstream socket (keepalive off: ut itself on the idle socket).
func linkOverVeth(t *testing.T, h *harness, addr net.Addr, ut time.Duration) *net.TCPConn {
	t.Helper()
	pathUp(t, addr)
	c := h.dial()
	roundTrip(t, c, []byte("hello"))
	// The window guard sets tcp_user_timeout a quarter of it (or of
	// keepalive's idle time) after the connect.
	for deadline := time.Now().Add(10 * time.Second); userTimeout(h) != int(ut.Milliseconds()); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("TCP_USER_TIMEOUT %d on the upstream socket, want %d", userTimeout(h), ut.Milliseconds())
		}
	}
	return c
}

// pathUp returns once addr, over a fresh veth, takes a connect at once:
// the first over it may lose its SYN.
func pathUp(t *testing.T, addr net.Addr) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		d, err := net.DialTimeout("tcp", addr.String(), 500*time.Millisecond)
		if err == nil {
			_ = d.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not reachable over the veth: %v", addr, err)
		}
	}
}

func ip(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// icmpDestUnreachs is the namespace's count of ICMP destination
// unreachable messages received (/proc/net/snmp Icmp InDestUnreachs),
// the ones the kernel sends itself when ARP fails included.
func icmpDestUnreachs(t *testing.T) int {
	t.Helper()
	f, err := os.Open("/proc/net/snmp")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var names []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) == 0 || fs[0] != "Icmp:" {
			continue
		}
		if names == nil {
			names = fs
			continue
		}
		for i, n := range names {
			if n == "InDestUnreachs" && i < len(fs) {
				v, err := strconv.Atoi(fs[i])
				if err != nil {
					t.Fatal(err)
				}
				return v
			}
		}
	}
	t.Fatal("no Icmp InDestUnreachs in /proc/net/snmp")
	return 0
}

// The kernel reports a socket's error to one call: when the request
// side's write takes the kernel's verdict (ETIMEDOUT: the upstream's path
// died under an upload), the response pump's read sees the stream end
// with no FIN and takes it for a reset (flow.ResetNotFin), and whichever
// of the two failed the link first decided its reason. The read first
// ended it upstream_error, which blames nothing: a dead upstream kept
// (measured in a netns, an upload into a path dropped at the peer with
// tcp_user_timeout 2 s: 3 runs of 20). The write's verdict now replaces the
// inferred reset. Driven here in that order (the write's goroutine holds
// the link open, as the writer does, until it has reported). The twin: an
// inferred reset with no verdict after it stays upstream_error, and the
// endpoint healthy.
func TestKernelVerdictTakenByAWriteOutranksTheInferredReset(t *testing.T) {
	t.Run("verdict after the inferred reset", func(t *testing.T) { inferredReset(t, true) })
	t.Run("twin: inferred reset alone", func(t *testing.T) { inferredReset(t, false) })
}

func inferredReset(t *testing.T, verdict bool) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	h := start(t, peer.Addr(), nil)
	c := h.dial()
	roundTrip(t, c, []byte("hello"))
	lk := h.onlyLink(5 * time.Second)
	e := lk.upEnd().(*tcpEnd)
	lk.live.Add(1) // the goroutine whose write took the socket's error
	e.fail(errResetInferred{})
	if verdict {
		e.fail(&net.OpError{Op: "writev", Net: "tcp", Err: os.NewSyscallError("writev", syscall.ETIMEDOUT)})
	}
	lk.exit()
	s := h.linkEnd(5 * time.Second)
	ep := h.endpoint()
	t.Logf("link ended %s (%v); endpoint %s (%s)", s.Reason, s.Err, ep.State, ep.Reason)
	want, state := CloseUpstreamError, "healthy"
	if verdict {
		want, state = CloseUpstreamTimeout, "excluded"
	}
	if s.Reason != want || ep.State != state {
		t.Fatalf("link ended %s, endpoint %s; want %s, %s", s.Reason, ep.State, want, state)
	}
}
