//go:build linux

package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/admin"
	"github.com/livenessproxy/livenessproxy/internal/harness"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// self is the running binary: the replays re-execute it in a role.
const self = "/proc/self/exe"

// child is a re-executed role process. It is ended only by its PID.
type child struct {
	cmd    *exec.Cmd
	pid    int
	stdin  io.WriteCloser
	stderr testutil.SyncBuffer // os/exec writes it from its own goroutine
	lines  chan []byte         // stdout lines after the first
	first  chan []byte         // the first stdout line
	done   chan struct{}       // stdout reader finished (the process closed it)
	once   sync.Once
}

// startChild starts this binary in role with env, in ns if ns is not nil
// (the fork then happens on the namespace's thread, so the process and
// every socket it opens live there). Setsid keeps a stopped child's
// process group from being orphaned (the kernel would SIGHUP+SIGCONT it,
// and it would die); Pdeathsig kills it if the thread that started it dies.
func startChild(ns *netns.NS, role string, env ...string) (*child, error) {
	c := &child{
		stderr: testutil.SyncBuffer{Keep: 64 << 10}, // the first 64 KiB: enough to say why
		lines:  make(chan []byte, 1024),
		first:  make(chan []byte, 1),
		done:   make(chan struct{}),
	}
	c.cmd = exec.Command(self)
	c.cmd.Env = append(os.Environ(), roleEnv+"="+role)
	c.cmd.Env = append(c.cmd.Env, env...)
	c.cmd.Stderr = &c.stderr
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	var err error
	if c.stdin, err = c.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	stdout, err := c.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if ns != nil {
		err = ns.Start(c.cmd)
	} else {
		err = c.cmd.Start()
	}
	if err != nil {
		return nil, fmt.Errorf("starting the %s process: %w", role, err)
	}
	c.pid = c.cmd.Process.Pid
	go c.read(stdout)
	return c, nil
}

// read forwards stdout lines until the child closes it. Lines beyond the
// channel's capacity are dropped (no role prints that many unread).
func (c *child) read(r io.Reader) {
	defer close(c.done)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	firstSeen := false
	for sc.Scan() {
		line := append([]byte(nil), sc.Bytes()...)
		if !firstSeen {
			firstSeen = true
			c.first <- line
			continue
		}
		select {
		case c.lines <- line:
		default:
		}
	}
	_, _ = io.Copy(io.Discard, r)
}

// hello waits up to timeout for the child's first line and decodes it.
func (c *child) hello(v any, timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case line := <-c.first:
		return json.Unmarshal(line, v)
	case <-c.done:
		return fmt.Errorf("process %d exited before it was ready: %s", c.pid, strings.TrimSpace(c.stderr.String()))
	case <-t.C:
		return fmt.Errorf("process %d not ready after %v: %s", c.pid, timeout, strings.TrimSpace(c.stderr.String()))
	}
}

// signal sends sig to the child, by PID.
func (c *child) signal(sig syscall.Signal) error {
	if err := syscall.Kill(c.pid, sig); err != nil {
		return fmt.Errorf("kill -%d %d: %w", sig, c.pid, err)
	}
	return nil
}

// stop asks the child to exit (stdin EOF), waits up to grace, then kills it
// by PID, and reaps it. Idempotent.
func (c *child) stop(grace time.Duration) {
	c.once.Do(func() {
		_ = syscall.Kill(c.pid, syscall.SIGCONT) // a stopped child cannot see EOF
		_ = c.stdin.Close()
		t := time.NewTimer(grace)
		select {
		case <-c.done:
		case <-t.C:
		}
		t.Stop()
		_ = syscall.Kill(c.pid, syscall.SIGKILL)
		<-c.done
		_ = c.cmd.Wait()
	})
}

// kill ends the child at once with SIGKILL, by PID, and reaps it.
func (c *child) kill() {
	c.once.Do(func() {
		_ = syscall.Kill(c.pid, syscall.SIGKILL)
		_ = c.stdin.Close()
		<-c.done
		_ = c.cmd.Wait()
	})
}

var (
	procState     = harness.ProcState
	waitProcState = harness.WaitProcState
)

// rssBytes returns the process's resident set size (VmRSS).
func rssBytes(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(rest)
			if len(f) == 2 && f[1] == "kB" {
				n, err := strconv.ParseInt(f[0], 10, 64)
				return n << 10, err
			}
		}
	}
	return 0, errors.New("no VmRSS in /proc/PID/status")
}

// serverProc is a pinotsim server in its own process.
type serverProc struct {
	*child
	addr   string
	health string
}

// startServer starts a server process listening on addr (and serving
// /health on health, if not empty), in ns if not nil.
func startServer(r *rig, ns *netns.NS, addr, health string) (*serverProc, error) {
	env := []string{addrEnv + "=" + addr}
	if health != "" {
		env = append(env, healthEnv+"="+health)
	}
	c, err := startChild(ns, "server", env...)
	if err != nil {
		return nil, err
	}
	r.cleanup(func() { c.stop(2 * time.Second) })
	var h serverHello
	if err := c.hello(&h, 10*time.Second); err != nil {
		c.kill()
		return nil, fmt.Errorf("server on %s: %w", addr, err)
	}
	return &serverProc{child: c, addr: h.Listening, health: h.Health}, nil
}

// stats asks the (running) server for its counters.
func (s *serverProc) stats() (pinotsim.ServerStats, error) {
	var st pinotsim.ServerStats
	// Drop answers to earlier requests that timed out.
	for len(s.lines) > 0 {
		<-s.lines
	}
	if _, err := io.WriteString(s.stdin, "stats\n"); err != nil {
		return st, err
	}
	t := time.NewTimer(5 * time.Second)
	defer t.Stop()
	select {
	case line := <-s.lines:
		return st, json.Unmarshal(line, &st)
	case <-s.done:
		return st, fmt.Errorf("server process %d exited", s.pid)
	case <-t.C:
		return st, fmt.Errorf("server process %d did not answer stats in 5s (state %s)", s.pid, procState(s.pid))
	}
}

// proxyProc is livenessproxy in its own process, with its admin API.
type proxyProc struct {
	*child
	admin     string // the read-only admin server
	control   string // the control server (the endpoint actions)
	listeners map[string]string
	http      *http.Client
	ends      harness.LinkEnds
	collected chan struct{}
}

// startProxy starts a proxy process with the YAML configuration yaml.
func startProxy(r *rig, yaml string) (*proxyProc, error) {
	c, err := startChild(nil, "proxy", configEnv+"="+yaml)
	if err != nil {
		return nil, err
	}
	p := &proxyProc{child: c, collected: make(chan struct{}),
		// No keep-alive: no idle connection (or its goroutines) outlives a
		// request.
		http: &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}},
	}
	var h proxyLine
	if err := c.hello(&h, 10*time.Second); err != nil || h.Ready == nil {
		c.kill()
		return nil, fmt.Errorf("proxy process: %v (first line %+v)", err, h)
	}
	p.admin, p.control, p.listeners = h.Ready.Admin, h.Ready.Control, h.Ready.Listeners
	go p.collect()
	r.cleanup(func() {
		c.stop(3 * time.Second)
		<-p.collected
	})
	return p, nil
}

// collect records the link ends the proxy reports until it exits.
func (p *proxyProc) collect() {
	defer close(p.collected)
	p.ends.Collect(p.lines, p.done)
}

// endpoint returns the status of upstream endpoint addr from GET
// /v1/endpoints.
func (p *proxyProc) endpoint(addr string) (proxy.EndpointStatus, error) {
	resp, err := p.http.Get("http://" + p.admin + "/v1/endpoints")
	if err != nil {
		return proxy.EndpointStatus{}, err
	}
	defer resp.Body.Close()
	var body struct {
		Endpoints []proxy.EndpointStatus `json:"endpoints"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return proxy.EndpointStatus{}, err
	}
	for _, e := range body.Endpoints {
		if e.Endpoint == addr {
			return e, nil
		}
	}
	return proxy.EndpointStatus{}, fmt.Errorf("endpoint %s not in /v1/endpoints", addr)
}

// action POSTs /v1/endpoints/{addr}/{action} and returns the JSON answer.
func (p *proxyProc) action(addr, action string) (map[string]any, error) {
	req, err := http.NewRequest("POST", "http://"+p.control+"/v1/endpoints/"+addr+"/"+action, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set(admin.ControlHeader, "1") // the control server refuses a change without it
	resp, err := p.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var body map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return body, fmt.Errorf("POST %s %s: %s %v", addr, action, resp.Status, body)
	}
	return body, nil
}

// counter sums a counter's series scraped from GET /metrics (name without
// the livenessproxy_ prefix), optionally only those carrying label="value".
func (p *proxyProc) counter(name, label, value string) (float64, error) {
	var labels []string
	if label != "" {
		labels = []string{label, value}
	}
	return harness.Counter(harness.Scrape(p.http, "http://"+p.admin+"/metrics"), name, labels...)
}

// rssSampler samples a process's RSS every 20 ms until stopped.
type rssSampler struct {
	pid  int
	quit chan struct{}
	done chan struct{}
	once sync.Once

	mu      sync.Mutex
	samples []rssSample
}

type rssSample struct {
	At  time.Time
	RSS int64
}

// sampleRSS starts sampling pid's RSS for at most maxDuration.
func sampleRSS(r *rig, pid int, maxDuration time.Duration) *rssSampler {
	s := &rssSampler{pid: pid, quit: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		end := time.Now().Add(maxDuration)
		for time.Now().Before(end) {
			if v, err := rssBytes(pid); err == nil {
				s.mu.Lock()
				s.samples = append(s.samples, rssSample{time.Now(), v})
				s.mu.Unlock()
			}
			select {
			case <-s.quit:
				return
			case <-tick.C:
			}
		}
	}()
	r.cleanup(s.stop)
	return s
}

func (s *rssSampler) stop() {
	s.once.Do(func() { close(s.quit) })
	<-s.done
}

// growth returns the RSS at the last sample before t0 (the baseline) and
// the highest RSS sampled from t0 on.
func (s *rssSampler) growth(t0 time.Time) (base, peak int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, x := range s.samples {
		if x.At.Before(t0) {
			base = x.RSS
		} else {
			peak = max(peak, x.RSS)
		}
	}
	return base, peak
}

type (
	stateChange  = harness.StateChange
	stateWatcher = harness.StateWatcher
)

// watchEndpoint records every state change of addr, polled through GET
// /v1/endpoints every 50 ms, until the run ends or maxDuration has passed.
func watchEndpoint(r *rig, p *proxyProc, addr string, maxDuration time.Duration) *stateWatcher {
	w := harness.WatchState(func() (proxy.EndpointStatus, error) { return p.endpoint(addr) }, 50*time.Millisecond, maxDuration)
	r.cleanup(w.Stop)
	return w
}

// serverBehindProxy builds replay n's namespaces, starts a server on port
// 9000 of the peer namespace, waits until it is reachable, and starts a
// proxy whose one listener (s0) is in front of it.
func serverBehindProxy(r *rig, n int) (t *topo, srvAddr string, srv *serverProc, px *proxyProc, err error) {
	if t, err = newTopo(r, n); err != nil {
		return nil, "", nil, nil, err
	}
	srvAddr = t.addr(9000)
	if srv, err = startServer(r, t.peer, srvAddr, ""); err != nil {
		return nil, "", nil, nil, err
	}
	if err = waitReachable(srvAddr); err != nil {
		return nil, "", nil, nil, err
	}
	if px, err = startProxy(r, proxyConfig{upstreams: []string{srvAddr}}.yaml()); err != nil {
		return nil, "", nil, nil, err
	}
	return t, srvAddr, srv, px, nil
}
