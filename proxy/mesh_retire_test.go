package proxy

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/relay"
	"github.com/livenessproxy/livenessproxy/policy"
)

// latencyDown relays egress->ingress at once and ingress->egress with a
// fixed one-way latency (pipelined, not a stall).
func latencyDown(lat time.Duration) relay.Handler {
	return func(down, up net.Conn) {
		type chunk struct {
			at time.Time
			b  []byte
		}
		ch := make(chan chunk, 4096)
		done := make(chan struct{}, 3)
		go func() {
			_, _ = io.Copy(up, down)
			done <- struct{}{}
		}()
		go func() {
			defer close(ch)
			for {
				buf := make([]byte, 32<<10)
				n, err := up.Read(buf)
				if n > 0 {
					ch <- chunk{time.Now(), buf[:n]}
				}
				if err != nil {
					return
				}
			}
		}()
		go func() {
			for c := range ch {
				time.Sleep(time.Until(c.at.Add(lat)))
				if _, err := down.Write(c.b); err != nil {
					break
				}
			}
			done <- struct{}{}
		}()
		<-done
		_ = up.Close()
		_ = down.Close()
		<-done
	}
}

// A retired session must not close while a link's stream is open on it,
// waiting for the ingress's ack (a link joins es.links only at attach;
// it closed so before: Hooks.Idle looked at es.links alone). Was:
// closed by Hooks.Idle (no link in es.links) while a link's stream is open on it, waiting for the
// ingress's ack (a link is added to es.links only at attach). Any retire
// trigger does it: "stream ids running out" retires the session under the
// very link that opened the stream; "dialled with other settings, and
// idle" under any link of the old settings still in its open. Es.Retire
// is called directly here, while the ack is in flight.
func TestMeshRetiredSessionWaitsForAnOpeningLink(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.1:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), func(s *policy.Settings) {
		s.Mesh.PingTimeout = policy.Duration(4 * time.Second)
		s.Mesh.WriteTimeout = policy.Duration(3 * time.Second)
	})
	rl, err := relay.Start(in.addr(), time.Second, latencyDown(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rl.Close)
	eg := startEgress(t, srv.Addr(), portOfInt(t, rl.Addr()), func(s *policy.Settings) {
		s.Mesh.PingTimeout = policy.Duration(4 * time.Second)
		s.Mesh.WriteTimeout = policy.Duration(3 * time.Second)
		s.ConnectTimeout = policy.Duration(5 * time.Second)
		s.Mesh.Sessions = 1
	})
	c1 := eg.dial()
	if _, err := c1.Write([]byte("first")); err != nil {
		t.Fatal(err)
	}
	buf1 := make([]byte, 5)
	_ = c1.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c1, buf1); err != nil {
		s := eg.linkEndOf(c1, 5*time.Second)
		t.Fatalf("first: %v; %s %v", err, s.Reason, s.Err)
	}
	_ = c1.Close()
	eg.linkEndOf(c1, 5*time.Second)

	es := firstEgressSession(eg.p)
	if es == nil {
		t.Fatal("no session")
	}

	t0 := time.Now()
	c2 := eg.dial()
	if _, err := c2.Write([]byte("second")); err != nil {
		t.Fatal(err)
	}
	// The stream is open (with the status stream, two), its ack ~1 s away.
	for deadline := time.Now().Add(5 * time.Second); es.Sess.NumStreams() < 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the second link's stream did not open within 5s (%d streams)", es.Sess.NumStreams())
		}
	}
	streams := es.Sess.NumStreams()
	es.Retire("stands for stream ids running out")
	got := make([]byte, len("second"))
	_ = c2.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c2, got); err != nil {
		s := eg.linkEndOf(c2, 5*time.Second)
		t.Fatalf("a link opening on a session retired meanwhile was cut: client read %v; link ended %s (%v); the session carried %d streams when retired",
			err, s.Reason, s.Err, streams)
	}
	t.Logf("echo after %v; streams at retire %d; session closed %v", time.Since(t0), streams, es.Closed())
}

// firstEgressSession is a session of p's first peer that has one, or nil.
func firstEgressSession(p *Proxy) *egressSession {
	p.meshMu.Lock()
	defer p.meshMu.Unlock()
	for _, pr := range p.peers {
		pr.mu.Lock()
		n := len(pr.sessions)
		var es *egressSession
		if n > 0 {
			es = pr.sessions[0]
		}
		pr.mu.Unlock()
		if es != nil {
			return es
		}
	}
	return nil
}
