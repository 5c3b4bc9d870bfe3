package policy

import (
	"strings"
	"testing"
)

// mesh.tls.peers is a list of strings in YAML, kept as Identities (so
// that Settings stay comparable); a listener inherits the defaults' TLS
// files and may name its own peers; ingress.allow takes addresses and
// CIDRs.
func TestMeshTLSAndAllowParse(t *testing.T) {
	c, err := Parse([]byte(doc(
		"defaults:",
		"  mesh: {tls: {cert_file: /c, key_file: /k, ca_file: /ca, peers: [spiffe://cluster.local/ns/a/sa/b, server.example]}}",
		"listeners:",
		"  - name: a",
		"    listen: 127.0.0.1:2",
		"    upstream: db:1",
		"    mesh: {port: 17400, tls: {peers: [spiffe://x/y]}}",
		"  - name: in",
		"    listen: 0.0.0.0:17400",
		"    ingress: {local: 127.0.0.1:8098, allow: [10.0.0.0/8, 192.168.1.7, \"fd00::/8\"], max_streams_per_session: 50}",
	)))
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Defaults.Mesh.TLS.Peers.List(); strings.Join(got, ",") != "spiffe://cluster.local/ns/a/sa/b,server.example" {
		t.Fatalf("defaults peers %q", got)
	}
	a := c.Listeners[0].Mesh.TLS
	if !a.Enabled() || a.CertFile != "/c" || a.Peers != NewIdentities("spiffe://x/y") {
		t.Fatalf("listener a's mesh.tls %+v, want the defaults' files and its own peers", a)
	}
	if in := c.Listeners[1].Ingress; len(in.Allow) != 3 || in.MaxStreamsPerSession != 50 {
		t.Fatalf("ingress %+v", in)
	}
	for _, a := range []string{"10.0.0.0/8", "192.168.1.7", "fd00::/8"} {
		if _, err := ParseAllow(a); err != nil {
			t.Errorf("%s: %v", a, err)
		}
	}
	// GET /v1/config's YAML parses back, the identities a list again.
	b, err := c.Effective()
	if err != nil {
		t.Fatal(err)
	}
	back, err := Parse(b)
	if err != nil {
		t.Fatalf("the effective config does not parse back: %v\n%s", err, b)
	}
	if back.Defaults.Mesh.TLS != c.Defaults.Mesh.TLS || back.Listeners[0].Mesh.TLS != a {
		t.Fatalf("mesh.tls %+v / %+v after the round trip, want %+v / %+v", back.Defaults.Mesh.TLS, back.Listeners[0].Mesh.TLS, c.Defaults.Mesh.TLS, a)
	}
	_, err = Parse([]byte(doc("defaults:", "  mesh: {tls: {cert_file: /c, key_file: /k, ca_file: /ca, peers: spiffe://x}}")))
	if err == nil || !strings.Contains(err.Error(), "defaults.mesh.tls.peers: expected a list") {
		t.Fatalf("peers as a string: %v, want an error naming the key", err)
	}
}
