//go:build linux

package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"time"
)

// kind is how a scenario drives its connections.
type kind int

const (
	// kindRR: each connection has one request in flight; the worker writes
	// a request and reads its response, in a loop.
	kindRR kind = iota
	// kindPipe: each connection has up to depth requests in flight; one
	// goroutine writes, another reads, a token channel bounds the window.
	kindPipe
	// kindCPS: each worker connects, sends one request, reads the response,
	// closes, in a loop.
	kindCPS
)

type scenario struct {
	name    string
	kind    kind
	conns   int // connections (kindRR, kindPipe) or workers (kindCPS)
	depth   int // requests in flight per connection (kindPipe)
	reqLen  int // request payload bytes
	respLen int // response payload bytes
	bulk    bool
	about   string
}

func scenarios(cpsWorkers int) []scenario {
	return []scenario{
		{name: "rr1", kind: kindRR, conns: 1, depth: 1, reqLen: 200, respLen: 2048,
			about: "1 connection, 200 B request / 2 KiB response, one in flight"},
		{name: "rr64", kind: kindRR, conns: 64, depth: 1, reqLen: 200, respLen: 2048,
			about: "64 connections, one in flight each"},
		{name: "pipe8x16", kind: kindPipe, conns: 8, depth: 16, reqLen: 200, respLen: 2048,
			about: "8 connections, 16 pipelined requests in flight each"},
		{name: "bulk", kind: kindPipe, conns: 1, depth: 4, reqLen: 1 << 20, respLen: 4, bulk: true,
			about: "1 connection, 1 MiB frames client->server, server acks each frame with a 4-byte frame, 4 frames in flight"},
		{name: "cps", kind: kindCPS, conns: cpsWorkers, depth: 1, reqLen: 200, respLen: 2048,
			about: fmt.Sprintf("%d workers: connect, 200 B request, 2 KiB response, close", cpsWorkers)},
	}
}

// window is the measured interval. Work done before start is warm-up;
// operations that complete outside [start, end] are not counted.
type window struct{ start, end time.Time }

// workerStats is owned by one worker goroutine until it returns.
type workerStats struct {
	ops      int64
	errs     int64
	firstErr error
	lat      []int64 // ns, operations completed inside the window
}

func (s *workerStats) record(t0, t1 time.Time, win window) {
	if t1.Before(win.start) || t1.After(win.end) {
		return
	}
	s.ops++
	s.lat = append(s.lat, int64(t1.Sub(t0)))
}

func (s *workerStats) fail(err error) {
	s.errs++
	if s.firstErr == nil {
		s.firstErr = err
	}
}

// loadResult is what one scenario run on one path measured on the client.
type loadResult struct {
	ops      int64
	errs     int64
	firstErr error
	lat      []int64 // sorted, ns
}

const (
	ioGrace     = 10 * time.Second // deadline slack after the window ends
	dialTimeout = 5 * time.Second
	cpsMaxErrs  = 100 // a cps worker gives up after this many errors
)

// dialer is used for every client connection. Keep-alive probes are off:
// the runs are short and the extra setsockopt calls only add client noise.
var dialer = net.Dialer{Timeout: dialTimeout, KeepAlive: -1}

// closeOnDone returns a function for context.AfterFunc that closes c, which
// unblocks any read or write on it.
func closeOnDone(c io.Closer) func() {
	return func() { _ = c.Close() }
}

// dialAll opens n connections to addr.
func dialAll(ctx context.Context, addr string, n int) ([]net.Conn, error) {
	conns := make([]net.Conn, 0, n)
	for range n {
		c, err := dialer.DialContext(ctx, "tcp", addr)
		if err != nil {
			closeAll(conns)
			return nil, err
		}
		conns = append(conns, c)
	}
	return conns, nil
}

func closeAll(conns []net.Conn) {
	for _, c := range conns {
		_ = c.Close()
	}
}

// runLoad runs scenario sc against addr: it sets the connections up, then
// runs warm-up followed by the measured window, calling meter.begin and
// meter.end at the window's edges. Workers stop issuing work at the window's
// end, or after maxOps operations in total, and every blocking call has a
// deadline of the window's end plus ioGrace, so runLoad returns by then
// whatever the path does.
func runLoad(ctx context.Context, addr string, sc scenario, warmup, dur time.Duration, maxOps int64, meter *cpuMeter) (loadResult, window, error) {
	ctx, cancel := context.WithTimeout(ctx, warmup+dur+ioGrace+dialTimeout)
	defer cancel()
	perWorker := max(maxOps/int64(sc.conns), 1)
	stats := make([]workerStats, sc.conns)
	req := makeRequest(sc.reqLen, sc.respLen, requestHead)
	var wg sync.WaitGroup
	var conns []net.Conn
	if sc.kind != kindCPS {
		var err error
		if conns, err = dialAll(ctx, addr, sc.conns); err != nil {
			return loadResult{}, window{}, fmt.Errorf("dial: %w", err)
		}
		defer closeAll(conns)
	}

	now := time.Now()
	win := window{start: now.Add(warmup), end: now.Add(warmup + dur)}
	for i := range stats {
		wg.Add(1)
		switch sc.kind {
		case kindRR, kindPipe:
			c := conns[i]
			_ = c.SetDeadline(win.end.Add(ioGrace))
			context.AfterFunc(ctx, closeOnDone(c))
			if sc.kind == kindRR {
				go rrWorker(&wg, c, req, sc.respLen, win, perWorker, &stats[i])
			} else {
				go pipeWorker(ctx, &wg, c, req, sc.respLen, sc.depth, win, perWorker, &stats[i])
			}
		case kindCPS:
			go cpsWorker(ctx, &wg, addr, req, sc.respLen, win, perWorker, &stats[i])
		}
	}
	sleepUntil(ctx, win.start)
	meter.begin()
	sleepUntil(ctx, win.end)
	meter.end()
	wg.Wait()

	var res loadResult
	n := 0
	for i := range stats {
		n += len(stats[i].lat)
	}
	res.lat = make([]int64, 0, n)
	for i := range stats {
		s := &stats[i]
		res.ops += s.ops
		res.errs += s.errs
		if res.firstErr == nil {
			res.firstErr = s.firstErr
		}
		res.lat = append(res.lat, s.lat...)
	}
	slices.Sort(res.lat)
	return res, win, ctx.Err()
}

// sleepUntil sleeps until t or until ctx ends.
func sleepUntil(ctx context.Context, t time.Time) {
	timer := time.NewTimer(time.Until(t))
	defer timer.Stop()
	select {
	case <-timer.C:
	case <-ctx.Done():
	}
}

// rrWorker drives one connection with one request in flight.
func rrWorker(wg *sync.WaitGroup, c net.Conn, req []byte, respLen int, win window, maxOps int64, st *workerStats) {
	defer wg.Done()
	r := bufio.NewReaderSize(c, 32<<10)
	for range maxOps {
		t0 := time.Now()
		if !t0.Before(win.end) {
			return
		}
		if _, err := c.Write(req); err != nil {
			st.fail(err)
			return
		}
		if err := readResponse(r, respLen); err != nil {
			st.fail(err)
			return
		}
		st.record(t0, time.Now(), win)
	}
}

// pipeWorker drives one connection with up to depth requests in flight:
// pipeWriter sends while a token is free, pipeReader matches responses (in
// order) to send times and frees tokens.
func pipeWorker(ctx context.Context, wg *sync.WaitGroup, c net.Conn, req []byte, respLen, depth int, win window, maxOps int64, st *workerStats) {
	defer wg.Done()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	tokens := make(chan struct{}, depth)
	for range depth {
		tokens <- struct{}{}
	}
	sent := make(chan time.Time, depth)
	var werr error
	var inner sync.WaitGroup
	inner.Add(1)
	go pipeWriter(ctx, &inner, c, req, tokens, sent, win, maxOps, &werr)
	pipeReader(c, respLen, tokens, sent, win, st, cancel)
	inner.Wait()
	if werr != nil {
		st.fail(werr)
	}
}

// pipeWriter writes requests while tokens are available and the window is
// open; it closes sent when it stops, which tells pipeReader how many
// responses are still due.
func pipeWriter(ctx context.Context, wg *sync.WaitGroup, c net.Conn, req []byte, tokens <-chan struct{}, sent chan<- time.Time, win window, maxOps int64, errp *error) {
	defer wg.Done()
	defer close(sent)
	for range maxOps {
		select {
		case <-tokens:
		case <-ctx.Done():
			return
		}
		now := time.Now()
		if !now.Before(win.end) {
			return
		}
		sent <- now // never blocks: at most depth sends are outstanding
		if _, err := c.Write(req); err != nil {
			if ctx.Err() == nil {
				*errp = err
			}
			return
		}
	}
}

// pipeReader reads one response per send time until pipeWriter is done and
// every outstanding response has arrived. On error it cancels the writer.
func pipeReader(c net.Conn, respLen int, tokens chan<- struct{}, sent <-chan time.Time, win window, st *workerStats, cancel context.CancelFunc) {
	r := bufio.NewReaderSize(c, 64<<10)
	for t0 := range sent {
		if err := readResponse(r, respLen); err != nil {
			st.fail(err)
			cancel()
			_ = c.Close() // unblocks a writer stuck in Write
			// Drain so the writer is never the one left waiting.
			for range sent {
			}
			return
		}
		st.record(t0, time.Now(), win)
		tokens <- struct{}{} // never blocks: one token per response
	}
}

// cpsWorker connects, sends one request, reads the response and closes, in a
// loop, until the window ends, maxOps, or cpsMaxErrs errors.
func cpsWorker(ctx context.Context, wg *sync.WaitGroup, addr string, req []byte, respLen int, win window, maxOps int64, st *workerStats) {
	defer wg.Done()
	r := bufio.NewReaderSize(nil, 4<<10)
	for range maxOps {
		t0 := time.Now()
		if !t0.Before(win.end) || ctx.Err() != nil {
			return
		}
		if err := oneShot(ctx, r, addr, req, respLen); err != nil {
			st.fail(err)
			if st.errs >= cpsMaxErrs || errors.Is(err, context.Canceled) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		st.record(t0, time.Now(), win)
	}
}

// oneShot is one connect-request-response-close.
func oneShot(ctx context.Context, r *bufio.Reader, addr string, req []byte, respLen int) error {
	c, err := dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(dialTimeout)); err != nil {
		return err
	}
	if _, err := c.Write(req); err != nil {
		return err
	}
	r.Reset(c)
	return readResponse(r, respLen)
}

// probe does one request/response on a fresh connection: a path that cannot
// do this is skipped instead of measured.
func probe(ctx context.Context, addr string) error {
	ctx, cancel := context.WithTimeout(ctx, dialTimeout)
	defer cancel()
	r := bufio.NewReaderSize(nil, 4<<10)
	return oneShot(ctx, r, addr, makeRequest(200, 2048, requestHead), 2048)
}
