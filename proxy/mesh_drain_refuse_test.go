package proxy

import (
	"errors"
	"io"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
)

// An ingress whose drain began refuses a new stream at once, even while
// the drain's GoAway has not been sent: drain sends each session's GoAway
// on a goroutine (da0fb67), and until that goroutine runs, yamux itself
// still takes new streams. Here the goroutine is held before its GoAway
// (testHookGoAway) and a stream is opened meanwhile on a session that
// carried a link before the drain: it is reset, and never becomes a link
// of the ingress (so never reaches the server). Before fe21f6d it was
// served as if no drain had begun. The twin, before the drain: a stream
// on the same session is served.
func TestMeshDrainingIngressRefusesAStreamBeforeItsGoAway(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngress(t, "127.0.0.2", srv.Addr(), nil)
	port := portOf(t, srv.Addr())
	ing := in.p.listeners[0].ingress
	waitFor(t, 5*time.Second, "the local port ready", func() bool { return ing.snapshot().Ports[port].Ready })
	sess, _ := rawSession(t, in)
	links := func() float64 { return testutil.ToFloat64(in.m.ForListener("ingress").LinksTotal) }

	// The twin: before the drain, a stream is served.
	st, ok := openRaw(sess, port)
	if !ok {
		t.Fatal("a stream before the drain was not acknowledged")
	}
	msg := []byte("before the drain")
	if _, err := st.Write(msg); err != nil {
		t.Fatal(err)
	}
	_ = st.SetReadDeadline(time.Now().Add(5 * time.Second))
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(st, got); err != nil || string(got) != string(msg) {
		t.Fatalf("echo %q, %v; want %q", got, err, msg)
	}
	if n := links(); n != 1 {
		t.Fatalf("%v ingress links, want the one served", n)
	}

	held, release := make(chan struct{}, 1), make(chan struct{})
	hold := func() {
		select {
		case held <- struct{}{}:
		default:
		}
		<-release
	}
	testHookGoAway.Store(&hold)
	t.Cleanup(func() { testHookGoAway.Store(nil) })
	released := false
	releaseOnce := func() {
		if !released {
			released = true
			close(release)
		}
	}
	t.Cleanup(releaseOnce) // before the ingress's close, which waits for the goroutine

	go ing.drain()
	select {
	case <-held:
	case <-time.After(10 * time.Second):
		t.Fatal("the drain's GoAway goroutine did not start within 10 s")
	}
	st2, ok := openRaw(sess, port)
	if ok {
		t.Fatal("a stream opened after the drain began, its GoAway not yet sent, was served")
	}
	var b [1]byte
	_ = st2.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := st2.Read(b[:]); !errors.Is(err, yamux.ErrConnectionReset) {
		t.Fatalf("the stream opened during the drain read %v, want it reset", err)
	}
	if n := links(); n != 1 {
		t.Fatalf("%v ingress links after the drain's stream, want still 1: it reached the server", n)
	}
	if sess.IsClosed() {
		t.Fatal("the session closed: the refusal is one stream's, the session and its link live on")
	}
	releaseOnce()
}
