package relay

import (
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Bytes go through the handler both ways; Close closes the relayed
// connections (the handler's reads end) and waits for every goroutine.
func TestRelayForwardsAndCloses(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	handled := make(chan struct{})
	r, err := Start(peer.Addr(), time.Second, func(down, up net.Conn) {
		defer close(handled)
		go func() { _, _ = io.Copy(up, down) }() // ends when the relay closes down
		_, _ = io.Copy(down, up)
	})
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", r.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("read %q %v, want the echo", buf, err)
	}
	r.Close()
	<-handled
	if _, err := c.Read(buf); err == nil {
		t.Fatal("the relayed connection is still open after Close")
	}
	r.Close() // idempotent
}

// A target that refuses makes the relay reset the accepted connection.
func TestRelayRefusedTargetResets(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	target := ln.Addr().String()
	_ = ln.Close()
	r, err := Start(target, time.Second, func(down, up net.Conn) { t.Error("handler called for a failed dial") })
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	c, err := net.Dial("tcp", r.Addr())
	if errors.Is(err, syscall.ECONNRESET) {
		return // reset before the handshake was through
	}
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("read through the relay to a closed port: %v, want a reset", err)
	}
}
