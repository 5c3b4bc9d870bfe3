package pinotsim

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/livenessproxy/livenessproxy/internal/pinotwire"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	s = strings.NewReplacer(" ", "", "\n", "", "\t", "", "|", "").Replace(s)
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestFrameRoundTrip(t *testing.T) {
	var buf bytes.Buffer
	for _, p := range [][]byte{{}, []byte("x"), bytes.Repeat([]byte{7}, 70000)} {
		if err := WriteFrame(&buf, p); err != nil {
			t.Fatal(err)
		}
	}
	for _, want := range []int{0, 1, 70000} {
		p, err := ReadFrame(&buf, 0)
		if err != nil || len(p) != want {
			t.Fatalf("ReadFrame = %d bytes, %v; want %d", len(p), err, want)
		}
	}
	if _, err := ReadFrame(&buf, 0); err != io.EOF {
		t.Fatalf("at end: %v, want io.EOF", err)
	}
	if got := AppendFrame(nil, []byte{1, 2}); !bytes.Equal(got, []byte{0, 0, 0, 2, 1, 2}) {
		t.Fatalf("AppendFrame = %x", got)
	}
}

func TestReadFrameRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []byte
		max  int
		want error
	}{
		{"negative", []byte{0x80, 0, 0, 0}, 0, ErrFrameLength},
		{"minus one", []byte{0xff, 0xff, 0xff, 0xff}, 0, ErrFrameLength},
		{"oversized", []byte{0, 0, 1, 1}, 256, ErrFrameLength},
		{"truncated payload", []byte{0, 0, 0, 5, 1, 2}, 0, io.ErrUnexpectedEOF},
		{"truncated header", []byte{0, 0}, 0, io.ErrUnexpectedEOF},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadFrame(bytes.NewReader(tc.in), tc.max)
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
	// At exactly max the frame is accepted.
	if _, err := ReadFrame(bytes.NewReader(AppendFrame(nil, make([]byte, 256))), 256); err != nil {
		t.Fatal(err)
	}
}

// A 56-byte InstanceRequest encoded with Go apache/thrift v0.20.0
// (TCompactProtocol, as Pinot's broker uses).
const pinotRequestHex = `16 82d0ede88ebd88a222 1c 2c 18 09 745f4f46464c494e45 00 fc 00 00
	19 28 02 7330 02 7331 12 18 0d 42726f6b65725f685f38303939 28 02 6331 00`

func TestRequestMatchesPinot(t *testing.T) {
	want := unhex(t, pinotRequestHex)
	if len(want) != 56 {
		t.Fatalf("example is %d bytes, want 56", len(want))
	}
	r := Request{ID: 1234567890000000001, Table: "t_OFFLINE", Segments: []string{"s0", "s1"},
		BrokerID: "Broker_h_8099", CID: "c1"}
	got := AppendRequest(nil, &r)
	if !bytes.Equal(got, want) {
		t.Fatalf("payload\n got %x\nwant %x", got, want)
	}
	if f := AppendFrame(nil, got); !bytes.Equal(f[:4], []byte{0, 0, 0, 0x38}) {
		t.Fatalf("frame prefix %x, want 00000038", f[:4])
	}
	id, err := RequestID(want)
	if err != nil || id != 1234567890000000001 {
		t.Fatalf("RequestID = %d, %v", id, err)
	}
	back, err := ParseRequest(want)
	if err != nil {
		t.Fatal(err)
	}
	if back.ID != r.ID || back.Table != r.Table || back.BrokerID != r.BrokerID || back.CID != r.CID ||
		len(back.Segments) != 2 || back.Segments[1] != "s1" || back.Trace || !back.SentAt.IsZero() {
		t.Fatalf("ParseRequest = %+v", back)
	}
}

func TestRequestRoundTrip(t *testing.T) {
	now := time.Now()
	segs := SegmentsFor("t_REALTIME", 32<<10)
	for _, id := range []int64{0, 1, -1, 1<<63 - 1, -1 << 63, 1840000000123} {
		r := Request{ID: id, Table: "t_REALTIME", Segments: segs, Trace: true, BrokerID: "b",
			SentAt: now, Deadline: now.Add(time.Second)}
		p := AppendRequest(nil, &r)
		if p[0] != 0x16 {
			t.Fatalf("payload starts with %#x", p[0])
		}
		if len(p) < 32<<10 || len(p) > 33<<10 {
			t.Fatalf("payload %d bytes, want about 32 KiB", len(p))
		}
		if got, err := RequestID(p); err != nil || got != id {
			t.Fatalf("RequestID = %d, %v; want %d", got, err, id)
		}
		back, err := ParseRequest(p)
		if err != nil {
			t.Fatal(err)
		}
		if back.ID != id || !back.Trace || len(back.Segments) != len(segs) ||
			!back.SentAt.Equal(now) || !back.Deadline.Equal(now.Add(time.Second)) {
			t.Fatalf("round trip %d: %+v", id, back)
		}
	}
}

func TestParseRequestSkipsUnknownFields(t *testing.T) {
	w := compactWriter{}
	w.field(ctI64, 1)
	w.i64(42)
	w.field(ctStruct, 2)
	w.push()
	w.field(ctStruct, 2)
	w.push()
	w.field(ctBinary, 1)
	w.str("tbl")
	w.pop()
	w.field(ctStruct, 17) // a PinotQuery with content to skip
	w.push()
	w.field(ctI32, 3)
	w.i64(7)
	w.field(ctDouble, 4)
	w.b = append(w.b, make([]byte, 8)...)
	w.field(ctMap, 5)
	w.b = append(w.b, 1, 0x88, 1, 'k', 1, 'v') // map<string,string>{k:v}
	w.field(ctList, 6)
	w.listHeader(ctStruct, 1)
	w.b = append(w.b, 0x11, 0) // {f1 true}
	w.pop()
	w.pop()
	w.field(ctList, 8) // tableSegmentsInfoList, unknown to the parser
	w.listHeader(ctBool(), 2)
	w.b = append(w.b, 1, 2)
	w.field(ctI64, 100) // long-form field id
	w.i64(5)
	w.stop()
	r, err := ParseRequest(w.b)
	if err != nil {
		t.Fatal(err)
	}
	if r.ID != 42 || r.Table != "tbl" {
		t.Fatalf("got %+v", r)
	}
	// Every truncation is an error, never a panic.
	for i := range len(w.b) - 1 {
		if _, err := ParseRequest(w.b[:i]); err == nil {
			t.Fatalf("truncated at %d: no error", i)
		}
	}
	if _, err := RequestID([]byte{0x18, 1}); !errors.Is(err, ErrNotRequest) {
		t.Fatalf("RequestID of a non-request: %v", err)
	}
}

func ctBool() byte { return ctBoolTrue }

// The 80-byte framed minimal DataTable V4 (empty table, REQUEST_ID the only
// metadata), derived from Pinot's serializer code (not checked against a
// JVM).
const pinotResponseHex = `0000004c 00000004 00000000 00000000 00000034 00000004 00000038 00000000 00000038 00000000
	00000038 00000000 00000038 00000000 | 00000000 | 00000010
	00000001 0000000e 112210f4768db401`

func TestResponseMatchesPinot(t *testing.T) {
	want := unhex(t, pinotResponseHex)
	if len(want) != 80 {
		t.Fatalf("example is %d bytes, want 80", len(want))
	}
	got := AppendFrame(nil, AppendResponse(nil, 1234567890000000001))
	if !bytes.Equal(got, want) {
		t.Fatalf("frame\n got %x\nwant %x", got, want)
	}
	p, err := ReadFrame(bytes.NewReader(want), 0)
	if err != nil || len(p) != MinimalResponseLen {
		t.Fatalf("ReadFrame: %d bytes, %v", len(p), err)
	}
	id, err := ResponseID(p)
	if err != nil || id != 1234567890000000001 {
		t.Fatalf("ResponseID = %d, %v", id, err)
	}
}

func TestResponseIDSkipsOtherKeys(t *testing.T) {
	p, err := AppendDataTable(nil, []Metadata{
		{Key: 41, Value: "cid-1"},   // STRING queryId
		{Key: 5, Value: "12"},       // INT
		{Key: 38, Value: "true"},    // BOOLEAN
		{Key: 2, Value: "99"},       // LONG
		{Key: 40, Value: "primary"}, // STRING workloadName
		{Key: KeyRequestID, Value: "-7"},
		{Key: 0, Value: "after"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if id, err := ResponseID(p); err != nil || id != -7 {
		t.Fatalf("ResponseID = %d, %v", id, err)
	}
	for i := range len(p) {
		if _, err := ResponseID(p[:i]); err == nil {
			// The id is found once its 8 bytes are there; before, an error.
			if i < len(p)-(4+4+5) {
				t.Fatalf("truncated at %d: no error", i)
			}
		}
	}
	// An unknown key cannot be skipped: stop with ErrNoRequestID.
	unknown := []byte{}
	unknown, _ = AppendDataTable(unknown, []Metadata{{Key: 0, Value: "x"}})
	binary.BigEndian.PutUint32(unknown[len(unknown)-9:], 45) // rewrite key 0 as 45
	if _, err := ResponseID(unknown); !errors.Is(err, ErrNoRequestID) {
		t.Fatalf("unknown key: %v", err)
	}
	if _, err := ResponseID(make([]byte, 76)); !errors.Is(err, ErrNotDataTable) {
		t.Fatalf("version 0: %v", err)
	}
	if _, err := AppendDataTable(nil, []Metadata{{Key: 45, Value: "x"}}); err == nil {
		t.Fatal("AppendDataTable accepted an unknown key")
	}
}

// queryAll runs n queries concurrently and returns their results.
func queryAll(ctx context.Context, b *Broker, addr string, n int) []Result {
	res := make([]Result, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() { defer wg.Done(); res[i] = b.Query(ctx, addr) }()
	}
	wg.Wait()
	return res
}

func count(rs []Result, o Outcome) int {
	n := 0
	for _, r := range rs {
		if r.Outcome == o {
			n++
		}
	}
	return n
}

func newServer(t *testing.T, cfg ServerConfig) *Server {
	t.Helper()
	s, err := NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func newBroker(t *testing.T, cfg BrokerConfig) *Broker {
	t.Helper()
	b := NewBroker(cfg)
	t.Cleanup(func() { _ = b.Close() })
	return b
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitProgress waits for cond while progress keeps moving: it fails only
// when progress has not changed for 5 s, so a drain that a loaded machine
// slows down (16 MiB through a 16 KiB receive buffer, under -race) is
// judged by whether it advances, not by how fast; a minute bounds it all.
func waitProgress(t *testing.T, what string, progress func() int64, cond func() bool) {
	t.Helper()
	last, moved := progress(), time.Now()
	giveUp := time.Now().Add(time.Minute)
	for !cond() {
		now := time.Now()
		if p := progress(); p != last {
			last, moved = p, now
		}
		if now.Sub(moved) > 5*time.Second || now.After(giveUp) {
			t.Fatalf("timed out waiting for %s (progress %d, last moved %v ago)", what, last, now.Sub(moved).Round(time.Millisecond))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestRoundTrip(t *testing.T) {
	s := newServer(t, ServerConfig{Delay: time.Millisecond})
	b := newBroker(t, BrokerConfig{Timeout: 2 * time.Second, ID: "rt", RequestSize: 2048})
	ctx := context.Background()

	rs := queryAll(ctx, b, s.Addr(), 50)
	if n := count(rs, OK); n != 50 {
		t.Fatalf("%d of 50 ok: %+v", n, rs)
	}
	waitFor(t, "the server to count its answers", func() bool { return s.Stats().Answered == 50 })
	st, bs := s.Stats(), b.Stats()
	if st.Executed != 50 || st.Answered != 50 || st.Stale != 0 || st.ByBroker["rt"].Executed != 50 {
		t.Fatalf("server stats %+v", st)
	}
	if bs.Sent != 50 || bs.OK != 50 || bs.Connects != 1 || bs.QueueBytes != 0 || bs.PeakQueueBytes <= 0 {
		t.Fatalf("broker stats %+v", bs)
	}

	// Responses go out in completion order: a slow query started first
	// finishes after a fast one started later, on the same connection.
	s.SetDelay(time.Second)
	slow := make(chan Result, 1)
	go func() { slow <- b.Query(ctx, s.Addr()) }()
	waitFor(t, "the slow query to reach the server", func() bool { return s.Stats().Executed == 51 })
	s.SetDelay(0)
	fast := b.Query(ctx, s.Addr())
	select {
	case r := <-slow:
		t.Fatalf("slow query finished before the fast one: %+v", r)
	default:
	}
	if fast.Outcome != OK {
		t.Fatalf("fast query: %+v", fast)
	}
	if r := <-slow; r.Outcome != OK || r.Latency < time.Second {
		t.Fatalf("slow query: %+v", r)
	}
	if c := b.Stats().Connects; c != 1 {
		t.Fatalf("%d connects, want 1", c)
	}
}

func TestStalledServerTimesOutAndKeepsConnection(t *testing.T) {
	s := newServer(t, ServerConfig{RecvBuffer: 16 << 10})
	b := newBroker(t, BrokerConfig{Timeout: 300 * time.Millisecond, ID: "stall", RequestSize: 32 << 10})
	ctx := context.Background()
	if r := b.Query(ctx, s.Addr()); r.Outcome != OK {
		t.Fatalf("warm-up: %+v", r)
	}

	s.Stall()
	// 16 MiB of requests: more than the kernel buffers on both sides hold.
	var rs []Result
	for range 4 {
		rs = append(rs, queryAll(ctx, b, s.Addr(), 128)...)
	}
	if n := count(rs, TimedOut); n != len(rs) {
		t.Fatalf("%d of %d timed out, want all: ok %d failed %d", n, len(rs), count(rs, OK), count(rs, FailedFast))
	}
	// A query that could not take the channel lock within its 300 ms (a
	// loaded machine scheduling 128 goroutines) was never sent: the server
	// and the late responses are counted against the queries sent.
	var sent int64
	for _, r := range rs {
		if !errors.Is(r.Err, ErrLockTimeout) {
			sent++
		}
	}
	if sent == 0 {
		t.Fatalf("no query was sent: %+v", b.Stats())
	}
	bs := b.Stats()
	if !b.Connected(s.Addr()) || bs.Closes != 0 || bs.Connects != 1 {
		t.Fatalf("connection not kept: connected %v, %+v", b.Connected(s.Addr()), bs)
	}
	if bs.QueueBytes <= 0 || bs.PeakQueueBytes < bs.QueueBytes {
		t.Fatalf("outbound queue did not grow: %+v", bs)
	}
	executedDuringStall := s.Stats().Executed

	// On resume the server reads the backlog and executes it, all stale.
	s.Resume()
	drained := func() int64 { return s.Stats().Executed - b.Stats().QueueBytes }
	waitProgress(t, "the backlog to drain", drained, func() bool {
		return s.Stats().Executed == 1+sent && b.Stats().QueueBytes == 0
	})
	st := s.Stats()
	if st.Stale < sent-executedDuringStall || st.ByBroker["stall"].Stale != st.Stale {
		t.Fatalf("stale %d, want at least %d: %+v", st.Stale, sent-executedDuringStall, st)
	}
	if r := b.Query(ctx, s.Addr()); r.Outcome != OK {
		t.Fatalf("after resume: %+v", r)
	}
	late := func() int64 { return b.Stats().Late }
	waitProgress(t, "late responses", late, func() bool { return late() == sent })
	if c := b.Stats().Connects; c != 1 {
		t.Fatalf("%d connects, want 1", c)
	}
}

func TestFailedFastOnServerClose(t *testing.T) {
	s, err := NewServer(ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	addr := s.Addr()
	var closes []ConnClose
	var mu sync.Mutex
	b := newBroker(t, BrokerConfig{Timeout: 5 * time.Second, OnClose: func(c ConnClose) {
		mu.Lock()
		closes = append(closes, c)
		mu.Unlock()
	}})
	s.SetSilent(true)
	ctx := context.Background()

	done := make(chan []Result, 1)
	go func() { done <- queryAll(ctx, b, addr, 20) }()
	waitFor(t, "20 requests at the server", func() bool { return s.Stats().Executed == 20 })
	start := time.Now()
	_ = s.Close()
	rs := <-done
	if n := count(rs, FailedFast); n != 20 {
		t.Fatalf("%d of 20 failed fast", n)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("failing took %v, want well under the 5s timeout", d)
	}
	// OnClose comes after the queries have failed (the broker fails them
	// first), so wait for it; and never hold mu across a Fatalf: the
	// broker's Close, in the cleanup, waits for the goroutine that calls
	// OnClose, which would wait for mu.
	got := func() []ConnClose {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(closes)
	}
	waitFor(t, "OnClose", func() bool { return len(got()) > 0 })
	if cs := got(); len(cs) != 1 || cs[0].FailedFast != 20 || cs[0].Addr != addr {
		t.Fatalf("OnClose: %+v", cs)
	}
	if b.Connected(addr) {
		t.Fatal("still connected after the server closed")
	}
	// The next query reconnects, is refused, and fails fast too.
	r := b.Query(ctx, addr)
	if r.Outcome != FailedFast || r.Latency > time.Second {
		t.Fatalf("after close: %+v", r)
	}
	if bs := b.Stats(); bs.DialErrors != 1 || bs.FailedFast != 21 || bs.Closes != 1 {
		t.Fatalf("broker stats %+v", bs)
	}
}

func TestQueryCanceledAndBrokerClose(t *testing.T) {
	s := newServer(t, ServerConfig{})
	s.SetSilent(true)
	b := NewBroker(BrokerConfig{Timeout: 5 * time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	go func() { time.Sleep(50 * time.Millisecond); cancel() }()
	if r := b.Query(ctx, s.Addr()); r.Outcome != Canceled {
		t.Fatalf("canceled query: %+v", r)
	}
	dctx, dcancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer dcancel()
	if r := b.Query(dctx, s.Addr()); r.Outcome != TimedOut {
		t.Fatalf("context deadline: %+v", r)
	}
	// Whether Close finds the query in flight, connecting or not yet
	// started, it fails fast with ErrBrokerClosed.
	res := make(chan Result, 1)
	go func() { res <- b.Query(context.Background(), s.Addr()) }()
	waitFor(t, "the third query", func() bool { return b.Stats().Sent == 3 })
	time.Sleep(20 * time.Millisecond)
	_ = b.Close()
	if r := <-res; r.Outcome != FailedFast || !errors.Is(r.Err, ErrBrokerClosed) {
		t.Fatalf("query on close: %+v", r)
	}
	if r := b.Query(context.Background(), s.Addr()); r.Outcome != FailedFast {
		t.Fatalf("query after close: %+v", r)
	}
}

// A Load sends at most max queries, records each with its outcome, and
// Stop cuts the ones still waiting on a silent server.
func TestLoadRecordsAndStops(t *testing.T) {
	s := newServer(t, ServerConfig{Addr: "127.0.0.1:0"})
	b := newBroker(t, BrokerConfig{Timeout: 5 * time.Second})
	l := StartLoad(b, s.Addr(), 5*time.Millisecond, 10, 10*time.Second)
	if !l.WaitOK(time.Time{}, 10, 5*time.Second) {
		t.Fatalf("10 queries did not succeed: %+v", l.Records())
	}
	if !l.WaitSent(10, 5*time.Second) || l.WaitSent(11, 50*time.Millisecond) {
		t.Fatal("WaitSent: want exactly 10 queries sent")
	}
	l.Finish(time.Second)
	if n := len(l.Records()); n != 10 {
		t.Fatalf("%d records, want max (10)", n)
	}

	s.SetSilent(true)
	silent := StartLoad(b, s.Addr(), 5*time.Millisecond, 3, 10*time.Second)
	time.Sleep(50 * time.Millisecond)
	begin := time.Now()
	silent.Stop() // must not wait for the broker's 5s timeout
	if d := time.Since(begin); d > 3*time.Second {
		t.Fatalf("Stop took %v, want it to cut the queries that wait (the broker's timeout is 5s)", d)
	}
	for _, r := range silent.Records() {
		if r.Outcome == OK {
			t.Fatalf("a silent server answered: %+v", r)
		}
	}
}

// TimeoutMs travels as PinotQuery's queryOptions {"timeoutMs": "<n>"} and
// comes back through both the simulator's decoder and the proxy's reader.
func TestRequestTimeoutOption(t *testing.T) {
	base := unhex(t, pinotRequestHex)
	r := Request{ID: 1234567890000000001, Table: "t_OFFLINE", TimeoutMs: 2500, Segments: []string{"s0", "s1"},
		BrokerID: "Broker_h_8099", CID: "c1"}
	p := AppendRequest(nil, &r)
	// The empty PinotQuery "fc 00" becomes "fc bb 01 88 09 timeoutMs 04 2500 00".
	opt := append([]byte{0xfc, 0xbb, 0x01, 0x88, 0x09}, "timeoutMs\x042500\x00"...)
	want := append(append(bytes.Clone(base[:24]), opt...), base[26:]...)
	if !bytes.Equal(p, want) {
		t.Fatalf("payload\n got %x\nwant %x", p, want)
	}
	back, err := ParseRequest(p)
	if err != nil || back.TimeoutMs != 2500 || back.ID != r.ID || back.Table != "t_OFFLINE" || back.CID != "c1" ||
		len(back.Segments) != 2 {
		t.Fatalf("ParseRequest = %+v, %v", back, err)
	}
	wr, need, err := pinotwire.ParseRequest(p, true)
	if err != nil || need != 0 || wr != (pinotwire.Request{ID: r.ID, Timeout: 2500 * time.Millisecond, HasTimeout: true}) {
		t.Fatalf("pinotwire.ParseRequest = %+v, %d, %v", wr, need, err)
	}
	// Without it, the payload is the one Pinot's example shows.
	r.TimeoutMs = 0
	if p := AppendRequest(nil, &r); !bytes.Equal(p, base) {
		t.Fatalf("without TimeoutMs: %x", p)
	}
	if back, err := ParseRequest(base); err != nil || back.TimeoutMs != 0 {
		t.Fatalf("ParseRequest without the option = %+v, %v", back, err)
	}
}

// readRequests accepts one connection on ln and sends every request payload
// it reads to out, until the connection closes.
func readRequests(t *testing.T, ln net.Listener, out chan<- []byte) {
	t.Helper()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		for {
			p, err := ReadFrame(c, 0)
			if err != nil {
				close(out)
				return
			}
			out <- p
		}
	}()
}

// The broker sends its remaining budget as timeoutMs unless told not to;
// the budget shrinks with the time the query waited for the channel lock.
func TestBrokerSendsTimeoutOption(t *testing.T) {
	for _, omit := range []bool{false, true} {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		reqs := make(chan []byte, 4)
		readRequests(t, ln, reqs)
		b := NewBroker(BrokerConfig{Timeout: 2 * time.Second, OmitTimeoutOption: omit})
		ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
		res := make(chan Result, 1)
		go func() { res <- b.Query(ctx, ln.Addr().String()) }() // the context is the tighter deadline
		p := <-reqs
		// The budget left when the request was framed: no more than the
		// context's 700 ms, and no less than what is left now that it is
		// here (how much less than 700 ms is the machine's business).
		deadline, _ := ctx.Deadline()
		least := max(time.Until(deadline).Truncate(time.Millisecond), time.Millisecond)
		r, _, err := pinotwire.ParseRequest(p, true)
		if err != nil {
			t.Fatal(err)
		}
		if omit {
			if r.HasTimeout {
				t.Fatalf("OmitTimeoutOption: request carries %v", r.Timeout)
			}
		} else if !r.HasTimeout || r.Timeout > 700*time.Millisecond || r.Timeout < least {
			t.Fatalf("request carries %+v, want the remaining budget when it was sent: at most 700ms, at least the %v left when it came", r, least)
		}
		back, err := ParseRequest(p)
		if err != nil || back.TimeoutMs != r.Timeout.Milliseconds() || back.Deadline.IsZero() {
			t.Fatalf("ParseRequest = %+v, %v", back, err)
		}
		if got := <-res; got.Outcome != TimedOut {
			t.Fatalf("query on a server that never answers: %+v", got)
		}
		cancel()
		_ = b.Close()
		_ = ln.Close()
	}
	if got := remainingMs(time.Unix(10, 0), time.Unix(11, 0)); got != 1 {
		t.Fatalf("remainingMs past the deadline = %d, want 1", got)
	}
	if got := remainingMs(time.Unix(10, 999_999), time.Unix(9, 0)); got != 1000 {
		t.Fatalf("remainingMs = %d, want 1000 (truncated)", got)
	}
}

// A DataTable with every section: the header gives each section's start and
// length back to back, the metadata comes last, and REQUEST_ID is found.
func TestDataTableSections(t *testing.T) {
	tbl := DataTable{
		NumRows: 3, NumColumns: 2,
		Exceptions: []Exception{{Code: 250, Message: "timed out"}},
		Dictionary: []string{"a", "bc"},
		Schema:     []byte{1, 2, 3},
		Fixed:      make([]byte, 24),
		Variable:   []byte{9},
		Metadata:   []Metadata{{Key: 40, Value: "primary"}, {Key: KeyRequestID, Value: "77"}},
	}
	p, err := tbl.Append(nil)
	if err != nil {
		t.Fatal(err)
	}
	lens := []int{4 + 4 + 4 + 9, 4 + 5 + 6, 3, 24, 1}
	off := 52
	for i, l := range lens {
		start, n := binary.BigEndian.Uint32(p[12+8*i:]), binary.BigEndian.Uint32(p[16+8*i:])
		if int(start) != off || int(n) != l {
			t.Fatalf("section %d: start %d length %d, want %d %d", i, start, n, off, l)
		}
		off += l
	}
	if v, rows := binary.BigEndian.Uint32(p), binary.BigEndian.Uint32(p[4:]); v != 4 || rows != 3 {
		t.Fatalf("version %d rows %d", v, rows)
	}
	if got, err := pinotwire.MetadataOffset(p); err != nil || got != int64(off) {
		t.Fatalf("MetadataOffset = %d, %v; want %d", got, err, off)
	}
	if id, err := ResponseID(p); err != nil || id != 77 {
		t.Fatalf("ResponseID = %d, %v", id, err)
	}
	if _, err := (&DataTable{Metadata: []Metadata{{Key: 2, Value: "x"}}}).Append(nil); err == nil {
		t.Fatal("a LONG key with a non-numeric value was accepted")
	}
	if _, err := ResponseID(p[:off+10]); !errors.Is(err, ErrNotDataTable) {
		t.Fatalf("truncated metadata: %v", err)
	}
	// A header whose sections run past the payload.
	short := bytes.Clone(p[:60])
	if _, err := ResponseID(short); !errors.Is(err, ErrNotDataTable) {
		t.Fatalf("sections past the end: %v", err)
	}
}

// FirstOK and Count over one list of records: the first success at or
// after t0, and the outcomes of the queries sent in a window.
func TestFirstOKAndCount(t *testing.T) {
	t0 := time.Unix(100, 0)
	rs := []Record{
		{Sent: t0.Add(-time.Second), Result: Result{Outcome: OK}}, // before t0
		{Sent: t0, Result: Result{Outcome: TimedOut}},
		{Sent: t0.Add(time.Second), Result: Result{Outcome: FailedFast}},
		{Sent: t0.Add(2 * time.Second), Result: Result{Outcome: OK}},
		{Sent: t0.Add(3 * time.Second), Result: Result{Outcome: Canceled}},
	}
	if r, ok := FirstOK(rs, t0); !ok || !r.Sent.Equal(t0.Add(2*time.Second)) {
		t.Fatalf("FirstOK = %+v %v, want the one sent at t0+2s", r, ok)
	}
	if _, ok := FirstOK(rs, t0.Add(3*time.Second)); ok {
		t.Fatal("FirstOK found a success after the last one")
	}
	want := Tally{Sent: 3, OK: 1, FailedFast: 1, TimedOut: 1}
	if got := Count(rs, t0, t0.Add(3*time.Second)); got != want || got.Lost() != 2 {
		t.Fatalf("Count = %+v (lost %d), want %+v (lost 2)", got, got.Lost(), want)
	}
	want.Sent, want.Canceled = 4, 1
	if got := Count(rs, t0, time.Time{}); got != want {
		t.Fatalf("Count with no end = %+v, want %+v", got, want)
	}
}

// Recovery waits for every load: the slowest one's first answer after t0.
func TestRecoveryAndFinishAll(t *testing.T) {
	s := newServer(t, ServerConfig{Addr: "127.0.0.1:0"})
	t0 := time.Now()
	var ls []*Load
	for range 2 {
		b := newBroker(t, BrokerConfig{Timeout: 5 * time.Second})
		ls = append(ls, StartLoad(b, s.Addr(), 5*time.Millisecond, 3, 10*time.Second))
	}
	for _, l := range ls {
		if !l.WaitOK(t0, 1, 5*time.Second) {
			t.Fatalf("no query succeeded: %+v", l.Records())
		}
	}
	FinishAll(ls, 5*time.Second)
	rec, ok := Recovery(ls, t0)
	var slowest time.Duration
	for _, l := range ls {
		f, _ := FirstOK(l.Records(), t0)
		slowest = max(slowest, f.Done.Sub(t0))
	}
	if !ok || rec != slowest {
		t.Fatalf("Recovery = %v %v, want %v", rec, ok, slowest)
	}
	if _, ok := Recovery(ls, time.Now()); ok {
		t.Fatal("Recovery after the last query: want none")
	}
}
