//go:build linux

package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The idle scenario measures what an idle link costs a proxy: it opens n
// connections through the proxy, makes one exchange on each (a 64 KiB
// request answered by a 64 KiB response, so that every read buffer the
// proxy uses has been touched), leaves them open and idle, and reads the
// proxy's memory before and after. A sidecar in every broker pod holds
// thousands of such links (Pinot brokers and Kafka clients keep them open
// between queries), so this is the figure that multiplies by the fleet.
//
// The figure per link is (after - before) / n of:
//   - RSS: VmRSS from /proc/PID/status, for any proxy;
//   - Go heap and stacks: go_memstats_heap_inuse_bytes and
//     go_memstats_stack_inuse_bytes from livenessproxy's /metrics.
//
// RSS after the exchange still holds garbage the Go runtime has not yet
// returned to the kernel; the reading waits idleSettle first, so that the
// runtime's background GC and scavenger can run, and reports what a
// scrape of the pod would see.

const (
	idleExchange = 64 << 10
	idleSettle   = 3 * time.Second
	idleDialers  = 32
)

// idleResult is the idle scenario on one proxy path.
type idleResult struct {
	Path  string `json:"path"`
	Links int    `json:"links"`
	// Per idle link, bytes.
	RSSPerLink   float64 `json:"rss_bytes_per_link"`
	HeapPerLink  float64 `json:"go_heap_bytes_per_link,omitempty"`
	StackPerLink float64 `json:"go_stack_bytes_per_link,omitempty"`
	RSSBeforeMiB float64 `json:"rss_before_mib"`
	RSSAfterMiB  float64 `json:"rss_after_mib"`
	Skipped      string  `json:"skipped,omitempty"`
}

// maxIdleLinks is how many idle links the descriptor limit allows: the
// proxy holds two descriptors per link (and HAProxy a few of its own), the
// client and the server one each.
func maxIdleLinks() int {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return 1000
	}
	return int(min(rl.Max, 1<<20)-200) / 2
}

// raiseNoFile lifts the soft descriptor limit to the hard one; children
// started afterwards inherit it.
func raiseNoFile() {
	var rl unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &rl) == nil && rl.Cur < rl.Max {
		rl.Cur = rl.Max
		_ = unix.Setrlimit(unix.RLIMIT_NOFILE, &rl)
	}
}

// measureIdle runs the idle scenario against one proxy path.
func measureIdle(ctx context.Context, p path, n int) idleResult {
	r := idleResult{Path: p.Name, Links: n}
	if p.proc == nil {
		r.Skipped = "not a proxy"
		return r
	}
	if p.proc.exited() {
		r.Skipped = fmt.Sprintf("%s exited: %v", p.Name, p.proc.waitErr)
		return r
	}
	rss0, err := vmRSS(p.proc.pid)
	if err != nil {
		r.Skipped = err.Error()
		return r
	}
	var go0 goMem
	if p.metricsAddr != "" {
		if go0, err = readGoMem(ctx, p.metricsAddr); err != nil {
			r.Skipped = "read /metrics: " + err.Error()
			return r
		}
	}
	conns, err := openIdle(ctx, p.Addr, n)
	defer closeAll(conns)
	if err != nil {
		r.Skipped = err.Error()
		return r
	}
	sleepUntil(ctx, time.Now().Add(idleSettle))
	rss1, err := vmRSS(p.proc.pid)
	if err != nil {
		r.Skipped = err.Error()
		return r
	}
	r.RSSBeforeMiB, r.RSSAfterMiB = float64(rss0)/(1<<20), float64(rss1)/(1<<20)
	r.RSSPerLink = float64(rss1-rss0) / float64(n)
	if p.metricsAddr != "" {
		go1, err := readGoMem(ctx, p.metricsAddr)
		if err != nil {
			r.Skipped = "read /metrics: " + err.Error()
			return r
		}
		r.HeapPerLink = (go1.heap - go0.heap) / float64(n)
		r.StackPerLink = (go1.stack - go0.stack) / float64(n)
	}
	return r
}

// openIdle opens n connections to addr and makes one exchange on each.
func openIdle(ctx context.Context, addr string, n int) ([]net.Conn, error) {
	conns := make([]net.Conn, n)
	req := makeRequest(idleExchange, idleExchange, requestHead)
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
	)
	next := make(chan int)
	for range idleDialers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			br := bufio.NewReaderSize(nil, 64<<10)
			for i := range next {
				c, err := oneExchange(ctx, addr, req, br)
				mu.Lock()
				conns[i] = c
				if err != nil && firstErr == nil {
					firstErr = fmt.Errorf("idle link %d of %d: %w", i+1, n, err)
				}
				mu.Unlock()
			}
		}()
	}
	for i := range n {
		mu.Lock()
		failed := firstErr != nil
		mu.Unlock()
		if failed || ctx.Err() != nil {
			break
		}
		next <- i
	}
	close(next)
	wg.Wait()
	open := conns[:0]
	for _, c := range conns {
		if c != nil {
			open = append(open, c)
		}
	}
	if firstErr == nil {
		firstErr = ctx.Err()
	}
	return open, firstErr
}

// oneExchange dials addr, sends req and reads its response, and returns
// the open connection.
func oneExchange(ctx context.Context, addr string, req []byte, br *bufio.Reader) (net.Conn, error) {
	c, err := dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(req); err != nil {
		return c, err
	}
	br.Reset(c)
	if err := readResponse(br, idleExchange); err != nil {
		return c, err
	}
	_ = c.SetDeadline(time.Time{})
	return c, nil
}

// vmRSS is the resident set size of pid, in bytes.
func vmRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
}

type goMem struct{ heap, stack float64 }

// readGoMem reads the Go heap and stack in use from a /metrics page.
func readGoMem(ctx context.Context, addr string) (goMem, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return goMem{}, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return goMem{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return goMem{}, err
	}
	var m goMem
	found := 0
	for line := range bytes.SplitSeq(body, []byte("\n")) {
		name, val, ok := strings.Cut(string(line), " ")
		if !ok {
			continue
		}
		var into *float64
		switch name {
		case "go_memstats_heap_inuse_bytes":
			into = &m.heap
		case "go_memstats_stack_inuse_bytes":
			into = &m.stack
		default:
			continue
		}
		if *into, err = strconv.ParseFloat(val, 64); err != nil {
			return goMem{}, fmt.Errorf("%s: %w", name, err)
		}
		found++
	}
	if found != 2 {
		return goMem{}, fmt.Errorf("go_memstats_heap_inuse_bytes or go_memstats_stack_inuse_bytes missing")
	}
	return m, nil
}

// writeIdleTable prints the idle scenario's results.
func writeIdleTable(w io.Writer, rs []idleResult) {
	if len(rs) == 0 {
		return
	}
	fmt.Fprintf(w, "\nidle links: one %d KiB exchange each way, then idle %s; memory per link\n", idleExchange>>10, idleSettle)
	fmt.Fprintf(w, "%-16s %7s %10s %10s %10s %12s\n", "path", "links", "RSS/link", "heap/link", "stack/link", "RSS before→after")
	for _, r := range rs {
		if r.Skipped != "" {
			fmt.Fprintf(w, "%-16s %7d SKIPPED: %s\n", r.Path, r.Links, r.Skipped)
			continue
		}
		heap, stack := "-", "-"
		if r.HeapPerLink != 0 || r.StackPerLink != 0 {
			heap, stack = fmtKiB(r.HeapPerLink), fmtKiB(r.StackPerLink)
		}
		fmt.Fprintf(w, "%-16s %7d %10s %10s %10s %6.0f→%.0f MiB\n", r.Path, r.Links, fmtKiB(r.RSSPerLink), heap, stack,
			r.RSSBeforeMiB, r.RSSAfterMiB)
	}
}

func fmtKiB(b float64) string { return fmt.Sprintf("%.1f KiB", b/1024) }
