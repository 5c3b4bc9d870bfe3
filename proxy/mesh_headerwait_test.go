package proxy

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// headerlessStream opens a stream on sess that sends half a header and
// no more, and returns when and how the ingress ended it: its reset,
// awaited up to within. The second byte comes a second after the first,
// after the ingress began its wait: a header's own bytes are not other
// links' data, they do not start the wait again.
func headerlessStream(t *testing.T, sess *yamux.Session, within time.Duration) (time.Duration, error) {
	t.Helper()
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	opened := time.Now()
	for _, b := range []string{"L", "P"} {
		if _, err := st.Write([]byte(b)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Second)
	}
	_ = st.SetReadDeadline(opened.Add(within))
	_, err = st.Read(make([]byte, 1))
	return time.Since(opened), err
}

// The twins of TestMeshHeaderBehindTheSendQueueReachesTheIngress, at the
// ingress. On a session that carries no data (the heartbeat's pings
// only), a stream whose header does not come is reset once
// mesh.HeaderTimeout has run out, as before: nothing starts the wait
// again.
func TestMeshIngressHeaderWaitOnAQuietSession(t *testing.T) {
	srv := startReadAll(t, "127.0.0.1:0")
	in := startIngress(t, "127.0.0.2", srv.ln.Addr().String(), nil)
	sess, _ := rawSession(t, in)
	took, err := headerlessStream(t, sess, 3*mesh.HeaderTimeout)
	t.Logf("the headerless stream ended %v after its open: %v", took.Round(time.Millisecond), err)
	if !errors.Is(err, yamux.ErrConnectionReset) {
		t.Fatalf("the headerless stream ended %v, want reset", err)
	}
	if took >= 2*mesh.HeaderTimeout {
		t.Fatalf("the headerless stream was reset %v after its open, want once mesh.HeaderTimeout (%v) ran out: its wait started again on a quiet session", took, mesh.HeaderTimeout)
	}
	waitFor(t, 5*time.Second, "the headerless stream's slot given back", func() bool { total, _, _ := in.slotsHeld(); return total == 0 })
}

// On a session whose links' data keeps arriving, the wait for a header
// starts again, but not for ever: a peer that streams data on one link
// and never sends another stream's header has that stream reset within
// headerWaits header timeouts of its open, its slot given back, while the
// link goes on.
func TestMeshIngressHeaderWaitBehindMovingDataIsBounded(t *testing.T) {
	srv := startReadAll(t, "127.0.0.1:0")
	in := startIngress(t, "127.0.0.2", srv.ln.Addr().String(), nil)
	sess, _ := rawSession(t, in)
	link, ok := openRaw(sess, portOf(t, srv.ln.Addr().String()))
	if !ok {
		t.Fatal("the link was refused")
	}
	stop, done := make(chan struct{}), make(chan error, 1)
	go func() { // 4 KiB every 50 ms until stopped (the test's end bounds it)
		chunk := bytes.Repeat([]byte("u"), 4<<10)
		tk := time.NewTicker(50 * time.Millisecond)
		defer tk.Stop()
		for {
			select {
			case <-stop:
				done <- nil
				return
			case <-tk.C:
			}
			if _, err := link.Write(chunk); err != nil {
				done <- err
				return
			}
		}
	}()
	took, err := headerlessStream(t, sess, (headerWaits+3)*mesh.HeaderTimeout)
	close(stop)
	t.Logf("the headerless stream ended %v after its open: %v", took.Round(time.Millisecond), err)
	if err := <-done; err != nil {
		t.Fatalf("the link's data: %v, want it to go on", err)
	}
	if !errors.Is(err, yamux.ErrConnectionReset) {
		t.Fatalf("the headerless stream ended %v, want reset within %d header timeouts", err, headerWaits)
	}
	if took < 2*mesh.HeaderTimeout {
		t.Fatalf("the headerless stream was reset %v after its open, want its wait started again while the link's data arrived", took)
	}
	waitFor(t, 5*time.Second, "the headerless stream's slot given back, the link's held", func() bool { total, _, _ := in.slotsHeld(); return total == 1 })
}
