package proxy

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/mesh"

	"github.com/hashicorp/yamux"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/relay"
	"github.com/livenessproxy/livenessproxy/policy"
)

// rawHandshake dials an ingress's mesh port as an egress would and does
// the handshake; it returns the connection and the answer's code and
// streams per session.
func rawHandshake(t *testing.T, addr string) (*net.TCPConn, byte, int) {
	t.Helper()
	return rawHandshakeFrom(t, nil, addr)
}

// rawHandshakeFrom is rawHandshake from the local address from (nil:
// any).
func rawHandshakeFrom(t *testing.T, from net.IP, addr string) (*net.TCPConn, byte, int) {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second}
	if from != nil {
		d.LocalAddr = &net.TCPAddr{IP: from}
	}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(mesh.Preface()); err != nil {
		t.Fatal(err)
	}
	var b [mesh.ReplyLen]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		t.Fatalf("handshake answer: %v", err)
	}
	if !bytes.Equal(b[:mesh.PrefaceLen], mesh.Preface()) {
		t.Fatalf("handshake answer %q, want the preface", b[:])
	}
	_ = c.SetDeadline(time.Time{})
	return c.(*net.TCPConn), b[mesh.PrefaceLen], int(binary.BigEndian.Uint32(b[mesh.PrefaceLen+1:]))
}

func (in *ingressProxy) addr() string { return in.p.Addr("ingress").String() }

func (in *ingressProxy) limitHits(limit string) float64 {
	return testutil.ToFloat64(in.m.MeshLimits(metrics.MeshIngress, limit))
}

func waitFor(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(within); !cond(); {
		if time.Now().After(end) {
			t.Fatalf("not within %v: %s", within, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A peer that sends pings without end and never reads its answers is cut
// off: yamux would start a goroutine for each ping (the review saw 12 to
// 91,139 goroutines in 3 s); the guard lets at most maxPendingPings wait.
func TestMeshPingFloodCut(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	runtime.GC()
	base := runtime.NumGoroutine()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	baseMem := ms.StackInuse + ms.HeapInuse

	c, _, _ := rawHandshake(t, in.addr())
	var ping [mesh.YamuxHeaderLen]byte
	ping[1] = mesh.YamuxTypePing
	binary.BigEndian.PutUint16(ping[2:], mesh.YamuxFlagSYN)
	batch := bytes.Repeat(ping[:], 1000)
	peakG, peakMem, sent := 0, uint64(0), 0
	end := time.Now().Add(3 * time.Second)
	cut := false
	for i := 0; i < 2000 && time.Now().Before(end); i++ { // at most 2 million pings, 3 s
		_ = c.SetWriteDeadline(time.Now().Add(time.Second))
		if _, err := c.Write(batch); err != nil {
			cut = true
			break
		}
		sent += len(batch) / mesh.YamuxHeaderLen
		if i%20 == 0 {
			peakG = max(peakG, runtime.NumGoroutine())
			runtime.ReadMemStats(&ms)
			peakMem = max(peakMem, ms.StackInuse+ms.HeapInuse)
		}
	}
	t.Logf("ping flood: %d pings sent, cut=%v; goroutines %d at the start, at most %d during; stack+heap %d KiB at the start, at most %d KiB during",
		sent, cut, base, peakG, baseMem>>10, peakMem>>10)
	waitFor(t, 5*time.Second, "the flood's session cut", func() bool {
		return in.limitHits(mesh.LimitPings) == 1 && testutil.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)) == 0
	})
	if peakG > base+50 {
		t.Fatalf("goroutines rose from %d to %d under the ping flood, want at most %d more", base, peakG, 50)
	}
}

// The heartbeat's own pings, one in flight at a time, are never taken
// for a flood (the twin of TestMeshPingFloodCut).
func TestMeshHeartbeatIsNoPingFlood(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	eg := startEgress(t, srv.Addr(), in.port, nil)
	c := eg.dial()
	roundTrip(t, c, []byte("hello"))
	time.Sleep(20 * 50 * time.Millisecond) // 20 ping intervals each way
	roundTrip(t, c, []byte("still here"))
	if got := in.limitHits(mesh.LimitPings); got != 0 {
		t.Fatalf("%v ping-flood cuts of a heartbeat, want none", got)
	}
	if got := testutil.ToFloat64(eg.m.MeshLimits(metrics.MeshEgress, mesh.LimitPings)); got != 0 {
		t.Fatalf("%v ping-flood cuts on the egress, want none", got)
	}
}

// synFrames is n yamux frames that open streams (a window update with
// SYN), the client's odd ids from first on.
func synFrames(first uint32, n int) []byte {
	b := make([]byte, n*mesh.YamuxHeaderLen)
	for i := range n {
		f := b[i*mesh.YamuxHeaderLen:]
		f[1] = 1 // a window update
		binary.BigEndian.PutUint16(f[2:], mesh.YamuxFlagSYN)
		binary.BigEndian.PutUint32(f[4:], first+2*uint32(i))
	}
	return b
}

// A peer that opens streams past its limit without end and never reads
// has its session cut: the reset refusing each waits to be written (the
// review saw 1,995,276 bytes of them after 2.4 MB of SYNs), and the
// heartbeat never ends the session, since bytes keep arriving. At most
// max_streams_per_session and 1024 more wait.
func TestMeshRefusalFloodCut(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) { l.Ingress.MaxStreamsPerSession = 1 })
	c, _, _ := rawHandshake(t, in.addr())
	_ = c.SetReadBuffer(4 << 10) // the resets fill what the path holds sooner
	const batch = 1000
	sent, cut := 0, false
	end := time.Now().Add(5 * time.Second)
	for id := uint32(1); sent < 8<<20 && time.Now().Before(end); id += 2 * batch { // at most 8 MB of SYNs, 5 s
		_ = c.SetWriteDeadline(time.Now().Add(time.Second))
		n, err := c.Write(synFrames(id, batch))
		sent += n
		if errors.Is(err, os.ErrDeadlineExceeded) {
			continue // a slow ingress: keep pushing until the end
		}
		if err != nil {
			cut = true // reset or closed: the session was cut
			break
		}
	}
	t.Logf("refusal flood: %d bytes of SYNs sent, cut=%v", sent, cut)
	waitFor(t, 5*time.Second, "the flood's session cut", func() bool {
		return in.limitHits(mesh.LimitRefusals) == 1 && testutil.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)) == 0
	})
}

// A peer that reads what it is sent may have any number of streams
// refused, far more than the bound of TestMeshRefusalFloodCut: only the
// refusals waiting to be written count (its twin).
func TestMeshRefusalsOfAReadingPeerAreNoFlood(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) { l.Ingress.MaxStreamsPerSession = 1 })
	sess, _ := rawSession(t, in)
	const opens = 3000 // the bound is 1 + 1024
	for i := range opens {
		if _, err := sess.OpenStream(); err != nil { // yamux waits when 256 opens are unanswered
			t.Fatalf("open %d: %v", i, err)
		}
	}
	// A burst of opens read at once may be taken before the first of
	// them counts (held until their header times out): wait for more
	// refusals than the bound allows to wait, not for every open.
	waitFor(t, 20*time.Second, "more opens refused than the bound", func() bool {
		return in.limitHits(mesh.LimitStreamsPerSession) > 1+1024
	})
	if sess.IsClosed() || in.limitHits(mesh.LimitRefusals) != 0 {
		t.Fatalf("the session was cut (closed %v, refusals limit %v): a reading peer is no flood",
			sess.IsClosed(), in.limitHits(mesh.LimitRefusals))
	}
}

// openRaw opens a stream for port on a raw session and waits for the
// ingress's answer: true when it acknowledged (a link to the server).
func openRaw(sess *yamux.Session, port uint16) (*yamux.Stream, bool) {
	st, err := sess.OpenStream()
	if err != nil {
		return nil, false
	}
	if _, err := st.Write(mesh.Header(port)); err != nil {
		return st, false
	}
	_ = st.SetReadDeadline(time.Now().Add(5 * time.Second))
	var ack [1]byte
	_, err = io.ReadFull(st, ack[:])
	_ = st.SetReadDeadline(time.Time{})
	return st, err == nil && ack[0] == mesh.Ack
}

func rawSession(t *testing.T, in *ingressProxy) (*yamux.Session, int) {
	t.Helper()
	c, code, streams := rawHandshake(t, in.addr())
	if code != mesh.OK {
		t.Fatalf("handshake code %d, want ok", code)
	}
	cfg := yamux.DefaultConfig()
	cfg.EnableKeepAlive = false
	cfg.LogOutput = io.Discard
	sess, err := yamux.Client(c, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sess.Close() })
	return sess, streams
}

func portOf(t *testing.T, addr string) uint16 {
	_, p, _ := net.SplitHostPort(addr)
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return uint16(n)
}

// A session that opens streams without end gets max_streams_per_session
// of them (the handshake says how many), the others reset before they
// reach the server; and the ingress as a whole carries max_streams.
func TestMeshStreamLimits(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) {
		l.Ingress.MaxStreamsPerSession = 20
		l.Ingress.MaxStreams = 30
	})
	port := portOf(t, srv.Addr())
	waitFor(t, 5*time.Second, "the local port ready", func() bool { return in.p.listeners[0].ingress.snapshot().Ports[port].Ready })

	sess, granted := rawSession(t, in)
	if granted != 20 {
		t.Fatalf("the handshake grants %d streams per session, want 20", granted)
	}
	acked := 0
	for range 100 {
		if _, ok := openRaw(sess, port); ok {
			acked++
		}
	}
	if acked > 20 || acked < 19 { // 19: the one-stream-stricter moment before the status stream counts
		t.Fatalf("%d of 100 streams on one session reached the server, want 20 (max_streams_per_session)", acked)
	}
	if in.limitHits(mesh.LimitStreamsPerSession) < 1 {
		t.Fatalf("no streams_per_session limit counted")
	}
	if sess.IsClosed() {
		t.Fatalf("the session was closed: a refused stream is reset, its session lives")
	}
	// A second session: the ingress stops at 30 in all.
	sess2, _ := rawSession(t, in)
	acked2 := 0
	for range 20 {
		if _, ok := openRaw(sess2, port); ok {
			acked2++
		}
	}
	if acked+acked2 != 30 {
		t.Fatalf("%d+%d streams reached the server, want 30 (max_streams)", acked, acked2)
	}
	if in.limitHits(mesh.LimitStreams) < 1 {
		t.Fatalf("no streams limit counted")
	}
	if n := len(in.p.listeners[0].snapshotLinks()); n != 30 {
		t.Fatalf("the ingress carries %d links, want 30", n)
	}
}

// heldStreams is the data streams the ingress's yamux sessions hold (their
// status streams not counted).
func (in *ingressProxy) heldStreams() int {
	ig := in.p.listeners[0].ingress
	ig.mu.Lock()
	defer ig.mu.Unlock()
	held := 0
	for is := range ig.sessions {
		held += is.Sess.NumStreams() - int(is.statusOpen.Load())
	}
	return held
}

// counted is the ingress's count of the streams it carries.
func (in *ingressProxy) counted() int64 { return in.p.listeners[0].ingress.streams.Load() }

// Streams that wait for their header, or whose header is bad, count
// against ingress.max_streams, and a refused one is reset, not
// half-closed: the review's three raw sessions, with max_streams 30, left
// yamux holding 573 streams (each with what the peer pushed into its
// window, for the half_close_timeout) and ~146 MiB more heap.
func TestMeshStreamsAwaitingTheirHeaderCount(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) {
		l.Ingress.MaxStreamsPerSession = 200
		l.Ingress.MaxStreams = 30
	})
	junk := append([]byte("XXXXXX"), bytes.Repeat([]byte("y"), 32<<10)...)
	var writers sync.WaitGroup
	var sessions []*yamux.Session
	for range 3 {
		sess, _ := rawSession(t, in)
		sessions = append(sessions, sess)
		for i := range 190 {
			st, err := sess.OpenStream()
			if err != nil {
				t.Fatalf("open %d: %v", i, err)
			}
			if i%2 == 0 { // a bad header and 32 KiB; the others send nothing
				writers.Add(1)
				go func() {
					defer writers.Done()
					_, _ = st.Write(junk)
				}()
			}
		}
	}
	defer func() {
		for _, s := range sessions {
			_ = s.Close()
		}
		writers.Wait()
	}()
	// The streams past the bound are reset as the ingress gets to them:
	// 570 of them take a while on a loaded machine (34 still held after
	// 3 s once, under -race with other tests), so the wait is generous;
	// what is asserted is the ingress's own count and its end state.
	held := in.heldStreams()
	for end := time.Now().Add(20 * time.Second); held > 30 && time.Now().Before(end); held = in.heldStreams() {
		time.Sleep(10 * time.Millisecond)
	}
	if n := in.counted(); held > 30 || n > 30 {
		t.Fatalf("the ingress's sessions hold %d streams and it counts %d, past max_streams 30", held, n)
	}
	if in.limitHits(mesh.LimitStreams) < 1 {
		t.Fatalf("no streams limit counted")
	}
}

// The ingress counts a stream from its accept to its end whatever way it
// ends (a bad header, a port it does not serve, past max_streams, a link
// that ends, a session that closes), once: the count comes back to 0. A
// stream refused is reset, not half-closed.
func TestMeshIngressStreamCountReleasedOnce(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) { l.Ingress.MaxStreams = 4 })
	port := portOf(t, srv.Addr())
	waitFor(t, 5*time.Second, "the local port ready", func() bool { return in.p.listeners[0].ingress.snapshot().Ports[port].Ready })
	sess, _ := rawSession(t, in)
	var sts []*yamux.Stream
	for range 4 {
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Write(mesh.Header(port)[:1]); err != nil { // not yet a header
			t.Fatal(err)
		}
		sts = append(sts, st)
	}
	waitFor(t, 5*time.Second, "four streams counted while they wait for their header", func() bool { return in.counted() == 4 })
	if _, ok := openRaw(sess, port); ok {
		t.Fatalf("a fifth stream reached the server past max_streams 4")
	}
	if in.limitHits(mesh.LimitStreams) != 1 {
		t.Fatalf("%v streams limit hits, want 1", in.limitHits(mesh.LimitStreams))
	}
	refused := func(st *yamux.Stream, what string) {
		t.Helper()
		_ = st.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := st.Read(make([]byte, 1)); !errors.Is(err, yamux.ErrConnectionReset) {
			t.Fatalf("%s: the stream read %v, want a reset", what, err)
		}
	}
	_, _ = sts[0].Write([]byte("XXXXX")) // a bad header: "LXXXXX"
	refused(sts[0], "a bad header")
	_, _ = sts[1].Write(mesh.Header(port + 1)[1:]) // a port the ingress does not serve
	refused(sts[1], "a port not served")
	_, _ = sts[2].Write(mesh.Header(port)[1:])
	var ack [1]byte
	_ = sts[2].SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(sts[2], ack[:]); err != nil || ack[0] != mesh.Ack {
		t.Fatalf("a good header: ack %v, %v", ack, err)
	}
	waitFor(t, 5*time.Second, "the refused streams released", func() bool { return in.counted() == 2 })
	_ = sts[2].Close() // the link ends
	waitFor(t, 5*time.Second, "the link's stream released", func() bool { return in.counted() == 1 })
	_ = sess.Close() // and sts[3], still without its header, with it
	waitFor(t, 5*time.Second, "every stream released", func() bool { return in.counted() == 0 })
	time.Sleep(100 * time.Millisecond)
	if n := in.counted(); n != 0 {
		t.Fatalf("the ingress counts %d streams after all ended, want 0", n)
	}
}

// An egress's links up to max_streams all reach the server, and the count
// comes back to 0 when they end (the twin of the two above).
func TestMeshStreamsUpToMaxStreamsAllServed(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) { l.Ingress.MaxStreams = 30 })
	eg := startEgress(t, srv.Addr(), in.port, nil)
	var cs []*net.TCPConn
	for i := range 30 {
		c := eg.dial()
		roundTrip(t, c, []byte("link "+strconv.Itoa(i)))
		cs = append(cs, c)
	}
	if n := in.counted(); n != 30 {
		t.Fatalf("the ingress counts %d streams, want 30", n)
	}
	for _, c := range cs {
		_ = c.Close()
	}
	waitFor(t, 5*time.Second, "every stream released", func() bool { return in.counted() == 0 })
	if got := in.limitHits(mesh.LimitStreams); got != 0 {
		t.Fatalf("%v streams limit hits, want none", got)
	}
}

// A peer address holds at most max_sessions_per_peer sessions; a peer
// outside ingress.allow gets none.
func TestMeshSessionLimitsAndAllow(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) { l.Ingress.MaxSessionsPerPeer = 3 })
	var codes []byte
	for range 5 {
		_, code, _ := rawHandshake(t, in.addr())
		codes = append(codes, code)
	}
	if !bytes.Equal(codes, []byte{mesh.OK, mesh.OK, mesh.OK, mesh.Refused, mesh.Refused}) {
		t.Fatalf("handshake codes %v, want three ok then refused", codes)
	}
	if got := in.limitHits(mesh.LimitSessionsPerPeer); got != 2 {
		t.Fatalf("%v sessions_per_peer refusals, want 2", got)
	}

	allowed := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) { l.Ingress.Allow = []string{"127.0.0.3", "10.0.0.0/8"} })
	if _, code, _ := rawHandshake(t, allowed.addr()); code != mesh.Refused {
		t.Fatalf("a peer outside ingress.allow got code %d, want refused", code)
	}
	if got := allowed.limitHits(mesh.LimitPeerNotAllowed); got != 1 {
		t.Fatalf("%v peer_not_allowed refusals, want 1", got)
	}
	ok := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) { l.Ingress.Allow = []string{"127.0.0.0/8"} })
	if _, code, _ := rawHandshake(t, ok.addr()); code != mesh.OK {
		t.Fatalf("a peer inside ingress.allow got code %d, want ok", code)
	}
}

// readAll is a server that reads each connection to its end and reports
// how it ended and how many bytes came.
type readAll struct {
	ln    net.Listener
	ended chan error
	n     chan int
	wg    sync.WaitGroup
}

func startReadAll(t *testing.T, addr string) *readAll {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	r := &readAll{ln: ln, ended: make(chan error, 100), n: make(chan int, 100)}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			r.wg.Add(1)
			go func() {
				defer r.wg.Done()
				defer c.Close()
				n, err := io.Copy(io.Discard, c)
				if n == 0 && err == nil {
					return // an ingress's readiness check
				}
				r.n <- int(n)
				r.ended <- err // nil: a clean end of stream
			}()
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); r.wg.Wait() })
	return r
}

// A client that sends 100 kB and then resets: the server behind the
// ingress sees a reset, as it would through a plain link, not a clean
// end after 100,000 bytes (a truncated upload taken for a whole one).
func TestMeshClientResetReachesServer(t *testing.T) {
	srv := startReadAll(t, "127.0.0.2:0")
	in := startIngress(t, "127.0.0.2", srv.ln.Addr().String(), nil)
	eg := startEgress(t, srv.ln.Addr().String(), in.port, nil)
	c := eg.dial()
	if _, err := c.Write(bytes.Repeat([]byte("x"), 100000)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // the bytes go first, as in the review
	_ = c.SetLinger(0)
	_ = c.Close()
	select {
	case err := <-srv.ended:
		if !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("the server saw %v after %d bytes, want a reset", err, <-srv.n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the server's connection did not end")
	}
}

// A server that resets its connection: the client before the egress sees
// a reset, not a FIN (a cut-short response taken for a whole one).
func TestMeshServerResetReachesClient(t *testing.T) {
	addr := serveEach(t, "127.0.0.2", func(c *net.TCPConn) {
		var b [5]byte
		if _, err := io.ReadFull(c, b[:]); err == nil { // not a readiness check
			_, _ = c.Write([]byte("partial"))
			_ = c.SetLinger(0)
		}
	})
	in := startIngress(t, "127.0.0.2", addr, nil)
	eg := startEgress(t, addr, in.port, nil)
	c := eg.dial()
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	err, _ := waitClosed(t, c, 10*time.Second)
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("client saw %v, want a reset", err)
	}
}

// throttle relays both ways at about rate bytes a second, in 4 KiB
// steps: a congested path on which bytes keep moving. Its receive buffers
// are small (no autotuning to tens of MiB), so what the path cannot carry
// waits in the sender, as on a real bottleneck.
func throttle(rate int) relay.Handler { return darkThrottle(rate, new(atomic.Bool), nil) }

// darkThrottle is throttle(rate) that, once dark is set, moves nothing
// more either way (a path gone dark: the bytes wait unread) until stop
// is closed.
func darkThrottle(rate int, dark *atomic.Bool, stop <-chan struct{}) relay.Handler {
	return func(down, up net.Conn) {
		_ = down.(*net.TCPConn).SetReadBuffer(32 << 10)
		_ = up.(*net.TCPConn).SetReadBuffer(32 << 10)
		var wg sync.WaitGroup
		move := func(dst, src net.Conn) {
			defer wg.Done()
			defer func() { _ = dst.Close(); _ = src.Close() }()
			buf := make([]byte, 4096)
			for {
				if dark.Load() {
					<-stop
					return
				}
				n, err := src.Read(buf)
				if n > 0 && !dark.Load() {
					if _, werr := dst.Write(buf[:n]); werr != nil {
						return
					}
					time.Sleep(time.Duration(n) * time.Second / time.Duration(rate))
				}
				if err != nil {
					return
				}
			}
		}
		wg.Add(2)
		go move(up, down)
		go move(down, up)
		wg.Wait()
	}
}

// Uploads that share one session over a path throttled to 2 MiB/s all
// finish: every byte keeps moving, so no link is cut for the time its
// frames wait in the send queue (yamux's ConnectionWriteTimeout was the
// mesh's write_timeout, 200 ms here: all 64 links of the review were cut)
// and no frame is lost.
//
// Every link has its stream open (the ingress's ack arrived: the egress
// attached it) before any upload starts. A stream opened during the
// congestion writes its header behind the uploads' queued bytes, and waits
// for its ack as long as they take to drain: as the machine slows the
// throttle down, past the link's connect budget (connect_timeout plus
// ping_timeout). Its link then tries again, and the attempt it abandoned
// reaches the server as a connection that is reset: "upload 5 ended ...
// connection reset by peer at the server" under -race -cpu 1 beside two
// CPU hogs, with link opens taking up to 2.26 s of the 2.3 s budget (1.5
// s heartbeat: 2.18 s of 3.5 s). That is a connect behind a congested
// path, not what this test is about.
//
// Its heartbeat is slower than fastMesh's (ping_timeout 1.5 s, not 300
// ms), still well inside the ~4 s the queue takes to drain, so the
// heartbeat is still judged under the congestion. It was slowed after
// two failures under load at 300 ms: the reset upload was the connect
// above; the other ("0 of 32 uploads ended at the server in 60 s") was
// not reproduced (with the opens first, 300 ms passed 10 of 10 runs
// under -race -cpu 1 beside two CPU hogs, no session death), so the
// margin stays.
func TestMeshCongestionKeepsLinks(t *testing.T) {
	slowerBeat := func(s *policy.Settings) {
		s.Mesh.PingInterval = policy.Duration(250 * time.Millisecond)
		s.Mesh.PingTimeout = policy.Duration(1500 * time.Millisecond)
	}
	srv := startReadAll(t, "127.0.0.1:0")
	in := startIngress(t, "127.0.0.2", srv.ln.Addr().String(), slowerBeat)
	rl, err := relay.Start(in.addr(), time.Second, throttle(2<<20))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rl.Close)
	eg := startEgress(t, srv.ln.Addr().String(), portOfInt(t, rl.Addr()), func(s *policy.Settings) {
		slowerBeat(s)
		s.Mesh.Sessions = 1
	})
	const uploads, size = 32, 256 << 10 // 8 MiB in all: about 4 s at 2 MiB/s, half of it more than the sender's socket holds
	cs := make([]*net.TCPConn, uploads)
	for i := range cs {
		cs[i] = eg.dial()
	}
	eg.waitLinksAttached(uploads, 30*time.Second)
	var wg sync.WaitGroup
	errs := make(chan error, uploads)
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := c.Write(bytes.Repeat([]byte("u"), size)); err != nil {
				errs <- err
				return
			}
			_ = c.CloseWrite()
			_ = c.SetReadDeadline(time.Now().Add(60 * time.Second))
			if _, err := io.Copy(io.Discard, c); err != nil {
				errs <- err
			}
			_ = c.Close()
		}()
	}
	total := 0
	for i := range uploads {
		select {
		case err := <-srv.ended:
			if err != nil {
				t.Fatalf("upload %d ended %v at the server, want a clean end", i, err)
			}
			total += <-srv.n
		case <-time.After(60 * time.Second):
			t.Fatalf("%d of %d uploads ended at the server in 60 s", i, uploads)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("a client saw %v", err)
	}
	if total != uploads*size {
		t.Fatalf("the server got %d bytes, want %d", total, uploads*size)
	}
	for range uploads {
		if s := eg.linkEnd(10 * time.Second); s.Reason != CloseClientClosed && s.Reason != CloseUpstreamClosed {
			t.Fatalf("link ended %s (%v), want a clean end", s.Reason, s.Err)
		}
	}
	if got := testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)); got != 0 {
		t.Fatalf("%v session deaths on a congested path, want none", got)
	}
}

func portOfInt(t *testing.T, addr string) int { return int(portOf(t, addr)) }

// waitLinksAttached waits until n links of the listener have their
// upstream (a mesh link: the ingress's ack arrived).
func (h *harness) waitLinksAttached(n int, within time.Duration) {
	h.t.Helper()
	l := h.p.listeners[0]
	for deadline := time.Now().Add(within); ; time.Sleep(5 * time.Millisecond) {
		got := 0
		l.mu.Lock()
		for lk := range l.links {
			lk.connMu.Lock()
			if lk.up != nil {
				got++
			}
			lk.connMu.Unlock()
		}
		l.mu.Unlock()
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("%d of %d links had their upstream within %v", got, n, within)
		}
	}
}

// foreignPeer accepts on host and answers whatever comes with another
// protocol's bytes, as a port of another mesh (an HTTP/2 server's
// settings frame here) would.
func foreignPeer(t *testing.T, host string) int {
	addr := serveEach(t, host, func(c *net.TCPConn) {
		_, _ = c.Write([]byte("\x00\x00\x00\x04\x00\x00\x00\x00\x00")) // an HTTP/2 SETTINGS frame
	})
	return portOfInt(t, addr)
}

// serveEach listens on host and runs serve for each connection, one at
// a time, then closes it; it returns the address.
func serveEach(t *testing.T, host string, serve func(*net.TCPConn)) string {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			serve(c.(*net.TCPConn))
			_ = c.Close()
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	return ln.Addr().String()
}

// A peer whose mesh port answers with another protocol is no ingress:
// the link falls back at once (mesh.fallback: direct), as for a refused
// port, and under fallback: refuse the client is refused.
func TestMeshForeignPeerFallsBack(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	port := foreignPeer(t, "127.0.0.2")
	eg := startEgress(t, srv.Addr(), port, nil)
	t0 := time.Now()
	c := eg.dial()
	roundTrip(t, c, []byte("direct"))
	t.Logf("a link to a foreign peer's mesh port fell back and round-tripped in %v", time.Since(t0).Round(time.Microsecond))
	if got := testutil.ToFloat64(eg.m.MeshFallbacks("test")); got != 1 {
		t.Fatalf("%v fallbacks, want 1", got)
	}
	if st := eg.stateOf(srv.Addr()); st != "healthy" {
		t.Fatalf("endpoint %s, want healthy: a foreign peer is no fault of the server", st)
	}
	refusing := startEgress(t, srv.Addr(), port, func(s *policy.Settings) { s.Mesh.Fallback = policy.MeshFallbackRefuse })
	expectClosedSoon(t, refusing.addr)
	if s := refusing.linkEnd(5 * time.Second); s.Reason != CloseRefused {
		t.Fatalf("link ended %s, want refused", s.Reason)
	}
}

// An ingress answers a preface of another version with its own version,
// and a connection that is no egress (no preface) is closed.
func TestMeshHandshakeVersion(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	c, err := net.Dial("tcp", in.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	_, _ = c.Write(append([]byte(mesh.PrefaceMagic), 2))
	var b [mesh.ReplyLen]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		t.Fatal(err)
	}
	if b[len(mesh.PrefaceMagic)] != mesh.Version || b[mesh.PrefaceLen] != mesh.BadVersion {
		t.Fatalf("answer %q, want version %d and code bad version", b[:], mesh.Version)
	}
	// The egress side reads it as no ingress of its version.
	if _, err := readMeshReplyFrom(b[:]); !errors.Is(err, mesh.ErrNoIngress) {
		t.Fatalf("the egress reads %v, want no ingress (fallback)", err)
	}

	d, err := net.Dial("tcp", in.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	_, _ = d.Write([]byte("GET / HTTP/1.1\r\n\r\n"))
	if err, _ := waitClosed(t, d, 5*time.Second); !isCloseSignal(err) {
		t.Fatalf("a client without preface saw %v, want its connection closed", err)
	}
}

func readMeshReplyFrom(b []byte) (int, error) {
	a, z := net.Pipe()
	defer a.Close()
	go func() { _, _ = z.Write(b); _ = z.Close() }()
	return mesh.ReadReply(a)
}

// Connections that never send their preface hold a handshake slot for at
// most mesh.HeaderTimeout; past maxHandshakes waiting at once, a new one is
// reset at once and counted.
func TestMeshHandshakesBounded(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	const extra = 10
	for range maxHandshakes + extra {
		c, err := net.Dial("tcp", in.addr())
		if errors.Is(err, syscall.ECONNRESET) {
			continue // one past the bound, reset before the connect returned
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
	}
	waitFor(t, 5*time.Second, "the connections past maxHandshakes refused", func() bool {
		return in.limitHits(mesh.LimitHandshakes) == extra
	})
	// The slots are given back: once the silent ones timed out, a real
	// egress gets its session.
	ing := in.p.listeners[0].ingress
	waitFor(t, 3*mesh.HeaderTimeout, "the silent connections' handshakes timed out", func() bool { return ing.handshakes.Load() == 0 })
	eg := startEgress(t, srv.Addr(), in.port, nil)
	roundTrip(t, eg.dial(), []byte("through the mesh"))
	if got := testutil.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)); got != 1 {
		t.Fatalf("%v ingress sessions, want 1", got)
	}
}

// The egress keeps to the streams per session the handshake granted: with
// mesh.sessions 2 and 3 streams a session, the fourth and fifth links go
// on a second session, the seventh finds both full and is refused by the
// egress itself (upstream_error, the server not blamed); the ingress never
// has to reset one.
func TestMeshEgressKeepsToGrantedStreams(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) { l.Ingress.MaxStreamsPerSession = 3 })
	eg := startEgress(t, srv.Addr(), in.port, func(s *policy.Settings) { s.Mesh.Sessions = 2 })
	for i := range 6 {
		roundTrip(t, eg.dial(), []byte("link "+strconv.Itoa(i)))
	}
	if got := testutil.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)); got != 2 {
		t.Fatalf("%v ingress sessions for 6 links at 3 a session, want 2", got)
	}
	expectClosedSoon(t, eg.addr)
	if s := eg.linkEnd(5 * time.Second); s.Reason != CloseUpstreamError {
		t.Fatalf("the seventh link ended %s (%v), want upstream_error", s.Reason, s.Err)
	}
	if got := in.limitHits(mesh.LimitStreamsPerSession); got != 0 {
		t.Fatalf("the ingress refused %v streams, want none: the egress keeps to the grant", got)
	}
	if st := eg.stateOf(srv.Addr()); st != "healthy" {
		t.Fatalf("endpoint %s, want healthy", st)
	}
}

// A peer refused at the handshake (here: not in ingress.allow) can come
// back as fast as it likes: every refusal is counted, and logged at
// debug; at warn at most once a second, with the refusals since the line
// before. Before, each one wrote a warn line.
func TestMeshRefusalsWarnOncePerSecond(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	var sink syncBuffer
	log := zerolog.New(&sink).Level(zerolog.DebugLevel)
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	fastMesh(&s)
	cfg.Listeners = []policy.Listener{{Name: "ingress", Listen: "127.0.0.2:0", Settings: s,
		Ingress: policy.Ingress{Local: srv.Addr(), Allow: []string{"10.0.0.0/8"}}}}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	in := &ingressProxy{m: metrics.New(), cfg: cfg}
	in.p = New(cfg, Options{metrics: in.m, Logger: &log})
	if err := in.p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = in.p.Close() })
	const peers = 40
	began := time.Now()
	for range peers {
		if c, code, _ := rawHandshake(t, in.addr()); code != mesh.Refused {
			t.Fatalf("a peer outside ingress.allow got code %d, want refused", code)
		} else {
			_ = c.Close()
		}
	}
	var lines []map[string]any
	waitFor(t, 5*time.Second, "a line for every refusal", func() bool {
		lines = sink.lines(t, "mesh session refused: the peer is not in ingress.allow")
		return len(lines) >= peers
	})
	took := time.Since(began)
	warns := 0
	for _, l := range lines {
		if l["level"] == "warn" {
			warns++
		}
	}
	if most := 1 + int(took/logEvery); warns < 1 || warns > most {
		t.Fatalf("%d warn lines for %d refusals in %v, want 1 to %d", warns, peers, took, most)
	}
	if got := in.limitHits(mesh.LimitPeerNotAllowed); got != peers {
		t.Fatalf("%v refusals counted, want %d", got, peers)
	}
}

// The status stream carries statuses from the ingress to the egress and
// nothing the other way: a session whose peer sends bytes on it is
// closed. Before, the ingress never read the stream, and what a peer
// pushed into it sat in yamux's buffer for the session's life, up to
// the stream's window (twice that in memory) a session, outside every
// bound (1,024 sessions: about 512 MiB).
//
// The twin: a peer that reads the statuses and closes its side of the
// stream, as an egress does at its end, keeps its session, which serves
// a link afterwards.
func TestMeshStatusStreamCarriesNothingFromThePeer(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	port := portOf(t, srv.Addr())
	acceptStatus := func(sess *yamux.Session) *yamux.Stream {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		st, err := sess.AcceptStreamWithContext(ctx)
		if err != nil {
			t.Fatalf("the ingress's status stream: %v", err)
		}
		_ = st.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := mesh.ReadStatus(st); err != nil {
			t.Fatalf("the first status: %v", err)
		}
		return st
	}

	pushing, _ := rawSession(t, in)
	st := acceptStatus(pushing)
	// The ingress closes the session on the first byte it reads there: the
	// write may see the session shut down before its last frame is sent.
	if _, err := st.Write(bytes.Repeat([]byte("x"), 64<<10)); err != nil &&
		!errors.Is(err, yamux.ErrSessionShutdown) && !errors.Is(err, yamux.ErrConnectionReset) {
		t.Fatal(err)
	}
	select {
	case <-pushing.CloseChan():
	case <-time.After(5 * time.Second):
		t.Fatal("a session whose peer pushed 64 KiB into the status stream is still open after 5s")
	}

	polite, _ := rawSession(t, in)
	st = acceptStatus(polite)
	_ = st.Close() // a FIN: the peer's side is done
	link, ok := openRaw(polite, port)
	if !ok {
		t.Fatal("after the peer closed its side of the status stream, a link stream was not acknowledged")
	}
	roundTripStream(t, link, "the session goes on")
	if polite.IsClosed() {
		t.Fatal("the session of a peer that sent nothing on the status stream was closed")
	}
}
