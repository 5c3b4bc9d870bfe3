package main

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// echoOn writes msg on c and reads it back.
func echoOn(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != msg {
		t.Fatalf("echo: %q, %v", got, err)
	}
}

// The client in the same pod gets SIGTERM at the proxy's moment and may
// still open connections while it shuts down: during shutdown_grace the
// proxy keeps accepting and serving, and it exits as soon as the client's
// links are gone (shutdown_idle later), long before the grace is over.
func TestShutdownGraceServesTheClientsLastConnects(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	var listenAddr string
	p := startProcUntil(t, func() (string, func() error) {
		var adminAddr string
		adminAddr, listenAddr = testutil.ClosedAddr(t), testutil.ClosedAddr(t)
		return writeConfig(t, fmt.Sprintf(`admin: {listen: %q, control_listen: ""}
shutdown_grace: 60s
shutdown_idle: 300ms
drain_timeout: 5s
listeners:
  - {name: echo, listen: %q, upstream: %q}
`, adminAddr, listenAddr, peer.Addr())), readyzOf(adminAddr)
	}, nil)

	c, err := net.Dial("tcp", listenAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	echoOn(t, c, "before")

	begin := time.Now()
	p.signal(syscall.SIGTERM)
	waitForLog(t, p.stderr, `"shutdown grace: still accepting`, `"shutdown_grace_ms":60000`)
	// A new connect after SIGTERM is served, and so is the open link.
	if !echoes(listenAddr) {
		t.Fatalf("a connect during the shutdown grace was not served\n%s", p.stderr.String())
	}
	echoOn(t, c, "during")
	if !p.running() {
		t.Fatalf("exited with a link open during the grace\n%s", p.stderr.String())
	}
	// The client goes: its last link closes, and the proxy follows.
	_ = c.Close()
	if err := p.wait(30 * time.Second); err != nil {
		t.Fatalf("exit: %v\n%s", err, p.stderr.String())
	}
	if d := time.Since(begin); d > 30*time.Second {
		t.Fatalf("exited after %v: the grace did not end when the links were gone", d)
	}
	waitForLog(t, p.stderr, "shutdown grace ended early: no link left")
	if bytes.Contains([]byte(p.stderr.String()), []byte("drain timeout: closed the links")) {
		t.Errorf("links were cut after the client had closed them all:\n%s", p.stderr.String())
	}
}

// The grace is bounded: a link that stays open past shutdown_grace is
// drained for drain_timeout and then closed, as without a grace.
func TestShutdownGraceBoundedWhenLinksStay(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	var listenAddr string
	p := startProcUntil(t, func() (string, func() error) {
		listenAddr = testutil.ClosedAddr(t)
		cfg := writeConfig(t, fmt.Sprintf(`admin: {listen: "", control_listen: ""}
shutdown_grace: 1s
shutdown_idle: 200ms
drain_timeout: 200ms
listeners:
  - {name: echo, listen: %q, upstream: %q}
`, listenAddr, peer.Addr()))
		return cfg, func() error {
			if !echoes(listenAddr) {
				return fmt.Errorf("no echo through %s", listenAddr)
			}
			return nil
		}
	}, nil)
	c, err := net.Dial("tcp", listenAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	echoOn(t, c, "held")

	begin := time.Now()
	p.signal(syscall.SIGTERM)
	if err := p.wait(20 * time.Second); err != nil {
		t.Fatalf("exit: %v\n%s", err, p.stderr.String())
	}
	if d := time.Since(begin); d < time.Second {
		t.Fatalf("exited after %v, inside the 1s grace with a link open", d)
	}
	waitForLog(t, p.stderr, "shutdown grace over: links still open", `"links":1`)
	waitForLog(t, p.stderr, "drain timeout: closed the links still open")
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("link still open after exit")
	}
}
