package proxy

import (
	"bytes"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/relay"
	"github.com/livenessproxy/livenessproxy/policy"
)

// gatedServer streams 64 KiB chunks to each connection once its first
// byte has arrived, until the connection fails. Its accept queue holds one
// connection (listen backlog 0): once gated it accepts no more, and a
// connect to it then waits (its SYNs dropped) until the test ends, a
// server the ingress cannot reach without being refused.
type gatedServer struct {
	ln       net.Listener
	accepted atomic.Int32
	gated    atomic.Bool
	stopped  chan struct{} // closed when the accept loop ends
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
}

func startGatedServer(t *testing.T) *gatedServer {
	t.Helper()
	ln, _ := listenBacklog0On(t, [4]byte{127, 0, 0, 1})
	s := &gatedServer{ln: ln, stopped: make(chan struct{})}
	s.wg.Go(s.accept)
	t.Cleanup(func() {
		_ = ln.Close()
		s.mu.Lock()
		for _, c := range s.conns {
			_ = c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *gatedServer) addr() string { return s.ln.Addr().String() }

func (s *gatedServer) accept() {
	defer close(s.stopped)
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns = append(s.conns, c)
		s.mu.Unlock()
		if s.gated.Load() {
			_ = c.Close()
			return
		}
		s.accepted.Add(1)
		s.wg.Go(func() {
			defer c.Close()
			var b [1]byte
			if _, err := c.Read(b[:]); err != nil {
				return
			}
			chunk := bytes.Repeat([]byte("d"), 64<<10)
			for {
				if _, err := c.Write(chunk); err != nil {
					return
				}
			}
		})
	}
}

// gate stops the server accepting and fills its accept queue: a connect
// to it no longer completes (checked: one does not in 300 ms).
func (s *gatedServer) gate(t *testing.T) {
	t.Helper()
	s.gated.Store(true)
	for i := range 2 { // the first is accepted and ends the accept loop, the second fills the queue
		c, err := net.DialTimeout("tcp", s.addr(), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		s.conns = append(s.conns, c)
		s.mu.Unlock()
		if i == 0 {
			<-s.stopped
		}
	}
	if c, err := net.DialTimeout("tcp", s.addr(), 300*time.Millisecond); err == nil {
		_ = c.Close()
		t.Fatal("a connect to the gated server completed: its accept queue is not full, the test proves nothing")
	}
}

// downSetup is one egress session congested from the peer's side:
// queueUploads downloads through a path throttled to queueRate, so that
// what the ingress sends (a new link's ack among it) waits behind them
// in the ingress's send queue.
type downSetup struct {
	srv     *gatedServer
	q       queueSetup // eg, dark, stop, limit (queueSetup's own fields)
	renewed struct{ own, peer atomic.Int32 }
}

// startDownloads starts the setup: the links attach before the server
// streams anything (each client's first byte starts its download), so
// that it does not rely on what it tests; the peer's queue holds about
// two seconds of them after settle.
func startDownloads(t *testing.T, settle time.Duration, tune func(*policy.Settings)) *downSetup {
	d := &downSetup{}
	d.q.stop = make(chan struct{})
	d.srv = startGatedServer(t)
	in := startIngressL(t, "127.0.0.2", d.srv.addr(), func(l *policy.Listener) {
		queueBeat(&l.Settings)
		l.Ingress.CheckInterval = policy.Duration(time.Hour) // one check, at the start
		l.Settings.ConnectTimeout = policy.Duration(time.Minute)
	})
	waitFor(t, 10*time.Second, "the ingress's first check of its server", func() bool { return d.srv.accepted.Load() >= 1 })
	rl, err := relay.Start(in.addr(), time.Second, darkThrottle(queueRate, &d.q.dark, d.q.stop))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rl.Close)
	t.Cleanup(func() { close(d.q.stop) })
	d.q.eg = startEgress(t, d.srv.addr(), portOfInt(t, rl.Addr()), func(s *policy.Settings) {
		queueBeat(s)
		s.Mesh.Sessions = 1
		s.ConnectTimeout = policy.Duration(300 * time.Millisecond)
		if tune != nil {
			tune(s)
		}
	})
	d.q.limit = 300*time.Millisecond + time.Second
	hook := func(own, peer bool) {
		if own {
			d.renewed.own.Add(1)
		}
		if peer {
			d.renewed.peer.Add(1)
		}
	}
	testHookAckRenewed.Store(&hook)
	t.Cleanup(func() { testHookAckRenewed.Store(nil) })
	var downs []*net.TCPConn
	for range queueUploads {
		downs = append(downs, d.q.eg.dial())
	}
	d.q.eg.waitLinksAttached(queueUploads, 30*time.Second)
	for _, c := range downs {
		d.q.wg.Go(func() {
			if _, err := c.Write([]byte("g")); err == nil {
				_, _ = io.Copy(io.Discard, c)
			}
		})
	}
	t.Cleanup(func() {
		for _, c := range downs {
			_ = c.Close()
		}
		d.q.wg.Wait()
	})
	time.Sleep(settle)
	return d
}

// A link opened on a session that downloads congest from the peer's
// side (a live peer and server, a slow path) connects on its first
// attempt: the ingress's ack, a byte of stream data, waits in the
// ingress's send queue behind the downloads' frames, and the egress
// keeps waiting for it while their data keeps arriving (peerQueue).
// Before, the egress gave the stream up after its connect budget plus
// ping_timeout, the ingress's connect to the server was reset, and after
// 3 attempts the link ended dial_error with everything healthy.
//
// The client half-closes as soon as it has sent its byte, while the link
// waits for the ack: a FIN is no client leaving (the twin of
// TestMeshLinkWaitingForItsAckEndsWithItsClient), the link goes on.
func TestMeshLinkOpenBehindThePeersSendQueue(t *testing.T) {
	d := startDownloads(t, 2*time.Second, nil)
	c := d.q.eg.dial()
	if _, err := c.Write([]byte("g")); err != nil {
		t.Fatal(err)
	}
	_ = c.CloseWrite()
	_ = c.SetReadDeadline(time.Now().Add(40 * time.Second))
	_, rerr := io.ReadFull(c, make([]byte, 1000))
	_ = c.Close()
	s := d.q.eg.linkEndOf(c, 60*time.Second)
	t.Logf("the link made %d connect attempts, the last took %v (connect budget %v), its wait renewed %d times for the peer's queue; its read: %v",
		s.ConnectAttempts, s.ConnectTime.Round(time.Millisecond), d.q.limit, d.renewed.peer.Load(), rerr)
	if s.ConnectAttempts != 1 {
		t.Fatalf("the link made %d connect attempts, want 1: it gave up its stream (%s: %v)", s.ConnectAttempts, s.Reason, s.Err)
	}
	if got := testutil.ToFloat64(d.q.eg.m.ForListener("test").DialErrors); got != 0 {
		t.Fatalf("%v dial errors, want none", got)
	}
	if rerr != nil {
		t.Fatalf("the link's client read %v, want the server's bytes", rerr)
	}
	if s.ConnectTime <= d.q.limit || d.renewed.peer.Load() == 0 {
		t.Fatalf("the link's connect took %v (its wait renewed %d times for the peer's queue), within its connect budget (%v): the queue did not hold its ack, the test proves nothing",
			s.ConnectTime, d.renewed.peer.Load(), d.q.limit)
	}
	if got := testutil.ToFloat64(d.q.eg.m.MeshSessionDeaths(metrics.MeshEgress)); got != 0 {
		t.Fatalf("%v session deaths on a congested path, want none", got)
	}
}

// The twin: the same downloads, then the path goes dark once the new
// link's wait has started again for the peer's queue. Nothing arrives
// any more: the heartbeat declares the session dead within ping_timeout
// and a second of the dark, and the waiting link ends mesh_dead with it,
// the endpoint excluded mesh_dead. The renewals do not outlive the
// session.
func TestMeshLinkOpenBehindThePeersSendQueueOfADeadPeer(t *testing.T) {
	d := startDownloads(t, 2*time.Second, nil)
	c := d.q.eg.dial()
	if _, err := c.Write([]byte("g")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "the new link's wait renewed for the peer's queue", func() bool { return d.renewed.peer.Load() > 0 })
	darkEnds(t, &d.q, c)
}

// The twin on a quiet session: an ingress that cannot reach its server
// (its connects wait, SYNs dropped: it neither acknowledges nor refuses)
// has the link judged as before, each attempt given up once its connect
// budget plus ping_timeout has run out: no data arrives on the session
// (the heartbeat's pings and their answers do not count, nor does the
// status stream), so the wait never starts again, and after
// connect_attempts the link ends dial_error.
func TestMeshLinkToAStuckIngressOnAQuietSession(t *testing.T) {
	d := &downSetup{}
	d.srv = startGatedServer(t)
	in := startIngressL(t, "127.0.0.1", d.srv.addr(), func(l *policy.Listener) {
		queueBeat(&l.Settings)
		l.Ingress.CheckInterval = policy.Duration(time.Hour)
		l.Settings.ConnectTimeout = policy.Duration(time.Minute)
	})
	waitFor(t, 10*time.Second, "the ingress's first check of its server", func() bool { return d.srv.accepted.Load() >= 1 })
	d.srv.gate(t)
	eg := startEgress(t, d.srv.addr(), in.port, func(s *policy.Settings) {
		queueBeat(s)
		s.Mesh.Sessions = 1
		s.ConnectTimeout = policy.Duration(300 * time.Millisecond)
	})
	var renewed atomic.Int32
	hook := func(bool, bool) { renewed.Add(1) }
	testHookAckRenewed.Store(&hook)
	t.Cleanup(func() { testHookAckRenewed.Store(nil) })
	dialed := time.Now()
	c := eg.dial()
	s := eg.linkEndOf(c, 30*time.Second)
	t.Logf("the link made %d connect attempts and ended %s (%v) %v after its dial; its waits renewed %d times",
		s.ConnectAttempts, s.Reason, s.Err, time.Since(dialed).Round(time.Millisecond), renewed.Load())
	if s.Reason != CloseDialError || !errors.Is(s.Err, errMeshRefused) {
		t.Fatalf("the link ended %s (%v), want dial_error (%v)", s.Reason, s.Err, errMeshRefused)
	}
	if want := policy.DefaultConfig().Defaults.ConnectAttempts; s.ConnectAttempts != want {
		t.Fatalf("the link made %d connect attempts, want %d", s.ConnectAttempts, want)
	}
	if n := renewed.Load(); n != 0 {
		t.Fatalf("the ack's wait started again %d times on a quiet session, want none: a stuck ingress is judged later than before", n)
	}
}

// The bound: the same stuck ingress behind the downloads' queue (their
// data keeps arriving) has the link's wait renewed at most
// maxPeerQueueWaits times; then it gives the stream up and ends
// dial_error (one attempt).
func TestMeshLinkToAStuckIngressBehindThePeersSendQueue(t *testing.T) {
	d := startDownloads(t, time.Second, func(s *policy.Settings) { s.ConnectAttempts = 1 })
	d.srv.gate(t)
	d.renewed.peer.Store(0)
	dialed := time.Now()
	c := d.q.eg.dial()
	s := d.q.eg.linkEndOf(c, 60*time.Second)
	t.Logf("the link made %d connect attempts and ended %s (%v) %v after its dial (connect budget %v); its wait renewed %d times for the peer's queue",
		s.ConnectAttempts, s.Reason, s.Err, time.Since(dialed).Round(time.Millisecond), d.q.limit, d.renewed.peer.Load())
	if s.Reason != CloseDialError || !errors.Is(s.Err, errMeshRefused) {
		t.Fatalf("the link ended %s (%v), want dial_error (%v)", s.Reason, s.Err, errMeshRefused)
	}
	if n := d.renewed.peer.Load(); n == 0 || n > maxPeerQueueWaits {
		t.Fatalf("the ack's wait started again %d times for the peer's queue, want 1 to %d", n, maxPeerQueueWaits)
	}
}

// A link's stream open (its SYN) and its header are two frames, each
// waiting its turn in the egress's send queue: on a session congested by
// uploads through a slow path (96 KiB/s here: a round of the queue, a
// 64 KiB frame of each of 8 uploads and the socket's 256 KiB unsent,
// takes about 8 s) the header reaches the ingress well after
// mesh.HeaderTimeout (5 s) from the open. The ingress keeps waiting for
// it while the links' data keeps arriving (the egress's queue moves),
// and the link connects on its first attempt. Before, the ingress reset
// the stream 5 s after its open: the link was refused and tried again,
// behind the same queue.
//
// tcp_user_timeout is off on the session: at this rate the relay's
// 32 KiB receive buffer, with loopback's 64 KiB MSS, leaves the
// egress's window shut for long spells (the receiver opens it a whole
// MSS at a time), and the kernel cut the session with 10 s
// ("connection timed out"), a artefact of the loopback relay.
func TestMeshHeaderBehindTheSendQueueReachesTheIngress(t *testing.T) {
	const size = 256 << 10
	q := startQueueAt(t, 96<<10, 1<<20, size, time.Second, func(s *policy.Settings) { s.TCPUserTimeout = 0 })
	connectsBehind(t, q, size)
}

// A client that resets while its link waits for the ack (here a wait
// renewed for the peer's queue, for an ingress that never answers) ends
// the link at once: client_error, its stream reset, nothing counted
// against the endpoint. Before, the link waited on for its ack until the
// renewals ran out, holding its stream and its goroutine, and ended
// dial_error.
func TestMeshLinkWaitingForItsAckEndsWithItsClient(t *testing.T) {
	d := startDownloads(t, time.Second, func(s *policy.Settings) { s.ConnectAttempts = 1 })
	d.srv.gate(t)
	d.renewed.peer.Store(0)
	c := d.q.eg.dial()
	if _, err := c.Write([]byte("g")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "the new link's wait renewed for the peer's queue", func() bool { return d.renewed.peer.Load() > 0 })
	_ = c.SetLinger(0)
	_ = c.Close()
	reset := time.Now()
	s := d.q.eg.linkEndOf(c, 30*time.Second)
	t.Logf("the link ended %s (%v) %v after its client's reset; its wait renewed %d times",
		s.Reason, s.Err, time.Since(reset).Round(time.Millisecond), d.renewed.peer.Load())
	if s.Reason != CloseClientError || !errors.Is(s.Err, errClientLeft) {
		t.Fatalf("the link ended %s (%v), want client_error (%v)", s.Reason, s.Err, errClientLeft)
	}
	if got := testutil.ToFloat64(d.q.eg.m.ForListener("test").DialErrors); got != 0 {
		t.Fatalf("%v dial errors, want none", got)
	}
}

// A link waiting for its ack when the proxy shuts down (Close: no drain,
// every link aborted, its client closed) ends then, not when its wait
// runs out: the client watch sees its socket closed under it as it sees
// a reset. Before, the wait went on to its end, and Close with it: here
// one wait of connect budget plus ping_timeout (10.3 s), on a session
// whose peer's queue moves up to maxPeerQueueWaits more (peerQueue);
// a drain whose time runs out aborts its links the same way.
func TestMeshLinkWaitingForItsAckEndsWithTheProxy(t *testing.T) {
	srv := startGatedServer(t)
	in := startIngressL(t, "127.0.0.1", srv.addr(), func(l *policy.Listener) {
		queueBeat(&l.Settings)
		l.Ingress.CheckInterval = policy.Duration(time.Hour)
		l.Settings.ConnectTimeout = policy.Duration(time.Minute)
	})
	waitFor(t, 10*time.Second, "the ingress's first check of its server", func() bool { return srv.accepted.Load() >= 1 })
	srv.gate(t)
	const pingTimeout = 10 * time.Second
	eg := startEgress(t, srv.addr(), in.port, func(s *policy.Settings) {
		s.Mesh.Sessions = 1
		s.Mesh.PingInterval = policy.Duration(time.Second)
		s.Mesh.PingTimeout = policy.Duration(pingTimeout)
		s.ConnectTimeout = policy.Duration(300 * time.Millisecond)
		s.ConnectAttempts = 1
	})
	opened := make(chan struct{}, 1)
	hook := func(*egressSession, *yamux.Stream) {
		select {
		case opened <- struct{}{}:
		default:
		}
	}
	testHookMeshStreamOpened.Store(&hook)
	t.Cleanup(func() { testHookMeshStreamOpened.Store(nil) })
	c := eg.dial()
	select {
	case <-opened:
	case <-time.After(20 * time.Second):
		t.Fatal("the link opened no stream in 20 s")
	}
	time.Sleep(300 * time.Millisecond) // in its ack's wait (the test holds either way)
	began := time.Now()
	_ = eg.p.Close()
	s := eg.linkEndOf(c, 30*time.Second)
	ended := s.Opened.Add(s.Duration).Sub(began)
	t.Logf("the link ended %s (%v) %v after the proxy's Close began (its wait: %v)", s.Reason, s.Err, ended.Round(time.Millisecond), 300*time.Millisecond+pingTimeout)
	if s.Reason != CloseShutdown {
		t.Fatalf("the link ended %s (%v), want shutdown", s.Reason, s.Err)
	}
	if ended > pingTimeout/2 {
		t.Fatalf("the link ended %v after the proxy's Close began, want at once (its wait, %v, ran out first)", ended, 300*time.Millisecond+pingTimeout)
	}
	if got := testutil.ToFloat64(eg.m.ForListener("test").DialErrors); got != 0 {
		t.Fatalf("%v dial errors, want none", got)
	}
}
