package limits

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// meshConfig is an ingress sidecar with every default: its local server
// (local) never reads, and echo, on the same host, is a further port its
// peers may name.
func meshConfig(local, echo string) string {
	_, port, _ := net.SplitHostPort(echo)
	return fmt.Sprintf(`
admin: {listen: "127.0.0.1:0", control_listen: ""}
log: {level: info}
drain_timeout: 1s
listeners:
  - {name: ingress, listen: "127.0.0.1:0", ingress: {local: %q, ports: [%s]}}
`, local, port)
}

// meshPeer is a session to the ingress at addr as an egress sidecar opens
// one (the handshake, then yamux without keepalives: the ingress answers
// pings, and sends its own, which yamux answers).
func meshPeer(t *testing.T, addr string) *yamux.Session {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(mesh.Preface()); err != nil {
		t.Fatal(err)
	}
	if _, err := mesh.ReadReply(c); err != nil {
		t.Fatalf("mesh handshake: %v", err)
	}
	_ = c.SetDeadline(time.Time{})
	cfg := yamux.DefaultConfig()
	cfg.EnableKeepAlive, cfg.LogOutput = false, io.Discard
	sess, err := yamux.Client(c, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sess.Close() })
	return sess
}

// openLink opens a stream to port on sess and waits (5 s at most) for
// the ingress's acknowledgement that it reached the server: false if the
// stream was refused.
func openLink(sess *yamux.Session, port uint16) (*yamux.Stream, bool) {
	st, ok := openEager(sess, port)
	if !ok {
		return nil, false
	}
	_ = st.SetReadDeadline(time.Now().Add(5 * time.Second))
	var ack [1]byte
	_, err := io.ReadFull(st, ack[:])
	_ = st.SetReadDeadline(time.Time{})
	if err != nil || ack[0] != mesh.Ack {
		_ = st.Close()
		return nil, false
	}
	return st, true
}

// openEager opens a stream to port on sess and writes its header, without
// waiting for anything.
func openEager(sess *yamux.Session, port uint16) (*yamux.Stream, bool) {
	st, err := sess.OpenStream()
	if err != nil {
		return nil, false
	}
	if _, err := st.Write(mesh.Header(port)); err != nil {
		_ = st.Close()
		return nil, false
	}
	return st, true
}

// meshLoad is what the load's streams did.
type meshLoad struct {
	links, refused, headerless atomic.Int64
	eager                      atomic.Int64 // streams opened without waiting for the acknowledgement
	pushed                     atomic.Int64 // bytes written on the links
}

// pushLinks runs workers that each, until until, open a link to port on
// sess (its header, then the ingress's acknowledgement, as an egress does)
// and write into it until the write fails (the ingress ended the link)
// or until; a refused stream is opened again after backoff (an egress's
// connect backoff). Eager workers write the header and data at once, as
// much as the window takes before the ingress reads the header, and
// never wait for the acknowledgement.
func (m *meshLoad) pushLinks(wg *sync.WaitGroup, sess *yamux.Session, port uint16, workers int, eager bool, until time.Time) {
	buf := make([]byte, 64<<10)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(until) && !sess.IsClosed() {
				st, ok := openLink(sess, port)
				if eager {
					st, ok = openEager(sess, port)
				}
				if !ok {
					m.refused.Add(1)
					time.Sleep(500 * time.Millisecond)
					continue
				}
				if eager {
					m.eager.Add(1)
				} else {
					m.links.Add(1)
				}
				_ = st.SetWriteDeadline(until)
				for {
					n, err := st.Write(buf)
					m.pushed.Add(int64(n))
					if err != nil {
						break
					}
				}
				_ = st.Close()
			}
		}()
	}
}

// holdHeaderless runs streams that send half a header and never the
// rest, each again (100 ms after) once the ingress resets it (at once,
// or after mesh.HeaderTimeout), until until.
func (m *meshLoad) holdHeaderless(wg *sync.WaitGroup, sess *yamux.Session, port uint16, streams int, until time.Time) {
	half := mesh.Header(port)[:3]
	for range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(until) && !sess.IsClosed() {
				st, err := sess.OpenStream()
				if err != nil {
					time.Sleep(500 * time.Millisecond)
					continue
				}
				m.headerless.Add(1)
				_, _ = st.Write(half)
				_ = st.SetReadDeadline(until)
				_, _ = st.Read(make([]byte, 1)) // the reset, or until
				_ = st.Close()
				time.Sleep(100 * time.Millisecond)
			}
		}()
	}
}

// An ingress sidecar in a 256 MiB cgroup with every default, its local
// server accepting and never reading. Egress peers open as many links as
// the ingress takes and push into each until its window is full (yamux
// buffers a stream's window, up to twice it as its buffer grows, outside
// the memory budget, once the link's pump stops reading at the budget),
// more keep coming as links end (800 at once, each again 500 ms after a
// refusal); beside them streams that push their header and data without
// waiting for the acknowledgement, streams that send half a header and
// wait, and one healthy link to an echo server that makes round trips.
// The ingress is never OOM-killed, its cgroup's peak stays below the
// limit, the links it holds reach and never pass the max_links it
// planned with the window counted (109 here), and every healthy round
// trip completes.
//
// Before the derived max_links counted the window (144 KiB a link: 500
// here), the ingress took 500 such links, and the kernel OOM-killed it
// within two seconds of the load (the cgroup at its 256 MiB), taking
// the healthy link with it. Measured with it: cgroup peak 229 MiB, peak
// RSS 239 MiB.
func TestMeshIngressWindowsUnderCgroupLimit(t *testing.T) {
	local := faultpeer.New(t, faultpeer.NeverRead, faultpeer.Options{Buffer: 4096})
	echo := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	pp := startProxy(t, cgroupLimit, meshConfig(local.Addr(), echo.Addr()))
	maxLinks, _ := pp.limits["max_links"].(float64)
	t.Logf("the start log: max_links %v (%v)", pp.limits["max_links"], pp.limits["max_links_source"])
	in := pp.listens["ingress"]

	stop := make(chan struct{})
	healthy := meshPeer(t, in)
	healthyDone, trips, failed := roundTripLoop(func() (net.Conn, error) {
		if st, ok := openLink(healthy, portNum(t, echo.Addr())); ok {
			return st, nil
		}
		return nil, errors.New("the healthy link's stream was refused")
	}, stop)
	stopHealthy := sync.OnceFunc(func() { close(stop); <-healthyDone })
	defer stopHealthy()
	waitTrips(t, trips, failed)

	const (
		sessions   = 4
		perSession = 200 // 800 workers: more than the 500 links max_links allowed before
		headerless = 300
		eager      = 200
		load       = 25 * time.Second // past write_timeout (10 s): links end on the budget, more come
	)
	var m meshLoad
	var wg sync.WaitGroup
	until := time.Now().Add(load)
	port := portNum(t, local.Addr())
	for range sessions {
		m.pushLinks(&wg, meshPeer(t, in), port, perSession, false, until)
	}
	m.pushLinks(&wg, meshPeer(t, in), port, eager, true, until)
	m.holdHeaderless(&wg, meshPeer(t, in), port, headerless, until)

	var held float64
	for time.Now().Before(until) && failed.Load() == nil && pp.alive() {
		if v, err := valueOf(pp.metrics(), "links_active", "listener", "ingress"); err == nil {
			held = max(held, v)
		}
		time.Sleep(250 * time.Millisecond)
	}
	wg.Wait()
	stopHealthy()
	peak, _ := pp.cg.peak()
	ooms, _ := pp.cg.ooms()
	t.Logf("links held at most %v (max_links %v), %d links opened, %d streams refused, %d eager streams, %d header-less streams, %.0f MiB pushed; %d healthy round trips; cgroup peak %.1f MiB, OOM kills %d",
		held, maxLinks, m.links.Load(), m.refused.Load(), m.eager.Load(), m.headerless.Load(), float64(m.pushed.Load())/(1<<20), trips.Load(), float64(peak)/(1<<20), ooms)
	if ooms != 0 || !pp.alive() {
		t.Fatalf("the ingress was OOM-killed (%d kills in its cgroup), healthy link: %v", ooms, errOf(failed))
	}
	checkMemory(t, pp)
	if p := failed.Load(); p != nil {
		t.Fatalf("a healthy round trip failed: %v", *p)
	}
	if trips.Load() < 10 {
		t.Fatalf("only %d healthy round trips", trips.Load())
	}
	if held > maxLinks || held < maxLinks/2 {
		t.Fatalf("the ingress held %v links at most, max_links %v: the load did not fill it, or it went past it", held, maxLinks)
	}
	if m.refused.Load() == 0 {
		t.Fatal("no stream was refused: the load never reached max_links")
	}
	if src := fmt.Sprint(pp.limits["max_links_source"]); !strings.Contains(src, "mesh.stream_window") {
		t.Fatalf("max_links %v from %q: the mesh streams' windows are not in the plan", maxLinks, src)
	}
}

// waitTrips waits (5 s at most) for the first healthy round trip.
func waitTrips(t *testing.T, trips *atomic.Int64, failed *atomic.Pointer[error]) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); trips.Load() == 0; {
		if p := failed.Load(); p != nil {
			t.Fatal(*p)
		}
		if time.Now().After(deadline) {
			t.Fatal("no healthy round trip within 5 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func portNum(t *testing.T, addr string) uint16 {
	t.Helper()
	_, p, _ := net.SplitHostPort(addr)
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return uint16(n)
}

// errOf is the failure failed holds, if any.
func errOf(failed *atomic.Pointer[error]) error {
	if p := failed.Load(); p != nil {
		return *p
	}
	return nil
}
