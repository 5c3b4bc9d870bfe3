package proxy

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// rawIngress plays a peer sidecar's ingress on its mesh port: it answers
// the handshake, runs each session as an ingress does (a mesh.Session,
// server side: it answers the egress's pings and pings it), and hands
// each stream the egress opens to stream, with the session's index (0
// for the first accepted). It serves no server of its own: a stream it
// serves is acknowledged and echoed.
type rawIngress struct {
	ln       net.Listener
	addr     string
	stream   func(sess int, ms *mesh.Session, st *yamux.Stream)
	accepted atomic.Int32
	thaw     chan struct{} // closed at the test's end: frozen sessions end

	mu       sync.Mutex
	sessions []*mesh.Session
	conns    []*freezeConn
	wg       sync.WaitGroup
}

func startRawIngress(t *testing.T, host string, stream func(sess int, ms *mesh.Session, st *yamux.Stream)) *rawIngress {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	ri := &rawIngress{ln: ln, addr: ln.Addr().String(), stream: stream, thaw: make(chan struct{})}
	ri.wg.Add(1)
	go ri.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		close(ri.thaw)
		ri.mu.Lock()
		sessions := ri.sessions
		ri.mu.Unlock()
		for _, ms := range sessions {
			ms.Close()
		}
		ri.wg.Wait()
	})
	return ri
}

func (ri *rawIngress) accept() {
	defer ri.wg.Done()
	s := policy.DefaultConfig().Defaults
	fastMesh(&s)
	m := s.Mesh.OrDefaults()
	for {
		c, err := ri.ln.Accept()
		if err != nil {
			return
		}
		tc := c.(*net.TCPConn)
		_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
		var pre [mesh.PrefaceLen]byte
		if _, err := io.ReadFull(tc, pre[:]); err != nil {
			_ = tc.Close()
			continue
		}
		if _, err := tc.Write(mesh.Reply(mesh.OK, 16)); err != nil {
			_ = tc.Close()
			continue
		}
		_ = tc.SetDeadline(time.Time{})
		fc := &freezeConn{Conn: tc, thaw: ri.thaw}
		ms, err := mesh.NewSession(tc, fc, false, metrics.MeshIngress, m, zerolog.Nop(), metrics.New(), mesh.Hooks{}, mesh.Admission{Streams: 16})
		if err != nil {
			_ = tc.Close()
			continue
		}
		// The status stream, as an ingress opens it (no message on it):
		// the egress gives a session to links once it has arrived.
		if _, err := ms.Sess.OpenStream(); err != nil {
			ms.Close()
			continue
		}
		ri.mu.Lock()
		ri.sessions = append(ri.sessions, ms)
		ri.conns = append(ri.conns, fc)
		ri.mu.Unlock()
		n := int(ri.accepted.Add(1)) - 1
		ri.wg.Add(1)
		go ri.streams(n, ms)
	}
}

func (ri *rawIngress) streams(n int, ms *mesh.Session) {
	defer ri.wg.Done()
	for {
		st, err := ms.Sess.AcceptStream()
		if err != nil {
			return
		}
		ri.wg.Add(1)
		go func() {
			defer ri.wg.Done()
			ri.stream(n, ms, st)
		}()
	}
}

// session is the n-th session the ingress accepted, and its connection.
func (ri *rawIngress) session(n int) (*mesh.Session, *freezeConn) {
	ri.mu.Lock()
	defer ri.mu.Unlock()
	return ri.sessions[n], ri.conns[n]
}

// serveRaw acknowledges st, a stream to port, and echoes it.
func serveRaw(st *yamux.Stream, port uint16) {
	defer st.Close()
	_ = st.SetReadDeadline(time.Now().Add(5 * time.Second))
	if p, err := mesh.ReadHeader(st); err != nil || p != port {
		return
	}
	_ = st.SetReadDeadline(time.Time{})
	if _, err := st.Write([]byte{mesh.Ack}); err != nil {
		return
	}
	_, _ = io.Copy(st, st)
}

// freezeConn is a connection that, once frozen, neither reads nor
// writes: the peer sidecar, stopped, says nothing more.
type freezeConn struct {
	net.Conn
	frozen atomic.Bool
	thaw   <-chan struct{}
}

func (c *freezeConn) Read(b []byte) (int, error) {
	if c.frozen.Load() {
		<-c.thaw
		return 0, net.ErrClosed
	}
	return c.Conn.Read(b)
}

func (c *freezeConn) Write(b []byte) (int, error) {
	if c.frozen.Load() {
		<-c.thaw
		return 0, net.ErrClosed
	}
	return c.Conn.Write(b)
}

// headerReset is a raw ingress that refuses the first stream it is
// opened, at once (resetFirst), and an egress to it whose first stream
// waits, before its header is written, for that reset to arrive, then
// for then (with the stream's session), if any; read is what the stream
// read.
type headerReset struct {
	srv  *faultpeer.Server // the endpoint (the raw ingress stands in for it)
	ri   *rawIngress
	eg   *harness
	read chan error
}

func startHeaderReset(t *testing.T, then func(ri *rawIngress, es *egressSession), tune func(*policy.Settings)) *headerReset {
	t.Helper()
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	hr := &headerReset{srv: srv, read: make(chan error, 1)}
	hr.ri = startRawIngress(t, "127.0.0.2", resetFirst(portOf(t, srv.Addr())))
	var held atomic.Bool
	hook := func(es *egressSession, st *yamux.Stream) {
		if es.peer.addr != hr.ri.addr || !held.CompareAndSwap(false, true) {
			return
		}
		_ = st.SetReadDeadline(time.Now().Add(5 * time.Second))
		var b [1]byte
		_, err := st.Read(b[:])
		_ = st.SetReadDeadline(time.Time{})
		if then != nil {
			then(hr.ri, es)
		}
		hr.read <- err
	}
	testHookMeshStreamOpened.Store(&hook)
	t.Cleanup(func() { testHookMeshStreamOpened.Store(nil) })
	hr.eg = startEgress(t, srv.Addr(), portOfInt(t, hr.ri.addr), func(s *policy.Settings) {
		// mesh.sessions at its limit: every link and probe on the one
		// usable session, a new one dialled only when it is out of use.
		s.Mesh.Sessions = 1
		tune(s)
	})
	return hr
}

// resetFirst is an ingress that refuses the first stream it is opened
// (at once, before its header: as an ingress at a limit could) and
// serves the others.
func resetFirst(port uint16) func(int, *mesh.Session, *yamux.Stream) {
	var first atomic.Bool
	return func(_ int, ms *mesh.Session, st *yamux.Stream) {
		if first.CompareAndSwap(false, true) {
			ms.RefuseStream(st)
			return
		}
		serveRaw(st, port)
	}
}

// expectResetRead checks that the held stream read the ingress's reset:
// its header's write met it.
func (hr *headerReset) expectResetRead(t *testing.T) {
	t.Helper()
	select {
	case err := <-hr.read:
		if !errors.Is(err, yamux.ErrConnectionReset) {
			t.Fatalf("the held stream read %v, want the ingress's reset", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no stream was held")
	}
}

func (hr *headerReset) dialErrors() float64 {
	return testutil.ToFloat64(hr.eg.m.ForListener("test").DialErrors)
}

// expectNoRefusal checks that the held stream's failed write was taken
// for no refusal: no dial error counted, and the link's stream tried
// once more, on a new session.
func (hr *headerReset) expectNoRefusal(t *testing.T) {
	t.Helper()
	if n := hr.ri.accepted.Load(); n != 2 {
		t.Fatalf("%d sessions dialled, want 2: the link's stream tried once more on a new one", n)
	}
	if got := hr.dialErrors(); got != 0 {
		t.Fatalf("%v dial errors, want none: no refusal", got)
	}
}

// waitUpTo waits, a bounded time, until cond holds.
func waitUpTo(within time.Duration, cond func() bool) {
	for end := time.Now().Add(within); !cond() && time.Now().Before(end); {
		time.Sleep(5 * time.Millisecond)
	}
}

// A stream the peer sidecar resets while the egress writes its header,
// on a session that lives, is that stream's refusal (errMeshRefused), as
// a reset after the header is: the link tries its next endpoint (the
// same one again) on the same session, and nothing is held against the
// server. The session is kept: the link and the next one go on it. The
// egress used to retire the session (stream open failed) and dial
// another for the link: two sessions for two links.
func TestMeshHeaderWriteResetIsARefusal(t *testing.T) {
	hr := startHeaderReset(t, nil, func(s *policy.Settings) {
		s.ConnectTimeout = policy.Duration(5 * time.Second)
	})
	c1 := hr.eg.dial()
	roundTrip(t, c1, []byte("first"))
	hr.expectResetRead(t)
	c2 := hr.eg.dial()
	roundTrip(t, c2, []byte("second"))

	if n := hr.ri.accepted.Load(); n != 1 {
		t.Fatalf("%d sessions dialled for two links, want 1: the session was retired for one stream's refusal", n)
	}
	if es := firstEgressSession(hr.eg.p); es == nil || !es.Usable() {
		t.Fatal("the session is out of use, want it kept")
	}
	if got := hr.dialErrors(); got != 1 {
		t.Fatalf("%v dial errors, want 1: the refusal", got)
	}
	if st := hr.eg.stateOf(hr.srv.Addr()); st != "healthy" {
		t.Fatalf("endpoint %s, want healthy: a stream refused by the peer sidecar is no fault of the server", st)
	}
}

// The twin: a stream reset as its header is written on a session that
// closed meanwhile (the peer sidecar reset it, then closed the session)
// is no refusal: as before, the link's stream goes on a new session at
// once, no dial error counted.
func TestMeshHeaderWriteResetOnAClosedSession(t *testing.T) {
	var held *egressSession
	hr := startHeaderReset(t, func(ri *rawIngress, es *egressSession) {
		held = es
		ms, _ := ri.session(0)
		_ = ms.Sess.Close()
		waitUpTo(10*time.Second, es.Closed)
	}, func(s *policy.Settings) { s.ConnectTimeout = policy.Duration(20 * time.Second) })
	c := hr.eg.dial()
	roundTrip(t, c, []byte("on a new session"))
	hr.expectResetRead(t)
	if !held.Closed() || held.Dead.Load() {
		t.Fatalf("the held stream's session closed %v, dead %v: want closed, not dead", held.Closed(), held.Dead.Load())
	}
	hr.expectNoRefusal(t)
}

// The twin: a stream reset as its header is written on a session the
// heartbeat declared dead meanwhile (the peer sidecar reset it, then
// went silent) is no refusal: the session's death judges it, as before
// (the peer's endpoints excluded, the link's stream tried once more on a
// new session), no dial error counted.
func TestMeshHeaderWriteResetOnADeadSession(t *testing.T) {
	var held *egressSession
	hr := startHeaderReset(t, func(ri *rawIngress, es *egressSession) {
		held = es
		_, fc := ri.session(0)
		fc.frozen.Store(true)
		waitUpTo(10*time.Second, es.Dead.Load)
	}, func(s *policy.Settings) {
		// Beyond the wait for the heartbeat's verdict (ping_timeout
		// 300 ms, bounded above at 10 s): the link's budget lasts.
		s.ConnectTimeout = policy.Duration(20 * time.Second)
	})
	c := hr.eg.dial()
	hr.expectResetRead(t)
	if !held.Dead.Load() {
		t.Fatal("the held stream's session is not dead")
	}
	s := hr.eg.linkEndOf(c, 30*time.Second)
	t.Logf("link ended %s (%v)", s.Reason, s.Err)
	if got := testutil.ToFloat64(hr.eg.m.MeshSessionDeaths(metrics.MeshEgress)); got != 1 {
		t.Fatalf("%v egress session deaths, want 1", got)
	}
	hr.expectNoRefusal(t)
}
