//go:build linux

package main

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// The bench server runs as a child process: the bench re-executes its own
// binary with serverEnv set. A child process gives fairer numbers than an
// in-process server:
//   - the client and the server do not share one Go scheduler, heap and GC,
//     so a proxy that slows the server down (or the reverse) is not hidden
//     by, or blamed on, work of the other side;
//   - the server's CPU can be read from /proc/PID/stat on its own, so "total
//     CPU per operation" (client + server + proxy) compares like with like
//     between the direct path and the proxied ones;
//   - the server can be pinned to a CPU independently of the client, like
//     the proxies.
//
// The same server process serves every path and every scenario.
const serverEnv = "LPBENCH_ROLE_SERVER"

// serverPortEnv carries -server-port to the server process.
const serverPortEnv = "LPBENCH_SERVER_PORT"

// serverMain listens on a loopback port, prints "LISTEN addr" on stdout and
// serves until its stdin reaches EOF (the parent closed it or died).
func serverMain() int {
	ln, err := serverListen(os.Getenv(serverPortEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench server:", err)
		return 1
	}
	fmt.Printf("LISTEN %s\n", ln.Addr())
	go watchStdin(ln)
	if err := acceptLoop(ln); err != nil && !errors.Is(err, net.ErrClosed) {
		fmt.Fprintln(os.Stderr, "bench server:", err)
		return 1
	}
	return 0
}

// serverListen listens on 127.0.0.1 at the port -server-port asks for:
//   - "below-range" (the default): a free port below the kernel's local
//     port range (net.ipv4.ip_local_port_range), where servers listen in
//     production (Pinot's 8098, Kafka's 9092, Redis's 6379). A client's
//     connect can then never take the server's port as its own, so a
//     client that guards against connecting to itself (net's dial, and
//     livenessproxy's) has nothing to check;
//   - "kernel": port 0, the kernel's pick, which lies inside that range;
//   - a number: that port.
func serverListen(spec string) (net.Listener, error) {
	switch spec {
	case "kernel":
		return net.Listen("tcp", "127.0.0.1:0")
	case "", "below-range":
		lo16, _ := flow.LocalPortRange() // the range the kernel takes connects' ports from
		lo := int(lo16)
		// Search [first, lo) from an offset of the pid, so two benches at
		// once do not try the same ports in the same order.
		const first = 10000
		if lo <= first {
			return nil, fmt.Errorf("the local port range starts at %d: no port below it from %d on (use -server-port kernel or a number)", lo, first)
		}
		span := lo - first
		start := os.Getpid() % span
		var lastErr error
		for i := 0; i < min(span, 2000); i++ {
			port := first + (start+i)%span
			ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
			if err == nil {
				return ln, nil
			}
			lastErr = err
		}
		return nil, fmt.Errorf("no free port below the local port range (from %d): %w", lo, lastErr)
	}
	port, err := strconv.ParseUint(spec, 10, 16)
	if err != nil || port == 0 {
		return nil, fmt.Errorf("-server-port %q: want below-range, kernel or a port from 1 to 65535", spec)
	}
	return net.Listen("tcp", net.JoinHostPort("127.0.0.1", spec))
}

// watchStdin closes the listener once stdin ends, which ends acceptLoop and
// with it the process (open connections die with the process).
func watchStdin(ln net.Listener) {
	_, _ = io.Copy(io.Discard, os.Stdin)
	_ = ln.Close()
}

// acceptLoop serves every accepted connection on its own goroutine.
func acceptLoop(ln net.Listener) error {
	for {
		c, err := ln.Accept()
		if errors.Is(err, net.ErrClosed) {
			return err
		}
		if err != nil {
			// Out of descriptors or an aborted handshake: the bench
			// counts the client's error; keep serving.
			fmt.Fprintln(os.Stderr, "bench server: accept:", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		go serveConn(c)
	}
}

// serveConn answers request frames in order. Responses are buffered and
// flushed only when the next request is not completely buffered yet, so
// pipelined requests get batched responses while a lone request is answered
// at once, and the server never blocks on a read with responses unsent.
func serveConn(c net.Conn) {
	defer c.Close()
	r := bufio.NewReaderSize(c, 64<<10)
	w := bufio.NewWriterSize(c, 64<<10)
	var hdr [hdrLen + minRequest]byte
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint32(hdr[0:4]))
		respLen := int(binary.BigEndian.Uint32(hdr[hdrLen+headLen:]))
		if n < minRequest || n > maxRequest || respLen > maxResponse {
			return
		}
		if _, err := r.Discard(n - minRequest); err != nil {
			return
		}
		// The response starts with bytes 4-8 of the request's head (a
		// Kafka correlation id), then zeros.
		binary.BigEndian.PutUint32(hdr[0:4], uint32(respLen))
		echo := min(respLen, 4)
		if _, err := w.Write(hdr[0 : 4+echo]); err != nil {
			return
		}
		if _, err := w.Write(zeros[:respLen-echo]); err != nil {
			return
		}
		if !nextFrameBuffered(r) {
			if err := w.Flush(); err != nil {
				return
			}
		}
	}
}

// nextFrameBuffered reports whether a whole frame is already in r's buffer,
// i.e. whether handling it cannot block on the network.
func nextFrameBuffered(r *bufio.Reader) bool {
	if r.Buffered() < hdrLen {
		return false
	}
	h, err := r.Peek(hdrLen)
	if err != nil {
		return false
	}
	return r.Buffered() >= hdrLen+int(binary.BigEndian.Uint32(h))
}
