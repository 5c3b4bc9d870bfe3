package main

import (
	"bytes"
	"fmt"
	"net"
	"strings"
	"testing"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// bindAll binds addrs in order, as run does (listeners and admin servers
// are plain TCP listeners), and reports whether the kernel refused one.
func bindAll(t *testing.T, addrs []string) (refused bool) {
	t.Helper()
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			_ = ln.Close()
		}
	}()
	for _, a := range addrs {
		ln, err := net.Listen("tcp", a)
		if err != nil {
			return true
		}
		lns = append(lns, ln)
	}
	return false
}

// check catches what run would fail on: addresses that clash through a
// wildcard, and a listener on the admin or control address. Each case is
// held to the kernel: its addresses are bound in order, and check fails
// exactly when a bind fails, so a config that passes check binds.
func TestCheckCatchesListenClashes(t *testing.T) {
	if ln, err := net.Listen("tcp", "[::1]:0"); err != nil {
		testutil.SkipOrFail(t, "no IPv6 loopback: %v", err)
	} else {
		_ = ln.Close()
	}
	// A port free on every address: [::]:0 binds one dual-stack.
	wild, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(wild.Addr().String())
	_ = wild.Close()
	p := func(host string) string { return net.JoinHostPort(host, port) }
	for _, tc := range []struct {
		name             string
		admin, control   string
		listens          []string
		clash            bool
		key, mentionsKey string // the key the problem is at, and the other one it names
	}{
		{name: "0.0.0.0 beside 127.0.0.1", listens: []string{p("0.0.0.0"), p("127.0.0.1")}, clash: true, key: "listeners[1].listen", mentionsKey: "listeners[0].listen"},
		{name: "127.0.0.1 beside 0.0.0.0", listens: []string{p("127.0.0.1"), p("0.0.0.0")}, clash: true, key: "listeners[1].listen", mentionsKey: "listeners[0].listen"},
		{name: ":port beside [::1]", listens: []string{":" + port, p("::1")}, clash: true, key: "listeners[1].listen", mentionsKey: "listeners[0].listen"},
		{name: "[::] beside 127.0.0.1", listens: []string{p("::"), p("127.0.0.1")}, clash: true, key: "listeners[1].listen", mentionsKey: "listeners[0].listen"},
		{name: "localhost beside 127.0.0.1", listens: []string{p("localhost"), p("127.0.0.1")}, clash: true, key: "listeners[1].listen", mentionsKey: "(also listeners[0])"},
		// Go opens an IPv6 socket with IPV6_V6ONLY off, even on ::1.
		{name: "0.0.0.0 beside [::1]", listens: []string{p("0.0.0.0"), p("::1")}, clash: true, key: "listeners[1].listen", mentionsKey: "listeners[0].listen"},
		{name: "a listener on admin.listen", admin: p("127.0.0.1"), listens: []string{p("127.0.0.1")}, clash: true, key: "listeners[0].listen", mentionsKey: "admin.listen"},
		{name: "a wildcard listener beside admin.listen", admin: p("127.0.0.1"), listens: []string{p("0.0.0.0")}, clash: true, key: "listeners[0].listen", mentionsKey: "admin.listen"},
		{name: "a listener on admin.control_listen", control: p("127.0.0.1"), listens: []string{":" + port}, clash: true, key: "listeners[0].listen", mentionsKey: "admin.control_listen"},

		// The healthy twins: what the kernel binds side by side.
		{name: "127.0.0.1 beside [::1]", listens: []string{p("127.0.0.1"), p("::1")}},
		{name: "two loopback addresses", listens: []string{p("127.0.0.1"), p("127.0.0.2")}},
		{name: "admin and a listener on two loopback addresses", admin: p("127.0.0.2"), listens: []string{p("127.0.0.1")}},
		{name: "port 0 twice", listens: []string{"127.0.0.1:0", "0.0.0.0:0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var cfg strings.Builder
			fmt.Fprintf(&cfg, "admin: {listen: %q, control_listen: %q}\nlisteners:\n", tc.admin, tc.control)
			binds := []string{}
			for _, a := range []string{tc.admin, tc.control} {
				if a != "" {
					binds = append(binds, a)
				}
			}
			for i, l := range tc.listens {
				fmt.Fprintf(&cfg, "  - {name: l%d, listen: %q, upstream: 127.0.0.1:9}\n", i, l)
				binds = append(binds, l)
			}
			if refused := bindAll(t, binds); refused != tc.clash {
				t.Fatalf("the kernel refused a bind: %v; the case says clash: %v (%q)", refused, tc.clash, binds)
			}
			path := writeConfig(t, cfg.String())
			var out, errb bytes.Buffer
			code := realMain([]string{"check", "--config", path}, &out, &errb)
			if !tc.clash {
				if code != 0 {
					t.Fatalf("check: exit %d, %s", code, errb.String())
				}
				return
			}
			if code != 1 || !strings.Contains(errb.String(), tc.key+": ") || !strings.Contains(errb.String(), tc.mentionsKey) {
				t.Fatalf("check: exit %d, %q; want 1, the problem at %s naming %s", code, errb.String(), tc.key, tc.mentionsKey)
			}
		})
	}
}
