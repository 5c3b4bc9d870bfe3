package policy

import (
	"strings"
	"testing"
)

// One address in two spellings is one endpoint: pool.endpoints and
// endpoints.disabled refuse it twice, naming the entry. Before, the
// uniqueness check compared IP hosts as written, so [fd00::1]:9092 and
// [fd00:0:0:0:0:0:0:1]:9092 passed as two pool members (two endpoints for
// one server), as did 10.0.0.1 and its IPv4-mapped spelling (found by a
// helper's audit).
func TestOneAddressInTwoSpellingsIsADuplicate(t *testing.T) {
	for _, tc := range []struct{ doc, key string }{
		{"listeners:\n  - {name: a, listen: '127.0.0.1:0', pool: {endpoints: ['[fd00::1]:9092', '[fd00:0:0:0:0:0:0:1]:9092']}}\n", "listeners[0].pool.endpoints[1]"},
		{"listeners:\n  - {name: a, listen: '127.0.0.1:0', pool: {endpoints: ['10.0.0.1:9092', '[::ffff:10.0.0.1]:9092']}}\n", "listeners[0].pool.endpoints[1]"},
		{"listeners:\n  - {name: a, listen: '127.0.0.1:0', upstream: '[fd00::1]:9092'}\nendpoints: {disabled: ['[fd00::1]:9092', '[FD00::1]:09092']}\n", "endpoints.disabled[1]"},
	} {
		_, err := Parse([]byte(tc.doc))
		if err == nil || !strings.Contains(err.Error(), tc.key+": duplicate endpoint") {
			t.Errorf("Parse: %v, want %s refused as a duplicate endpoint:\n%s", err, tc.key, tc.doc)
		}
	}
}

// Its twin: distinct addresses stay distinct (an IPv4-compatible ::a00:1
// is not 10.0.0.1, nor is fd00::1 fd00::1:0), and a name is kept as
// written beside its address.
func TestDistinctEndpointsAreNoDuplicates(t *testing.T) {
	doc := "listeners:\n  - {name: a, listen: '127.0.0.1:0', pool: {endpoints: ['10.0.0.1:9092', '[::a00:1]:9092', '[fd00::1]:9092', '[fd00::1:0]:9092', 'kafka-0:9092', 'Kafka-1:9092']}}\n" +
		"endpoints: {disabled: ['kafka-0:9092', '10.0.0.1:9092']}\n"
	if _, err := Parse([]byte(doc)); err != nil {
		t.Errorf("Parse refused distinct endpoints: %v\n%s", err, doc)
	}
}

// The one spelling: netip's for an IP address (an IPv4-mapped one
// unmapped), the port a plain number, a name as written.
func TestCanonicalEndpoint(t *testing.T) {
	for in, want := range map[string]string{
		"[0:0:0:0:0:0:0:1]:09": "[::1]:9",
		"[FD00::A]:80":         "[fd00::a]:80",
		"[::ffff:10.0.0.1]:80": "10.0.0.1:80",
		"Kafka-0.Kafka:09092":  "Kafka-0.Kafka:9092",
		"no-port":              "no-port",
	} {
		if got := CanonicalEndpoint(in); got != want {
			t.Errorf("CanonicalEndpoint(%q) = %q, want %q", in, got, want)
		}
	}
}
