package mesh

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// tcpPair is two ends of a loopback TCP connection.
func tcpPair(t *testing.T) (*net.TCPConn, *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	peer, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	local, err := ln.Accept()
	if err != nil {
		_ = peer.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = local.Close(); _ = peer.Close() })
	return local.(*net.TCPConn), peer.(*net.TCPConn)
}

// synFrames is n frames that open streams from id first on (the odd ids
// of a client), each a window update with SYN.
func synFrames(first uint32, n int) []byte {
	b := make([]byte, 0, n*YamuxHeaderLen)
	for i := range n {
		b = append(b, yamuxFrame(yamuxTypeWindowUpdate, YamuxFlagSYN, first+2*uint32(i), 0)...)
	}
	return b
}

// hits records the limits a guard counts.
type hits struct {
	mu sync.Mutex
	l  []string
}

func (h *hits) hit(limit string) { h.mu.Lock(); h.l = append(h.l, limit); h.mu.Unlock() }

func (h *hits) all() []string { h.mu.Lock(); defer h.mu.Unlock(); return append([]string(nil), h.l...) }

// A peer that opens streams past its limit without end and never reads
// has its session cut once the resets refusing them wait beyond the
// bound (the streams it may hold and refusalMargin more): without it,
// the guard's queue held about a byte for every byte the peer sent (the
// review: 1,995,276 bytes after 2.4 MB of SYNs), and bytes kept arriving,
// so the heartbeat never ended the session.
func TestGuardRefusalFloodIsCut(t *testing.T) {
	local, peer := tcpPair(t)
	const streams = 10
	var last atomic.Int64
	var h hits
	g := newMeshGuard(local, local, &last, Admission{Admit: func() bool { return false }, Streams: streams}, h.hit)
	// No flusher: nothing queued is written, as when the peer does not
	// read and the connection's buffers are full.
	sent := make(chan error, 1)
	go func() {
		_, err := peer.Write(synFrames(1, 10*(streams+refusalMargin)))
		_ = peer.CloseWrite()
		sent <- err
	}()
	var err error
	for buf := make([]byte, 4096); err == nil; {
		_, err = g.Read(buf)
	}
	_ = local.Close() // the session closes, as yamux does on the error
	<-sent
	if !errors.Is(err, errRefusalFlood) {
		t.Errorf("the guard read ended with %v, want the refusal flood", err)
	}
	if bound := (streams + refusalMargin) * YamuxHeaderLen; len(g.outQ) > bound {
		t.Errorf("%d bytes of refusals wait to be written, want at most %d", len(g.outQ), bound)
	}
	if got := h.all(); len(got) != 1 || got[0] != LimitRefusals {
		t.Errorf("limits counted %q, want one %q", got, LimitRefusals)
	}
}

// A peer that reads its refusals as it opens streams, as yamux does (at
// most 256 of its opens unanswered at once), may have any number refused:
// only those waiting to be written count (the twin of
// TestGuardRefusalFloodIsCut).
func TestGuardRefusalsOfAReadingPeerAreNoFlood(t *testing.T) {
	local, peer := tcpPair(t)
	var last atomic.Int64
	var h hits
	g := newMeshGuard(local, local, &last, Admission{Admit: func() bool { return false }}, h.hit)
	done := make(chan struct{})
	flushed := make(chan struct{})
	go func() {
		defer close(flushed)
		g.flusher(done)
	}()
	read := make(chan error, 1)
	go func() {
		var err error
		for buf := make([]byte, 4096); err == nil; {
			_, err = g.Read(buf)
		}
		read <- err
	}()
	const batch, batches = 256, 20 // 5120 refusals: five times refusalMargin
	var rst [batch * YamuxHeaderLen]byte
	_ = peer.SetDeadline(time.Now().Add(20 * time.Second))
	for i := range batches {
		if _, err := peer.Write(synFrames(uint32(1+2*batch*i), batch)); err != nil {
			t.Fatalf("batch %d: %v", i, err)
		}
		if _, err := io.ReadFull(peer, rst[:]); err != nil {
			t.Fatalf("batch %d: the resets: %v", i, err)
		}
		for k := 0; k < batch; k++ {
			f := rst[k*YamuxHeaderLen:]
			if f[1] != yamuxTypeWindowUpdate || binary.BigEndian.Uint16(f[2:]) != yamuxFlagRST {
				t.Fatalf("batch %d: frame %d is % x, want a reset", i, k, f[:YamuxHeaderLen])
			}
		}
	}
	_ = peer.CloseWrite()
	if err := <-read; !errors.Is(err, io.EOF) {
		t.Errorf("the guard read ended with %v, want the peer's end", err)
	}
	close(done)
	<-flushed
	if got := h.all(); len(got) != 0 {
		t.Errorf("limits counted %q, want none", got)
	}
}

// LinkBytesIn counts the data that arrives on the links' streams (odd
// ids: the egress opens them), as the guard passes it on, and nothing
// else: not the data of the status stream (even: the ingress's), nor the
// pings and their answers, nor window updates. The waits for a stream's
// first bytes go on while it grows (the peer's queue moves), so a quiet
// session whose status or heartbeat alone arrives must leave it still.
// The link's frame is larger than the guard's read buffer: its body
// passes partly through the buffer (filter), the rest straight into
// yamux's (Read), and both count.
func TestGuardCountsLinkData(t *testing.T) {
	local, peer := tcpPair(t)
	var last atomic.Int64
	g := newMeshGuard(local, local, &last, Admission{}, func(string) {})
	var in []byte
	in = append(in, yamuxFrame(yamuxTypeData, 0, 2, 100)...) // the status stream's
	in = append(in, make([]byte, 100)...)
	in = append(in, yamuxFrame(YamuxTypePing, YamuxFlagSYN, 0, 7)...)
	in = append(in, yamuxFrame(YamuxTypePing, yamuxFlagACK, 0, guardPingID|1)...)
	in = append(in, yamuxFrame(yamuxTypeWindowUpdate, 0, 3, 1<<20)...)
	link := 3 * len(g.raw) // a link's
	in = append(in, yamuxFrame(yamuxTypeData, 0, 3, uint32(link))...)
	in = append(in, make([]byte, link)...)
	in = append(in, yamuxFrame(yamuxTypeData, 0, 4, 10)...)
	in = append(in, make([]byte, 10)...)
	if _, err := peer.Write(in); err != nil {
		t.Fatal(err)
	}
	_ = peer.CloseWrite()
	if _, err := io.Copy(io.Discard, g); err != nil {
		t.Fatal(err)
	}
	if n := g.linkIn.Load(); n != int64(link) {
		t.Fatalf("%d bytes counted as the links' data, want %d (stream 3's)", n, link)
	}
}
