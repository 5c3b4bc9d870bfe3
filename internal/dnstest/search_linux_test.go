//go:build linux

package dnstest_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/dnstest"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// searchChildEnv marks the child process TestSearchDomains re-executes into.
const searchChildEnv = "LIVENESSPROXY_DNSTEST_SEARCH_CHILD"

// podResolvConf is what a Kubernetes pod in namespace "data" gets (ndots:5,
// three search domains), with two nameservers that do not exist: Resolver's
// Dial must ignore them.
const podResolvConf = `# dnstest TestSearchDomains, bind-mounted in a private mount namespace
nameserver 192.0.2.53
nameserver 192.0.2.54
search data.svc.cluster.local svc.cluster.local cluster.local
options ndots:5
`

// TestSearchDomains checks Resolver against a Kubernetes pod's resolv.conf:
// the test re-executes itself in a new user and mount namespace and
// bind-mounts podResolvConf over /etc/resolv.conf there (the host's file is
// untouched).
func TestSearchDomains(t *testing.T) {
	if os.Getenv(searchChildEnv) == "" {
		runInMountNamespace(t)
		return
	}
	useResolvConf(t, podResolvConf)

	s := dnstest.Start(t)
	r := s.Resolver()
	v4, v6 := netip.MustParseAddr("10.3.0.1"), netip.MustParseAddr("fd03::1")
	s.Set("kafka-headless.data.svc", v4, v6)
	s.Set("pinot-server-0.pinot-server-headless", v4)
	// What "kafka" resolves to inside namespace "data" (first search domain).
	s.Set("kafka.data.svc.cluster.local", v6)

	for _, c := range []struct {
		host    string
		want    []netip.Addr // nil: IsNotFound
		queries int64        // for network "ip": names tried x 2 (A, AAAA)
	}{
		// 2 dots < ndots: the 3 suffixed names (NXDOMAIN), then the name.
		{"kafka-headless.data.svc", []netip.Addr{v4, v6}, 8},
		{"pinot-server-0.pinot-server-headless", []netip.Addr{v4}, 8},
		// The first suffixed name answers: the name as is is not tried.
		{"kafka", []netip.Addr{v6}, 2},
		// Rooted: only the name itself.
		{"kafka-headless.data.svc.", []netip.Addr{v4, v6}, 2},
		// Unknown: every name tried, all NXDOMAIN.
		{"gone.data.svc", nil, 8},
		{"gone", nil, 8},
		// 5 dots >= ndots: the name as is first, then the suffixed ones.
		{"a.b.c.d.e.f", nil, 8},
	} {
		before := s.Queries()
		start := time.Now()
		got, err := lookupNetIP(t, r, "ip", c.host)
		elapsed := time.Since(start)
		n := s.Queries() - before
		t.Logf("LookupNetIP(ip, %q) = %v, %v: %d queries in %v", c.host, got, err, n, elapsed)
		switch {
		case c.want == nil && !isNotFound(err):
			t.Errorf("LookupNetIP(%q) = %v, %v; want IsNotFound", c.host, got, err)
		case c.want != nil && err != nil:
			t.Errorf("LookupNetIP(%q): %v", c.host, err)
		case c.want != nil && !equalSets(got, c.want):
			t.Errorf("LookupNetIP(%q) = %v; want %v", c.host, got, c.want)
		}
		if n != c.queries {
			t.Errorf("LookupNetIP(%q) made %d queries; want %d", c.host, n, c.queries)
		}
		if elapsed > time.Second {
			t.Errorf("LookupNetIP(%q) took %v", c.host, elapsed)
		}
	}
	wantAddrs(t, r, "kafka-headless.data.svc", v4, v6)

	// SERVFAIL: each of the 4 names x 2 types is retried on both
	// nameserver lines, twice (attempts:2), all answered by this server.
	s.SetFailing(true)
	before := s.Queries()
	got, err := lookupNetIP(t, r, "ip", "kafka-headless.data.svc")
	var de *net.DNSError
	if !errors.As(err, &de) || de.IsNotFound || !de.IsTemporary {
		t.Errorf("LookupNetIP while failing = %v, %#v; want a temporary DNSError", got, err)
	}
	n := s.Queries() - before
	t.Logf("while failing: %v after %d queries", err, n)
	if n != 32 {
		t.Errorf("LookupNetIP while failing made %d queries; want 32", n)
	}
	s.SetFailing(false)
	wantAddrs(t, r, "kafka-headless.data.svc", v4, v6)
}

func equalSets(a, b []netip.Addr) bool {
	return slices.Equal(sorted(a), sorted(b))
}

// useResolvConf bind-mounts a file holding content over /etc/resolv.conf.
// It runs in the child only, whose mount namespace is private.
func useResolvConf(t *testing.T, content string) {
	t.Helper()
	// A mount namespace owned by a new user namespace already gets slave
	// copies of shared mounts; make sure nothing propagates back anyway.
	if err := syscall.Mount("", "/", "", syscall.MS_REC|syscall.MS_PRIVATE, ""); err != nil {
		testutil.SkipOrFail(t, "making / private in the child mount namespace: %v", err)
	}
	file := filepath.Join(t.TempDir(), "resolv.conf")
	if err := os.WriteFile(file, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount(file, "/etc/resolv.conf", "", syscall.MS_BIND, ""); err != nil {
		testutil.SkipOrFail(t, "bind-mounting over /etc/resolv.conf: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount("/etc/resolv.conf", 0) })
	got, err := os.ReadFile("/etc/resolv.conf")
	if err != nil || string(got) != content {
		t.Fatalf("/etc/resolv.conf after the bind mount: %q, %v", got, err)
	}
}

// runInMountNamespace re-executes the test binary, running only t, in a new
// user and mount namespace, and reports the child's verdict as t's.
func runInMountNamespace(t *testing.T) {
	t.Helper()
	timeout := 2 * time.Minute
	if d, ok := t.Deadline(); ok && time.Until(d)*8/10 < timeout {
		timeout = time.Until(d) * 8 / 10
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "/proc/self/exe",
		"-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1",
		"-test.timeout="+(timeout*9/10).String())
	cmd.Env = append(os.Environ(), searchChildEnv+"=1")
	if g := os.Getenv("GORACE"); !strings.Contains(g, "atexit_sleep_ms") {
		cmd.Env = append(cmd.Env, strings.TrimSpace("GORACE="+g+" atexit_sleep_ms=0"))
	}
	if testing.Short() {
		cmd.Args = append(cmd.Args, "-test.short")
	}
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	cmd.WaitDelay = 5 * time.Second
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER | syscall.CLONE_NEWNS,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}},
		Pdeathsig:   syscall.SIGKILL,
	}
	if err := cmd.Start(); err != nil {
		testutil.SkipOrFail(t, "cannot create a user and mount namespace (%v); "+
			"unprivileged user namespaces may be disabled", err)
	}
	err := cmd.Wait()
	for line := range strings.Lines(out.String()) {
		t.Log("child| " + strings.TrimRight(line, "\n"))
	}
	switch {
	case strings.Contains(out.String(), "--- SKIP: "+t.Name()):
		t.Skip("skipped in the child (see its output)")
	case err != nil:
		t.Fatalf("child: %v", err)
	case !strings.Contains(out.String(), "--- PASS: "+t.Name()):
		t.Fatal("child did not run the test")
	}
}
