package proxy

import (
	"bytes"
	"maps"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/relay"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// queueSetup is one egress session congested by uploads through a path
// throttled to queueRate: a new link's stream open (its SYN, then its
// header) waits behind what the session queued, longer than the link's
// connect budget (connect_timeout plus ping_timeout).
type queueSetup struct {
	srv   *readAll
	eg    *harness
	dark  atomic.Bool // the path carries nothing more, either way
	ups   []*net.TCPConn
	wg    sync.WaitGroup
	stop  chan struct{}
	limit time.Duration // connect_timeout + ping_timeout
}

const (
	queueRate    = 512 << 10
	queueUploads = 8
	queueSize    = 512 << 10 // 4 MiB in all: 8 s at queueRate
)

func queueBeat(s *policy.Settings) {
	s.Mesh.PingInterval = policy.Duration(250 * time.Millisecond)
	s.Mesh.PingTimeout = policy.Duration(time.Second)
}

// startQueue opens queueUploads links on one session, has the egress
// attach them all, and starts their uploads.
func startQueue(t *testing.T) *queueSetup { return startQueueOf(t, 1<<20, queueSize, time.Second) }

// startQueueOf is startQueue with the egress's high_water_mark hwm (its
// session's TCP_NOTSENT_LOWAT a quarter of it), uploads of size each, and
// settle the wait after they start.
func startQueueOf(t *testing.T, hwm int64, size int, settle time.Duration) *queueSetup {
	return startQueueAt(t, queueRate, hwm, size, settle, nil)
}

// startQueueAt is startQueueOf through a path throttled to rate, the
// egress's settings tuned by tune (nil: none).
func startQueueAt(t *testing.T, rate int, hwm int64, size int, settle time.Duration, tune func(*policy.Settings)) *queueSetup {
	q := &queueSetup{stop: make(chan struct{})}
	q.srv = startReadAll(t, "127.0.0.1:0")
	in := startIngress(t, "127.0.0.2", q.srv.ln.Addr().String(), queueBeat)
	rl, err := relay.Start(in.addr(), time.Second, darkThrottle(rate, &q.dark, q.stop))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rl.Close)
	t.Cleanup(func() { close(q.stop) }) // first: the dark movers end, then the relay closes
	q.eg = startEgress(t, q.srv.ln.Addr().String(), portOfInt(t, rl.Addr()), func(s *policy.Settings) {
		queueBeat(s)
		s.Mesh.Sessions = 1
		s.ConnectTimeout = policy.Duration(300 * time.Millisecond)
		// The session's socket holds hwm/4 unsent (TCP_NOTSENT_LOWAT;
		// startQueue: 256 KiB), yamux's queue a frame (64 KiB at most)
		// of each upload: the SYN, then the header, each waits about
		// 1.5 s at queueRate (startQueue), well within the ingress's
		// wait for a header after the SYN (mesh.HeaderTimeout, 5 s).
		s.WriteBuffer.HighWaterMark = policy.Size(hwm)
		s.WriteBuffer.LowWaterMark = policy.Size(hwm / 2)
		if tune != nil {
			tune(s)
		}
	})
	q.limit = 300*time.Millisecond + time.Second
	for range queueUploads {
		q.ups = append(q.ups, q.eg.dial())
	}
	q.eg.waitLinksAttached(queueUploads, 30*time.Second)
	for _, c := range q.ups {
		q.wg.Add(1)
		go func() {
			defer q.wg.Done()
			_, _ = c.Write(bytes.Repeat([]byte("u"), size))
			_ = c.CloseWrite()
		}()
	}
	t.Cleanup(func() {
		for _, c := range q.ups {
			_ = c.Close()
		}
		q.wg.Wait()
	})
	// startQueue: the uploads fill the session's send queue, half a MiB
	// of them has gone out by then, the rest (3.5 MiB, 7 s at queueRate)
	// waits.
	time.Sleep(settle)
	return q
}

// A link opened on a session whose send queue holds more than its
// connect budget's worth (uploads to a live peer that reads slowly)
// connects once its header goes out: the time its stream's open and
// header waited in this proxy's own queue is not spent from the budget
// (the heartbeat judges the peer meanwhile). Before, its ack was awaited
// until connect_timeout plus ping_timeout from the dial's start, which
// the queue had spent: the link gave up, its abandoned attempt reached
// the server as a connection that was reset, and it tried again.
// Here the wait is mostly in yamux's queue (the socket's is 256 KiB,
// 0.5 s): it passes without sendQueue.restart, see
// TestMeshLinkOpenBehindTheSocketsSendQueue for that.
func TestMeshLinkOpenBehindTheSendQueue(t *testing.T) {
	connectsBehind(t, startQueue(t), queueSize)
}

// The same with the queue in the session's socket alone: uploads (1 MiB
// in all) that its unsent backlog (TCP_NOTSENT_LOWAT 1 MiB, at
// high_water_mark 4 MiB) takes in whole, so that the new link's stream
// open and header pass yamux's queue at once (no time discounted there)
// and wait behind them in the socket for longer than the link's budget.
// The look at the wait's end finds the peer's kernel has taken more of
// the bytes ahead of the header, and the wait starts again
// (sendQueue.restart). Without that look the link gave up and tried
// again (2 attempts). The link is dialled once the socket holds 3/4 MiB
// (1.5 s at queueRate): its own count, not a sleep.
func TestMeshLinkOpenBehindTheSocketsSendQueue(t *testing.T) {
	const size = 128 << 10
	q := startQueueOf(t, 4<<20, size, 0)
	waitFor(t, 10*time.Second, "the session's socket holding 3/4 MiB", func() bool {
		return sessionQueued(q.eg) >= 768<<10
	})
	connectsBehind(t, q, size)
}

// sessionQueued is what the kernel holds of h's one egress session's
// bytes (SIOCOUTQ), 0 if none.
func sessionQueued(h *harness) int64 {
	h.p.meshMu.Lock()
	peers := slices.Collect(maps.Values(h.p.peers))
	h.p.meshMu.Unlock()
	for _, pr := range peers {
		pr.mu.Lock()
		ss := slices.Clone(pr.sessions)
		pr.mu.Unlock()
		for _, es := range ss {
			if raw, err := es.Conn.SyscallConn(); err == nil {
				if d, ok := flow.SampleDelivery(raw); ok {
					return d.Queued
				}
			}
		}
	}
	return 0
}

// connectsBehind dials a link on q's congested session and asserts it
// connects on its first attempt, and every upload of size reaches the
// server whole.
func connectsBehind(t *testing.T, q *queueSetup, size int) {
	c := q.eg.dial()
	if _, err := c.Write([]byte("late")); err != nil {
		t.Fatal(err)
	}
	_ = c.CloseWrite()
	s := q.eg.linkEndOf(c, 60*time.Second)
	t.Logf("the link made %d connect attempts, the last took %v (connect budget %v); it ended %s (%v)",
		s.ConnectAttempts, s.ConnectTime.Round(time.Millisecond), q.limit, s.Reason, s.Err)
	if s.ConnectAttempts != 1 {
		t.Fatalf("the link made %d connect attempts, want 1: it gave up its stream and tried again", s.ConnectAttempts)
	}
	if got := testutil.ToFloat64(q.eg.m.ForListener("test").DialErrors); got != 0 {
		t.Fatalf("%v dial errors, want none", got)
	}
	if s.Reason != CloseClientClosed && s.Reason != CloseUpstreamClosed {
		t.Fatalf("the link ended %s (%v), want a clean end", s.Reason, s.Err)
	}
	if s.ConnectTime <= q.limit {
		t.Fatalf("the link's connect took %v, within its connect budget (%v): the queue did not hold it, the test proves nothing", s.ConnectTime, q.limit)
	}
	total := 0
	for i := range queueUploads + 1 {
		select {
		case err := <-q.srv.ended:
			if err != nil {
				t.Fatalf("connection %d ended %v at the server, want a clean end", i, err)
			}
			total += <-q.srv.n
		case <-time.After(60 * time.Second):
			t.Fatalf("%d of %d connections ended at the server in 60 s", i, queueUploads+1)
		}
	}
	if want := queueUploads*size + len("late"); total != want {
		t.Fatalf("the server got %d bytes, want %d", total, want)
	}
	if got := testutil.ToFloat64(q.eg.m.MeshSessionDeaths(metrics.MeshEgress)); got != 0 {
		t.Fatalf("%v session deaths on a congested path, want none", got)
	}
}

// The twin: the same queue, then the path goes dark while the new link's
// stream waits in it. The heartbeat declares the session dead within
// ping_timeout and a second of the dark (nothing arrives), the endpoint
// is excluded mesh_dead, and the waiting link ends mesh_dead with it:
// the queue's wait is bounded by the session's life, not by a clock.
func TestMeshLinkOpenBehindTheSendQueueOfADeadPeer(t *testing.T) {
	q := startQueue(t)
	c := q.eg.dial()
	time.Sleep(300 * time.Millisecond) // its stream waits in yamux's queue
	darkEnds(t, q, c)
}

// The twin of TestMeshLinkOpenBehindTheSocketsSendQueue: the path goes
// dark once the wait for the ack has run out and started again (the
// socket's queue moved: testHookAckRenewed's own), the header still
// behind the socket's bytes. The restarted wait does not outlive the
// session: the link ends mesh_dead with it, within ping_timeout and a
// second.
func TestMeshLinkOpenBehindTheSocketsSendQueueOfADeadPeer(t *testing.T) {
	q := startQueueOf(t, 4<<20, 128<<10, 0)
	waitFor(t, 10*time.Second, "the session's socket holding 3/4 MiB", func() bool {
		return sessionQueued(q.eg) >= 768<<10
	})
	var renewed atomic.Int32
	hook := func(own, _ bool) {
		if own {
			renewed.Add(1)
		}
	}
	testHookAckRenewed.Store(&hook)
	t.Cleanup(func() { testHookAckRenewed.Store(nil) })
	c := q.eg.dial()
	waitFor(t, 20*time.Second, "the new link's ack wait started again for its own send queue", func() bool { return renewed.Load() > 0 })
	darkEnds(t, q, c)
}

// darkEnds has q's path go dark while c's link waits to connect, and
// asserts the link, the session and the endpoint end mesh_dead within
// ping_timeout and a second of the fault taking effect at the egress:
// the dark, or the session's last arrival when bytes already on their
// way (in the relay's socket, or unread in the egress's) arrived after
// it, from which the heartbeat counts the silence. The link's end is the
// proxy's own (its stats), not when this test got to read it; the time
// this process could not run meanwhile is added to the bound, as the
// heartbeat does not count it against the peer (mesh.silence; a loaded
// machine under -race measured 2.04 s from the dark once).
func darkEnds(t *testing.T, q *queueSetup, c *net.TCPConn) {
	es := firstEgressSession(q.eg.p)
	if es == nil {
		t.Fatal("no egress session to go dark")
	}
	stalls := meterStalls(t)
	q.dark.Store(true)
	darkAt := flow.Mono()
	s := q.eg.linkEndOf(c, 30*time.Second)
	stalled := stalls()
	heard := es.LastHeard()
	from := max(darkAt, heard)
	ended := time.Duration(flow.MonoOf(s.Opened.Add(s.Duration)) - from)
	t.Logf("the waiting link ended %s (%v) %v after the fault took effect at the egress (its last arrival %v after the dark; this process stalled %v)",
		s.Reason, s.Err, ended.Round(time.Millisecond), time.Duration(heard-darkAt).Round(time.Millisecond), stalled.Round(time.Millisecond))
	if s.Reason != CloseMeshDead {
		t.Fatalf("the waiting link ended %s (%v), want mesh_dead", s.Reason, s.Err)
	}
	if limit := time.Second + time.Second + stalled; ended > limit {
		t.Fatalf("the waiting link ended %v after the fault took effect at the egress, want within ping_timeout + 1 s and this process's stalls (%v)", ended, limit)
	}
	waitFor(t, 5*time.Second, "the session's death counted", func() bool {
		return testutil.ToFloat64(q.eg.m.MeshSessionDeaths(metrics.MeshEgress)) == 1
	})
	ep := q.eg.waitState("excluded", 5*time.Second)
	if ep.Reason != string(CloseMeshDead) {
		t.Fatalf("endpoint excluded for %q, want mesh_dead", ep.Reason)
	}
}
