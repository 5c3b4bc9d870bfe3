package proxy

import (
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
)

// An idle link holds no read buffer: each pump takes a 64 KiB chunk only
// once its socket is readable and returns it after the bytes are handed
// on, and a drained queue returns its last chunk. Measured in the Go
// heap's own accounting after a GC (which also empties the chunk pool):
// links through the proxy, each after one 64 KiB exchange each way, less
// the same connections made directly to the same peer. Holding a chunk
// per pump would cost 128 KiB per link.
func TestIdleLinkHoldsNoBuffer(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	h := start(t, peer.Addr(), nil)
	const n = 200
	msg := make([]byte, 64<<10)
	heapFor := func(addr string) uint64 {
		before := heapInuse()
		conns := make([]net.Conn, 0, n)
		for range n {
			c, err := net.DialTimeout("tcp", addr, 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			conns = append(conns, c)
			roundTrip(t, c, msg)
		}
		after := heapInuse()
		for _, c := range conns {
			_ = c.Close()
		}
		return (max(after, before) - before) / n
	}
	direct := heapFor(peer.Addr())
	proxied := heapFor(h.addr)
	for range n {
		h.linkEnd(10 * time.Second)
	}
	perLink := int64(proxied) - int64(direct)
	t.Logf("Go heap per idle link: %d B through the proxy, %d B direct: the proxy's share %d B", proxied, direct, perLink)
	if perLink > 16<<10 {
		t.Fatalf("an idle link holds %d B of the proxy's heap, want at most 16 KiB (a read buffer is 64 KiB)", perLink)
	}
}

// heapInuse is the Go heap in use once garbage (and the pooled chunks, which
// a sync.Pool drops over two collections) is collected.
func heapInuse() uint64 { return settledMemStats().HeapInuse }

// settledMemStats are the runtime's memory statistics after two GCs: the
// garbage collected, the pooled chunks dropped, the stacks that may shrink
// shrunk and the free ones returned.
func settledMemStats() runtime.MemStats {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms
}
