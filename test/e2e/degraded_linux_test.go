//go:build linux

package e2e

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/internal/pinotsim"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
)

// Degraded but alive paths: real per-segment loss (nftables numgen) and a
// real bandwidth limit (tc tbf) between the proxy and a healthy server.
// Every detection rule has its twin here: a path that is slow or lossy,
// with a server that answers everything, must neither close a link nor
// exclude the endpoint, and every request must get its answer. (netem is
// missing on this kind of machine: FAULTS.md, "Substitutes for the missing
// netem".)

// degradedPort is the server's port in the peer namespace.
const degradedPort = 9000

// degradedPath is a peer namespace joined to this one by a veth pair whose
// two ends have a small MTU and carry one segment per packet (gso_max_segs
// 1): a drop loses one segment, not a 64 KB GSO super-packet, which would
// hide the loss (FAULTS.md).
type degradedPath struct {
	peer *netns.NS
	link *netns.Link
}

// newDegradedPath builds the path on 10.231.<subnet>.0/24 (.1 here, .2
// there) with the given MTU on both ends.
func newDegradedPath(t *testing.T, subnet, mtu int) *degradedPath {
	t.Helper()
	testutil.RequireCommand(t, "ip")
	testutil.RequireCommand(t, "nft")
	d := &degradedPath{peer: netns.NewNS(t)}
	d.link = netns.Veth(t, d.peer, fmt.Sprintf("10.231.%d.1/24", subnet), fmt.Sprintf("10.231.%d.2/24", subnet))
	d.link.Both(t, "ip", "link", "set", "dev", "DEV", "mtu", strconv.Itoa(mtu), "gso_max_segs", "1")
	return d
}

// addr is the server's address in the peer namespace.
func (d *degradedPath) addr() string {
	return net.JoinHostPort(d.link.PeerIP().String(), strconv.Itoa(degradedPort))
}

// lose drops permille/1000 of the segments of the server's port at
// random, in both directions, where they arrive: toward the server in the
// peer's input hook, from it in this namespace's (a drop where a segment
// is sent keeps it unsent, which is not a loss on the path).
func (d *degradedPath) lose(t *testing.T, permille int) {
	t.Helper()
	d.loseOn(t, degradedPort, permille)
}

// loseOn is lose for the server's port port.
func (d *degradedPath) loseOn(t *testing.T, port, permille int) {
	t.Helper()
	rule := func(match string) string {
		return fmt.Sprintf(`table inet lploss {
	chain in { type filter hook input priority 0; policy accept; %s numgen random mod 1000 < %d counter drop; }
}
`, match, permille)
	}
	if err := d.peer.NFT(rule(fmt.Sprintf("tcp dport %d", port))); err != nil {
		t.Fatalf("installing the loss toward the server: %v", err)
	}
	if err := netns.LocalNFT(rule(fmt.Sprintf("ip saddr %s tcp sport %d", d.link.PeerIP(), port))); err != nil {
		t.Fatalf("installing the loss from the server: %v", err)
	}
}

var nftDropped = regexp.MustCompile(`counter packets (\d+)`)

// dropped returns how many segments lose has dropped toward the server and
// from it.
func (d *degradedPath) dropped(t *testing.T) (toServer, fromServer int) {
	t.Helper()
	count := func(out []byte, err error) int {
		if err != nil {
			t.Fatalf("reading the loss counters: %v", err)
		}
		m := nftDropped.FindSubmatch(out)
		if m == nil {
			t.Fatalf("no counter in %q", out)
		}
		n, _ := strconv.Atoi(string(m[1]))
		return n
	}
	return count(d.peer.Run("", "nft", "list", "table", "inet", "lploss")),
		count(netns.LocalRun("", "nft", "list", "table", "inet", "lploss"))
}

// limit shapes both ends of the path to rate (tc tbf, as FAULTS.md: a
// burst of 32 kbit and 50 ms of queue).
func (d *degradedPath) limit(t *testing.T, rate string) {
	t.Helper()
	testutil.RequireCommand(t, "tc")
	d.link.Both(t, "tc", "qdisc", "add", "dev", "DEV", "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "50ms")
}

// degradedServer builds a path (newDegradedPath), shapes it to rate
// unless rate is empty, and serves a framedServer reading at readRate
// behind it, reachable.
func degradedServer(t *testing.T, subnet, mtu int, rate string, readRate int64) (*degradedPath, *framedServer) {
	t.Helper()
	d := newDegradedPath(t, subnet, mtu)
	if rate != "" {
		d.limit(t, rate)
	}
	srv := serveFramed(t, d.peer, d.addr(), readRate)
	waitReachable(t, d.addr())
	return d, srv
}

// framedServer is a healthy request/response server for length_field
// framing (4-byte big-endian length): each request frame is a sequence
// number (8 bytes), the size of the answer it asks for (4 bytes) and
// padding; the answer is a frame of the sequence number and that many
// bytes. It answers every request, in order, as fast as it can, reading
// at readRate bytes a second when that is positive (a slow reader).
type framedServer struct {
	ln       net.Listener
	readRate int64
	answered atomic.Int64

	wg    sync.WaitGroup
	mu    sync.Mutex
	conns []net.Conn
}

// serveFramed starts a framedServer in ns on addr; t.Cleanup stops it and
// waits for its goroutines.
func serveFramed(t *testing.T, ns *netns.NS, addr string, readRate int64) *framedServer {
	t.Helper()
	ln, err := ns.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("framed server on %s: %v", addr, err)
	}
	s := &framedServer{ln: ln, readRate: readRate}
	s.wg.Add(1)
	go s.accept()
	t.Cleanup(s.close)
	return s
}

func (s *framedServer) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns = append(s.conns, c)
		s.mu.Unlock()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.serve(c)
		}()
	}
}

func (s *framedServer) close() {
	_ = s.ln.Close()
	s.mu.Lock()
	for _, c := range s.conns {
		_ = c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// pacedReader reads at most rate bytes a second, 4 KiB at a time.
type pacedReader struct {
	r    io.Reader
	rate int64
}

func (p pacedReader) Read(b []byte) (int, error) {
	if p.rate <= 0 {
		return p.r.Read(b)
	}
	if len(b) > 4096 {
		b = b[:4096]
	}
	n, err := p.r.Read(b)
	time.Sleep(time.Duration(int64(n) * int64(time.Second) / p.rate))
	return n, err
}

func (s *framedServer) serve(c net.Conn) {
	r := pacedReader{r: c, rate: s.readRate}
	head := make([]byte, 16)
	zeros := make([]byte, 64<<10)
	for {
		if _, err := io.ReadFull(r, head); err != nil {
			return
		}
		n := int64(binary.BigEndian.Uint32(head)) - 12
		want := int64(binary.BigEndian.Uint32(head[12:]))
		if _, err := io.CopyN(io.Discard, r, n); err != nil {
			return
		}
		out := make([]byte, 12)
		binary.BigEndian.PutUint32(out, uint32(8+want))
		copy(out[4:], head[4:12])
		if _, err := c.Write(out); err != nil {
			return
		}
		for left := want; left > 0; {
			k := min(left, int64(len(zeros)))
			if _, err := c.Write(zeros[:k]); err != nil {
				return
			}
			left -= k
		}
		s.answered.Add(1)
	}
}

// exchange is one client's load: n requests on c, request i of reqSize(i)
// bytes (at least 16) asking for an answer of respSize(i) bytes, at most
// depth of them outstanding (1: one at a time; more: pipelined). It
// returns how many were answered, each checked for its sequence number and
// length, and the first error; it gives up after timeout.
func exchange(c net.Conn, n, depth int, reqSize, respSize func(i int) int, timeout time.Duration) (int, error) {
	_ = c.SetDeadline(time.Now().Add(timeout))
	defer func() { _ = c.SetDeadline(time.Time{}) }()
	slots := make(chan struct{}, depth)
	werr := make(chan error, 1)
	stop := make(chan struct{})
	go func() {
		werr <- writeRequests(c, n, slots, stop, reqSize, respSize)
	}()
	answered, err := readAnswers(c, n, slots, respSize)
	close(stop)
	if e := <-werr; err == nil {
		err = e
	}
	return answered, err
}

func writeRequests(c net.Conn, n int, slots chan struct{}, stop chan struct{}, reqSize, respSize func(i int) int) error {
	for i := range n {
		select {
		case slots <- struct{}{}:
		case <-stop:
			return nil
		}
		size := max(reqSize(i), 16)
		req := make([]byte, size)
		binary.BigEndian.PutUint32(req, uint32(size-4))
		binary.BigEndian.PutUint64(req[4:], uint64(i))
		binary.BigEndian.PutUint32(req[12:], uint32(respSize(i)))
		if _, err := c.Write(req); err != nil {
			return fmt.Errorf("writing request %d: %w", i, err)
		}
	}
	return nil
}

func readAnswers(c net.Conn, n int, slots chan struct{}, respSize func(i int) int) (int, error) {
	head := make([]byte, 12)
	for i := range n {
		if _, err := io.ReadFull(c, head); err != nil {
			return i, fmt.Errorf("reading answer %d: %w", i, err)
		}
		length := int64(binary.BigEndian.Uint32(head)) - 8
		if seq := binary.BigEndian.Uint64(head[4:]); seq != uint64(i) || length != int64(respSize(i)) {
			return i, fmt.Errorf("answer %d: sequence %d, %d bytes; want %d bytes", i, seq, length, respSize(i))
		}
		if _, err := io.CopyN(io.Discard, c, length); err != nil {
			return i, fmt.Errorf("reading answer %d: %w", i, err)
		}
		<-slots
	}
	return n, nil
}

// lengthFieldSettings are the defaults with length_field framing (4-byte
// big-endian length) and unanswered tracking on: every request judged by
// the unanswered rule and the staleness check.
func lengthFieldSettings() policy.Settings {
	s := policy.DefaultSettings()
	s.Framing = pinotSettings(0, 0, 0).Framing
	s.Framing.MaxFrameLength = 64 * policy.MiB // the 20 MB frames below
	s.Unanswered.Track = policy.TrackOn
	return s
}

// runClients runs load on links clients through pp at once and fails the
// test unless every request of every link was answered. The links stay
// open until the test ends (their ends would be link ends to tell apart).
func runClients(t *testing.T, pp *pinotProxy, links int, load func(c net.Conn) (int, error)) int {
	t.Helper()
	type result struct {
		answered int
		err      error
	}
	results := make(chan result, links)
	for range links {
		c, err := net.Dial("tcp", pp.addr)
		if err != nil {
			t.Fatalf("dialling the proxy: %v", err)
		}
		t.Cleanup(func() { _ = c.Close() })
		go func() {
			n, err := load(c)
			results <- result{n, err}
		}()
	}
	total := 0
	var errs []error
	for range links {
		r := <-results
		total += r.answered
		if r.err != nil {
			errs = append(errs, r.err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		t.Errorf("%d requests answered; %d links failed: %v (endpoint %+v)", total, len(errs), err, pp.state())
	}
	return total
}

// assertCutNothing is what every twin here asserts of the proxy once its
// load is done, its clients still connected: no link ended, nothing
// counted unanswered or stale, and the endpoint healthy throughout.
func assertCutNothing(t *testing.T, pp *pinotProxy, w *stateWatcher, start time.Time) {
	t.Helper()
	assertNoLinkEnds(t, pp, time.Now(), start)
	for _, name := range []string{"unanswered_timeouts_total", "stale_frames_dropped_total"} {
		if n := pp.counter(t, name, "", ""); n != 0 {
			t.Errorf("%s = %v on a healthy server, want 0", name, n)
		}
	}
	w.Stop()
	assertAlwaysHealthy(t, pp, w, start)
}

// startDegradedProxy starts a proxy with settings s (admin off, one
// listener) in front of upstream and a watcher on its endpoint.
func startDegradedProxy(t *testing.T, upstream string, s policy.Settings, watchFor time.Duration) (*pinotProxy, *stateWatcher) {
	t.Helper()
	pp := startPinotProxy(t, upstream, s)
	return pp, watchEndpoint(t, pp, watchFor)
}

// A lossy path under framed request/response load: 5% of the segments
// lost at random in each direction, one segment per packet. TCP recovers
// every loss (fast retransmits, and timeouts of 200 ms and more when a
// retransmission is lost too); a server that answers everything is never
// excluded, no link is cut (no write_timeout, no upstream_timeout, no
// stale request, no unanswered one), and every request gets its answer.
func TestLossyPathCutsNothingLengthField(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	d, srv := degradedServer(t, 41, 1000, "", 0)
	start := time.Now()
	pp, w := startDegradedProxy(t, d.addr(), lengthFieldSettings(), 2*time.Minute)
	d.lose(t, 50)
	const links, each = 8, 150
	total := runClients(t, pp, links, func(c net.Conn) (int, error) {
		return exchange(c, each, 1,
			func(i int) int { return 200 + (i*977)%6000 },
			func(i int) int { return 100 + (i*7919)%40000 }, time.Minute)
	})
	toServer, fromServer := d.dropped(t)
	t.Logf("%d requests answered in %v; %d segments lost toward the server, %d from it (server answered %d)",
		total, ms(time.Since(start)), toServer, fromServer, srv.answered.Load())
	if toServer < 20 || fromServer < 20 {
		t.Fatalf("only %d and %d segments dropped: the path was not lossy", toServer, fromServer)
	}
	assertCutNothing(t, pp, w, start)
}

// narrowLoad runs, through pp, one link whose single request is of
// bigReq bytes and asks for bigResp, beside another that makes small
// requests one after another on the same narrow path for as long; it
// fails the test unless every request was answered, and returns how many
// the small link made.
func narrowLoad(t *testing.T, pp *pinotProxy, bigReq, bigResp int) int {
	t.Helper()
	c, err := net.Dial("tcp", pp.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	done := make(chan error, 1)
	go func() {
		_, err := exchange(c, 1, 1, func(int) int { return bigReq }, func(int) int { return bigResp }, 2*time.Minute)
		done <- err
	}()
	small := 0
	runClients(t, pp, 1, func(c net.Conn) (int, error) {
		for {
			select {
			case err := <-done:
				done <- err
				return small, nil
			default:
			}
			n, err := exchange(c, 1, 1, func(int) int { return 100 }, func(int) int { return 100 }, time.Minute)
			small += n
			if err != nil || small >= 10000 {
				return small, err
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	if err := <-done; err != nil {
		t.Errorf("the large exchange (%d bytes up, %d down): %v", bigReq, bigResp, err)
	}
	return small
}

// A 20 MB answer across a 16 Mbit/s path takes about 10 s, three times
// request_timeout and as long as write_timeout: the server answers at
// once and keeps sending, so nothing may end the link or exclude the
// endpoint, nor the small requests another link makes meanwhile.
func TestNarrowPathLargeAnswerCutsNothing(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft", "tc") {
		return
	}
	d, _ := degradedServer(t, 42, 1500, "16mbit", 0)
	start := time.Now()
	pp, w := startDegradedProxy(t, d.addr(), lengthFieldSettings(), 2*time.Minute)
	small := narrowLoad(t, pp, 100, 20<<20)
	took := time.Since(start)
	t.Logf("20 MiB answered in %v, %d small requests beside it", ms(took), small)
	if took < 2*lengthFieldSettings().Unanswered.RequestTimeout.D() {
		t.Fatalf("the answer crossed in %v: the path was not narrow", took)
	}
	assertCutNothing(t, pp, w, start)
}

// A 20 MB upload across a 16 Mbit/s path takes about 10 s: five times
// write_timeout (2 s here) and ten times request_timeout (1 s), and the
// server answers only once it has all of it. write_timeout judges
// progress, not completion, and a request the upstream is still taking in
// is neither stale nor unanswered: nothing ends the link or excludes the
// endpoint.
func TestNarrowPathLargeUploadCutsNothing(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft", "tc") {
		return
	}
	d, _ := degradedServer(t, 43, 1500, "16mbit", 0)
	s := lengthFieldSettings()
	s.WriteTimeout = policy.Duration(2 * time.Second)
	s.Unanswered.RequestTimeout = policy.Duration(time.Second)
	start := time.Now()
	pp, w := startDegradedProxy(t, d.addr(), s, 2*time.Minute)
	small := narrowLoad(t, pp, 20<<20, 100)
	took := time.Since(start)
	t.Logf("20 MiB uploaded and answered in %v, %d small requests beside it", ms(took), small)
	if took < 2*s.WriteTimeout.D() {
		t.Fatalf("the upload crossed in %v: the path was not narrow", took)
	}
	assertCutNothing(t, pp, w, start)
}

// A large upload across a lossy path (10% of the segments lost each way):
// each 3 MiB request takes seconds to cross, often past request_timeout (3 s),
// and a lost retransmission keeps the live server silent for one
// retransmission timeout and then another twice as long (the kernel's
// timeout grows on such a path: 0.7 s and 1.4 s were seen). It is still
// being taken in: neither stale nor unanswered. Before, a request not
// acknowledged further for 0.8 s was taken to have stopped, whatever the
// kernel was doing: the healthy server was excluded (unanswered) in
// every run (3 of 3 with 3 MiB uploads, 5 of 5 with 4 MiB). At this loss the kernel's backoff now and
// then leaves 10 s without an acknowledgement (4 losses in a row of one
// segment, on a grown timeout): write_timeout and tcp_user_timeout are
// the operator's to set for such a path, and are 30 s here, out of the
// way of the rules this test is for.
func TestLossyPathLargeUploadCutsNothing(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	d, _ := degradedServer(t, 44, 1000, "", 0)
	s := lengthFieldSettings()
	s.WriteTimeout = policy.Duration(30 * time.Second)
	s.TCPUserTimeout = policy.Duration(30 * time.Second)
	start := time.Now()
	pp, w := startDegradedProxy(t, d.addr(), s, 2*time.Minute)
	d.lose(t, 30)
	const uploads = 3
	runClients(t, pp, 1, func(c net.Conn) (int, error) {
		for i := range uploads {
			if _, err := exchange(c, 1, 1, func(int) int { return 3 << 20 }, func(int) int { return 100 }, time.Minute); err != nil {
				return i, err
			}
			t.Logf("upload %d answered at +%v", i, ms(time.Since(start)))
		}
		return uploads, nil
	})
	toServer, fromServer := d.dropped(t)
	t.Logf("%d uploads of 3 MiB answered in %v; %d segments lost toward the server, %d from it; %v verdicts put off",
		uploads, ms(time.Since(start)), toServer, fromServer, pp.counter(t, "unanswered_deferred_total", "", ""))
	assertCutNothing(t, pp, w, start)
}

// startJudgingProxy starts a proxy in front of upstream with the
// unanswered rule at a 1 s request_timeout and no readmission within a
// test, a watcher on its endpoint, and one client connected through it.
func startJudgingProxy(t *testing.T, upstream string) (*pinotProxy, *stateWatcher, net.Conn) {
	t.Helper()
	s := lengthFieldSettings()
	s.Unanswered.RequestTimeout = policy.Duration(time.Second)
	s.Detector.InitialDelay = policy.Duration(30 * time.Second)
	pp, w := startDegradedProxy(t, upstream, s, time.Minute)
	c, err := net.Dial("tcp", pp.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return pp, w, c
}

// The twin: the path of a large upload dies in the middle, past the
// request's deadline (1 s; the 16 MiB take 8 s at 16 Mbit/s). The kernel
// retransmits into the silence; once two of its retransmissions in a row
// went unanswered (1.4 s on a LAN), the server is no longer taken to be
// taking the request in, and is excluded (unanswered), long before
// tcp_user_timeout (10 s) would have ended the link.
func TestLargeUploadOnADyingPathIsJudged(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft", "tc") {
		return
	}
	d, _ := degradedServer(t, 45, 1500, "16mbit", 0)
	pp, w, c := startJudgingProxy(t, d.addr())
	done := make(chan error, 1)
	go func() {
		_, err := exchange(c, 1, 1, func(int) int { return 16 << 20 }, func(int) int { return 100 }, time.Minute)
		done <- err
	}()
	// Past the request's deadline, while it is still being taken in: its
	// verdict put off.
	for deadline := time.Now().Add(6 * time.Second); pp.counter(t, "unanswered_deferred_total", "", "") == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("6 s into the upload, past its 1 s deadline, no verdict was put off (endpoint %+v)", pp.state())
		}
	}
	if err := d.peer.NFT(blackhole9000); err != nil {
		t.Fatalf("installing the blackhole: %v", err)
	}
	cut := time.Now()
	ex := waitExcluded(t, pp, w, cut, 3*time.Second, "the path died")
	t.Logf("excluded (%s) %v after the path died, in the middle of the upload", ex.Reason, ms(ex.At.Sub(cut)))
	if ex.Reason != "unanswered" {
		t.Fatalf("excluded for %s, want unanswered (the request's silence, before tcp_user_timeout)", ex.Reason)
	}
	if err := <-done; err == nil {
		t.Fatal("the upload was answered across a dead path")
	}
}

// Another twin: a server that stops reading in the middle of a large
// upload while bytes of it are in flight (queued on the narrow path), and
// whose kernel drops them and answers with a zero window: what Linux does
// when the socket's memory runs out (ICSK_ACK_NOMEM; here its receive
// buffer is cut to 4 KiB once it stopped). The kernel retransmits those
// bytes into the zero window without counting the retransmissions
// (tcp_retransmit_timer's "shrunk window" branch leaves tcpi_retransmits
// at 0): that is no lossy path awaiting an answer, and the server is judged
// as one whose window closed, flow.DeliveryQuiet (and the judging slack)
// after it stopped, within a second of the request's deadline.
func TestLargeUploadToAServerThatDropsWhatIsInFlightIsJudged(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft", "tc") {
		return
	}
	d := newDegradedPath(t, 48, 1500)
	d.limit(t, "16mbit")
	ln, err := d.peer.Listen("tcp", d.addr())
	if err != nil {
		t.Fatal(err)
	}
	stopped := make(chan time.Time, 1)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		b := make([]byte, 16<<10)
		for read := 0; read < 256<<10; {
			n, err := c.Read(b)
			if err != nil {
				return
			}
			read += n
		}
		_ = c.(*net.TCPConn).SetReadBuffer(4 << 10)
		stopped <- time.Now()
		<-done
	}()
	t.Cleanup(func() { close(done); _ = ln.Close(); wg.Wait() })
	pp, w, c := startJudgingProxy(t, d.addr())
	sent := time.Now()
	go func() {
		_, _ = exchange(c, 1, 1, func(int) int { return 4 << 20 }, func(int) int { return 100 }, time.Minute)
	}()
	var stop time.Time
	select {
	case stop = <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("the server did not take in 256 KiB within 30 s")
	}
	ex := waitExcluded(t, pp, w, sent, 20*time.Second, "the server stopped reading")
	t.Logf("excluded (%s) %v after the request was sent, %v after the server stopped reading", ex.Reason, ms(ex.At.Sub(sent)), ms(ex.At.Sub(stop)))
	if ex.Reason != "unanswered" {
		t.Fatalf("excluded for %s, want unanswered", ex.Reason)
	}
	// At the request's deadline, or flow.DeliveryQuiet (0.8 s) after the
	// proxy last saw the stream acknowledged further, which its first look
	// at the deadline may be; 3 s of margin for a loaded machine, as
	// TestLargeRequestToAServerThatStopsReadingIsJudged has. The kernel's
	// own bound is tcp_user_timeout, 10 s.
	if limit := sent.Add(time.Second + 800*time.Millisecond + 3*time.Second); ex.At.After(limit) {
		t.Fatalf("excluded %v after the request was sent (%v after the server stopped reading), want by %v",
			ms(ex.At.Sub(sent)), ms(ex.At.Sub(stop)), ms(limit.Sub(sent)))
	}
}

// The pinot profile on a lossy path (5% of the segments each way): a
// broker's steady queries, each with Pinot's default 10 s budget, to a
// server that answers them all. None may be lost to the proxy, no link
// cut, the server never excluded.
func TestLossyPathCutsNothingPinot(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	d := newDegradedPath(t, 46, 1000)
	startPinotIn(t, d.peer, pinotsim.ServerConfig{Addr: d.addr()})
	waitReachable(t, d.addr())
	start := time.Now()
	pp, w := startDegradedProxy(t, d.addr(), defaultsWith(policy.FramingPinot), 2*time.Minute)
	d.lose(t, 50)
	b := pinotsim.NewBroker(pinotsim.BrokerConfig{Timeout: pinotQueryTimeout, RequestSize: 3000})
	t.Cleanup(func() { _ = b.Close() })
	const queries = 600
	l := startLoad(t, b, pp.addr, 10*time.Millisecond, queries)
	l.WaitSent(queries, 10*time.Second) // the load's own bound: a query every 10 ms for 6 s
	l.Finish(pinotQueryTimeout + time.Second)
	rs := l.Records()
	got := outcomes(rs, time.Time{}, time.Now())
	toServer, fromServer := d.dropped(t)
	t.Logf("%d queries in %v: %s; %d segments lost toward the server, %d from it",
		len(rs), ms(time.Since(start)), fmtOutcomes(got), toServer, fromServer)
	if len(rs) < queries/2 || got[pinotsim.OK] != len(rs) {
		t.Errorf("%s of %d queries, want at least %d, all OK", fmtOutcomes(got), len(rs), queries/2)
	}
	if toServer < 20 || fromServer < 20 {
		t.Fatalf("only %d and %d segments dropped: the path was not lossy", toServer, fromServer)
	}
	assertCutNothing(t, pp, w, start)
}

// A slow reader behind a narrow path (2 Mbit/s), two clients pipelining:
// each keeps 8 requests of 32 KiB outstanding to a server that reads
// 96 KB a second, so the server's window closes and opens again all the
// time, and a request waits about as long as request_timeout (3 s) for
// the ones ahead of it, some longer. The server takes everything in at
// its own pace and answers it all: no write_timeout (it acknowledges as
// it reads), no stale request (it is still taking the stream in), nothing
// unanswered (answers keep coming), no exclusion.
func TestSlowReaderBehindNarrowPathCutsNothing(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft", "tc") {
		return
	}
	d, srv := degradedServer(t, 47, 1500, "2mbit", 96_000)
	start := time.Now()
	pp, w := startDegradedProxy(t, d.addr(), lengthFieldSettings(), 2*time.Minute)
	const links, each = 2, 24
	total := runClients(t, pp, links, func(c net.Conn) (int, error) {
		return exchange(c, each, 8, func(int) int { return 32 << 10 }, func(int) int { return 200 }, time.Minute)
	})
	t.Logf("%d pipelined requests answered in %v (server answered %d); %v verdicts put off",
		total, ms(time.Since(start)), srv.answered.Load(), pp.counter(t, "unanswered_deferred_total", "", ""))
	assertCutNothing(t, pp, w, start)
}

// The kafka profile on a lossy path (5% of the segments each way): a
// producer (acks=all, one 3 KB record every 20 ms) and a consumer of the same
// topic through the proxy, to a kfake broker in the peer namespace. Every
// record is acknowledged and consumed, no client connects again, no link
// ends, nothing counts unanswered, the broker is never excluded.
func TestLossyPathCutsNothingKafka(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	const topic = "lossy"
	d := newDegradedPath(t, 48, 1000)
	t.Setenv(kafkaListenEnv, d.addr())
	r := &kafkaRun{mode: kafkaProfileMode, start: time.Now()}
	r.kb = startKafkaBrokerIn(t, d.peer, topic)
	r.cfg = kafkaConfig(t, r.mode, r.kb.addr, "")
	r.pp = startKafkaProxy(t, r.kb, r.cfg)
	r.w = watchEndpoint(t, r.pp, 2*time.Minute)
	c := startKafkaConsumer(t, "lossy-consumer", r.pp.addr, kgo.ConsumeTopics(topic), kgo.FetchMaxWait(500*time.Millisecond))
	p := newKafkaClient(t, "lossy-producer", r.pp.addr, kgo.DefaultProduceTopic(topic), kgo.ProducerLinger(0))
	produceValues(t, p, topic, []string{"warm"}, 30*time.Second)
	if !c.waitValues([]string{"warm"}, 30*time.Second) {
		t.Fatal("the consumer got no record within 30 s")
	}
	warm := time.Now()
	d.lose(t, 50)
	rng := rand.New(rand.NewPCG(1, 2))
	var values []string
	for i := range 300 {
		pad := make([]byte, 1500) // random: the producer compresses its batches
		for j := range pad {
			pad[j] = byte(rng.Uint32())
		}
		values = append(values, fmt.Sprintf("r%d.%x", i, pad)) // a few segments each
	}
	var (
		mu     sync.Mutex
		failed []error
		wg     sync.WaitGroup
	)
	for _, v := range values {
		wg.Add(1)
		p.Produce(context.Background(), &kgo.Record{Value: []byte(v)}, func(_ *kgo.Record, err error) {
			defer wg.Done()
			if err != nil {
				mu.Lock()
				failed = append(failed, err)
				mu.Unlock()
			}
		})
		time.Sleep(20 * time.Millisecond)
	}
	wg.Wait()
	if len(failed) > 0 {
		t.Errorf("%d of %d records failed, the first: %v", len(failed), len(values), failed[0])
	}
	if !c.waitValues(values, 30*time.Second) {
		t.Errorf("consumed: %s", compareValues(append([]string{"warm"}, values...), c.got()))
	}
	end := time.Now()
	toServer, fromServer := d.dropped(t)
	t.Logf("%d records produced and consumed in %v; %d segments lost toward the broker, %d from it",
		len(values), ms(end.Sub(warm)), toServer, fromServer)
	if toServer < 20 || fromServer < 20 {
		t.Fatalf("only %d and %d segments dropped: the path was not lossy", toServer, fromServer)
	}
	for _, h := range []*clientHooks{c.hooks, p.hooks} {
		h.assertNoRedials(t, warm, end, r.start)
	}
	r.assertProxyStayedOut(t, end)
}

// The mesh on a lossy path (10% of the segments each way between the two
// sidecars): the heartbeat (a ping every second, dead after 3 s of
// silence) rides the same TCP connection as the streams, so a lost segment
// holds every frame behind it until the kernel's retransmission gets
// through. Two idle links and one echoing every 100 ms, for 15 s: no link
// may end mesh_dead while the ingress answers, and the endpoint stays
// healthy.
func TestLossyPathMeshIsNotDead(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	d := newDegradedPath(t, 49, 1000)
	srv := echoIn(t, d.peer, d.addr())
	waitReachable(t, srv)
	const meshPort = 17400
	if _, port := startIngressProcess(t, d.peer, ingressConfig(net.JoinHostPort(d.link.PeerIP().String(), strconv.Itoa(meshPort)), srv, nil)); port != meshPort {
		t.Fatalf("ingress on port %d", port)
	}
	p, ended := meshEgress(t, srv, meshPort, nil)
	idle := []net.Conn{meshDial(t, p, "idle 1"), meshDial(t, p, "idle 2")}
	busy := meshDial(t, p, "busy")
	d.loseOn(t, meshPort, 100)
	start := time.Now()
	echoes := 0
	for time.Since(start) < 15*time.Second {
		msg := fmt.Sprintf("echo %d", echoes)
		if _, err := busy.Write([]byte(msg)); err != nil {
			t.Fatalf("echo %d through the lossy mesh: %v", echoes, err)
		}
		_ = busy.SetReadDeadline(time.Now().Add(30 * time.Second))
		if _, err := io.ReadFull(busy, make([]byte, len(msg))); err != nil {
			t.Fatalf("echo %d through the lossy mesh, at +%v: %v", echoes, ms(time.Since(start)), err)
		}
		echoes++
		time.Sleep(100 * time.Millisecond)
	}
	for i, c := range idle {
		meshEcho(t, c, fmt.Sprintf("idle %d, still there", i))
	}
	toIngress, fromIngress := d.dropped(t)
	t.Logf("%d echoes in %v; %d segments lost toward the ingress, %d from it", echoes, ms(time.Since(start)), toIngress, fromIngress)
	select {
	case s := <-ended:
		t.Fatalf("a link ended on a lossy but live mesh: %s (%v) after %v", s.Reason, s.Err, ms(s.Duration))
	default:
	}
	for _, st := range p.Endpoints() {
		if st.State != "healthy" {
			t.Fatalf("endpoint %s %s (%s), want healthy", st.Endpoint, st.State, st.Reason)
		}
	}
	if toIngress < 10 || fromIngress < 10 {
		t.Fatalf("only %d and %d segments dropped: the path was not lossy", toIngress, fromIngress)
	}
}

// Probes across a lossy path (10% of the segments each way, and the first
// SYN after the server came back): a probe whose SYN or SYN-ACK is lost
// gets no second SYN within probe_timeout (1 s; the kernel sends it again
// at 1 s) and fails. That only delays the
// readmission of a server that came back, a probe a second while its
// clients are turned away; it excludes nothing, and once readmitted the
// server is kept while links to it carry traffic across the same loss.
func TestLossyPathProbesDelayReadmissionOnly(t *testing.T) {
	if !netns.Reexec(t, "ip", "nft") {
		return
	}
	d := newDegradedPath(t, 50, 1000)
	ln, err := d.peer.Listen("tcp", d.addr())
	if err != nil {
		t.Fatal(err)
	}
	stop := netns.ServeEcho(t, ln)
	waitReachable(t, d.addr())
	s := policy.DefaultSettings()
	s.Detector.Probe = policy.ProbeKindConnect
	pp, w := startDegradedProxy(t, d.addr(), s, 2*time.Minute)
	d.lose(t, 100)
	stop() // the server goes away: its port refuses
	if c, err := net.Dial("tcp", pp.addr); err == nil {
		_, _ = c.Read(make([]byte, 1)) // reset once the connects are refused
		_ = c.Close()
	}
	ex, ok := pp.waitStatus("excluded", 20*time.Second)
	if !ok || ex.Reason != "dial_error" {
		t.Fatalf("endpoint %+v after its port refused, want excluded for dial_error", pp.state())
	}
	// Besides the random loss, the first SYN to reach the server's
	// namespace from now on is lost: the next probe fails on it.
	if err := d.peer.NFT(dropOneSYN); err != nil {
		t.Fatalf("installing the SYN drop: %v", err)
	}
	failedBefore := pp.counter(t, "probes_total", "result", "fail")
	ln, err = d.peer.Listen("tcp", d.addr())
	if err != nil {
		t.Fatal(err)
	}
	netns.ServeEcho(t, ln)
	back := time.Now()
	if !pp.waitState("healthy", 30*time.Second) {
		t.Fatalf("endpoint %+v 30 s after the server came back", pp.state())
	}
	failed := pp.counter(t, "probes_total", "result", "fail") - failedBefore
	t.Logf("readmitted %v after the server came back; %v probes failed meanwhile", ms(time.Since(back)), failed)
	if failed < 1 {
		t.Fatalf("no probe failed after the server came back: the lost SYN was not a probe's")
	}
	readmitted := time.Now()
	runClients(t, pp, 4, func(c net.Conn) (int, error) {
		for i := range 100 {
			msg := fmt.Sprintf("echo %d", i)
			if _, err := c.Write([]byte(msg)); err != nil {
				return i, err
			}
			_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
			if _, err := io.ReadFull(c, make([]byte, len(msg))); err != nil {
				return i, err
			}
			time.Sleep(20 * time.Millisecond)
		}
		return 100, nil
	})
	toServer, fromServer := d.dropped(t)
	t.Logf("400 echoes after the readmission; %d segments lost toward the server, %d from it", toServer, fromServer)
	w.Stop()
	for _, c := range w.After(readmitted) {
		if c.State != "healthy" {
			t.Errorf("endpoint %s at %v after the readmission (%s), want healthy", c.State, ms(c.At.Sub(readmitted)), c.Reason)
		}
	}
	if st := pp.state(); st.State != "healthy" {
		t.Errorf("endpoint %s (%s) after the echoes, want healthy", st.State, st.Reason)
	}
	if _, ends := pp.links.Before(time.Now()); len(ends) > 0 {
		for _, e := range ends {
			if e.At.After(readmitted) {
				t.Errorf("link %s ended after the readmission: %s (%v)", e.Client, e.Reason, e.Err)
			}
		}
	}
}
