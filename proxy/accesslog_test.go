//go:build linux

package proxy

import (
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
)

// waitLine waits for the first log line with msg.
func waitLine(t *testing.T, sink *syncBuffer, msg string) map[string]any {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if ls := sink.lines(t, msg); len(ls) > 0 {
			return ls[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %q line within 5s:\n%s", msg, sink.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A pool link that failed over: the access log names the client, the
// member it reached, the two attempts it took and the connect time of the one that
// succeeded; who ended it and why.
func TestAccessLogFailover(t *testing.T) {
	peers, addrs := peersOn(t, faultpeer.Echo, "127.0.0.2", "127.0.0.3")
	peers[0].Close() // refuses from now on: the first pick fails over
	var sink syncBuffer
	log := zerolog.New(&sink)
	cfg := policy.DefaultConfig()
	s := cfg.Defaults
	s.Detector.InitialDelay = policy.Duration(10 * time.Second)
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Pool: policy.Pool{Endpoints: addrs, Balance: policy.BalanceRoundRobin, Refresh: policy.Duration(time.Second)}, Settings: s}}
	_, c := startConfig(t, cfg, Options{Logger: &log, AccessLog: true})
	roundTrip(t, c, []byte("over"))
	_ = c.Close()
	l := waitLine(t, &sink, "link closed")
	if l["upstream"] != addrs[1] || l["connect_attempts"] != 2.0 || l["reason"] != "client_closed" || l["ended_by"] != "client" ||
		l["request_bytes"] != 4.0 || l["response_bytes"] != 4.0 {
		t.Fatalf("access log line %v: want %s after 2 attempts, 4 bytes each way", l, addrs[1])
	}
	if ms, _ := l["connect_ms"].(float64); ms <= 0 {
		t.Errorf("connect_ms %v", l["connect_ms"])
	}
	if l["client"] != c.LocalAddr().String() {
		t.Errorf("client %v, the client dialled from %s", l["client"], c.LocalAddr())
	}
}

// A link whose dial failed: the access log names the upstream that
// failed, the proxy as the one that ended it, and no connect time.
func TestAccessLogDialError(t *testing.T) {
	peer := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	dead := peer.Addr()
	peer.Close()
	var sink syncBuffer
	log := zerolog.New(&sink)
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Upstream: dead, Settings: cfg.Defaults}}
	startConfig(t, cfg, Options{Logger: &log, AccessLog: true}) // its client connects; the link's dial fails
	l := waitLine(t, &sink, "link closed")
	if l["upstream"] != dead || l["reason"] != "dial_error" || l["ended_by"] != "proxy" || l["connect_attempts"] != 1.0 || l["cause"] == nil {
		t.Fatalf("access log line %v: want dial_error on %s, by the proxy, one attempt, the cause", l, dead)
	}
	if _, ok := l["connect_ms"]; ok {
		t.Errorf("connect_ms %v on a dial that failed", l["connect_ms"])
	}
}
