//go:build linux

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// path is one way from the client to the server.
type path struct {
	Name     string `json:"name"`
	Addr     string `json:"addr,omitempty"`
	Version  string `json:"version,omitempty"`
	Affinity string `json:"affinity,omitempty"` // the proxy's CPU list, read back
	Skipped  string `json:"skipped,omitempty"`
	proc     *child // nil for direct
	// metricsAddr serves the proxy's Prometheus page (livenessproxy only).
	metricsAddr string
}

const (
	pathDirect = "direct"
	pathLP     = "livenessproxy"
	pathHA     = "haproxy"
	readyWait  = 15 * time.Second
)

// setupLivenessproxy builds (unless -proxy-bin is given) and starts
// livenessproxy in front of serverAddr. Any failure skips the path.
func setupLivenessproxy(ctx context.Context, o options, tmp, serverAddr string, cpus *unix.CPUSet) path {
	p := path{Name: pathLP}
	bin := o.proxyBin
	if bin == "" {
		var err error
		if bin, err = buildLivenessproxy(ctx, tmp); err != nil {
			p.Skipped = "build failed: " + err.Error()
			return p
		}
	}
	addr, err := freePort()
	if err != nil {
		p.Skipped = err.Error()
		return p
	}
	adminAddr, err := freePort()
	if err != nil {
		p.Skipped = err.Error()
		return p
	}
	framing := ""
	switch o.lpFraming {
	case "length_field":
		// With tracking on, as a user of a framed protocol would run it.
		framing = "    framing: {type: length_field, length_field_length: 4, byte_order: big, max_frame_length: 16MiB}\n" +
			"    unanswered: {track: on}\n"
	case "kafka", "pinot":
		framing = "    framing: {type: " + o.lpFraming + ", max_frame_length: 16MiB}\n"
	}
	conf := fmt.Sprintf(`admin: {listen: %s, control_listen: ""}
log: {level: warn}
listeners:
  - name: bench
    listen: %s
    upstream: %s
%s`, adminAddr, addr, serverAddr, framing)
	cfgPath := filepath.Join(tmp, "livenessproxy.yaml")
	if err := os.WriteFile(cfgPath, []byte(conf), 0o644); err != nil {
		p.Skipped = err.Error()
		return p
	}
	p.Version = commandFirstLine(ctx, bin, "version")
	cmd := exec.Command(bin, "run", "--config", cfgPath)
	p = startProxy(ctx, p, cmd, addr, cpus, filepath.Join(tmp, "livenessproxy.log"))
	if p.Skipped == "" {
		p.metricsAddr = adminAddr
	}
	return p
}

// buildLivenessproxy runs `go build ./cmd/livenessproxy` in the module root.
func buildLivenessproxy(ctx context.Context, tmp string) (string, error) {
	root, err := moduleRoot()
	if err != nil {
		return "", err
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		return "", err
	}
	out := filepath.Join(tmp, "livenessproxy")
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, goBin, "build", "-o", out, "./cmd/livenessproxy")
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("%v: %s", err, tailLines(string(b), 3))
	}
	return out, nil
}

// moduleRoot finds the directory holding go.mod, from the working directory up.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory (run from the module, or pass -proxy-bin)")
		}
		dir = parent
	}
}

// setupHAProxy starts HAProxy in TCP mode, one thread, no logging.
func setupHAProxy(ctx context.Context, o options, tmp, serverAddr string, cpus *unix.CPUSet) path {
	p := path{Name: pathHA}
	bin, err := exec.LookPath(o.haproxyBin)
	if err != nil {
		p.Skipped = "not found on PATH (apt-get install -y haproxy)"
		return p
	}
	addr, err := freePort()
	if err != nil {
		p.Skipped = err.Error()
		return p
	}
	// No "log" line anywhere: HAProxy logs nothing. Timeouts are far above
	// any scenario's latency and bound a dead connection's life.
	conf := fmt.Sprintf(`global
    nbthread 1
    maxconn %d

defaults
    mode tcp
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout client-fin 5s
    timeout server-fin 5s

frontend bench
    bind %s
    default_backend server

backend server
    server s1 %s
`, max(8192, o.idleLinks+100), addr, serverAddr)
	cfgPath := filepath.Join(tmp, "haproxy.cfg")
	if err := os.WriteFile(cfgPath, []byte(conf), 0o644); err != nil {
		p.Skipped = err.Error()
		return p
	}
	p.Version = commandFirstLine(ctx, bin, "-v")
	// -db: stay in the foreground, so the PID we hold is the one serving.
	cmd := exec.Command(bin, "-db", "-f", cfgPath)
	return startProxy(ctx, p, cmd, addr, cpus, filepath.Join(tmp, "haproxy.log"))
}

// startProxy starts a proxy child, waits until it accepts, and checks one
// request/response through it.
func startProxy(ctx context.Context, p path, cmd *exec.Cmd, addr string, cpus *unix.CPUSet, logPath string) path {
	c, err := startChild(p.Name, cmd, cpus, logPath)
	if err != nil {
		p.Skipped = err.Error()
		return p
	}
	if err := waitListening(ctx, addr, c, readyWait); err != nil {
		c.stop()
		p.Skipped = err.Error()
		return p
	}
	if cpus != nil {
		// Threads started since the first pinning inherited the mask;
		// re-applying makes sure none escaped.
		if err := pinTasks(c.pid, cpus); err != nil {
			c.stop()
			p.Skipped = "pin: " + err.Error()
			return p
		}
	}
	if err := probe(ctx, addr); err != nil {
		c.stop()
		p.Skipped = fmt.Sprintf("request through it failed: %v (%s)", err, c.logTail())
		return p
	}
	p.Addr = addr
	p.Affinity = affinityOf(c.pid)
	p.proc = c
	return p
}

// commandFirstLine runs a short command and returns its first output line.
func commandFirstLine(ctx context.Context, bin string, args ...string) string {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	b, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	if err != nil {
		return ""
	}
	line, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	return line
}
