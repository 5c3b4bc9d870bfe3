package harness

import (
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"
)

func TestProcStateOfThisProcess(t *testing.T) {
	if st := ProcState(os.Getpid()); !strings.Contains("RS", st) {
		t.Fatalf("this process is in state %q, want R or S", st)
	}
	if !WaitProcState(os.Getpid(), "RS", time.Second) {
		t.Fatal("WaitProcState did not see this process running")
	}
	if st := ProcState(-1); st != "?" {
		t.Fatalf("a process that does not exist: %q, want ?", st)
	}
}

func TestServeHealth(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ServeHealth(ln)()
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Get("http://" + ln.Addr().String() + "/health")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "OK" {
		t.Fatalf("GET /health = %d %q, want 200 OK", resp.StatusCode, body)
	}
	if resp, err := c.Get("http://" + ln.Addr().String() + "/other"); err != nil || resp.StatusCode != 404 {
		t.Fatalf("GET /other = %v %v, want 404", resp, err)
	} else {
		resp.Body.Close()
	}
}

func TestWaitReachable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := WaitReachable(addr, time.Second); err != nil {
		t.Fatalf("a listening port: %v", err)
	}
	_ = ln.Close()
	if err := WaitReachable(addr, 100*time.Millisecond); err == nil {
		t.Fatal("a closed port was reported reachable")
	}
}
