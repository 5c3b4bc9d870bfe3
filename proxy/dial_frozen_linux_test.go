package proxy

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// waitSynSent waits until n sockets of this network namespace are
// connecting to addr (SYN_SENT in /proc/net/tcp): the proxy's dials
// are under way.
func waitSynSent(t *testing.T, addr string, n int) {
	t.Helper()
	_, port, _ := net.SplitHostPort(addr)
	p, _ := strconv.Atoi(port)
	suffix := fmt.Sprintf(":%04X", p)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		b, err := os.ReadFile("/proc/net/tcp")
		if err != nil {
			t.Fatal(err)
		}
		got := 0
		for _, line := range strings.Split(string(b), "\n")[1:] {
			// sl local_address rem_address st ...; st 02 is SYN_SENT.
			if f := strings.Fields(line); len(f) > 3 && strings.HasSuffix(f[2], suffix) && f[3] == "02" {
				got++
			}
		}
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d connects to %s under way after 10s, want %d", got, addr, n)
		}
	}
}

// freezeProcess stops this process (SIGSTOP) for d, as CPU throttling or a
// host under contention stops a proxy, from a child that also starts it
// again: the test stays stopped only if that child is killed between the
// two, whatever its own goroutines do.
func freezeProcess(t *testing.T, d time.Duration) {
	t.Helper()
	pid := os.Getpid()
	script := fmt.Sprintf("kill -STOP %d; sleep %.3f; kill -CONT %d", pid, d.Seconds(), pid)
	began := time.Now()
	if out, err := exec.Command("sh", "-c", script).CombinedOutput(); err != nil {
		t.Fatalf("freezing the process: %v (%s)", err, out)
	}
	if took := time.Since(began); took < d {
		t.Fatalf("the freeze took %v, want at least %v", took, d)
	}
}

// The review's case: the proxy is frozen (SIGSTOP here; CPU throttling or
// a host under contention in production) for longer than connect_timeout
// while two links dial a healthy upstream. Each connect goes to a full
// accept queue (its SYN dropped, so it is under way when the freeze
// begins); the kernel sends the SYN again a second later, during the
// freeze.
//
// Answered during the freeze (the test made room in the queue first): the
// handshakes completed while the proxy could not run, and both links
// work. Before flow.DialRaw looked at the socket after its deadline, such
// a dial could end in a timeout (the runtime runs expired timers before
// it polls the network).
//
// Unanswered during the freeze: both connects time out, and both links
// fail (dial_error), but the proxy noticed the timeouts at least
// connect_timeout late: nothing is held against the endpoint, which stays
// healthy. Before, the two counted as two timeouts in a row and excluded
// it. Two links that time out one after the other with the proxy running
// still exclude it.
func TestFrozenProxyBlamesNoUpstream(t *testing.T) {
	const (
		// connect_timeout well past the SYN sent again at 1 s, so that a
		// freeze that begins late (a busy machine forks the shell slowly)
		// still begins before the deadline, and so that both links' dials
		// are under way at once even when the proxy starts the second
		// one late (2 s was not enough with a benchmark pinned beside the
		// test); the freeze past 2 timeouts with a second to spare.
		timeout = 4 * time.Second
		freeze  = 9 * time.Second
	)
	tune := func(s *policy.Settings) {
		s.ConnectTimeout = policy.Duration(timeout)
		s.ConnectAttempts = 1
	}

	t.Run("answered during the freeze", func(t *testing.T) {
		lfd, addr := queueFullOf(t, [4]byte{127, 0, 0, 1}, 0, 1)
		h := start(t, addr, tune)
		c1, c2 := h.dial(), h.dial()
		waitSynSent(t, addr, 2)
		for range 2 { // room for both SYNs sent again
			nfd, _, err := unix.Accept(lfd)
			if err != nil {
				t.Fatal(err)
			}
			_ = unix.Close(nfd)
		}
		freezeProcess(t, freeze)
		for range 2 {
			nfd, _, err := unix.Accept(lfd)
			if err != nil {
				t.Fatal(err)
			}
			s := os.NewFile(uintptr(nfd), "upstream")
			t.Cleanup(func() { _ = s.Close() })
			go func() { _, _ = io.Copy(s, s) }() // ends at the cleanup's close
		}
		roundTrip(t, c1, []byte("connected while the proxy was frozen"))
		roundTrip(t, c2, []byte("so was this one"))
		if ep := h.endpoint(); ep.State != "healthy" {
			t.Fatalf("endpoint %s (%s), want healthy", ep.State, ep.Reason)
		}
	})

	t.Run("unanswered during the freeze", func(t *testing.T) {
		_, addr := queueFull(t, [4]byte{127, 0, 0, 1}, 0)
		h := start(t, addr, tune)
		h.dial()
		h.dial()
		waitSynSent(t, addr, 2)
		freezeProcess(t, freeze)
		for range 2 {
			s := h.linkEnd(5 * time.Second)
			if s.Reason != CloseDialError || s.Err == nil || !strings.Contains(s.Err.Error(), "the proxy could not run") {
				t.Fatalf("link ended %s (%v), want dial_error noticed late", s.Reason, s.Err)
			}
		}
		if ep := h.endpoint(); ep.State != "healthy" {
			t.Fatalf("endpoint %s (%s) after two timeouts the proxy noticed late, want healthy", ep.State, ep.Reason)
		}

		// The twin, with the proxy running: two timeouts in a row (the
		// second connect begun after the first ended) exclude.
		for i := range 2 {
			h.dial()
			if s := h.linkEnd(2 * timeout); s.Reason != CloseDialError || strings.Contains(s.Err.Error(), "could not run") {
				t.Fatalf("link %d ended %s (%v), want dial_error noticed in time", i+1, s.Reason, s.Err)
			}
		}
		if ep := h.waitState("excluded", 5*time.Second); ep.Reason != string(CloseDialError) {
			t.Fatalf("excluded for %s, want dial_error", ep.Reason)
		}
	})
}

// The same freeze during a mesh session's handshake: the peer sidecar's
// mesh port accepts and answers nothing (as a SIGSTOPped sidecar's kernel
// does), and the proxy is frozen for longer than twice ping_timeout while
// the handshake waits. When it runs again, the handshake's deadline and
// the link's connect budget are long past, but the proxy could not have
// read an answer meanwhile: the link fails (dial_error, noticed late),
// the peer's endpoints stay healthy and no session death is counted.
// Before, the handshake's timeout alone declared the peer dead and
// excluded its endpoints. The twin: the same silent sidecar with the
// proxy running is dead at ping_timeout, and its endpoint excluded.
func TestFrozenProxyBlamesNoMeshPeer(t *testing.T) {
	const (
		// ping_timeout as connect_timeout above; the link's connect
		// budget half a second longer, so that with the proxy running the
		// handshake's own deadline comes first. The freeze is past twice
		// either, whichever deadline the proxy sees first after it.
		timeout = 2 * time.Second
		budget  = timeout + timeout/4
		freeze  = 5 * time.Second
	)
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	silent := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Addr: "127.0.0.2:0"})
	_, port, _ := net.SplitHostPort(silent.Addr())
	meshPort, _ := strconv.Atoi(port)
	h := startEgress(t, srv.Addr(), meshPort, func(s *policy.Settings) {
		s.Mesh.PingTimeout = policy.Duration(timeout)
		s.ConnectTimeout = policy.Duration(budget)
		s.ConnectAttempts = 1
	})

	c := h.dial()
	waitFor(t, 5*time.Second, "the session's connection accepted", func() bool { return silent.Accepted() >= 1 })
	freezeProcess(t, freeze)
	s := h.linkEndOf(c, 5*time.Second)
	if s.Reason != CloseDialError || s.Err == nil || !strings.Contains(s.Err.Error(), "the proxy could not run") {
		t.Fatalf("link ended %s (%v), want dial_error noticed late", s.Reason, s.Err)
	}
	if ep := h.endpoint(); ep.State != "healthy" {
		t.Fatalf("endpoint %s (%s) after a handshake the proxy could not wait for, want healthy", ep.State, ep.Reason)
	}
	if got := testutil.ToFloat64(h.m.MeshSessionDeaths(metrics.MeshEgress)); got != 0 {
		t.Fatalf("%v egress session deaths counted for a handshake noticed late, want 0", got)
	}

	// The twin, with the proxy running.
	h.dial()
	if ep := h.waitState("excluded", 10*time.Second); ep.Reason != string(reasonMeshDead) {
		t.Fatalf("excluded for %s, want %s", ep.Reason, reasonMeshDead)
	}
	if got := testutil.ToFloat64(h.m.MeshSessionDeaths(metrics.MeshEgress)); got != 1 {
		t.Fatalf("%v egress session deaths, want 1", got)
	}
}
