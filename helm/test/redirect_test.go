package charttest

import (
	"os/exec"
	"strings"
	"testing"
)

// redirectArgs is the args of the redirect init container of a render.
func redirectArgs(t *testing.T, out string) []string {
	t.Helper()
	for _, pod := range decodeStrict(t, out).pods() {
		for _, c := range pod.Spec.InitContainers {
			if c.Name == "livenessproxy-redirect" {
				return c.Args
			}
		}
	}
	t.Fatal("no redirect init container rendered")
	return nil
}

// redirectRefuses runs the real `livenessproxy redirect --dry-run` with
// args: its output when it refuses them, "" when it takes them.
func redirectRefuses(t *testing.T, args []string) string {
	t.Helper()
	out, err := exec.Command(proxyBinary(t), append(args, "--dry-run")...).CombinedOutput()
	if err != nil {
		return strings.TrimSpace(string(out)) + " (" + err.Error() + ")"
	}
	return ""
}

// TestRedirectValuesFailAtRender: a redirect value the init container
// would refuse fails helm template, naming the value (the chart's promise:
// "a mistake fails helm install, not the pod"). Before, each of these
// rendered, and the pod sat in Init:CrashLoopBackOff.
func TestRedirectValuesFailAtRender(t *testing.T) {
	for _, tc := range []struct{ name, set, want string }{
		{"port 0 in redirect.ports", "redirect.ports={0}", "/redirect/ports/0"},
		{"port 70000 in redirect.ports", "redirect.ports={70000}", "/redirect/ports/0"},
		{"port 0 in redirect.excludePorts", "redirect.excludePorts={0}", "/redirect/excludePorts/0"},
		{"negative port in redirect.excludePorts", "redirect.excludePorts={-1}", "/redirect/excludePorts/0"},
		{"host bits in redirect.cidrs", "redirect.cidrs={10.0.0.1/8}", `redirect.cidrs has "10.0.0.1/8", whose address has bits set past its /8 prefix, which the redirect init container refuses: did you mean 10.0.0.0/8?`},
		{"not a CIDR in redirect.cidrs", "redirect.cidrs={10.0.0.0/33}", `redirect.cidrs has "10.0.0.0/33", which is not a CIDR (prefix length 33 is above 32)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"template", "rel", chartDir, "--namespace", namespace},
				valuesArgs([]string{"testdata/values-pinot-broker.yaml"}, tc.set)...)
			out, err := helm(t, args...)
			if err == nil {
				ra := redirectArgs(t, out)
				t.Fatalf("--set %s renders, and the init container's command %v: %s", tc.set, ra, redirectRefuses(t, ra))
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("--set %s: error %v\ndoes not contain %q", tc.set, err, tc.want)
			}
		})
	}
}

// TestRedirectCIDRsAsTheInitContainerTakesThem: the chart's reading of
// redirect.cidrs is the init container's: each CIDR renders exactly when
// the real `livenessproxy redirect` takes the arguments rendered for it
// (the twin of TestRedirectValuesFailAtRender: valid forms, a single
// address, IPv6 with an embedded IPv4 address, still render). The
// transparent listener matches everything, so only the CIDR decides.
func TestRedirectCIDRsAsTheInitContainerTakesThem(t *testing.T) {
	const anything = `config.listeners=[{"name":"out","listen":":15001","transparent":{"match":[{"cidr":"0.0.0.0/0"},{"cidr":"::/0"}]}}]`
	for _, tc := range []struct {
		cidr  string
		valid bool
	}{
		{"10.0.0.0/8", true}, {"10.1.2.3", true}, {"10.1.2.3/32", true}, {"0.0.0.0/0", true},
		{"fd00::/8", true}, {"FD00::/8", true}, {"2001:db8::1", true}, {"::/0", true},
		{"64:ff9b::10.0.0.0/120", true}, {"1:2:3:4:5:6:7::/128", true}, {"1:2:3:4:5:6:1.2.3.4/128", true},
		{"10.0.0.1/8", false}, {"10.0.0.0/33", false}, {"10.0.0.0/08", false}, {"1.2.3.04/32", false},
		{"10.0.0.0/", false}, {"10.0.0", false}, {"fd00::1/8", false}, {"fd00::/129", false},
		{"::ffff:10.0.0.0/104", false}, {"::ffff:10.1.2.3", false}, {"1:2:3:4:5:6:7:8::/128", false},
		{"00001::/16", false}, {"1:::2/64", false}, {"1::2::3/64", false}, {"1:2:3:4:5:6:7:1.2.3.4/128", false},
	} {
		t.Run(tc.cidr, func(t *testing.T) {
			out, err := helm(t, "template", "rel", chartDir, "--set", "example.enabled=true", "--set", "redirect.enabled=true",
				"--set-json", anything, "--set-json", `redirect.cidrs=["`+tc.cidr+`"]`)
			if err != nil {
				if tc.valid {
					t.Errorf("refused at render: %v", err)
				}
				return
			}
			refused := redirectRefuses(t, redirectArgs(t, out))
			switch {
			case !tc.valid:
				t.Errorf("renders, want it refused (the init container: %q)", refused)
			case refused != "":
				t.Errorf("renders, but the init container refuses it: %s", refused)
			}
		})
	}
}

// transparentOut is config.listeners with one transparent listener, out,
// on listen, whose match list is match (JSON).
func transparentOut(listen, match string) string {
	return `config.listeners=[{"name":"out","listen":"` + listen + `","transparent":{"match":` + match + `}}]`
}

// TestRedirectNotCoveredByMatchFailsAtRender: rules that redirect a
// destination the transparent listener's match list does not cover fail
// helm template, naming the CIDR and port left out. Such a connection is
// reset as no_match: with the Pinot broker guide's match list
// ({cidr: 10.0.0.0/8, ports: [8098]}) and redirect.ports empty (the
// values' default, every port), the broker's connections to ZooKeeper, the
// controller or DNS over TCP inside 10.0.0.0/8 would all be cut. Before,
// each of these rendered.
func TestRedirectNotCoveredByMatchFailsAtRender(t *testing.T) {
	guide := []string{"testdata/values-pinot-broker.yaml"}
	for _, tc := range []struct {
		name  string
		files []string
		set   []string
		json  []string
		want  string
	}{
		{name: "every port (redirect.ports empty)", files: guide, set: []string{"redirect.ports=null"},
			want: "redirect.ports is empty, so the rules redirect 10.0.0.0/8 on every port (less redirect.excludePorts), but the match list of transparent listener pinot-servers (127.0.0.1:15001) covers 10.0.0.0/8 on the ports its entries list at most (8098)"},
		{name: "a CIDR beyond the match list", files: guide, set: []string{"redirect.cidrs={10.0.0.0/8,172.16.0.0/12}"},
			want: "redirect.cidrs has 172.16.0.0/12 and the rules redirect port 8098, but the match list of transparent listener pinot-servers (127.0.0.1:15001) does not cover 172.16.0.0/12 on port 8098"},
		{name: "a port beyond the match list", files: guide, set: []string{"redirect.ports={8098,8097}"},
			want: "does not cover 10.0.0.0/8 on port 8097"},
		{name: "entries that cover part of the CIDR", set: []string{"redirect.enabled=true", "redirect.cidrs={10.0.0.0/8}", "redirect.ports={8098}"},
			json: []string{transparentOut("127.0.0.1:15001", `[{"cidr":"10.0.0.0/9","ports":[8098]},{"cidr":"10.192.0.0/10"}]`)},
			want: "the match list of transparent listener out (127.0.0.1:15001) does not cover 10.128.0.0/10 on port 8098"},
		{name: "every port, the entry without ports covering half", set: []string{"redirect.enabled=true", "redirect.cidrs={10.0.0.0/8}"},
			json: []string{transparentOut("127.0.0.1:15001", `[{"cidr":"10.0.0.0/9"},{"cidr":"10.128.0.0/9","ports":[8098]}]`)},
			want: "covers 10.128.0.0/9 on the ports its entries list at most (8098)"},
		{name: "an IPv4 match list for IPv6 rules", set: []string{"redirect.enabled=true", "redirect.cidrs={fd00::/8}", "redirect.ports={8098}"},
			json: []string{transparentOut("[::1]:15001", `[{"cidr":"10.0.0.0/8","ports":[8098]}]`)},
			want: "does not cover fd00::/8 on port 8098"},
		// IPv6 connections go to the [::1] listener: its own match list counts.
		{name: "the IPv6 listener's match list", files: []string{"testdata/values-pools.yaml"},
			json: []string{`config.listeners[3].transparent.match=[{"cidr":"fd00::/9","ports":[8098]}]`},
			want: "the match list of transparent listener out6 ([::1]:15001) does not cover fd80::/9 on port 8098"},
		// A wildcard listener takes both families.
		{name: "a wildcard listener", set: []string{"redirect.enabled=true", "redirect.cidrs={10.0.0.0/8,fd00::/8}", "redirect.ports={8098}"},
			json: []string{transparentOut(":15001", `[{"cidr":"10.0.0.0/8","ports":[8098]}]`)},
			want: "the match list of transparent listener out (:15001) does not cover fd00::/8 on port 8098"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"template", "rel", chartDir, "--namespace", namespace}, valuesArgs(tc.files, tc.set...)...)
			for _, j := range tc.json {
				args = append(args, "--set-json", j)
			}
			_, err := helm(t, args...)
			if err == nil {
				t.Fatalf("renders: the rules redirect destinations that the transparent listener's match list does not cover; each such connection is reset (no_match)")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v\ndoes not contain %q", err, tc.want)
			}
		})
	}
}

// TestRedirectCoveredByMatchRenders: the twin of
// TestRedirectNotCoveredByMatchFailsAtRender. A match list covers the
// rules as the proxy matches (a destination is matched by any one entry
// holding its address and listing its port, or no port), so each of these
// renders, as do the guides, values-full and values-pools (TestTemplate).
func TestRedirectCoveredByMatchRenders(t *testing.T) {
	for _, tc := range []struct {
		name, listen, match string
		set                 []string
	}{
		// The guides' and the values.yaml example's match entry, with the guides' redirect.ports.
		{"the guide's values", "127.0.0.1:15001", `[{"cidr":"10.0.0.0/8","ports":[8098]}]`, []string{"redirect.ports={8098}"}},
		{"a narrower redirect", "127.0.0.1:15001", `[{"cidr":"10.0.0.0/8","ports":[8097,8098]}]`, []string{"redirect.cidrs={10.1.0.0/16,10.2.3.4}", "redirect.ports={8098}"}},
		{"two halves together", "127.0.0.1:15001", `[{"cidr":"10.0.0.0/9","ports":[8098]},{"cidr":"10.128.0.0/9"}]`, []string{"redirect.ports={8098}"}},
		{"each port its own entry", "127.0.0.1:15001", `[{"cidr":"10.0.0.0/8","ports":[8098]},{"cidr":"10.0.0.0/8","ports":[8097]}]`, []string{"redirect.ports={8098,8097}"}},
		{"every port, an entry without ports", "127.0.0.1:15001", `[{"cidr":"10.0.0.0/8","ports":[8098]},{"cidr":"0.0.0.0/0"}]`, nil},
		{"an excluded port is not redirected", "127.0.0.1:15001", `[{"cidr":"10.0.0.0/8","ports":[8098]}]`, []string{"redirect.ports={8098,22}", "redirect.excludePorts={22}"}},
		{"a match cidr with host bits (the proxy masks it)", "127.0.0.1:15001", `[{"cidr":"10.1.2.3/8","ports":[8098]}]`, []string{"redirect.ports={8098}"}},
		{"a wildcard listener, both families", "[::]:15001", `[{"cidr":"10.0.0.0/8","ports":[8098]},{"cidr":"fd00::/8","ports":[8098]}]`, []string{"redirect.cidrs={10.0.0.0/8,fd00::/8}", "redirect.ports={8098}"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"template", "rel", chartDir, "--namespace", namespace, "--set-json", transparentOut(tc.listen, tc.match)},
				valuesArgs(nil, append([]string{"redirect.enabled=true", "redirect.cidrs={10.0.0.0/8}"}, tc.set...)...)...)
			out, err := helm(t, args...)
			if err != nil {
				t.Fatal(err)
			}
			checkConfig(t, decodeStrict(t, out).config(t))
		})
	}
}
