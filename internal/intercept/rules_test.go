package intercept

import (
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// representative is the flag set of the golden file: IPv4 and IPv6 CIDRs,
// ports, excluded ports, uid and mark, and the excluded set.
func representative() Config {
	return Config{
		ProxyPort: 15001,
		CIDRs: []netip.Prefix{
			netip.MustParsePrefix("10.0.0.0/8"),
			netip.MustParsePrefix("192.168.7.10/32"),
			netip.MustParsePrefix("fd00:10::/64"),
		},
		Ports:        []uint16{9000, 8098, 9000},
		ExcludePorts: []uint16{15020, 22},
		ProxyUID:     DefaultProxyUID,
		ProxyMark:    0x99,
		ExcludedSet:  true,
	}
}

func TestRenderGolden(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"representative", representative()},
		{"minimal", Config{
			ProxyPort: 15001,
			CIDRs:     []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")},
			ProxyUID:  DefaultProxyUID,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rs, err := Build(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			got := rs.Render()
			golden := filepath.Join("testdata", tc.name+".nft")
			if *update {
				if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run go test -update to create it)", err)
			}
			if got != string(want) {
				t.Errorf("Render differs from %s (go test -update rewrites it):\n--- got\n%s\n--- want\n%s", golden, got, want)
			}
		})
	}
}

func TestBuildOrderAndComments(t *testing.T) {
	rs, err := Build(representative())
	if err != nil {
		t.Fatal(err)
	}
	// Exemptions come first, then the rejects, then the redirects: a
	// redirect must never win over an exemption or a reject.
	last := Return
	for i, r := range rs.Rules {
		if r.Comment == "" || !strings.HasPrefix(r.Comment, "livenessproxy: ") {
			t.Errorf("rule %d (%s) has no livenessproxy comment", i, r)
		}
		if r.Verdict < last {
			t.Errorf("rule %d (%s) comes after a %v rule", i, r, last)
		}
		last = r.Verdict
	}
	if n := len(rs.Rules); n != 2+2+1+2+3 {
		t.Errorf("%d rules, want 10", n)
	}
	if got := rs.Rules[len(rs.Rules)-1].DPorts; len(got) != 2 || got[0] != 8098 || got[1] != 9000 {
		t.Errorf("ports %v, want sorted and deduplicated [8098 9000]", got)
	}
}

func TestValidate(t *testing.T) {
	ok := func() Config {
		return Config{ProxyPort: 15001, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, ProxyUID: NoUID, ProxyMark: 1}
	}
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		want string // substring of the error; "" = valid
	}{
		{"ok", func(*Config) {}, ""},
		{"no port", func(c *Config) { c.ProxyPort = 0 }, "proxy port: required"},
		{"no cidr", func(c *Config) { c.CIDRs = nil }, "at least one destination CIDR"},
		{"host bits", func(c *Config) { c.CIDRs = []netip.Prefix{netip.MustParsePrefix("10.1.2.3/8")} }, "did you mean 10.0.0.0/8"},
		{"4in6", func(c *Config) { c.CIDRs = []netip.Prefix{netip.MustParsePrefix("::ffff:10.0.0.0/104")} }, "IPv4-mapped"},
		{"invalid prefix", func(c *Config) { c.CIDRs = []netip.Prefix{{}} }, "invalid prefix"},
		{"port 0", func(c *Config) { c.Ports = []uint16{0} }, "ports: port 0"},
		{"exclude port 0", func(c *Config) { c.ExcludePorts = []uint16{0} }, "exclude ports: port 0"},
		{"uid too big", func(c *Config) { c.ProxyUID = 1 << 32 }, "out of range"},
		{"no exemption", func(c *Config) { c.ProxyMark = 0 }, "must be exempt"},
		{"uid only", func(c *Config) { c.ProxyMark = 0; c.ProxyUID = 0 }, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := ok()
			tc.mod(&c)
			_, err := Build(c)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}
