package dnstest_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"go.uber.org/goleak"

	"github.com/livenessproxy/livenessproxy/internal/dnstest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// quick bounds every lookup: Go's resolver waits 5s (resolv.conf "timeout")
// for an answer that does not come, so a lookup slower than this means the
// server failed to answer some query.
const quick = 2 * time.Second

var (
	v4a = netip.MustParseAddr("10.1.0.1")
	v4b = netip.MustParseAddr("10.1.0.2")
	v4c = netip.MustParseAddr("10.1.0.3")
	v6a = netip.MustParseAddr("fd00::1")
	v6b = netip.MustParseAddr("fd00::2")
)

// lookupNetIP runs r.LookupNetIP and fails the test if it took more than
// quick.
func lookupNetIP(t *testing.T, r *net.Resolver, network, host string) ([]netip.Addr, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	start := time.Now()
	addrs, err := r.LookupNetIP(ctx, network, host)
	if d := time.Since(start); d > quick {
		t.Errorf("LookupNetIP(%q, %q) took %v", network, host, d)
	}
	return addrs, err
}

// lookupHost runs r.LookupHost and fails the test if it took more than
// quick.
func lookupHost(t *testing.T, r *net.Resolver, host string) ([]string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	start := time.Now()
	addrs, err := r.LookupHost(ctx, host)
	if d := time.Since(start); d > quick {
		t.Errorf("LookupHost(%q) took %v", host, d)
	}
	return addrs, err
}

// sorted returns a sorted copy of addrs: Go's resolver reorders addresses
// (RFC 6724), so answers are compared as sets.
func sorted(addrs []netip.Addr) []netip.Addr {
	out := slices.Clone(addrs)
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

func strs(addrs []netip.Addr) []string {
	out := make([]string, len(addrs))
	for i, a := range sorted(addrs) {
		out[i] = a.String()
	}
	slices.Sort(out)
	return out
}

// wantAddrs checks both LookupNetIP (ip, ip4, ip6) and LookupHost against
// want.
func wantAddrs(t *testing.T, r *net.Resolver, host string, want ...netip.Addr) {
	t.Helper()
	var want4, want6 []netip.Addr
	for _, a := range want {
		if a.Is4() {
			want4 = append(want4, a)
		} else {
			want6 = append(want6, a)
		}
	}
	for _, c := range []struct {
		network string
		want    []netip.Addr
	}{{"ip", want}, {"ip4", want4}, {"ip6", want6}} {
		got, err := lookupNetIP(t, r, c.network, host)
		if len(c.want) == 0 {
			if !isNotFound(err) {
				t.Errorf("LookupNetIP(%q, %q) = %v, %v; want a not-found error", c.network, host, got, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("LookupNetIP(%q, %q): %v", c.network, host, err)
			continue
		}
		if !slices.Equal(sorted(got), sorted(c.want)) {
			t.Errorf("LookupNetIP(%q, %q) = %v; want %v (any order)", c.network, host, got, c.want)
		}
	}
	got, err := lookupHost(t, r, host)
	if err != nil {
		t.Errorf("LookupHost(%q): %v", host, err)
		return
	}
	slices.Sort(got)
	if !slices.Equal(got, strs(want)) {
		t.Errorf("LookupHost(%q) = %v; want %v (any order)", host, got, strs(want))
	}
}

func isNotFound(err error) bool {
	var de *net.DNSError
	return errors.As(err, &de) && de.IsNotFound
}

// exchange sends one query for name/qtype straight to s over network (udp
// or tcp), with EDNS0 if edns.
func exchange(t *testing.T, s *dnstest.Server, network, name string, qtype uint16, edns bool) *dns.Msg {
	t.Helper()
	m := new(dns.Msg)
	m.SetQuestion(name, qtype)
	m.RecursionDesired = true
	if edns {
		m.SetEdns0(1232, false)
	}
	c := &dns.Client{Net: network, Timeout: 5 * time.Second}
	resp, _, err := c.Exchange(m, s.Addr())
	if err != nil {
		t.Fatalf("%s query %s %s: %v", network, name, dns.TypeToString[qtype], err)
	}
	return resp
}

func TestStartAddr(t *testing.T) {
	s := dnstest.Start(t)
	ap, err := netip.ParseAddrPort(s.Addr())
	if err != nil {
		t.Fatalf("Addr() = %q: %v", s.Addr(), err)
	}
	if ap.Addr() != netip.MustParseAddr("127.0.0.1") || ap.Port() == 0 {
		t.Errorf("Addr() = %q; want 127.0.0.1:<port>", s.Addr())
	}
	if n := s.Queries(); n != 0 {
		t.Errorf("Queries() = %d before any query", n)
	}
}

// TestLookup covers dotted and dotless names, mixed IPv4/IPv6 records,
// IPv4-only and IPv6-only names, FQDN and case normalisation.
func TestLookup(t *testing.T) {
	s := dnstest.Start(t)
	r := s.Resolver()
	s.Set("kafka-headless.data.svc", v4a, v6a, v4b, v6b)
	s.Set("pinot-server-0.pinot-server-headless.", v4c)
	s.Set("Controller", v6b)
	s.Set("MIXED.Case.example.", v4a, v6a)

	for _, c := range []struct {
		host string
		want []netip.Addr
	}{
		{"kafka-headless.data.svc", []netip.Addr{v4a, v4b, v6a, v6b}},
		{"kafka-headless.data.svc.", []netip.Addr{v4a, v4b, v6a, v6b}},
		{"pinot-server-0.pinot-server-headless", []netip.Addr{v4c}},
		{"pinot-server-0.pinot-server-headless.", []netip.Addr{v4c}},
		{"controller", []netip.Addr{v6b}},
		{"CONTROLLER", []netip.Addr{v6b}},
		{"mixed.case.example", []netip.Addr{v4a, v6a}},
		{"Mixed.CASE.Example.", []netip.Addr{v4a, v6a}},
	} {
		t.Run(c.host, func(t *testing.T) { wantAddrs(t, r, c.host, c.want...) })
	}
}

// TestAnswerFormat checks the raw answers: TTL 1, AA, only the asked family,
// over UDP with and without EDNS0.
func TestAnswerFormat(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("kafka-headless.data.svc", v4a, v6a, v4b)
	for _, edns := range []bool{false, true} {
		for _, c := range []struct {
			qtype uint16
			want  []netip.Addr
		}{{dns.TypeA, []netip.Addr{v4a, v4b}}, {dns.TypeAAAA, []netip.Addr{v6a}}, {dns.TypeMX, nil}} {
			resp := exchange(t, s, "udp", "Kafka-Headless.Data.Svc.", c.qtype, edns)
			if resp.Rcode != dns.RcodeSuccess || !resp.Authoritative || resp.Truncated {
				t.Errorf("%s (edns %v): rcode %s, aa %v, tc %v; want NOERROR, aa, !tc",
					dns.TypeToString[c.qtype], edns, dns.RcodeToString[resp.Rcode], resp.Authoritative, resp.Truncated)
			}
			if got := resp.IsEdns0() != nil; got != edns {
				t.Errorf("%s: response has OPT %v; query had OPT %v", dns.TypeToString[c.qtype], got, edns)
			}
			var got []netip.Addr
			for _, rr := range resp.Answer {
				if rr.Header().Ttl != 1 {
					t.Errorf("%s: TTL %d; want 1", rr, rr.Header().Ttl)
				}
				switch rr := rr.(type) {
				case *dns.A:
					a, _ := netip.AddrFromSlice(rr.A)
					got = append(got, a.Unmap())
				case *dns.AAAA:
					a, _ := netip.AddrFromSlice(rr.AAAA)
					got = append(got, a)
				default:
					t.Errorf("unexpected record %s", rr)
				}
			}
			if !slices.Equal(got, c.want) {
				t.Errorf("%s: answer %v; want %v (in Set order)", dns.TypeToString[c.qtype], got, c.want)
			}
		}
	}
}

// TestSetReplaces checks that a second Set replaces the answer and that the
// very next lookup sees it (no caching anywhere).
func TestSetReplaces(t *testing.T) {
	s := dnstest.Start(t)
	r := s.Resolver()
	const host = "pinot-server-0.pinot-server-headless"
	s.Set(host, v4a, v6a)
	wantAddrs(t, r, host, v4a, v6a)
	s.Set(host, v4b)
	wantAddrs(t, r, host, v4b)
	s.Set(host+".", v6b, v4c) // same name, written as an FQDN
	wantAddrs(t, r, host, v4c, v6b)

	// Flip quickly: every lookup sees the latest Set, well within the 1s
	// TTL.
	for i := range 20 {
		a := netip.AddrFrom4([4]byte{10, 9, 0, byte(i)})
		s.Set(host, a)
		got, err := lookupNetIP(t, r, "ip", host)
		if err != nil || len(got) != 1 || got[0] != a {
			t.Fatalf("lookup %d right after Set(%v) = %v, %v", i, a, got, err)
		}
	}
}

// TestSetNoAddrs: a name set without addresses exists (NOERROR, empty
// answer, AA), which Go's resolver reports as not found.
func TestSetNoAddrs(t *testing.T) {
	s := dnstest.Start(t)
	r := s.Resolver()
	const host = "kafka-headless.data.svc"
	s.Set(host)
	for _, qtype := range []uint16{dns.TypeA, dns.TypeAAAA} {
		for _, network := range []string{"udp", "tcp"} {
			resp := exchange(t, s, network, host+".", qtype, true)
			if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 0 || !resp.Authoritative {
				t.Errorf("%s %s: rcode %s, %d answers, aa %v; want NOERROR, none, aa",
					network, dns.TypeToString[qtype], dns.RcodeToString[resp.Rcode], len(resp.Answer), resp.Authoritative)
			}
		}
	}
	for _, network := range []string{"ip", "ip4", "ip6"} {
		got, err := lookupNetIP(t, r, network, host)
		if !isNotFound(err) {
			t.Errorf("LookupNetIP(%q) = %v, %v; want IsNotFound", network, got, err)
		}
	}
	if got, err := lookupHost(t, r, host); !isNotFound(err) {
		t.Errorf("LookupHost = %v, %v; want IsNotFound", got, err)
	}

	// A name with only IPv4 records: the AAAA query is NOERROR/empty.
	s.Set(host, v4a)
	resp := exchange(t, s, "udp", host+".", dns.TypeAAAA, true)
	if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 0 {
		t.Errorf("AAAA for an IPv4-only name: rcode %s, %d answers; want NOERROR, none",
			dns.RcodeToString[resp.Rcode], len(resp.Answer))
	}
	wantAddrs(t, r, host, v4a)
}

// TestRemove: a removed (or never set) name gets NXDOMAIN, IsNotFound.
func TestRemove(t *testing.T) {
	s := dnstest.Start(t)
	r := s.Resolver()
	const host = "kafka-headless.data.svc"
	s.Set(host, v4a, v6a)
	wantAddrs(t, r, host, v4a, v6a)
	s.Remove("KAFKA-headless.data.svc.")
	s.Remove("never-set") // no-op

	for _, name := range []string{host, "never-set", "never.set.either"} {
		for _, network := range []string{"udp", "tcp"} {
			resp := exchange(t, s, network, dns.Fqdn(name), dns.TypeA, false)
			if resp.Rcode != dns.RcodeNameError {
				t.Errorf("%s %s: rcode %s; want NXDOMAIN", network, name, dns.RcodeToString[resp.Rcode])
			}
		}
		for _, network := range []string{"ip", "ip4", "ip6"} {
			got, err := lookupNetIP(t, r, network, name)
			if !isNotFound(err) {
				t.Errorf("LookupNetIP(%q, %q) = %v, %v; want IsNotFound", network, name, got, err)
			}
		}
		if got, err := lookupHost(t, r, name); !isNotFound(err) {
			t.Errorf("LookupHost(%q) = %v, %v; want IsNotFound", name, got, err)
		}
	}

	s.Set(host, v4b)
	wantAddrs(t, r, host, v4b)
}

// TestSetFailing: SERVFAIL for everything, surfacing as a temporary error
// that is not "not found"; the records come back afterwards.
func TestSetFailing(t *testing.T) {
	s := dnstest.Start(t)
	r := s.Resolver()
	const host = "pinot-server-0.pinot-server-headless"
	s.Set(host, v4a, v6a)
	wantAddrs(t, r, host, v4a, v6a)

	s.SetFailing(true)
	for _, name := range []string{host, "unknown.name"} {
		for _, network := range []string{"udp", "tcp"} {
			resp := exchange(t, s, network, dns.Fqdn(name), dns.TypeA, true)
			if resp.Rcode != dns.RcodeServerFailure || len(resp.Answer) != 0 {
				t.Errorf("%s %s while failing: rcode %s, %d answers; want SERVFAIL, none",
					network, name, dns.RcodeToString[resp.Rcode], len(resp.Answer))
			}
		}
		for _, network := range []string{"ip", "ip4", "ip6"} {
			got, err := lookupNetIP(t, r, network, name)
			var de *net.DNSError
			if !errors.As(err, &de) || de.IsNotFound || !de.IsTemporary {
				t.Errorf("LookupNetIP(%q, %q) while failing = %v, %#v; want a temporary, not not-found, DNSError",
					network, name, got, err)
			}
		}
		got, err := lookupHost(t, r, name)
		if err == nil || isNotFound(err) {
			t.Errorf("LookupHost(%q) while failing = %v, %v; want an error other than not found", name, got, err)
		}
	}
	s.Set(host, v4b) // changes made while failing are served afterwards

	s.SetFailing(false)
	wantAddrs(t, r, host, v4b)
}

// TestTCP queries over TCP directly, with and without EDNS0.
func TestTCP(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("kafka-headless.data.svc", v4a, v6a)
	for _, edns := range []bool{false, true} {
		resp := exchange(t, s, "tcp", "kafka-headless.data.svc.", dns.TypeA, edns)
		if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
			t.Fatalf("TCP A: rcode %s, answer %v", dns.RcodeToString[resp.Rcode], resp.Answer)
		}
		if a, ok := resp.Answer[0].(*dns.A); !ok || !a.A.Equal(v4a.AsSlice()) || a.Hdr.Ttl != 1 {
			t.Errorf("TCP A answer %v; want %v TTL 1", resp.Answer[0], v4a)
		}
		resp = exchange(t, s, "tcp", "kafka-headless.data.svc.", dns.TypeAAAA, edns)
		if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
			t.Fatalf("TCP AAAA: rcode %s, answer %v", dns.RcodeToString[resp.Rcode], resp.Answer)
		}
		if a, ok := resp.Answer[0].(*dns.AAAA); !ok || !a.AAAA.Equal(v6a.AsSlice()) {
			t.Errorf("TCP AAAA answer %v; want %v", resp.Answer[0], v6a)
		}
	}

	// Several queries on one TCP connection.
	c := &dns.Client{Net: "tcp", Timeout: 5 * time.Second}
	conn, err := c.Dial(s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for i := range 3 {
		m := new(dns.Msg)
		m.SetQuestion("kafka-headless.data.svc.", dns.TypeA)
		resp, _, err := c.ExchangeWithConn(m, conn)
		if err != nil || resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
			t.Fatalf("query %d on a shared TCP connection: %v, %v", i, resp, err)
		}
	}
}

// TestTruncationFallsBackToTCP: a record set too large for UDP is truncated
// (TC) and Go's resolver gets the whole set over TCP.
func TestTruncationFallsBackToTCP(t *testing.T) {
	s := dnstest.Start(t)
	r := s.Resolver()
	const host = "big-headless.data.svc"
	var want []netip.Addr
	for i := range 300 {
		want = append(want, netip.AddrFrom4([4]byte{10, 2, byte(i >> 8), byte(i)}))
	}
	for i := range 50 {
		want = append(want, netip.AddrFrom16([16]byte{0: 0xfd, 15: byte(i)}))
	}
	s.Set(host, want...)

	for _, edns := range []bool{false, true} {
		resp := exchange(t, s, "udp", host+".", dns.TypeA, edns)
		if !resp.Truncated || len(resp.Answer) == 0 || len(resp.Answer) >= 300 {
			t.Errorf("UDP (edns %v): tc %v, %d answers; want tc and a partial answer", edns, resp.Truncated, len(resp.Answer))
		}
		resp.Compress = true // as sent; Len is the uncompressed size otherwise
		if l := resp.Len(); edns && l > 1232 || !edns && l > 512 {
			t.Errorf("UDP (edns %v) response is %d bytes", edns, l)
		}
	}
	resp := exchange(t, s, "tcp", host+".", dns.TypeA, true)
	if resp.Truncated || len(resp.Answer) != 300 {
		t.Errorf("TCP: tc %v, %d answers; want all 300", resp.Truncated, len(resp.Answer))
	}
	wantAddrs(t, r, host, want...)

	// A and AAAA each: a truncated UDP answer, then the full one over TCP.
	before := s.Queries()
	got, err := lookupNetIP(t, r, "ip", host+".")
	if err != nil || len(got) != len(want) {
		t.Fatalf("LookupNetIP = %d addresses, %v; want %d", len(got), err, len(want))
	}
	if n := s.Queries() - before; n != 4 {
		t.Errorf("lookup of a rooted name with truncated A and AAAA answers made %d queries; want 4 (UDP then TCP, twice)", n)
	}
}

// TestQueries counts queries: a rooted name costs exactly one query per
// address family (no search domains are tried for it).
func TestQueries(t *testing.T) {
	s := dnstest.Start(t)
	r := s.Resolver()
	s.Set("kafka-headless.data.svc", v4a, v6a)
	for i, c := range []struct {
		network string
		host    string
		want    int64
	}{
		{"ip", "kafka-headless.data.svc.", 2},
		{"ip4", "kafka-headless.data.svc.", 1},
		{"ip6", "kafka-headless.data.svc.", 1},
		{"ip", "unknown.data.svc.", 2},
	} {
		before := s.Queries()
		_, _ = lookupNetIP(t, r, c.network, c.host)
		if got := s.Queries() - before; got != c.want {
			t.Errorf("%d: LookupNetIP(%q, %q) made %d queries; want %d", i, c.network, c.host, got, c.want)
		}
	}
	before := s.Queries()
	exchange(t, s, "tcp", "kafka-headless.data.svc.", dns.TypeA, false)
	if got := s.Queries() - before; got != 1 {
		t.Errorf("one TCP query counted %d times", got)
	}
}

// TestSearchSuffixedNames: the names Go's resolver builds from search domains
// get NXDOMAIN unless set, so an unsuffixed name still resolves.
func TestSearchSuffixedNames(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("kafka-headless.data.svc", v4a)
	for _, suffixed := range []string{
		"kafka-headless.data.svc.data.svc.cluster.local.",
		"kafka-headless.data.svc.svc.cluster.local.",
		"kafka-headless.data.svc.cluster.local.",
		"kafka-headless.data.svc.example.com.",
	} {
		for _, qtype := range []uint16{dns.TypeA, dns.TypeAAAA} {
			if resp := exchange(t, s, "udp", suffixed, qtype, true); resp.Rcode != dns.RcodeNameError {
				t.Errorf("%s %s: rcode %s; want NXDOMAIN", suffixed, dns.TypeToString[qtype], dns.RcodeToString[resp.Rcode])
			}
		}
	}
	// Only the exact name answers: no suffix or prefix matching.
	for _, other := range []string{"data.svc.", "svc.", "x.kafka-headless.data.svc."} {
		if resp := exchange(t, s, "udp", other, dns.TypeA, true); resp.Rcode != dns.RcodeNameError {
			t.Errorf("%s: rcode %s; want NXDOMAIN", other, dns.RcodeToString[resp.Rcode])
		}
	}
}

// TestConcurrent changes the records while lookups run (for the race
// detector) and checks every answer is one of the sets that were Set.
func TestConcurrent(t *testing.T) {
	s := dnstest.Start(t)
	r := s.Resolver()
	const host = "kafka-headless.data.svc"
	setA, setB := []netip.Addr{v4a, v6a}, []netip.Addr{v4b, v4c, v6b}
	s.Set(host, setA...)

	var writer, readers sync.WaitGroup
	stop := make(chan struct{})
	writer.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if i%2 == 0 {
				s.Set(host, setB...)
			} else {
				s.Set(host, setA...)
			}
			time.Sleep(time.Millisecond)
		}
	})
	errs := make(chan error, 4)
	for range 4 {
		readers.Go(func() {
			for range 25 {
				got, err := r.LookupNetIP(t.Context(), "ip", host)
				if err != nil {
					errs <- err
					return
				}
				// A and AAAA are separate queries, so one lookup may see the
				// IPv4 records of one Set and the IPv6 records of the other.
				for _, a := range got {
					if !slices.Contains(setA, a) && !slices.Contains(setB, a) {
						errs <- fmt.Errorf("unexpected address %v in %v", a, got)
						return
					}
				}
			}
		})
	}
	readers.Wait()
	close(stop)
	writer.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestSetPanics(t *testing.T) {
	s := dnstest.Start(t)
	for _, c := range []struct {
		name string
		f    func()
	}{
		{"empty name", func() { s.Set("", v4a) }},
		{"invalid name", func() { s.Set("a..b", v4a) }},
		{"zero addr", func() { s.Set("a.b", netip.Addr{}) }},
		{"zoned addr", func() { s.Set("a.b", netip.MustParseAddr("fe80::1%eth0")) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Error("no panic")
				}
			}()
			c.f()
		})
	}
}

// TestStopWithOpenTCPConnection: the cleanup stops the server promptly even
// with an idle client TCP connection open (the server closes it).
func TestStopWithOpenTCPConnection(t *testing.T) {
	var (
		conn      *dns.Conn
		stopStart time.Time
	)
	// Registered before Start, so it runs after the server's cleanup.
	t.Cleanup(func() {
		if conn == nil { // the test failed before dialing
			return
		}
		if d := time.Since(stopStart); d > time.Second {
			t.Errorf("stopping the server took %v", d)
		}
		_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := conn.ReadMsg(); err == nil {
			t.Error("the connection is still open after the server stopped")
		}
		_ = conn.Close()
	})
	s := dnstest.Start(t)
	s.Set("kafka-headless.data.svc", v4a)
	c := &dns.Client{Net: "tcp", Timeout: 5 * time.Second}
	var err error
	if conn, err = c.Dial(s.Addr()); err != nil {
		t.Fatal(err)
	}
	m := new(dns.Msg)
	m.SetQuestion("kafka-headless.data.svc.", dns.TypeA)
	if resp, _, err := c.ExchangeWithConn(m, conn); err != nil || len(resp.Answer) != 1 {
		t.Fatalf("query: %v, %v", resp, err)
	}
	t.Cleanup(func() { stopStart = time.Now() }) // runs just before the server's cleanup
}
