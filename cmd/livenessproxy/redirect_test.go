package main

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"github.com/livenessproxy/livenessproxy/internal/intercept"
)

func TestRedirectFlagValidation(t *testing.T) {
	base := []string{"--proxy-port", "15001", "--cidr", "10.0.0.0/8"}
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string // substring of stderr
	}{
		{"no proxy port", []string{"--cidr", "10.0.0.0/8"}, 2, "--proxy-port is required"},
		{"proxy port out of range", []string{"--proxy-port", "70000", "--cidr", "10.0.0.0/8"}, 2, "--proxy-port 70000: out of range"},
		{"negative proxy port", []string{"--proxy-port", "-1", "--cidr", "10.0.0.0/8"}, 2, "out of range"},
		{"no cidr", []string{"--proxy-port", "15001"}, 2, "--cidr is required"},
		{"bad cidr", append(base, "--cidr", "10.0.0.0/33"), 2, `--cidr "10.0.0.0/33": not a valid CIDR`},
		{"garbage cidr", append(base, "--cidr", "pinot-server"), 2, "not a CIDR or an IP address"},
		{"host bits", append(base, "--cidr", "10.1.2.3/16"), 2, "did you mean 10.1.0.0/16?"},
		{"empty list element", append(base, "--cidr", "10.0.0.0/8,,fd00::/8"), 2, "empty element"},
		{"port out of range", append(base, "--ports", "9000,65536"), 2, "--ports 65536: out of range (1-65535)"},
		{"port zero", append(base, "--ports", "0"), 2, "--ports 0: out of range"},
		{"port not a number", append(base, "--ports", "http"), 2, `--ports "http": not a port number`},
		{"exclude port out of range", append(base, "--exclude-ports", "99999"), 2, "--exclude-ports 99999: out of range"},
		{"neither uid nor mark", append(base, "--proxy-uid", "-1"), 2, "give --proxy-uid or --proxy-mark"},
		{"uid out of range", append(base, "--proxy-uid", "-2"), 2, "--proxy-uid -2: out of range"},
		{"mark out of range", append(base, "--proxy-mark", "0x100000000"), 2, "--proxy-mark 4294967296: out of range"},
		{"unknown flag", append(base, "--table", "x"), 2, "flag provided but not defined"},
		{"extra argument", append(base, "now"), 2, `unexpected argument "now"`},
		{"several errors at once", []string{"--ports", "0", "--proxy-uid", "-1"}, 2, "--cidr is required"},
		{"mark only", append(base, "--proxy-uid", "-1", "--proxy-mark", "0x99", "--dry-run"), 0, ""},
		{"ipv6 and bare addresses", append(base, "--cidr", "fd00::/8,192.168.1.7", "--cidr", "fd00::7", "--dry-run"), 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := cmdRedirect(tc.args, &stdout, &stderr)
			if code != tc.code {
				t.Fatalf("exit %d, want %d; stderr:\n%s", code, tc.code, stderr.String())
			}
			if !strings.Contains(stderr.String(), tc.want) {
				t.Fatalf("stderr does not mention %q:\n%s", tc.want, stderr.String())
			}
		})
	}
}

// The dry run prints the same script as intercept's Render (whose golden
// file is internal/intercept/testdata/representative.nft).
func TestRedirectDryRun(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := cmdRedirect([]string{
		"--proxy-port", "15001",
		"--cidr", "10.0.0.0/8,192.168.7.10/32", "--cidr", "fd00:10::/64",
		"--ports", "9000,8098", "--ports", "9000",
		"--exclude-ports", "15020,22",
		"--proxy-mark", "0x99",
		"--excluded-set",
		"--dry-run",
	}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	want, err := readGolden("../../internal/intercept/testdata/representative.nft")
	if err != nil {
		t.Fatal(err)
	}
	if stdout.String() != want {
		t.Fatalf("dry run differs from the golden file:\n%s", stdout.String())
	}

	stdout.Reset()
	if code := cmdRedirect([]string{"--remove", "--dry-run"}, &stdout, &stderr); code != 0 {
		t.Fatalf("--remove --dry-run: exit %d: %s", code, stderr.String())
	}
	if stdout.String() != intercept.RemoveScript() {
		t.Fatalf("--remove --dry-run printed %q", stdout.String())
	}
}

func readGolden(path string) (string, error) {
	b, err := os.ReadFile(path)
	return string(b), err
}
