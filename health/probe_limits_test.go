package health

import (
	"context"
	"errors"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// A probe that fails for the prober's own reason (no descriptors:
// EMFILE, the error net.Dialer returns when socket(2) fails so) does not
// count against the endpoint: no failed probe, no grown backoff, no
// probes_total{result="fail"}. Before (found by a helper's audit), each
// counted. A refused probe still counts (TestConnectProbeRefusedThenReopened);
// which errors are the proxy's own: proxy.TestOwnFailureIsTheProxys.
func TestProbeOutOfDescriptorsIsNoFailedProbe(t *testing.T) {
	var dials atomic.Int32
	emfile := func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return nil, &net.OpError{Op: "dial", Net: network, Err: os.NewSyscallError("socket", syscall.EMFILE)}
	}
	var fails atomic.Int32
	own := func(err error) bool { return errors.Is(err, syscall.EMFILE) }
	d := New(Options{Dial: emfile, OwnFailure: own, OnProbe: func(_ string, ok bool) {
		if !ok {
			fails.Add(1)
		}
	}})
	defer d.Close()
	const ep = "127.0.0.1:1"
	d.Register(ep, ProbeConfig{Kind: ProbeConnect, InitialDelay: 20 * time.Millisecond, Factor: 2, MaxDelay: time.Minute, Timeout: 200 * time.Millisecond})
	d.Report(ep, "write_timeout")
	deadline := time.Now().Add(3 * time.Second)
	for dials.Load() < 3 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond)
	var st Status
	for _, s := range d.Statuses() {
		if s.Endpoint == ep {
			st = s
		}
	}
	t.Logf("probes dialled %d times, all EMFILE; failed_probes=%d, probes_total{fail} reported %d, last_probe_error=%q, next probe in %v",
		dials.Load(), st.FailedProbes, fails.Load(), st.LastProbeError, time.Until(st.NextProbe).Round(time.Millisecond))
	if st.FailedProbes != 0 || fails.Load() != 0 {
		t.Fatalf("a probe that failed for want of the proxy's own descriptors counted as %d failed probes of the endpoint (backoff grown to %v): the proxy's own failure was held against the upstream",
			st.FailedProbes, time.Until(st.NextProbe).Round(time.Millisecond))
	}
}

// A probe that fails for the prober's own reason after the endpoint's
// failed probes grew the backoff is retried at InitialDelay, not at the
// grown delay: it asked nothing of the endpoint, and an endpoint back
// while the prober's own failure lasted is readmitted within InitialDelay
// of its end. Two such probes in a row are the initial delay apart, not
// the backoff's (a probe comes its delay or more after the last one
// ended, so a gap shorter than the backoff's delay shows the backoff did
// not apply). Before, the next came at the backoff's delay.
func TestProbeOwnFailureIsRetriedAtTheInitialDelay(t *testing.T) {
	ep := testutil.ClosedAddr(t) // refused: the endpoint's failures
	var dials atomic.Int32
	var mu sync.Mutex
	var owned []time.Time
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		// After the endpoint's three failed probes the prober runs out of
		// descriptors: decided here, at the dial, so that no probe that
		// began meanwhile is refused and counted as a fourth.
		if dials.Add(1) > 3 {
			mu.Lock()
			owned = append(owned, time.Now())
			mu.Unlock()
			return nil, &net.OpError{Op: "dial", Net: network, Err: os.NewSyscallError("socket", syscall.EMFILE)}
		}
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}
	d := New(Options{Dial: dial, OwnFailure: func(err error) bool { return errors.Is(err, syscall.EMFILE) }})
	defer d.Close()
	const initial, factor = 20 * time.Millisecond, 4
	d.Register(ep, ProbeConfig{Kind: ProbeConnect, InitialDelay: initial, Factor: factor, MaxDelay: time.Minute, Timeout: time.Second})
	d.Report(ep, "write_timeout")
	status := func() Status {
		for _, s := range d.Statuses() {
			if s.Endpoint == ep {
				return s
			}
		}
		return Status{}
	}
	deadline := time.Now().Add(20 * time.Second)
	for status().FailedProbes < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("the refused endpoint's probes never failed three times: %+v", status())
		}
		time.Sleep(5 * time.Millisecond)
	}
	backoff := initial * factor * factor * factor
	for {
		mu.Lock()
		n := len(owned)
		mu.Unlock()
		if n >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d probes failed for the prober's own reason in 20 s", n)
		}
		time.Sleep(5 * time.Millisecond)
	}
	mu.Lock()
	gap := owned[1].Sub(owned[0])
	mu.Unlock()
	st := status()
	t.Logf("failed probes %d; two probes out of descriptors %v apart (the initial delay %v, the backoff's %v)", st.FailedProbes, gap.Round(time.Millisecond), initial, backoff)
	if st.FailedProbes != 3 || gap >= backoff {
		t.Fatalf("failed probes %d (want 3), probes failing for the prober's own reason %v apart: the backoff's delay %v applied to them, not the initial %v", st.FailedProbes, gap, backoff, initial)
	}
}

// An HTTP probe's answer headers are bounded (16 KiB): whatever answers
// on an excluded endpoint's probe port cannot make each probe hold
// megabytes outside the memory budget, once per excluded endpoint at once
// (a transparent listener tracks up to 4096 destinations); the probe
// fails. Before (found by a helper's audit), net/http's default let an
// answer's headers take 10 MB.
func TestHTTPProbeResponseHeadersAreBounded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	const headerBytes = 8 << 20
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 4096)
				_, _ = c.Read(buf) // the request
				_, _ = c.Write([]byte("HTTP/1.1 200 OK\r\nX-Big: "))
				chunk := make([]byte, 64<<10)
				for i := range chunk {
					chunk[i] = 'a'
				}
				for sent := 0; sent < headerBytes; sent += len(chunk) {
					if _, err := c.Write(chunk); err != nil {
						return
					}
				}
				_, _ = c.Write([]byte("\r\nContent-Length: 0\r\n\r\n"))
			}()
		}
	}()
	d := New(Options{})
	defer d.Close()
	pc := ProbeConfig{Kind: ProbeHTTP, Timeout: 5 * time.Second}.normalized()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, perr := d.probe(context.Background(), ln.Addr().String(), pc)
	runtime.ReadMemStats(&after)
	alloc := after.TotalAlloc - before.TotalAlloc
	t.Logf("one http probe answered with %d MiB of headers: err=%v, allocated %.1f MiB", headerBytes>>20, perr, float64(alloc)/(1<<20))
	if alloc > 1<<20 {
		t.Fatalf("one HTTP probe allocated %.1f MiB for the answer's headers (net/http's default MaxResponseHeaderBytes, 10 MB): a probe's memory is not bounded (x up to max_destinations excluded endpoints probed at once, outside the budget)", float64(alloc)/(1<<20))
	}
}
