//go:build linux

package main

import (
	"bytes"
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/netns"
)

// TestRedirectCommandInstallsAndRemoves runs the verb in a private network
// namespace: it installs the table (twice: idempotent), nft lists the
// expected rules, and --remove deletes it.
func TestRedirectCommandInstallsAndRemoves(t *testing.T) {
	if !netns.Reexec(t, "nft") {
		return
	}
	nft := func(args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, "nft", args...).CombinedOutput()
		return string(out), err
	}
	args := []string{"--proxy-port", "15001", "--cidr", "10.0.0.0/8,fd00::/8", "--ports", "9000", "--excluded-set"}
	for range 2 {
		var stdout, stderr bytes.Buffer
		if code := cmdRedirect(args, &stdout, &stderr); code != 0 {
			t.Fatalf("redirect: exit %d: %s", code, stderr.String())
		}
		t.Logf("redirect: %s", strings.TrimSpace(stdout.String()))
	}
	out, err := nft("list", "ruleset")
	if err != nil {
		t.Fatalf("nft list ruleset: %v\n%s", err, out)
	}
	for _, want := range []string{
		"meta skuid 1337 return",
		"ip daddr 10.0.0.0/8 tcp dport 9000 redirect to :15001",
		"ip6 daddr fd00::/8 tcp dport 9000 redirect to :15001",
		"ip daddr . tcp dport @excluded4 reject with tcp reset",
	} {
		if strings.Count(out, want) != 1 {
			t.Errorf("ruleset has %d copies of %q, want 1:\n%s", strings.Count(out, want), want, out)
		}
	}
	var stdout, stderr bytes.Buffer
	if code := cmdRedirect([]string{"--remove"}, &stdout, &stderr); code != 0 {
		t.Fatalf("redirect --remove: exit %d: %s", code, stderr.String())
	}
	if out, err := nft("list", "ruleset"); err != nil || strings.TrimSpace(out) != "" {
		t.Fatalf("ruleset after --remove (err %v):\n%s", err, out)
	}
}
