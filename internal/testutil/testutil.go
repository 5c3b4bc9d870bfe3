// Package testutil holds small helpers shared by the livenessproxy tests.
//
// Its main job is to decide what a test does when the machine lacks a
// capability it needs (a binary, user namespaces, ...): skip locally, but
// fail in CI, where LIVENESSPROXY_REQUIRE_ALL=1 is set so that a missing
// capability cannot silently turn a fault-injection suite into a no-op.
package testutil

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// RequireAllEnv is the environment variable that turns SkipOrFail skips into
// failures when set to "1".
const RequireAllEnv = "LIVENESSPROXY_REQUIRE_ALL"

// RequireAll reports whether RequireAllEnv is set to "1", i.e. whether a
// missing capability must fail the test instead of skipping it.
func RequireAll() bool { return os.Getenv(RequireAllEnv) == "1" }

// SkipOrFail skips the test with the formatted reason, or fails it with
// t.Fatalf when RequireAll() is true. Like t.Skipf and t.Fatalf it does not
// return: it must be called from the goroutine running the test.
func SkipOrFail(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if RequireAll() {
		t.Fatalf("%s (failing instead of skipping because %s=1)", msg, RequireAllEnv)
	}
	t.Skip(msg)
}

// sbinDirs are searched after $PATH: unprivileged users (and setpriv'd test
// binaries) often have a PATH without the sbin directories where ip and nft
// live.
var sbinDirs = []string{"/usr/sbin", "/sbin", "/usr/local/sbin"}

// LookCommand returns the absolute path of the executable name, searching
// $PATH first and then the usual sbin directories.
func LookCommand(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, dir := range sbinDirs {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: %w (searched $PATH and %v)", name, exec.ErrNotFound, sbinDirs)
}

// RequireCommand returns the path of the executable name (see LookCommand),
// or calls SkipOrFail when it is not installed.
func RequireCommand(t testing.TB, name string) string {
	t.Helper()
	p, err := LookCommand(name)
	if err != nil {
		if errors.Is(err, exec.ErrNotFound) {
			SkipOrFail(t, "required command %q is not installed: %v", name, err)
		}
		SkipOrFail(t, "required command %q is unusable: %v", name, err)
	}
	return p
}
