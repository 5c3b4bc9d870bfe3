package proxy

import (
	"io"
	"net"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/policy"
)

// BenchmarkProxyAllocsPerLink counts the proxy's own heap allocations per
// new connection: connect, a 200 B request, a 2 KiB response, close (the
// bench's cps), through a proxy set up as the binary sets it (a logger at
// warn, a registry of its own). The client and the server use raw system
// calls on blocking sockets and allocate nothing per connection, so the
// process's mallocs over the links, once every link has ended, are the
// proxy's (and the runtime's own background work, a few per thousand
// links). Run with -memprofile -memprofilerate=1 to list the sites.
func BenchmarkProxyAllocsPerLink(b *testing.B) {
	srv := rawListen(b)
	go rawServe(srv)
	b.Cleanup(func() { _ = unix.Shutdown(srv, unix.SHUT_RDWR); _ = unix.Close(srv) })
	sa, err := unix.Getsockname(srv)
	if err != nil {
		b.Fatal(err)
	}
	port := sa.(*unix.SockaddrInet4).Port
	cfg := policy.DefaultConfig()
	up := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	cfg.Listeners = []policy.Listener{{Name: "bench", Listen: "127.0.0.1:0", Upstream: up, Settings: cfg.Defaults}}
	log := zerolog.New(io.Discard).Level(zerolog.WarnLevel)
	p := New(cfg, Options{Logger: &log, Registerer: prometheus.NewRegistry()})
	if err := p.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = p.Close() })
	to := &unix.SockaddrInet4{Port: p.Addr("bench").(*net.TCPAddr).Port, Addr: [4]byte{127, 0, 0, 1}}
	req, resp := make([]byte, 200), make([]byte, 2048)
	link := func() {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			b.Fatal(err)
		}
		defer unix.Close(fd)
		if err := unix.Connect(fd, to); err != nil {
			b.Fatal(err)
		}
		if _, err := unix.Write(fd, req); err != nil {
			b.Fatal(err)
		}
		if !rawReadFull(fd, resp) {
			b.Fatal("short response")
		}
	}
	for range 200 { // warm-up: starters, pools, the runtime's caches
		link()
	}
	waitNoLinks(b, p)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	b.ResetTimer()
	for range b.N {
		link()
	}
	b.StopTimer()
	waitNoLinks(b, p)
	runtime.ReadMemStats(&after)
	b.ReportMetric(float64(after.Mallocs-before.Mallocs)/float64(b.N), "proxy-mallocs/link")
	b.ReportMetric(float64(after.TotalAlloc-before.TotalAlloc)/float64(b.N), "proxy-B/link")
}

func waitNoLinks(b *testing.B, p *Proxy) {
	deadline := time.Now().Add(10 * time.Second)
	for p.ActiveLinks() != 0 {
		if time.Now().After(deadline) {
			b.Fatalf("%d links still open", p.ActiveLinks())
		}
		time.Sleep(time.Millisecond)
	}
}

// rawListen is a blocking listening socket on 127.0.0.1, outside net.
func rawListen(b *testing.B) int {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		b.Fatal(err)
	}
	if err := unix.Listen(fd, 128); err != nil {
		b.Fatal(err)
	}
	return fd
}

// rawServe answers each connection, one at a time: it reads the 200 B
// request, writes 2 KiB, reads to the end and closes. No allocation per
// connection (accept4 without an address).
func rawServe(lfd int) {
	req, resp := make([]byte, 200), make([]byte, 2048)
	for {
		r, _, errno := unix.Syscall6(unix.SYS_ACCEPT4, uintptr(lfd), 0, 0, unix.SOCK_CLOEXEC, 0, 0)
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			return
		}
		fd := int(r)
		if rawReadFull(fd, req) {
			if _, err := unix.Write(fd, resp); err == nil {
				for { // to the client's end
					if n, err := unix.Read(fd, req); n <= 0 && err != unix.EINTR {
						break
					}
				}
			}
		}
		_ = unix.Close(fd)
	}
}

func rawReadFull(fd int, buf []byte) bool {
	for got := 0; got < len(buf); {
		n, err := unix.Read(fd, buf[got:])
		if err == unix.EINTR {
			continue
		}
		if n <= 0 {
			return false
		}
		got += n
	}
	return true
}
