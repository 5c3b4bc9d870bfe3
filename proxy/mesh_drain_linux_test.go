package proxy

import (
	"encoding/binary"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// rawFrame is one yamux frame: its header, then payload.
func rawFrame(typ byte, flags uint16, id uint32, payload []byte, length uint32) []byte {
	f := make([]byte, mesh.YamuxHeaderLen, mesh.YamuxHeaderLen+len(payload))
	f[1] = typ
	binary.BigEndian.PutUint16(f[2:], flags)
	binary.BigEndian.PutUint32(f[4:], id)
	binary.BigEndian.PutUint32(f[8:], length)
	return append(f, payload...)
}

// An ingress's drain does not wait for its GoAway to get through a
// congested session: the peer is alive (it keeps sending) and the path
// holds the ingress's frames back (the peer reads nothing). Before, drain
// wrote each session's GoAway in turn and waited until it was written,
// without a bound: one such peer held up the listener's close (a reload, a
// shutdown) for as long as the path stayed congested.
func TestMeshIngressDrainDoesNotWaitOnACongestedPeer(t *testing.T) {
	srv := streamingServer(t, "127.0.0.2:0")
	in := startIngress(t, "127.0.0.2", srv, nil)
	c, _, _ := rawHandshake(t, in.addr())
	_ = c.SetReadBuffer(4 << 10)
	// 40 streams to the streaming server, each taking up to its window
	// (256 KiB): 10 MiB the peer never reads, more than the sockets hold.
	port := portOf(t, srv)
	var b []byte
	for i := range uint32(40) {
		id := 1 + 2*i
		h := mesh.Header(port)
		b = append(b, rawFrame(1, mesh.YamuxFlagSYN, id, nil, 0)...)
		b = append(b, rawFrame(0, 0, id, h, uint32(len(h)))...)
	}
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
	// The peer stays alive: a ping every 50 ms.
	stop := make(chan struct{})
	pinged := make(chan struct{})
	go func() {
		defer close(pinged)
		tk := time.NewTicker(50 * time.Millisecond)
		defer tk.Stop()
		for n := uint32(1); ; n++ {
			select {
			case <-stop:
				return
			case <-tk.C:
			}
			_ = c.SetWriteDeadline(time.Now().Add(time.Second))
			if _, err := c.Write(rawFrame(mesh.YamuxTypePing, mesh.YamuxFlagSYN, 0, nil, n)); err != nil {
				return
			}
		}
	}()
	defer func() { close(stop); <-pinged }()
	ing := in.p.listeners[0].ingress
	// Full: more than 1 MiB unacknowledged, no longer growing.
	last := 0
	waitFor(t, 10*time.Second, "the session's send path to fill", func() bool {
		time.Sleep(200 * time.Millisecond)
		n := unacked(ing)
		full := n > 1<<20 && n == last
		last = n
		return full
	})

	done := make(chan struct{})
	go func() { ing.drain(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		t.Fatal("drain did not return within 2 s: it waits for a GoAway stuck behind a congested path")
	}
	if got := sessionsOf(ing); got != 1 {
		t.Fatalf("%d ingress sessions after the drain, want the congested one kept (it is alive)", got)
	}
}

// unacked is what the ingress's sessions' sockets hold that their peers
// have not acknowledged, the most of any one.
func unacked(in *ingress) int {
	in.mu.Lock()
	defer in.mu.Unlock()
	most := 0
	for is := range in.sessions {
		rc, err := is.Conn.SyscallConn()
		if err != nil {
			continue
		}
		n := 0
		_ = rc.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.SIOCOUTQ) })
		most = max(most, n)
	}
	return most
}

func sessionsOf(in *ingress) int {
	in.mu.Lock()
	defer in.mu.Unlock()
	return len(in.sessions)
}
