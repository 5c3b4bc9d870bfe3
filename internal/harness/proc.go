package harness

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"
)

// ProcState returns the state letter of /proc/PID/stat (R, S, T, ...), or
// "?" when it cannot be read.
func ProcState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return "?"
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 >= len(s) {
		return "?"
	}
	return s[i+2 : i+3]
}

// WaitProcState waits up to timeout for the process to be in one of
// states (state letters, such as "T" or "tT").
func WaitProcState(pid int, states string, timeout time.Duration) bool {
	for deadline := time.Now().Add(timeout); ; time.Sleep(5 * time.Millisecond) {
		if strings.Contains(states, ProcState(pid)) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}

// ServeHealth serves GET /health with 200 "OK" on ln, as a Pinot server's
// admin port does: it answers only while the process runs. stop closes
// the server and returns once its serving goroutine has.
func ServeHealth(ln net.Listener) (stop func()) {
	hs := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/health" {
				http.NotFound(w, r)
				return
			}
			_, _ = io.WriteString(w, "OK")
		}),
		ReadHeaderTimeout: 5 * time.Second,
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = hs.Serve(ln) }()
	return func() { _ = hs.Close(); <-done }
}

// WaitReachable dials addr until it accepts, for up to timeout: a fresh
// veth may take a moment before it carries traffic.
func WaitReachable(addr string, timeout time.Duration) error {
	for deadline := time.Now().Add(timeout); ; time.Sleep(20 * time.Millisecond) {
		c, err := net.DialTimeout("tcp", addr, 500*time.Millisecond)
		if err == nil {
			_ = c.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not reachable over the veth: %w", addr, err)
		}
	}
}
