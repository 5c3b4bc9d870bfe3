package proxy

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/policy"
)

// An idle link's two goroutines wait on their first 2 KiB stacks. A pump
// whose work once went deeper than that keeps the grown stack for the
// link's life: the runtime shrinks a parked stack only when it uses under
// a quarter of it, its guard counted, and a pump parked in the poller uses
// more. One frame too many on a request's or a response's way is 2 KiB
// more per idle link (docs/performance.md, "Idle links: the pumps'
// stacks").
//
// Each profile's links carry the protocol's own exchange (a Kafka
// Metadata request and its response, a Pinot InstanceRequest and its
// DataTable, 64 KiB each way for opaque), so the requests are tracked and
// answered as in production. Measured in the runtime's own accounting
// (stack spans in use, after a GC), in a fresh process for each profile
// (this test run again as a child), so that no earlier test's goroutines
// lend their stacks. The upstream is the child's test goroutine, which
// answers each link in turn: the proxy's are the only goroutines the links
// add (a peer's goroutine per connection would also move the runtime's
// starting stack size, which follows the average stack in use).
//
// The child is this package's tests built without -race (the race
// detector's instrumentation deepens every frame, so under it the stacks
// grow by design), and runs with GOMAXPROCS=1, the proxy's default
// (limits.procs): each P keeps a cache of free stacks of its own.
func TestIdleLinkStacksStayAtTheirStart(t *testing.T) {
	if p, ok := os.LookupEnv(stackChildEnv); ok {
		idleLinkStacks(t, p)
		return
	}
	bin := nonRaceTestBinary(t)
	for _, profile := range []string{"opaque", policy.FramingKafka, policy.FramingPinot, "parked"} {
		t.Run(profile, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin, "-test.run=^TestIdleLinkStacksStayAtTheirStart$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), stackChildEnv+"="+profile, "GOMAXPROCS=1")
			out, err := cmd.CombinedOutput()
			t.Logf("%s", out)
			if err != nil {
				t.Fatalf("the %s child: %v", profile, err)
			}
		})
	}
}

// nonRaceTestBinary builds this package's tests without the race detector
// (whatever this binary was built with) and returns the binary's path.
func nonRaceTestBinary(t *testing.T) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	bin := filepath.Join(t.TempDir(), "proxy.test")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, goTool, "test", "-c", "-race=false", "-o", bin, "github.com/livenessproxy/livenessproxy/proxy")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go test -c: %v\n%s", err, out)
	}
	return bin
}

const stackChildEnv = "LIVENESSPROXY_STACK_CHILD"

// idleLinkStacks measures, in this process, the stacks of n idle links
// under profile, and fails above two 2 KiB stacks a link (with room for
// the stack pool's spans).
func idleLinkStacks(t *testing.T, profile string) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	// As many links as the descriptors allow, up to 1000: the runtime's
	// caches of free stacks are a few hundred KiB whatever the links, and
	// more links make them less of each link's share. Four descriptors a
	// link (the client's, the upstream's, the proxy's two), 600 for the
	// rest, and the proxy's derived max_links (the same 600, two a link).
	n := 200
	var rl syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl) == nil {
		rl.Cur = rl.Max
		if syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl) == nil && rl.Cur >= 1000*4+600 {
			n = 1000
		}
	}
	var h *harness
	exchange := profile
	switch profile {
	case "opaque":
		h = start(t, ln.Addr().String(), nil)
	case "parked":
		// Kafka's links, whose request pump grew, parked once idle.
		h = startParking(t, ln.Addr().String(), 20*time.Millisecond, func(s *policy.Settings) { s.Framing.Type = policy.FramingKafka })
		exchange = policy.FramingKafka
	default:
		h = start(t, ln.Addr().String(), func(s *policy.Settings) { s.Framing.Type = profile })
	}
	var open []net.Conn
	defer func() {
		for _, c := range open {
			_ = c.Close()
		}
		// The links' ends, taken here: the harness holds 256 of them,
		// and a link whose end is not taken never ends.
		for range n {
			h.linkEnd(time.Minute)
		}
	}()
	before := stackInuse()
	for i := range n {
		c, err := net.DialTimeout("tcp", h.addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		open = append(open, c)
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		var u net.Conn
		// Two exchanges: a framed link's first request is recorded
		// outside the read (its first bytes are checked for TLS), the
		// next ones inside it, deeper.
		for j := range int32(2) {
			req, resp := exchangeOf(exchange, int32(2*i)+j+1)
			if _, err := c.Write(req); err != nil {
				t.Fatal(err)
			}
			if u == nil {
				_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(10 * time.Second))
				if u, err = ln.Accept(); err != nil {
					t.Fatal(err)
				}
				open = append(open, u)
				_ = u.SetDeadline(time.Now().Add(10 * time.Second))
			}
			if _, err := io.ReadFull(u, make([]byte, len(req))); err != nil {
				t.Fatal(err)
			}
			if _, err := u.Write(resp); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(c, make([]byte, len(resp))); err != nil {
				t.Fatal(err)
			}
		}
	}
	if profile == "parked" {
		h.waitParked(2*n, time.Minute)
		waitNoPumpGoroutines(t, time.Minute)
	}
	perLink := (int64(stackInuse()) - int64(before)) / int64(n)
	for _, r := range metrics.UntrackedReasons {
		if got := testutil.ToFloat64(h.m.ForListener("test").Untracked(r)); got != 0 {
			t.Fatalf("untracked{%s} = %v: the exchange is not the protocol's", r, got)
		}
	}
	t.Logf("%s: goroutine stacks per idle link: %d B", profile, perLink)
	// An opaque link's pumps both stay at their 2 KiB start. A framed
	// link's request pump parses the protocol's request header (Kafka's
	// parser alone takes over 500 B of stack, on top of the poller's and
	// the scanner's frames), so it grows once to 4 KiB; its response pump
	// stays at 2 KiB. The limits leave 1 KiB for the stack pool's spans.
	want, what := int64(5<<10), "two stacks at their 2 KiB start"
	switch profile {
	case "parked":
		// No goroutine: what is left is the runtime's caches (the stacks
		// of up to 64 dead goroutines per P, the stack pool's partly used
		// spans: 60-400 KiB in all, whatever the links: 230-260 B a link of
		// 1000), far below the 4 KiB a link's two waiting pumps take.
		want, what = 1<<10, "none of the link's: both pumps parked"
		if n < 1000 {
			want = 3 << 10 // the caches' share is five times larger
		}
	case policy.FramingKafka, policy.FramingPinot:
		want, what = 7<<10, "the request pump's 4 KiB and the response pump's 2 KiB"
	}
	if perLink > want {
		t.Fatalf("%s: an idle link's goroutines hold %d B of stack, want %s (at most %d B): a pump's stack grew and stays grown", profile, perLink, what, want)
	}
}

// exchangeOf is one request of profile, with correlation id or request id
// id, and its response.
func exchangeOf(profile string, id int32) (req, resp []byte) {
	switch profile {
	case policy.FramingKafka:
		resp = binary.BigEndian.AppendUint32(nil, 8)
		resp = binary.BigEndian.AppendUint32(resp, uint32(id))
		return metadataReq(id), append(resp, 0, 0, 0, 0)
	case policy.FramingPinot:
		q := pinotsim.AppendRequest(nil, &pinotsim.Request{ID: int64(id), Table: "t_OFFLINE", TimeoutMs: 10_000})
		return pinotsim.AppendFrame(nil, q), pinotsim.AppendFrame(nil, pinotsim.AppendResponse(nil, int64(id)))
	}
	msg := make([]byte, 64<<10)
	return msg, msg
}

// stackInuse is the memory in goroutine stacks once a GC has shrunk the
// stacks it may and returned the free ones.
func stackInuse() uint64 { return settledMemStats().StackInuse }
