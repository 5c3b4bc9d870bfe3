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
