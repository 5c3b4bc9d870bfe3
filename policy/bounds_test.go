package policy

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// aliasBomb is a small document whose aliases expand to n listeners, each
// with n transparent match entries, each with n ports: n³ ports from a
// file of a few bytes per n.
func aliasBomb(n int) []byte {
	var b strings.Builder
	b.WriteString("x:\n  - &p [1")
	b.WriteString(strings.Repeat(",1", n-1))
	b.WriteString("]\n  - &m {cidr: 10.0.0.0/8, ports: *p}\n  - &l {name: a, listen: '127.0.0.1:0', transparent: {match: [*m")
	b.WriteString(strings.Repeat(",*m", n-1))
	b.WriteString("]}}\nlisteners: [*l")
	b.WriteString(strings.Repeat(",*l", n-1))
	b.WriteString("]\n")
	return []byte(b.String())
}

// A kilobyte of YAML whose aliases expand to a million values (a
// ConfigMap edit, parsed by the running proxy) is refused promptly, with
// an error that names the aliasing, at a bounded cost. Before, Parse
// followed every alias: this one cost 329 MiB and two seconds, and at
// 3.6 KB the cost would have been tens of GiB.
func TestAliasExpansionIsBounded(t *testing.T) {
	data := aliasBomb(100)
	alloc, err := parseAllocating(data)
	t.Logf("%d-byte document: Parse allocated %d MiB", len(data), alloc>>20)
	if err == nil || !strings.Contains(err.Error(), "YAML aliases") {
		t.Fatalf("Parse: %v, want an error about the aliases' expansion", err)
	}
	if alloc > 64<<20 {
		t.Errorf("Parse allocated %d MiB for a %d-byte document, want at most 64 MiB", alloc>>20, len(data))
	}
}

// Aliases that expand to fewer values than the bound are decoded as
// before (the twin): a match list shared by 300 transparent listeners.
func TestAliasesWithinTheBoundDecode(t *testing.T) {
	var b strings.Builder
	b.WriteString("listeners:\n  - {name: l0, listen: '127.0.0.1:20000', transparent: {match: &m [{cidr: 10.0.0.0/8, ports: [80, 443, 8080, 9092]}, {cidr: 192.168.0.0/16, ports: [8098]}]}}\n")
	for i := 1; i < 300; i++ {
		fmt.Fprintf(&b, "  - {name: l%d, listen: '127.0.0.1:%d', transparent: {match: *m}}\n", i, 20000+i)
	}
	cfg, err := Parse([]byte(b.String()))
	if err != nil {
		t.Fatalf("an aliased config within the bound: %v", err)
	}
	if len(cfg.Listeners) != 300 || len(cfg.Listeners[299].Transparent.Match) != 2 {
		t.Fatalf("%d listeners, want 300 with their match lists", len(cfg.Listeners))
	}
}

// A file over MaxConfigBytes is refused with an error that says so, and
// ReadFile reads no more than one byte past the bound, whatever its size.
func TestConfigFileSizeIsBounded(t *testing.T) {
	path := filepath.Join(t.TempDir(), "big.yaml")
	big := "listeners: []\n" + strings.Repeat("# filler\n", (2*MaxConfigBytes)/9)
	if err := os.WriteFile(path, []byte(big), 0o600); err != nil {
		t.Fatal(err)
	}
	data, err := ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(data) != MaxConfigBytes+1 {
		t.Fatalf("ReadFile read %d bytes, want %d", len(data), MaxConfigBytes+1)
	}
	if _, err := Load(path); err == nil || !strings.Contains(err.Error(), "ConfigMap's own limit") {
		t.Fatalf("Load: %v, want the size refused", err)
	}
}

// A listener that dials an address the proxy binds is refused, the key
// named: its upstream, a pool entry or an ingress's local server that is
// a listener's (or the admin server's) own address, in any spelling that
// binds the same socket. Before, it passed, and one client connection
// became a chain of links up to max_links (found by a helper's audit).
func TestSelfTargetIsRefused(t *testing.T) {
	for _, tc := range []struct{ name, doc, key string }{
		{"own listen", "listeners:\n  - {name: a, listen: '127.0.0.1:18098', upstream: '127.0.0.1:18098'}\n", "listeners[0].upstream"},
		{"localhost spelling", "listeners:\n  - {name: a, listen: '127.0.0.1:18098', upstream: 'localhost:18098'}\n", "listeners[0].upstream"},
		{"another listener", "listeners:\n  - {name: a, listen: '127.0.0.1:18098', upstream: '127.0.0.1:18099'}\n  - {name: b, listen: '127.0.0.1:18099', upstream: '127.0.0.1:18097'}\n", "listeners[0].upstream"},
		{"pool member on a wildcard listener", "listeners:\n  - {name: a, listen: '0.0.0.0:18098', pool: {endpoints: ['127.0.0.1:9000', '127.0.0.1:18098']}}\n", "listeners[0].pool.endpoints[1]"},
		{"IPv6 loopback on a dual-stack wildcard", "listeners:\n  - {name: a, listen: ':18098', upstream: '[::1]:18098'}\n", "listeners[0].upstream"},
		{"the admin server", "admin: {listen: '127.0.0.1:19901'}\nlisteners:\n  - {name: a, listen: '127.0.0.1:18098', upstream: '127.0.0.1:19901'}\n", "listeners[0].upstream"},
	} {
		_, err := Parse([]byte(tc.doc))
		if err == nil || !strings.Contains(err.Error(), tc.key) || !strings.Contains(err.Error(), "dial itself") {
			t.Errorf("%s: Parse: %v, want %s refused as the proxy itself", tc.name, err, tc.key)
		}
	}
}

// Its twin: the same port on another host is no loop, nor is a name, nor
// a wildcard listener's port on a remote address (a sidecar on :9092 in
// front of kafka-0:9092 is the usual case).
func TestSamePortElsewhereIsNoSelfTarget(t *testing.T) {
	for _, doc := range []string{
		"listeners:\n  - {name: a, listen: '127.0.0.1:18098', upstream: '127.0.0.2:18098'}\n",
		"listeners:\n  - {name: a, listen: '0.0.0.0:9092', upstream: '10.1.2.3:9092'}\n",
		"listeners:\n  - {name: a, listen: '0.0.0.0:9092', upstream: 'kafka-0.kafka:9092'}\n",
		"listeners:\n  - {name: a, listen: '127.0.0.1:0', upstream: '127.0.0.1:9'}\n",
	} {
		if _, err := Parse([]byte(doc)); err != nil {
			t.Errorf("Parse refused a config with no loop: %v\n%s", err, doc)
		}
	}
}

// A list of many aliases of one listener within MaxConfigBytes (350,000
// of them) is stopped by the value bound before it costs their memory,
// and checked in linear time. Before, the slice for all of them was made
// first (456 MiB allocated) and the address checks were quadratic (20 s
// of a core) (found by a review).
func TestListenerListAllocationIsBounded(t *testing.T) {
	n := (MaxConfigBytes - 200) / 3
	var b strings.Builder
	b.WriteString("x: &l {name: a, listen: '127.0.0.1:0', upstream: '127.0.0.1:9'}\nlisteners: [*l")
	b.WriteString(strings.Repeat(",*l", n-1))
	b.WriteString("]\n")
	data := []byte(b.String())
	alloc, err := parseAllocating(data)
	t.Logf("%d-byte document (%d listener aliases): Parse allocated %d MiB", len(data), n, alloc>>20)
	if err == nil || !strings.Contains(err.Error(), "YAML aliases") {
		t.Fatalf("Parse: %.200v, want the value bound named", err)
	}
	if alloc > 256<<20 {
		t.Errorf("Parse allocated %d MiB for a %d-byte document, want at most 256 MiB (YAML's own parse of it is about 80)", alloc>>20, len(data))
	}
}

// Many listeners on one port of distinct hosts: the clash and loop checks
// take linear time, and still find every clash (the twin of the above).
func TestManyListenersAreCheckedInLinearTime(t *testing.T) {
	var b strings.Builder
	b.WriteString("listeners:\n")
	for i := range 3000 {
		fmt.Fprintf(&b, "  - {name: l%d, listen: '127.0.%d.%d:18000', upstream: '10.0.0.1:9'}\n", i, i/250, 1+i%250)
	}
	b.WriteString("  - {name: wild, listen: '0.0.0.0:18000', upstream: '127.0.0.1:18000'}\n")
	_, err := Parse([]byte(b.String()))
	if err == nil || !strings.Contains(err.Error(), "listeners[3000].listen") || !strings.Contains(err.Error(), "listeners[3000].upstream") {
		t.Fatalf("Parse: %.300v, want the wildcard's clash and its loop named", err)
	}
}

// parseAllocating parses data and returns the bytes Parse allocated and
// its error.
func parseAllocating(data []byte) (uint64, error) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err := Parse(data)
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc, err
}
