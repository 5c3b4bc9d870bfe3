//go:build linux

package e2e

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/livenessproxy/livenessproxy/internal/harness"
	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/policy"
)

// Helpers shared by the Kafka end-to-end tests (kafka_*_test.go): a kfake
// broker in a child process (so that a test can SIGSTOP it), a proxy built
// from a YAML configuration in front of it, and franz-go clients whose
// connection hooks are recorded.
//
// Routing. A Kafka client dials its seed broker, then the host:port every
// broker advertises in Metadata (and FindCoordinator, Produce and Fetch
// leader hints). kfake advertises whatever its listener's Addr() returns,
// and it lets the listener be supplied (kfake.ListenFn), so the child wraps
// its real listener in one whose Addr() is the proxy listener's address:
// the broker advertises the sidecar, exactly as a real broker would with
// advertised.listeners pointing at it. Clients only ever know the proxy's
// address; no client-side dialer rewrite is involved. The advertised
// address is set after the proxy has bound its listener (the proxy needs
// the broker's real address as its upstream first), through the child's
// stdin, before any client exists.

// kafkaBrokerEnv makes the test binary, re-executed as a child process, run
// a single-broker kfake cluster instead of running tests. Its value lists
// the topics to create, "name:partitions,..." (a bare name has 1
// partition). The child prints "kfake-broker listening ADDR"; a line
// "advertise HOST:PORT" on its stdin makes the broker advertise that address
// from then on (acknowledged with "kfake-broker advertising HOST:PORT"); it
// exits when its stdin is closed (or when it is killed). Handled in init,
// before TestMain, like pinotServerEnv.
const kafkaBrokerEnv = "LIVENESSPROXY_E2E_KFAKE_BROKER"

// kafkaListenEnv, when set for the child, is the address its broker
// listens on instead of kfake's own (a loopback port): a broker in a peer
// namespace listens on the namespace's address.
const kafkaListenEnv = "LIVENESSPROXY_E2E_KFAKE_LISTEN"

func init() {
	if spec, ok := os.LookupEnv(kafkaBrokerEnv); ok {
		os.Exit(runKafkaBrokerProcess(spec))
	}
}

// advertisingListener is a net.Listener that accepts on its real socket
// but reports adv as its address once adv is set: kfake puts its
// listener's Addr() into every broker address it hands out.
type advertisingListener struct {
	net.Listener
	adv atomic.Pointer[net.TCPAddr]
}

func (l *advertisingListener) Addr() net.Addr {
	if a := l.adv.Load(); a != nil {
		return a
	}
	return l.Listener.Addr()
}

func runKafkaBrokerProcess(spec string) int {
	var opts []kfake.Opt
	for _, item := range strings.Split(spec, ",") {
		if item == "" {
			continue
		}
		name, parts, _ := strings.Cut(item, ":")
		n := 1
		if parts != "" {
			var err error
			if n, err = strconv.Atoi(parts); err != nil {
				fmt.Fprintf(os.Stderr, "kfake broker: bad topic %q\n", item)
				return 1
			}
		}
		opts = append(opts, kfake.SeedTopics(int32(n), name))
	}
	var ln *advertisingListener
	opts = append(opts, kfake.NumBrokers(1), kfake.ListenFn(func(network, addr string) (net.Listener, error) {
		if a := os.Getenv(kafkaListenEnv); a != "" {
			addr = a
		}
		l, err := net.Listen(network, addr)
		if err != nil {
			return nil, err
		}
		ln = &advertisingListener{Listener: l}
		return ln, nil
	}))
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kfake broker: %v\n", err)
		return 1
	}
	defer c.Close()
	fmt.Printf("kfake-broker listening %s\n", ln.Listener.Addr())
	release := make(chan struct{})
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "hold-produce "); ok {
			// Hold every Produce for d before answering it, as a broker
			// waiting for its replicas (acks=all) does.
			hold, err := time.ParseDuration(d)
			if err != nil {
				fmt.Fprintf(os.Stderr, "kfake broker: hold-produce %q: %v\n", d, err)
				return 1
			}
			c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
				c.SleepControl(func() { time.Sleep(hold) })
				return nil, nil, false // then handled as usual
			})
			fmt.Printf("kfake-broker holding produce %s\n", hold)
			continue
		}
		if sc.Text() == "gate-produce" {
			// Hold the next Produce (and so everything behind it on its
			// connection) until "release-produce", then answer as usual.
			gateProduce(c, release)
			fmt.Println("kfake-broker gating produce")
			continue
		}
		if sc.Text() == "release-produce" {
			close(release)
			fmt.Println("kfake-broker released produce")
			continue
		}
		a, ok := strings.CutPrefix(sc.Text(), "advertise ")
		if !ok {
			continue
		}
		tcp, err := net.ResolveTCPAddr("tcp", a)
		if err != nil {
			fmt.Fprintf(os.Stderr, "kfake broker: advertise %q: %v\n", a, err)
			return 1
		}
		ln.adv.Store(tcp)
		fmt.Printf("kfake-broker advertising %s\n", tcp)
	}
	return 0
}

// gateProduce makes c hold the first Produce it handles until release is
// closed (the cluster serves other connections meanwhile); the ones after
// it are handled as usual.
func gateProduce(c *kfake.Cluster, release chan struct{}) {
	c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.SleepControl(func() { <-release })
		c.DropControl()
		return nil, nil, false
	})
}

// kafkaBroker is a kfake broker running in a child process. The embedded
// serverProcess (sigstop_test.go) gives signal, procState, waitProcState
// and kill; addr is the broker's real listening address (the proxy's
// upstream).
type kafkaBroker struct {
	*serverProcess
	lines chan string // the child's stdout, line by line
}

// startKafkaBroker re-executes the test binary as a kfake broker with the
// given topics ("name:partitions,..."), in its own session with Pdeathsig,
// as startServerProcess does; t.Cleanup continues, kills and reaps it.
func startKafkaBroker(t *testing.T, topics string) *kafkaBroker {
	t.Helper()
	return startKafkaBrokerIn(t, nil, topics)
}

// startKafkaBrokerIn is startKafkaBroker with the broker in network
// namespace ns when ns is not nil (listening where kafkaListenEnv, set
// in this process's environment, says).
func startKafkaBrokerIn(t *testing.T, ns *netns.NS, topics string) *kafkaBroker {
	t.Helper()
	kb := &kafkaBroker{lines: make(chan string, 16)}
	kb.serverProcess = startChildIn(t, ns, kafkaBrokerEnv+"="+topics, "the kfake broker process", func(line string) {
		select {
		case kb.lines <- line:
		default:
		}
	})
	line := kb.expect(t, "kfake-broker listening ", 20*time.Second)
	kb.addr = strings.TrimPrefix(line, "kfake-broker listening ")
	return kb
}

// expect waits for a line of the child's stdout starting with prefix.
func (kb *kafkaBroker) expect(t *testing.T, prefix string, timeout time.Duration) string {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case l := <-kb.lines:
			if strings.HasPrefix(l, prefix) {
				return l
			}
		case <-deadline:
			t.Fatalf("kfake broker process %d printed no %q in %v; stderr: %s", kb.pid, prefix, timeout, kb.stderr.String())
			return ""
		}
	}
}

// advertise makes the broker advertise addr (the proxy's listener) as its
// own address in everything it tells clients.
func (kb *kafkaBroker) advertise(t *testing.T, addr string) {
	t.Helper()
	if _, err := fmt.Fprintf(kb.stdin, "advertise %s\n", addr); err != nil {
		t.Fatalf("telling the broker to advertise %s: %v", addr, err)
	}
	kb.expect(t, "kfake-broker advertising "+addr, 10*time.Second)
}

// holdProduce makes the broker hold every Produce for d before it
// answers, as one waiting for its replicas does.
func (kb *kafkaBroker) holdProduce(t *testing.T, d time.Duration) {
	t.Helper()
	if _, err := fmt.Fprintf(kb.stdin, "hold-produce %s\n", d); err != nil {
		t.Fatalf("telling the broker to hold produce requests: %v", err)
	}
	kb.expect(t, "kfake-broker holding produce "+d.String(), 10*time.Second)
}

// gateProduce makes the broker hold the next Produce it reads, and every
// request behind it on that connection, until releaseProduce.
func (kb *kafkaBroker) gateProduce(t *testing.T) {
	t.Helper()
	if _, err := fmt.Fprintln(kb.stdin, "gate-produce"); err != nil {
		t.Fatalf("telling the broker to gate produce requests: %v", err)
	}
	kb.expect(t, "kfake-broker gating produce", 10*time.Second)
}

// releaseProduce lets the broker answer the Produce gateProduce held.
func (kb *kafkaBroker) releaseProduce(t *testing.T) {
	t.Helper()
	if _, err := fmt.Fprintln(kb.stdin, "release-produce"); err != nil {
		t.Fatalf("telling the broker to release produce requests: %v", err)
	}
	kb.expect(t, "kfake-broker released produce", 10*time.Second)
}

// kafkaMode is one framing mode the Kafka tests run under.
type kafkaMode struct {
	name    string // subtest name
	framing string // defaults.framing.type
}

// kafkaModes: opaque (the default), the generic length_field framing with
// Kafka's (default) parameters, and the kafka profile. The kafka profile
// is what these tests are written for; until it lands its subtests fail at
// config validation.
var kafkaModes = []kafkaMode{
	{"opaque", policy.FramingNone},
	{"length_field", policy.FramingLengthField},
	{"kafka", "kafka"},
}

// kafkaListener is the name of the proxy's one explicit listener.
const kafkaListener = "kafka"

// kafkaConfig parses a configuration the way a user writes it: defaults
// with framing.type set to the mode's (and extraDefaults, further YAML
// lines under defaults, two-space indented), and one explicit listener in
// front of upstream. Everything else is the proxy's defaults, including
// those a framing profile brings with it (YAML is parsed, not a Settings
// struct built, so that a default that depends on which keys are set is
// the one a user would get).
func kafkaConfig(t *testing.T, mode kafkaMode, upstream, extraDefaults string) policy.Config {
	t.Helper()
	var b strings.Builder
	b.WriteString("defaults:\n")
	fmt.Fprintf(&b, "  framing: {type: %s}\n", mode.framing)
	b.WriteString(extraDefaults)
	b.WriteString("listeners:\n")
	fmt.Fprintf(&b, "  - name: %s\n    listen: 127.0.0.1:0\n    upstream: %s\n", kafkaListener, upstream)
	cfg, err := policy.Parse([]byte(b.String()))
	if err != nil {
		t.Fatalf("test configuration is invalid:\n%s\n%v", b.String(), err)
	}
	cfg.Admin.Listen = ""
	return cfg
}

// startKafkaProxy starts a proxy from cfg (its one listener in front of
// kb), tells kb to advertise the listener, and closes the proxy in
// t.Cleanup. The returned pinotProxy is the shared recorder type
// (pinot_helpers_test.go): links, state, counter, waitState, watchEndpoint.
func startKafkaProxy(t *testing.T, kb *kafkaBroker, cfg policy.Config) *pinotProxy {
	t.Helper()
	pp := runRecordingProxy(t, cfg, kb.addr)
	kb.advertise(t, pp.addr)
	return pp
}

// runKafkaModes runs test as a subtest for each of kafkaModes.
func runKafkaModes(t *testing.T, test func(t *testing.T, mode kafkaMode)) {
	for _, mode := range kafkaModes {
		t.Run(mode.name, func(t *testing.T) { test(t, mode) })
	}
}

// kafkaRun is a Kafka test's setup: a kfake broker in a child process, a
// proxy built from the mode's configuration in front of it (advertised by
// the broker), and a watcher on the proxy's endpoint.
type kafkaRun struct {
	mode  kafkaMode
	start time.Time
	kb    *kafkaBroker
	cfg   policy.Config
	pp    *pinotProxy
	w     *stateWatcher
}

// startKafkaRun starts a broker with topics ("name:partitions,..."), a
// proxy from kafkaConfig(mode, extraDefaults) in front of it, and a
// watcher for up to watchFor; t.Cleanup ends them.
func startKafkaRun(t *testing.T, mode kafkaMode, topics, extraDefaults string, watchFor time.Duration) *kafkaRun {
	t.Helper()
	r := &kafkaRun{mode: mode, start: time.Now()}
	r.kb = startKafkaBroker(t, topics)
	r.cfg = kafkaConfig(t, mode, r.kb.addr, extraDefaults)
	r.pp = startKafkaProxy(t, r.kb, r.cfg)
	r.w = watchEndpoint(t, r.pp, watchFor)
	return r
}

// requestTimeout is the listener's unanswered.request_timeout.
func (r *kafkaRun) requestTimeout() time.Duration {
	return listenerSettings(r.cfg).Unanswered.RequestTimeout.D()
}

// assertProxyStayedOut is what the healthy twins of
// TestKafkaStoppedBrokerExcluded assert of the proxy at end: its counters
// logged; under the kafka profile nothing counted unanswered; no link
// ended before end except for a reason in allowed; the endpoint always
// healthy (the watcher is stopped).
func (r *kafkaRun) assertProxyStayedOut(t *testing.T, end time.Time, allowed ...string) {
	t.Helper()
	logProxyCounters(t, r.pp)
	assertNoUnansweredUnderKafka(t, r.pp, r.mode)
	assertNoLinkEnds(t, r.pp, end, r.start, allowed...)
	r.w.Stop()
	assertAlwaysHealthy(t, r.pp, r.w, r.start)
}

// listenerSettings returns the settings the proxy's listener runs with.
func listenerSettings(cfg policy.Config) policy.Settings { return cfg.Listeners[0].Settings }

// assertNoLinkEnds fails the test for every link that ended before t0,
// except those whose reason is in allowed (logged).
func assertNoLinkEnds(t *testing.T, pp *pinotProxy, t0 time.Time, start time.Time, allowed ...string) {
	t.Helper()
	_, ends := pp.links.Before(t0)
	reasons := map[string]int{}
	var bad []harness.LinkEnd
	for _, e := range ends {
		if slices.Contains(allowed, e.Reason) {
			t.Logf("link %s ended at +%v after %v: %s (the client closed it)", e.Client, ms(e.At.Sub(start)), ms(e.Duration), e.Reason)
			continue
		}
		reasons[e.Reason]++
		bad = append(bad, e)
	}
	if len(bad) == 0 {
		return
	}
	t.Errorf("%d links ended before teardown, by reason %v", len(bad), reasons)
	for i, e := range bad {
		if i == 6 {
			t.Logf("  ... %d more", len(bad)-i)
			break
		}
		t.Logf("  link %s ended at +%v after %v: %s (%v), %d bytes up, %d down",
			e.Client, ms(e.At.Sub(start)), ms(e.Duration), e.Reason, e.Err, e.BytesUp, e.BytesDown)
	}
}

// assertAlwaysHealthy fails the test unless every state the watcher saw
// (the initial one included) is healthy, and the endpoint is healthy now.
func assertAlwaysHealthy(t *testing.T, pp *pinotProxy, w *stateWatcher, start time.Time) {
	t.Helper()
	for _, c := range w.Snapshot() {
		if c.State != "healthy" {
			t.Errorf("endpoint %s at +%v (reason %s), want always healthy", c.State, ms(c.At.Sub(start)), c.Reason)
		}
	}
	if st := pp.state(); st.State != "healthy" {
		t.Errorf("endpoint %s now (reason %s, since +%v), want healthy", st.State, st.Reason, ms(st.Since.Sub(start)))
	}
	if n := pp.counter(t, "endpoint_suspect_total", "", ""); n != 0 {
		t.Errorf("endpoint_suspect_total = %v, want 0", n)
	}
}

// assertNoUnansweredUnderKafka fails the test, in the kafka mode only, if
// the proxy counted any request as unanswered: under the kafka profile a
// request's deadline is request_timeout plus the hold it asks for (a
// Fetch's max_wait_ms, a JoinGroup's rebalance_timeout_ms, ...) and an
// acks=0 Produce is never tracked, so healthy traffic never counts, not
// even below the threshold. The other modes count such requests by
// design (README "The unanswered rule"); for them only exclusions and cut
// links are asserted.
func assertNoUnansweredUnderKafka(t *testing.T, pp *pinotProxy, mode kafkaMode) {
	t.Helper()
	if mode.framing != "kafka" {
		return
	}
	if n := pp.counter(t, "unanswered_timeouts_total", "", ""); n != 0 {
		t.Errorf("unanswered_timeouts_total = %v under the kafka profile, want 0", n)
	}
}

// logProxyCounters logs the proxy's unanswered accounting.
func logProxyCounters(t *testing.T, pp *pinotProxy) {
	t.Helper()
	reasons := map[string]int{}
	for _, e := range pp.links.All() {
		reasons[e.Reason]++
	}
	t.Logf("proxy: links ended %v; unanswered_timeouts_total=%v endpoint_suspect_total=%v stale_frames_dropped_total=%v probes ok=%v fail=%v",
		reasons, pp.counter(t, "unanswered_timeouts_total", "", ""), pp.counter(t, "endpoint_suspect_total", "", ""),
		pp.counter(t, "stale_frames_dropped_total", "", ""),
		pp.counter(t, "probes_total", "result", "ok"), pp.counter(t, "probes_total", "result", "fail"))
}

// Kafka API keys the tests look for in the client's hooks.
const (
	keyProduce   int16 = 0
	keyFetch     int16 = 1
	keyJoinGroup int16 = 11
	keySyncGroup int16 = 14
)

// hookEvent is one connection or request event a client reported.
type hookEvent struct {
	At   time.Time
	Node int32
	Key  int16         // requests only
	Dur  time.Duration // e2e only: write start to response read
	Err  error
}

// clientHooks records a franz-go client's own view of its connections:
// every connect (OnBrokerConnect, failed ones included), every disconnect,
// every request written and every request's end-to-end result.
type clientHooks struct {
	name        string
	mu          sync.Mutex
	connects    []hookEvent
	disconnects []hookEvent
	writes      []hookEvent
	e2e         []hookEvent
}

var (
	_ kgo.HookBrokerConnect    = (*clientHooks)(nil)
	_ kgo.HookBrokerDisconnect = (*clientHooks)(nil)
	_ kgo.HookBrokerWrite      = (*clientHooks)(nil)
	_ kgo.HookBrokerE2E        = (*clientHooks)(nil)
)

func (h *clientHooks) OnBrokerConnect(meta kgo.BrokerMetadata, _ time.Duration, _ net.Conn, err error) {
	h.mu.Lock()
	h.connects = append(h.connects, hookEvent{At: time.Now(), Node: meta.NodeID, Err: err})
	h.mu.Unlock()
}

func (h *clientHooks) OnBrokerDisconnect(meta kgo.BrokerMetadata, _ net.Conn) {
	h.mu.Lock()
	h.disconnects = append(h.disconnects, hookEvent{At: time.Now(), Node: meta.NodeID})
	h.mu.Unlock()
}

func (h *clientHooks) OnBrokerWrite(meta kgo.BrokerMetadata, key int16, _ int, _, _ time.Duration, err error) {
	h.mu.Lock()
	h.writes = append(h.writes, hookEvent{At: time.Now(), Node: meta.NodeID, Key: key, Err: err})
	h.mu.Unlock()
}

func (h *clientHooks) OnBrokerE2E(meta kgo.BrokerMetadata, key int16, e kgo.BrokerE2E) {
	h.mu.Lock()
	h.e2e = append(h.e2e, hookEvent{At: time.Now(), Node: meta.NodeID, Key: key, Dur: e.DurationE2E(), Err: e.Err()})
	h.mu.Unlock()
}

// since returns the events of list at or after t0.
func (h *clientHooks) since(list *[]hookEvent, t0 time.Time) []hookEvent {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []hookEvent
	for _, e := range *list {
		if !e.At.Before(t0) {
			out = append(out, e)
		}
	}
	return out
}

// wrote reports whether the client has written a request with key.
func (h *clientHooks) wrote(key int16) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.ContainsFunc(h.writes, func(e hookEvent) bool { return e.Key == key && e.Err == nil })
}

// firstWrite returns when the client first wrote a request with key, or
// the zero time.
func (h *clientHooks) firstWrite(key int16) time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, e := range h.writes {
		if e.Key == key && e.Err == nil {
			return e.At
		}
	}
	return time.Time{}
}

// answered returns the requests with key that got their response, and
// those that failed, between from and to.
func (h *clientHooks) answered(key int16, from, to time.Time) (ok, failed []hookEvent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, e := range h.e2e {
		if e.Key != key || e.At.Before(from) || !e.At.Before(to) {
			continue
		}
		if e.Err != nil {
			failed = append(failed, e)
		} else {
			ok = append(ok, e)
		}
	}
	return ok, failed
}

// assertNoRedials fails the test if the client connected between from
// (the end of its initial connects) and to, or before to lost a
// connection or failed to connect: a healthy client keeps the connections
// it opened at start.
func (h *clientHooks) assertNoRedials(t *testing.T, from, to time.Time, start time.Time) {
	t.Helper()
	type ev struct {
		hookEvent
		what string
	}
	var evs []ev
	var conns, fails, discs int
	h.mu.Lock()
	for _, e := range h.connects {
		switch {
		case !e.At.Before(to):
		case e.Err != nil:
			fails++
			evs = append(evs, ev{e, "connect failed"})
		case !e.At.Before(from):
			conns++
			evs = append(evs, ev{e, "connected"})
		}
	}
	for _, e := range h.disconnects {
		if e.At.Before(to) {
			discs++
			evs = append(evs, ev{e, "disconnected"})
		}
	}
	h.mu.Unlock()
	if len(evs) == 0 {
		return
	}
	t.Errorf("client %s: %d connects after its initial ones, %d disconnects, %d failed connects; want none",
		h.name, conns, discs, fails)
	slices.SortFunc(evs, func(a, b ev) int { return a.At.Compare(b.At) })
	for i, e := range evs {
		if i == 4 {
			t.Logf("  client %s: ... %d more", h.name, len(evs)-i)
			break
		}
		if e.Err != nil {
			t.Logf("  client %s: +%v node %d %s: %v", h.name, ms(e.At.Sub(start)), e.Node, e.what, e.Err)
		} else {
			t.Logf("  client %s: +%v node %d %s", h.name, ms(e.At.Sub(start)), e.Node, e.what)
		}
	}
}

// assertNoFailedConnects fails the test if the client failed to connect
// before to (refused while the endpoint was excluded, or a dial error).
func (h *clientHooks) assertNoFailedConnects(t *testing.T, to, start time.Time) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	var failed []hookEvent
	for _, e := range h.connects {
		if e.Err != nil && e.At.Before(to) {
			failed = append(failed, e)
		}
	}
	if len(failed) > 0 {
		t.Errorf("client %s: %d failed connects, the first at +%v: %v", h.name, len(failed), ms(failed[0].At.Sub(start)), failed[0].Err)
	}
}

// kafkaClient is a franz-go client through the proxy with recorded hooks.
type kafkaClient struct {
	*kgo.Client
	hooks *clientHooks
}

// newKafkaClient creates a client that bootstraps from addr (the proxy),
// with a connection idle timeout well beyond any test (so the client's own
// reaper never closes a connection during one), and closes it in
// t.Cleanup (registered after the broker and the proxy, so it runs first).
func newKafkaClient(t *testing.T, name, addr string, opts ...kgo.Opt) *kafkaClient {
	t.Helper()
	c := makeKafkaClient(t, name, addr, opts...)
	t.Cleanup(c.Close)
	return c
}

// makeKafkaClient is newKafkaClient without the cleanup.
func makeKafkaClient(t *testing.T, name, addr string, opts ...kgo.Opt) *kafkaClient {
	t.Helper()
	h := &clientHooks{name: name}
	all := append([]kgo.Opt{
		kgo.SeedBrokers(addr),
		kgo.ClientID(name),
		kgo.WithHooks(h),
		kgo.ConnIdleTimeout(2 * time.Minute),
	}, opts...)
	cl, err := kgo.NewClient(all...)
	if err != nil {
		t.Fatalf("client %s: %v", name, err)
	}
	return &kafkaClient{Client: cl, hooks: h}
}

// kafkaConsumer is a client polling in its own goroutine and keeping every
// record value it receives.
type kafkaConsumer struct {
	*kafkaClient
	done chan struct{}

	mu     sync.Mutex
	values []string
	errs   []error
}

// startKafkaConsumer starts a consumer (opts say what it consumes); it
// polls until the client is closed, in t.Cleanup, which also waits for
// its goroutine.
func startKafkaConsumer(t *testing.T, name, addr string, opts ...kgo.Opt) *kafkaConsumer {
	t.Helper()
	c := &kafkaConsumer{done: make(chan struct{})}
	c.kafkaClient = makeKafkaClient(t, name, addr, opts...)
	t.Cleanup(func() {
		c.Close()
		<-c.done
	})
	go func() {
		defer close(c.done)
		for {
			fs := c.PollFetches(context.Background())
			if fs.IsClientClosed() {
				return
			}
			c.mu.Lock()
			fs.EachError(func(topic string, p int32, err error) {
				if !errors.Is(err, context.Canceled) {
					c.errs = append(c.errs, fmt.Errorf("%s[%d]: %w", topic, p, err))
				}
			})
			fs.EachRecord(func(r *kgo.Record) { c.values = append(c.values, string(r.Value)) })
			c.mu.Unlock()
		}
	}()
	return c
}

// got returns the record values received so far.
func (c *kafkaConsumer) got() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.values)
}

// fetchErrors returns the fetch errors seen so far.
func (c *kafkaConsumer) fetchErrors() []error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.errs)
}

// waitValues waits up to timeout until the consumer has every value of
// want (and returns true), polling every 20 ms.
func (c *kafkaConsumer) waitValues(want []string, timeout time.Duration) bool {
	return waitHasAll(c.got, want, timeout)
}

// waitHasAll waits up to timeout until got returns every value of want
// (and returns true), polling every 20 ms.
func waitHasAll(got func() []string, want []string, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for {
		have := map[string]bool{}
		for _, v := range got() {
			have[v] = true
		}
		if !slices.ContainsFunc(want, func(v string) bool { return !have[v] }) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// compareValues describes how got differs from want as a multiset:
// missing values, unexpected ones and duplicates. Empty when equal.
func compareValues(want, got []string) string {
	wantSet := map[string]bool{}
	for _, v := range want {
		wantSet[v] = true
	}
	seen := map[string]int{}
	for _, v := range got {
		seen[v]++
	}
	var missing, extra, dups []string
	for _, v := range want {
		if seen[v] == 0 {
			missing = append(missing, v)
		}
	}
	for v, n := range seen {
		if !wantSet[v] {
			extra = append(extra, v)
		}
		if n > 1 {
			dups = append(dups, v)
		}
	}
	if len(missing)+len(extra)+len(dups) == 0 {
		return ""
	}
	short := func(vs []string) string {
		slices.Sort(vs)
		if len(vs) > 5 {
			return fmt.Sprintf("%v ... (%d)", vs[:5], len(vs))
		}
		return fmt.Sprint(vs)
	}
	return fmt.Sprintf("want %d records, got %d: missing %s, unexpected %s, duplicated %s",
		len(want), len(got), short(missing), short(extra), short(dups))
}

// produceValues produces one record per value to topic with acks=all and
// waits for every ack.
func produceValues(t *testing.T, cl *kafkaClient, topic string, values []string, timeout time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	rs := make([]*kgo.Record, len(values))
	for i, v := range values {
		rs[i] = &kgo.Record{Topic: topic, Value: []byte(v)}
	}
	if err := cl.ProduceSync(ctx, rs...).FirstErr(); err != nil {
		t.Fatalf("producing %d records to %s: %v", len(values), topic, err)
	}
}

// waitAll waits up to timeout until cond holds for every i in [0, n).
func waitAll(n int, timeout time.Duration, cond func(i int) bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		ok := true
		for i := range n {
			if !cond(i) {
				ok = false
				break
			}
		}
		if ok {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
}
