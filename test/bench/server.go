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
	"time"
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

// serverMain listens on a loopback port, prints "LISTEN addr" on stdout and
// serves until its stdin reaches EOF (the parent closed it or died).
func serverMain() int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
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
