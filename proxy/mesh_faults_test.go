package proxy

// Tests from an audit of the mesh end: each failed before its fix (the
// comment on each says what the fault was).

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/relay"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// frameCutter follows the yamux frames of the ingress-to-egress direction
// of a relayed session (after the handshake's reply) and, once armed,
// lets through the header and half the body of the next data frame, then
// nothing more.
type frameCutter struct {
	skip   int // handshake bytes still to pass
	hdr    [mesh.YamuxHeaderLen]byte
	hdrN   int
	body   uint32
	cut    int // -1: no cut chosen; else bytes still to pass before it
	armed  *atomic.Bool
	frames int // data frames seen
}

// feed returns how many bytes of b go through, and whether the cut is
// reached at their end.
func (f *frameCutter) feed(b []byte) (int, bool) {
	for i := 0; i < len(b); i++ {
		switch {
		case f.cut >= 0:
			if f.cut == 0 {
				return i, true
			}
			f.cut--
		case f.skip > 0:
			f.skip--
		case f.body > 0:
			f.body--
		default:
			f.hdr[f.hdrN] = b[i]
			if f.hdrN++; f.hdrN < mesh.YamuxHeaderLen {
				continue
			}
			f.hdrN = 0
			if f.hdr[1] != 0 { // not a data frame
				continue
			}
			f.frames++
			n := binary.BigEndian.Uint32(f.hdr[8:])
			f.body = n
			if f.armed.Load() && n >= 2 {
				f.body, f.cut = 0, int(n/2)
			}
		}
	}
	return len(b), f.cut == 0
}

// blackholeMidFrame relays a mesh session both ways until armed; then the
// path goes dark in the middle of the next data frame from the ingress:
// half its body has come, the rest never does, and nothing passes either
// way any more (a partition, or a peer sidecar frozen while it wrote).
// holed is closed when that happens (once, whichever of the sessions
// relayed goes dark first); the handler's goroutines end when stop is
// closed.
func blackholeMidFrame(armed *atomic.Bool, holed, stop chan struct{}) relay.Handler {
	var once sync.Once // holed is shared by every connection relayed
	return func(down, up net.Conn) {
		var dark atomic.Bool
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { // egress -> ingress
			defer wg.Done()
			buf := make([]byte, 4096)
			for !dark.Load() {
				_ = down.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
				n, err := down.Read(buf)
				if n > 0 && !dark.Load() {
					if _, werr := up.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil && !deadlinePassed(err) {
					return
				}
			}
			<-stop
		}()
		go func() { // ingress -> egress
			defer wg.Done()
			f := &frameCutter{skip: mesh.ReplyLen, cut: -1, armed: armed}
			buf := make([]byte, 4096)
			for {
				n, err := up.Read(buf)
				if n > 0 {
					k, cut := f.feed(buf[:n])
					if _, werr := down.Write(buf[:k]); werr != nil {
						return
					}
					if cut {
						dark.Store(true)
						once.Do(func() { close(holed) })
						<-stop
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
		wg.Wait()
	}
}

// streamingServer writes 64 KiB chunks to every connection until it fails
// (an ingress's readiness check just closes).
func streamingServer(t *testing.T, addr string) string {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	return serveConns(t, ln, func(c net.Conn, _ <-chan struct{}) {
		chunk := bytes.Repeat([]byte("d"), 64<<10)
		for {
			if _, err := c.Write(chunk); err != nil {
				return
			}
		}
	})
}

// goroutineOf is the stack of the first goroutine whose stack holds fn.
func goroutineOf(fn string) string {
	var b strings.Builder
	_ = pprof.Lookup("goroutine").WriteTo(&b, 2)
	for _, g := range strings.Split(b.String(), "\n\n") {
		if strings.Contains(g, fn) {
			return g
		}
	}
	return "(none)"
}

// A path that goes dark in the middle of a data frame the egress is
// receiving (a partition during a download, or the ingress sidecar
// frozen while it wrote a frame) must end the link mesh_dead within
// ping_timeout plus a second, as any silent session's (README, "Mesh
// mode", Heartbeat). It does not: yamux's receive loop waits for the rest
// of the frame's body holding the stream's recvLock (yamux stream.go,
// readData), and the heartbeat, at its next ping interval, calls Tick ->
// egressSession.shrinkStreams -> Stream.Shrink, which waits for that lock
// for good. The heartbeat never checks again: no ping, no verdict, the
// link hangs, the endpoint is never excluded. shrinkStreams holds es.mu
// and the link's connMu meanwhile, so the link cannot even be aborted.
func TestMeshBlackholeMidFrameIsDetected(t *testing.T) {
	srv := streamingServer(t, "127.0.0.1:0")
	in := startIngress(t, "127.0.0.2", srv, nil)
	var armed atomic.Bool
	holed, stop := make(chan struct{}), make(chan struct{})
	rl, err := relay.Start(in.addr(), time.Second, blackholeMidFrame(&armed, holed, stop))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rl.Close)
	t.Cleanup(func() { close(stop) })
	eg := startEgress(t, srv, portOfInt(t, rl.Addr()), nil)

	c := eg.dial()
	got := make(chan int64, 1)
	go func() {
		n, _ := io.Copy(io.Discard, c)
		got <- n
	}()
	time.Sleep(300 * time.Millisecond) // the download flows
	armed.Store(true)
	select {
	case <-holed:
	case <-time.After(5 * time.Second):
		t.Fatal("no data frame to cut in 5 s")
	}
	t0 := time.Now()
	// ping_timeout is 300 ms here: the bound is 1.3 s; 5 s is plenty.
	deadline := time.After(5 * time.Second)
	for {
		select {
		case s := <-eg.ended:
			if s.Client != c.LocalAddr().String() {
				continue
			}
			if s.Reason != CloseMeshDead {
				t.Fatalf("link ended %s (%v), want mesh_dead", s.Reason, s.Err)
			}
			t.Logf("link ended mesh_dead %v after the path went dark", time.Since(t0).Round(time.Millisecond))
			return
		case <-deadline:
			t.Errorf("the link on a session dark mid-frame did not end within 5 s (ping_timeout 300 ms); egress session deaths: %v",
				testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)))
			t.Logf("the egress heartbeat's goroutine:\n%s", goroutineOf("egressSession).shrinkStreams"))
			// The proxy's own shutdown hangs too: it aborts the links
			// (connMu, held by shrinkStreams) before it closes the mesh.
			closed := make(chan struct{})
			go func() { _ = eg.p.Close(); close(closed) }()
			select {
			case <-closed:
			case <-time.After(3 * time.Second):
				t.Errorf("the egress proxy's Close did not return in 3 s:\n%s", goroutineOf("listener).abortAll"))
				closeEgressSessionConns(eg.p) // unstick it, so that the test ends
				<-closed
			}
			return
		}
	}
}

// closeEgressSessionConns closes the TCP connection of every egress
// session of p under yamux's feet.
func closeEgressSessionConns(p *Proxy) {
	p.meshMu.Lock()
	defer p.meshMu.Unlock()
	for _, pr := range p.peers {
		pr.mu.Lock()
		for _, es := range pr.sessions {
			_ = es.Conn.Close()
		}
		pr.mu.Unlock()
	}
}

// throttleDown relays a mesh session, the egress-to-ingress direction at
// full speed and the ingress-to-egress direction at about rate bytes a
// second in 4 KiB steps: a path congested one way, on which bytes keep
// moving.
func throttleDown(rate int) relay.Handler {
	pc := &pathCtl{}
	pc.rate.Store(int64(rate))
	return pc.handler
}

// pathCtl is a relayed mesh path a test changes as it goes: the
// ingress-to-egress direction moves about rate bytes a second in steps
// of chunk bytes (0: 4 KiB) (rate 0: at full speed); once dark is set
// nothing passes either way any more: what arrives is dropped, and a
// side's close or reset is not passed on either (a path that went dark
// carries no FIN). The relay's Close ends it then.
type pathCtl struct {
	rate  atomic.Int64
	dark  atomic.Bool
	chunk int
}

func (pc *pathCtl) handler(down, up net.Conn) {
	_ = down.(*net.TCPConn).SetReadBuffer(32 << 10)
	_ = up.(*net.TCPConn).SetReadBuffer(32 << 10)
	var wg sync.WaitGroup
	move := func(dst, src net.Conn, slow bool) {
		defer wg.Done()
		buf := make([]byte, 4096)
		if slow && pc.chunk > 0 {
			buf = make([]byte, pc.chunk)
		}
		for {
			n, err := src.Read(buf)
			if n > 0 && !pc.dark.Load() {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					break
				}
				if rate := pc.rate.Load(); slow && rate > 0 {
					time.Sleep(time.Duration(n) * time.Second / time.Duration(rate))
				}
			}
			if err != nil {
				break
			}
		}
		if !pc.dark.Load() {
			_ = dst.Close()
			_ = src.Close()
		}
	}
	wg.Add(2)
	go move(up, down, false)
	go move(down, up, true)
	wg.Wait()
}

// On a path congested one way (a download from the ingress, its bytes
// moving at 64 KiB/s, a 64 KiB frame about a second), the other way is
// free and should carry the egress's pings (README, Heartbeat: "on a path
// congested one way, the other way carries the pings"). It carries none
// while a frame arrives: the egress's heartbeat waits in Tick ->
// shrinkStreams -> Stream.Shrink for the recvLock yamux's receive loop
// holds until the frame's last byte. The ingress, hearing nothing for
// ping_timeout (300 ms here; 3 s at the defaults, a frame at about 21
// KiB/s), declares the live session dead and cuts the healthy link.
func TestMeshSlowDownloadKeepsEgressPinging(t *testing.T) {
	srv := streamingServer(t, "127.0.0.1:0")
	in := startIngress(t, "127.0.0.2", srv, nil)
	rl, err := relay.Start(in.addr(), time.Second, throttleDown(64<<10))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rl.Close)
	eg := startEgress(t, srv, portOfInt(t, rl.Addr()), nil)

	c := eg.dial()
	got := make(chan error, 1)
	go func() {
		_, err := io.Copy(io.Discard, c)
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("the download ended: %v", err)
	case s := <-eg.ended:
		t.Fatalf("the link ended %s (%v); ingress session deaths %v, egress %v", s.Reason, s.Err,
			testutil.ToFloat64(in.m.MeshSessionDeaths(metrics.MeshIngress)), testutil.ToFloat64(eg.m.MeshSessionDeaths(metrics.MeshEgress)))
	case <-time.After(5 * time.Second):
	}
	if d := testutil.ToFloat64(in.m.MeshSessionDeaths(metrics.MeshIngress)); d != 0 {
		t.Fatalf("%v ingress session deaths on a path where bytes keep moving, want none", d)
	}
}

// A link whose client half-closed and whose server has not finished its
// answer within half_close_timeout is cut: "Anything else that ends a
// link (... a timeout ...) resets both sides at once ... never a clean
// FIN" (README, "Half-close, and resets travel"), and the reason is
// half_close_timeout. A plain link does so. Through the mesh, yamux's own
// close timer (yamuxConfig: StreamCloseTimeout = half_close_timeout),
// armed a moment before the link's (st.Close arms it before it waits for
// its FIN to be written; passedFin arms the link's after), races it: when
// it wins, it force-closes the stream, the response pump reads that as
// the server's clean end (responses: io.EOF on a session still open) and
// passes a FIN to the client, which takes the cut-short answer for a whole
// one; the link ends client_closed. Sixteen links, each raced once (about
// one in four loses on a 2-core machine).
func TestMeshHalfCloseTimeoutResetsClient(t *testing.T) {
	for _, meshed := range []bool{false, true} {
		name := "plain"
		if meshed {
			name = "mesh"
		}
		t.Run(name, func(t *testing.T) {
			srv := faultpeer.New(t, faultpeer.HoldAfterEOF, faultpeer.Options{Addr: "127.0.0.2:0"})
			hc := func(s *policy.Settings) { s.HalfCloseTimeout = policy.Duration(300 * time.Millisecond) }
			var h *harness
			if meshed {
				in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
				h = startEgress(t, srv.Addr(), in.port, hc)
			} else {
				h = start(t, srv.Addr(), hc)
			}
			fins := 0
			for i := range 16 {
				c := h.dial()
				if _, err := c.Write([]byte("x")); err != nil {
					t.Fatal(err)
				}
				if err := c.CloseWrite(); err != nil {
					t.Fatal(err)
				}
				err, _ := waitClosed(t, c, 5*time.Second)
				s := h.linkEndOf(c, 5*time.Second)
				if !errors.Is(err, syscall.ECONNRESET) || s.Reason != CloseHalfCloseTimeout {
					fins++
					t.Errorf("link %d: client saw %v, link ended %s; want a reset and %s", i, err, s.Reason, CloseHalfCloseTimeout)
				}
			}
			if fins > 0 {
				t.Errorf("%d of 16 links cut by half_close_timeout passed a clean end to their client", fins)
			}
		})
	}
}

// The same race on the ingress, the other way: the server answered and
// half-closed (its FIN passed on), the client's upload stalled (no FIN)
// when the ingress's half_close_timeout comes. The link must reset the server
// (a truncated upload is never passed on as a whole one). When yamux's
// close timer on the ingress wins, the ingress's request pump reads the
// force-closed stream's io.EOF as the client's FIN (streamClient.read:
// the session is still open) and passes a FIN to the server, which
// takes the cut-short upload for a whole one.
func TestMeshIngressHalfCloseTimeoutResetsServer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	ends := make(chan error, 64)
	serveConns(t, ln, func(c net.Conn, _ <-chan struct{}) {
		_, _ = c.Write([]byte("answer"))
		_ = c.(*net.TCPConn).CloseWrite()
		n, err := io.Copy(io.Discard, c)
		if n > 0 {
			ends <- err // nil: the upload ended with a FIN
		}
	})
	in := startIngress(t, "127.0.0.2", ln.Addr().String(), func(s *policy.Settings) {
		s.HalfCloseTimeout = policy.Duration(300 * time.Millisecond)
	})
	eg := startEgress(t, ln.Addr().String(), in.port, nil) // half_close_timeout 30 s
	fins := 0
	for i := range 16 {
		c := eg.dial()
		stop := make(chan struct{})
		up := make(chan struct{})
		go stalledUpload(c, stop, up)
		select {
		case err := <-ends:
			if err == nil {
				fins++
				t.Errorf("upload %d: the server saw a clean end of a cut-short upload", i)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("upload %d: not ended at the server in 5 s", i)
		}
		close(stop)
		<-up
		_ = c.Close()
	}
	if fins > 0 {
		t.Errorf("%d of 16 uploads cut by the ingress's half_close_timeout reached the server as whole ones (FIN)", fins)
	}
}

// egressWithConfig is startEgress that also returns its config, for
// reloads (Apply).
func egressWithConfig(t *testing.T, upstream string, meshPort int, tune func(*policy.Settings)) (*harness, policy.Config) {
	t.Helper()
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	fastMesh(&s)
	s.Mesh.Port = meshPort
	if tune != nil {
		tune(&s)
	}
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Upstream: upstream, Settings: s}}
	h := &harness{t: t, m: metrics.New(), ended: make(chan LinkStats, 256)}
	h.p = New(cfg, Options{metrics: h.m, Logger: testLogger(), OnLinkEnd: func(s LinkStats) { h.ended <- s }})
	if err := h.p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.p.Close() })
	h.addr = h.p.Addr("test").String()
	return h, cfg
}

// A retired session is closed by its heartbeat "once its last stream has
// ended" (Session.retired; README, "Bounded state": "after a reload an
// idle session of the old settings is retired"). It never is: the
// heartbeat waits for NumStreams() == 0, and the status stream the
// ingress opened stays open for the session's life, so a retired
// session's count never drops below 1. Each reload that changes the mesh
// settings leaves the idle sessions of the old ones open for good (their
// heartbeats, their sockets, a place in the ingress's
// max_sessions_per_peer); once they fill it, the ingress refuses every
// new session from this sidecar and new links to the peer fail. Here
// max_sessions_per_peer is 3 and each of 4 reloads changes ping_interval.
func TestMeshRetiredSessionCloses(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressL(t, "127.0.0.2", srv.Addr(), func(l *policy.Listener) { l.Ingress.MaxSessionsPerPeer = 3 })
	eg, cfg := egressWithConfig(t, srv.Addr(), in.port, func(s *policy.Settings) { s.Mesh.Sessions = 1 })
	sessions := func() float64 { return testutil.ToFloat64(in.m.MeshSessions(metrics.MeshIngress)) }
	for i := range 5 {
		if i > 0 {
			cfg.Listeners[0].Settings.Mesh.PingInterval = policy.Duration(50*time.Millisecond + time.Duration(i)*time.Millisecond)
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			if _, err := eg.p.Apply(cfg); err != nil {
				t.Fatal(err)
			}
		}
		nc, err := net.Dial("tcp", eg.addr)
		if err != nil {
			ep := eg.endpoint()
			t.Fatalf("after %d reloads a new link was refused: %v; endpoint %s (%s); the ingress holds %v sessions of this sidecar, %v refused for max_sessions_per_peer",
				i, err, ep.State, ep.Reason, sessions(), in.limitHits(mesh.LimitSessionsPerPeer))
		}
		c := nc.(*net.TCPConn)
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		msg := []byte("after reload " + string(rune('0'+i)))
		if _, err := c.Write(msg); err != nil {
			t.Fatalf("reload %d: %v", i, err)
		}
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(c, buf); err != nil {
			s := eg.linkEndOf(c, 5*time.Second)
			t.Fatalf("after %d reloads a new link failed: %v (link ended %s: %v); the ingress holds %v sessions of this sidecar, %v refused for max_sessions_per_peer",
				i, err, s.Reason, s.Err, sessions(), in.limitHits(mesh.LimitSessionsPerPeer))
		}
		_ = c.Close()
		eg.linkEndOf(c, 5*time.Second)
		if i == 0 {
			continue
		}
		// The new link retired the idle session of the old settings: it
		// should close within a few heartbeat steps.
		deadline := time.Now().Add(10 * time.Second)
		for sessions() > 1 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if n := sessions(); n > 1 {
			t.Errorf("reload %d: the ingress still holds %v sessions of this sidecar 10 s after the idle ones were retired, want 1", i, n)
		}
	}
}

// An ingress listener that a reload replaces (here renamed, on the same
// address; a changed ingress.local does the same) drains: "An ingress that
// stops accepting (shutdown, or its listener removed by a reload)
// announces every port not ready ... the links still open are left to
// finish ... by the exclusion and by the readmission that follows", and a
// port's epoch is "drawn again when it turns ready after refusing
// connections". The new ingress draws new epochs for ports whose server
// never stopped (judgeLocked: old.Epoch == 0), and the egress, once a
// probe's new session brings the new boot's status, takes them for a
// server that started afresh and evicts every link still draining
// through the old ingress (applyStatus -> evictMeshEpoch).
func TestMeshReplacedIngressLetsLinksDrain(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in, eg := replaceableIngress(t, srv.Addr())
	c := eg.dial()
	roundTrip(t, c, []byte("before"))
	in.rename(t)
	eg.waitReadmitted(srv.Addr(), 10*time.Second) // excluded (not ready), then readmitted through the new ingress
	time.Sleep(time.Second)
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("during the drain")); err == nil {
		buf := make([]byte, len("during the drain"))
		if _, err = io.ReadFull(c, buf); err == nil {
			return
		}
	}
	s := eg.linkEndOf(c, 5*time.Second)
	t.Fatalf("the link open before the reload, whose server never stopped, ended %s (%v) during the old ingress's drain, want it kept", s.Reason, s.Err)
}

// replaceableIngress starts an ingress in front of local on a fixed
// address (so that a reload can replace it there) and an egress to it.
func replaceableIngress(t *testing.T, local string) (*ingressProxy, *harness) {
	listen := net.JoinHostPort("127.0.0.2", strconv.Itoa(refusingPort(t, "127.0.0.2")))
	in := startIngressL(t, "127.0.0.2", local, func(l *policy.Listener) { l.Listen = listen })
	return in, startEgress(t, local, in.port, nil)
}

// rename replaces the ingress listener by reload with one of another
// name on the same address.
func (in *ingressProxy) rename(t *testing.T) {
	t.Helper()
	cfg := in.cfg
	cfg.Listeners = slices.Clone(cfg.Listeners)
	cfg.Listeners[0].Name += "-renamed"
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if _, err := in.p.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	in.cfg = cfg
}

// The twin of TestMeshReplacedIngressLetsLinksDrain: a port that refused
// connections while its ingress was replaced gets a new epoch from the new
// ingress, as from the old one (its server started afresh).
func TestMeshReplacedIngressNewEpochAfterARefusal(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	addr := srv.Addr()
	in, eg := replaceableIngress(t, addr)
	roundTrip(t, eg.dial(), []byte("before"))
	pr := eg.p.meshPeer("127.0.0.2", in.port)
	_, sp, _ := net.SplitHostPort(addr)
	n, _ := strconv.Atoi(sp)
	first := waitEpoch(t, pr, uint16(n))

	srv.Close()
	eg.waitStateOf(addr, "excluded", 5*time.Second)
	in.rename(t)
	// The new ingress checks the port (refused) before the server is back.
	ing := in.p.listeners[0].ingress
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		ing.mu.Lock()
		refused := ing.checks[uint16(n)] != nil && ing.checks[uint16(n)].refused
		ing.mu.Unlock()
		if refused {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the new ingress did not find the port refusing within 5s")
		}
	}
	faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: addr})
	eg.waitReadmittedOf(addr, 10*time.Second)
	if got := pr.epochOf(uint16(n)); got == first || got == 0 {
		t.Fatalf("epoch %d after the server refused and came back under a replaced ingress, want a new one (was %d)", got, first)
	}
	roundTrip(t, eg.dialWhenReadmitted(5*time.Second), []byte("after"))
}

// stalledUpload writes a little to c, then nothing more (and no FIN)
// until stop is closed, then closes up: an upload that stopped moving,
// which half_close_timeout ends once the other side has sent its FIN.
func stalledUpload(c net.Conn, stop <-chan struct{}, up chan<- struct{}) {
	defer close(up)
	if _, err := c.Write([]byte("upload chunk ")); err != nil {
		return
	}
	<-stop
}
