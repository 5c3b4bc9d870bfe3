//go:build linux

package e2e

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// Kafka clients built on librdkafka (kcat, confluent-kafka-python, -go,
// -dotnet) behave unlike franz-go, the client of the other Kafka tests:
// a librdkafka producer pipelines without a limit of its own
// (max.in.flight 1,000,000 without idempotence), so with
// batch.num.messages 1 every record is a Produce request of its own and
// thousands are in flight on one connection at once, past the kafka
// profile's 1,024 matching entries; its consumer long-polls Fetch with
// fetch.wait.max.ms, keeps its group's heartbeats on the coordinator's
// connection, and sends Produce with timeout_ms = request.timeout.ms (30 s).
// These tests run the real librdkafka, through kcat (Debian's package), as
// a separate process against the kfake broker.

// kcatProc is a kcat process: its stdout's lines, its stderr.
type kcatProc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{} // closed once the process was waited for
	err  error         // its exit, once done

	mu     sync.Mutex
	lines  []string
	stderr bytes.Buffer
}

// startKcat starts kcat with args, stdin from in (nil: none); t.Cleanup
// ends it with SIGTERM (a consumer leaves its group then) and waits.
func startKcat(t *testing.T, name string, in io.Reader, args ...string) *kcatProc {
	t.Helper()
	bin := testutil.RequireCommand(t, "kcat")
	k := &kcatProc{name: name, cmd: exec.Command(bin, args...), done: make(chan struct{})}
	k.cmd.Stdin = in
	k.cmd.Stderr = lockedWriter{&k.mu, &k.stderr}
	out, err := k.cmd.StdoutPipe()
	if err != nil {
		t.Fatalf("kcat %s: %v", name, err)
	}
	k.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := k.cmd.Start(); err != nil {
		t.Fatalf("starting kcat %s: %v", name, err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			k.mu.Lock()
			k.lines = append(k.lines, sc.Text())
			k.mu.Unlock()
		}
		k.err = k.cmd.Wait()
		close(k.done)
	}()
	t.Cleanup(func() { k.stop(t) })
	return k
}

// lockedWriter is an io.Writer that holds mu while it writes to w.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// stop ends the process with SIGTERM (SIGKILL after 10 s) and waits.
func (k *kcatProc) stop(t *testing.T) {
	t.Helper()
	select {
	case <-k.done:
		return
	default:
	}
	_ = k.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-k.done:
	case <-time.After(10 * time.Second):
		t.Logf("kcat %s did not end within 10s of SIGTERM; killed", k.name)
		_ = k.cmd.Process.Kill()
		<-k.done
	}
}

// wait waits up to timeout for the process to exit and returns its error.
func (k *kcatProc) wait(t *testing.T, timeout time.Duration) error {
	t.Helper()
	select {
	case <-k.done:
		return k.err
	case <-time.After(timeout):
		t.Fatalf("kcat %s still running after %v; stderr:\n%s", k.name, timeout, k.stderrTail())
		return nil
	}
}

// got returns the lines kcat printed so far.
func (k *kcatProc) got() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.lines...)
}

// stderrText returns what kcat wrote to stderr so far.
func (k *kcatProc) stderrText() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.stderr.String()
}

// stderrTail returns the last 40 lines of stderr.
func (k *kcatProc) stderrTail() string {
	lines := strings.Split(k.stderrText(), "\n")
	if len(lines) > 40 {
		lines = lines[len(lines)-40:]
	}
	return strings.Join(lines, "\n")
}

// waitStderr waits up to timeout for stderr to match re.
func (k *kcatProc) waitStderr(re *regexp.Regexp, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for !re.MatchString(k.stderrText()) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// waitLines waits up to timeout until kcat has printed every value of
// want.
func (k *kcatProc) waitLines(want []string, timeout time.Duration) bool {
	return waitHasAll(k.got, want, timeout)
}

// rdkRequests matches librdkafka's protocol debug lines for a request
// sent or a response received ("Sent ProduceRequest (v7, 95 bytes @ 0,
// CorrId 5)", "Received ProduceResponse (v7, 52 bytes, CorrId 5, rtt
// 1.23ms)").
var rdkRequests = regexp.MustCompile(`(Sent|Received) ([A-Za-z]+)(?:Request|Response) \(v\d+, \d+ bytes(?: @ \d+)?, CorrId (\d+)`)

// maxInFlight reads librdkafka's protocol debug output (-d protocol) and
// returns how many requests named api were ever outstanding at once on
// one connection (per "thread" name in the log line), and how many were
// sent in all.
func maxInFlight(debug, api string) (most, sent int) {
	inflight := map[string]int{}
	for _, line := range strings.Split(debug, "\n") {
		m := rdkRequests.FindStringSubmatch(line)
		if m == nil || m[2] != api {
			continue
		}
		conn := line[:strings.Index(line, m[0])]
		if i := strings.LastIndex(conn, "["); i >= 0 {
			conn = conn[i:] // "[thrd:127.0.0.1:port/1]: 127.0.0.1:port/1: "
		}
		if _, err := strconv.Atoi(m[3]); err != nil {
			continue
		}
		if m[1] == "Sent" {
			sent++
			inflight[conn]++
			most = max(most, inflight[conn])
		} else {
			inflight[conn]--
		}
	}
	return most, sent
}

// waitFor polls cond every 20 ms for up to timeout.
func waitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// TestKafkaLibrdkafkaClients runs librdkafka's consumer and producer (kcat)
// through the proxy in every Kafka mode, with the broker healthy: a
// consumer in a group long-polling 5 s Fetches (longer than
// request_timeout) on an idle topic for two fetch waits and a second,
// then a producer that pipelines one Produce request per record (3,000
// records, acks=all; under the kafka profile, more in flight at once than
// the profile keeps matching entries, the first held by the broker past
// request_timeout), then an acks=0 producer (no response by protocol).
//
// Asserted: the consumer prints every record produced, once; both
// producers exit 0 (every delivery reported); under the kafka profile, as
// a premise, the first producer had more than maxOutstanding Produce
// requests in flight at once on one connection (librdkafka's own protocol
// log); no link ended before the producers started, and none before
// teardown but by a client's own close (client_closed); the
// endpoint never left healthy; under the kafka profile nothing counted
// unanswered.
//
// A healthy twin of TestKafkaStoppedBrokerExcluded, with a client
// library unlike franz-go.
func TestKafkaLibrdkafkaClients(t *testing.T) {
	testutil.RequireCommand(t, "kcat")
	runKafkaModes(t, kafkaLibrdkafkaClients)
}

func kafkaLibrdkafkaClients(t *testing.T, mode kafkaMode) {
	const (
		topic     = "rdk"
		group     = "rdk-group"
		fetchWait = 5 * time.Second
		observe   = 2*fetchWait + time.Second
		records   = 3000
		acks0     = 300
		// inFlightWanted: more than the kafka profile's 1,024 matching
		// entries per link (maxOutstanding).
		inFlightWanted = 1100
	)
	r := startKafkaRun(t, mode, topic+":2", "", 120*time.Second)
	start, pp := r.start, r.pp

	consumer := startKcat(t, "consumer", nil, "-C", "-b", pp.addr, "-G", group,
		"-X", "client.id=rdk-consumer", "-X", "auto.offset.reset=earliest",
		"-X", fmt.Sprintf("fetch.wait.max.ms=%d", fetchWait.Milliseconds()),
		"-f", "%s\n", "-u", topic)
	assigned := regexp.MustCompile(`(?i)assigned: .*` + topic)
	if !consumer.waitStderr(assigned, 30*time.Second) {
		t.Fatalf("the kcat consumer was not assigned partitions of %s within 30s; stderr:\n%s", topic, consumer.stderrTail())
	}
	t.Logf("the librdkafka consumer joined %s at +%v; idle for %v", group, ms(time.Since(start)), observe)
	time.Sleep(observe)
	// Until the producers start, no link may end at all.
	assertNoLinkEnds(t, pp, time.Now(), start)

	want := make([]string, 0, records+acks0)
	var in strings.Builder
	for i := range records {
		v := fmt.Sprintf("rdk-%05d", i)
		want = append(want, v)
		in.WriteString(v + "\n")
	}
	// Under the kafka profile the broker holds the first Produce until
	// the client has sent more than the profile keeps matching entries
	// for (by the client's own log), so that the requests past them are
	// in flight at once whatever the scheduler does, and for at least a
	// second past request_timeout: a healthy broker waiting for its
	// replicas, well within the Produce's timeout_ms (30 s).
	gated := mode.framing == "kafka"
	var gatedAt time.Time
	if gated {
		r.kb.gateProduce(t)
		gatedAt = time.Now()
	}
	producer := startKcat(t, "producer", strings.NewReader(in.String()), "-P", "-b", pp.addr, "-t", topic,
		"-X", "client.id=rdk-producer", "-X", "acks=all", "-X", "linger.ms=0",
		"-X", "batch.num.messages=1", "-X", "queue.buffering.max.messages=100000",
		"-d", "protocol")
	if gated {
		if !waitFor(30*time.Second, func() bool { _, n := maxInFlight(producer.stderrText(), "Produce"); return n > inFlightWanted }) {
			t.Fatalf("the producer did not send %d Produce requests within 30s; stderr:\n%s", inFlightWanted, producer.stderrTail())
		}
		time.Sleep(time.Until(gatedAt.Add(r.requestTimeout() + time.Second)))
		r.kb.releaseProduce(t)
	}
	if err := producer.wait(t, 60*time.Second); err != nil {
		t.Fatalf("the acks=all producer failed: %v; stderr:\n%s", err, producer.stderrTail())
	}
	most, sent := maxInFlight(producer.stderrText(), "Produce")
	t.Logf("the acks=all producer sent %d Produce requests, at most %d in flight on one connection", sent, most)
	if gated && most <= inFlightWanted {
		t.Errorf("premise: at most %d Produce requests were in flight at once, want more than %d", most, inFlightWanted)
	}

	in.Reset()
	for i := range acks0 {
		v := fmt.Sprintf("rdk-acks0-%04d", i)
		want = append(want, v)
		in.WriteString(v + "\n")
	}
	producer0 := startKcat(t, "producer-acks0", strings.NewReader(in.String()), "-P", "-b", pp.addr, "-t", topic,
		"-X", "client.id=rdk-producer-acks0", "-X", "acks=0", "-X", "linger.ms=0", "-X", "batch.num.messages=1")
	if err := producer0.wait(t, 60*time.Second); err != nil {
		t.Fatalf("the acks=0 producer failed: %v; stderr:\n%s", err, producer0.stderrTail())
	}

	if !consumer.waitLines(want, 30*time.Second) {
		t.Errorf("the consumer did not print every record within 30s of producing them")
	}
	time.Sleep(time.Second) // a duplicate would come with the same fetches
	end := time.Now()
	if d := compareValues(want, consumer.got()); d != "" {
		t.Errorf("consumed records: %s", d)
	}
	r.assertProxyStayedOut(t, end, string(proxy.CloseClientClosed))
}

// TestKafkaLibrdkafkaStoppedBrokerExcluded (kafka profile) stops the broker
// with SIGSTOP while one librdkafka consumer, the only client, long-polls
// it in a group: one Fetch in flight on the leader's connection (5 s
// max_wait_ms) and a heartbeat every 3 s on the coordinator's
// (heartbeat.interval.ms, librdkafka's default), never two at once. A
// client that keeps so few requests in flight must still see the broker
// excluded by the clock: within a heartbeat interval (by when every
// request that can count was sent), the longest hold any of them may
// ask (the Fetch's 5 s, or a coordinator's write, 5 s) and
// request_timeout, plus a second. Then SIGCONT: readmitted within a probe
// interval and timeout (+ 2 s), and a record produced through the proxy
// after it is read back with the one produced before the stop.
//
// TestKafkaLibrdkafkaClients is its healthy twin.
func TestKafkaLibrdkafkaStoppedBrokerExcluded(t *testing.T) {
	testutil.RequireCommand(t, "kcat")
	const (
		topic            = "rdkstop"
		group            = "rdkstop-group"
		fetchWait        = 5 * time.Second
		heartbeat        = 3 * time.Second
		coordinatorWrite = 5 * time.Second
	)
	mode := kafkaMode{"kafka", "kafka"}
	r := startKafkaRun(t, mode, topic+":1",
		"  detector: {initial_delay: 1s, backoff_factor: 1, max_delay: 1s, jitter: 0}\n", 90*time.Second)
	start, kb, pp, w := r.start, r.kb, r.pp, r.w
	s := listenerSettings(r.cfg)
	rt, interval, probeTimeout := s.Unanswered.RequestTimeout.D(), s.Detector.InitialDelay.D(), s.Detector.ProbeTimeout.D()
	bound := heartbeat + max(fetchWait, coordinatorWrite) + rt + time.Second
	t.Cleanup(func() { _ = syscall.Kill(kb.pid, syscall.SIGCONT) })

	consumer := startKcat(t, "consumer", nil, "-C", "-b", pp.addr, "-G", group,
		"-X", "client.id=rdkstop-consumer", "-X", "auto.offset.reset=earliest",
		"-X", fmt.Sprintf("fetch.wait.max.ms=%d", fetchWait.Milliseconds()),
		"-X", fmt.Sprintf("heartbeat.interval.ms=%d", heartbeat.Milliseconds()),
		"-f", "%s\n", "-u", topic)
	if !consumer.waitStderr(regexp.MustCompile(`(?i)assigned: .*`+topic), 30*time.Second) {
		t.Fatalf("the kcat consumer was not assigned %s within 30s; stderr:\n%s", topic, consumer.stderrTail())
	}
	produceKcat(t, pp.addr, topic, "before-stop")
	if !consumer.waitLines([]string{"before-stop"}, 20*time.Second) {
		t.Fatalf("the consumer did not get a record within 20s; stderr:\n%s", consumer.stderrTail())
	}
	time.Sleep(time.Second) // the consumer's next long poll is parked
	if st := pp.state(); st.State != "healthy" {
		t.Fatalf("endpoint %s (reason %s) before the stop", st.State, st.Reason)
	}

	stopAt := time.Now()
	kb.sigstop(t, "broker")
	ex := waitExcluded(t, pp, w, stopAt, bound+5*time.Second, "SIGSTOP")
	after := ex.At.Sub(stopAt)
	t.Logf("SIGSTOP at +%v; excluded %v after it (reason %s); bound %v", ms(stopAt.Sub(start)), ms(after), ex.Reason, bound)
	if after > bound {
		t.Errorf("excluded %v after SIGSTOP, want <= %v (heartbeat %v + hold %v + request_timeout %v + 1s)",
			ms(after), bound, heartbeat, max(fetchWait, coordinatorWrite), rt)
	}
	if ex.Reason != string(proxy.CloseUnanswered) {
		t.Errorf("excluded for %q, want %q", ex.Reason, proxy.CloseUnanswered)
	}

	contAt := time.Now()
	kb.signal(t, syscall.SIGCONT)
	readmitBound := interval + probeTimeout + 2*time.Second
	if !pp.waitState("healthy", readmitBound+5*time.Second) {
		t.Fatalf("endpoint not healthy %v after SIGCONT: %+v", readmitBound+5*time.Second, pp.state())
	}
	back, ok := w.FirstAfter(contAt, "healthy", 200*time.Millisecond)
	if !ok {
		back = stateChange{At: pp.state().Since}
	}
	if d := back.At.Sub(contAt); d > readmitBound {
		t.Errorf("readmitted %v after SIGCONT, want <= %v", ms(d), readmitBound)
	}
	// kcat ends itself once every broker connection is down (refused
	// while the endpoint is excluded): a new consumer reads the topic.
	produceKcat(t, pp.addr, topic, "after-cont")
	reader := startKcat(t, "reader", nil, "-C", "-b", pp.addr, "-t", topic, "-o", "beginning", "-e",
		"-X", "client.id=rdkstop-reader", "-f", "%s\n", "-u")
	if err := reader.wait(t, 60*time.Second); err != nil {
		t.Errorf("reading %s after SIGCONT: %v; stderr:\n%s", topic, err, reader.stderrTail())
	}
	if d := compareValues([]string{"before-stop", "after-cont"}, reader.got()); d != "" {
		t.Errorf("read after SIGCONT: %s", d)
	}
	logProxyCounters(t, pp)
}

// produceKcat produces one record with value v to topic through addr with
// a kcat producer (acks=all) and waits for it to exit.
func produceKcat(t *testing.T, addr, topic, v string) {
	t.Helper()
	p := startKcat(t, "producer-"+v, strings.NewReader(v+"\n"), "-P", "-b", addr, "-t", topic,
		"-X", "client.id=rdk-producer", "-X", "acks=all")
	if err := p.wait(t, 60*time.Second); err != nil {
		t.Fatalf("producing %s: %v; stderr:\n%s", v, err, p.stderrTail())
	}
}
