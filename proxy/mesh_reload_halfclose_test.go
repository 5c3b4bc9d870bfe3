package proxy

import (
	"io"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/policy"
)

// A reload that raises the ingress listener's half_close_timeout must
// not let a yamux close timer armed from the old one end a stream first
// (the ingress's sessions now have none). Was: the ingress's yamux StreamCloseTimeout is fixed per session from
// the listener's half_close_timeout at the handshake; a reload that raises
// (or zeroes) the ingress listener's half_close_timeout keeps the
// sessions, and their backstop (old hc + ping_timeout + 1 s) now fires
// before the link's own timer: the force-closed stream is read as the
// client's FIN and a cut-short upload reaches the server as a whole one.
func TestMeshIngressReloadedHalfCloseResetsTheServer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	type end struct {
		err error
		at  time.Time
	}
	ends := make(chan end, 64)
	serveConns(t, ln, func(c net.Conn, _ <-chan struct{}) {
		_, _ = c.Write([]byte("answer"))
		_ = c.(*net.TCPConn).CloseWrite()
		n, err := io.Copy(io.Discard, c)
		if n > 0 {
			ends <- end{err, time.Now()}
		}
	})
	in := startIngress(t, "127.0.0.2", ln.Addr().String(), func(s *policy.Settings) {
		s.HalfCloseTimeout = policy.Duration(300 * time.Millisecond)
	})
	eg := startEgress(t, ln.Addr().String(), in.port, func(s *policy.Settings) { s.Mesh.Sessions = 1 })
	upload := func(i int) (end, time.Time) {
		c := eg.dial()
		stop := make(chan struct{})
		up := make(chan struct{})
		t0 := time.Now()
		go stalledUpload(c, stop, up)
		var e end
		select {
		case e = <-ends:
		case <-time.After(15 * time.Second):
			t.Fatalf("upload %d: not ended at the server in 15 s", i)
		}
		close(stop)
		<-up
		_ = c.Close()
		return e, t0
	}
	if e, t0 := upload(0); e.err == nil {
		t.Fatalf("premise: before the reload the upload was cut with a FIN after %v", e.at.Sub(t0))
	}
	cfg := in.cfg
	cfg.Listeners = slices.Clone(cfg.Listeners)
	cfg.Listeners[0].Settings.HalfCloseTimeout = policy.Duration(5 * time.Second)
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	ch, err := in.p.Apply(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("reload: %+v", ch)
	e, t0 := upload(1)
	if e.err == nil {
		t.Fatalf("after the reload (half_close_timeout 300ms -> 5s) the server saw a clean end (FIN) of a cut-short upload %v after it began", e.at.Sub(t0))
	}
	t.Logf("server saw %v after %v", e.err, e.at.Sub(t0))
}
