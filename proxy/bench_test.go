package proxy

import (
	"io"
	"net"
	"testing"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
)

// BenchmarkConnectRequestClose profiles the per-connection path in
// process (the comparison with a direct connection and HAProxy is
// test/bench's job).
func BenchmarkConnectRequestClose(b *testing.B) {
	peer := faultpeer.New(b, faultpeer.Echo, faultpeer.Options{})
	h := startB(b, peer.Addr())
	msg := make([]byte, 200)
	got := make([]byte, 200)
	b.ReportAllocs()
	for b.Loop() {
		c, err := net.Dial("tcp", h)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := c.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, got); err != nil {
			b.Fatal(err)
		}
		c.Close()
	}
}

// BenchmarkRequestResponse profiles one request/response round trip.
func BenchmarkRequestResponse(b *testing.B) {
	peer := faultpeer.New(b, faultpeer.Echo, faultpeer.Options{})
	c, err := net.Dial("tcp", startB(b, peer.Addr()))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	msg := make([]byte, 200)
	got := make([]byte, 200)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := c.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, got); err != nil {
			b.Fatal(err)
		}
	}
}
