// Package dnstest runs a small authoritative DNS server on loopback for
// tests, with answers the test changes at will, and hands out a
// *net.Resolver (Go's own resolver) that asks only that server.
//
// It exists for code that re-resolves a name on an interval and follows the
// answer as it changes, such as a Kubernetes headless Service (one A/AAAA
// record per ready pod):
//
//	dns := dnstest.Start(t)
//	dns.Set("kafka-headless.data.svc", netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("fd00::1"))
//	r := dns.Resolver()
//	addrs, err := r.LookupNetIP(ctx, "ip", "kafka-headless.data.svc")
//
// Only tests import this package (it imports testing and
// github.com/miekg/dns).
//
// # What the server answers
//
// The server knows a set of names, each with zero or more addresses. For a
// query of class IN:
//   - a known name gets NOERROR with its A records (for type A) or AAAA
//     records (for type AAAA), TTL 1 second; other types, and a name with no
//     address of the asked family, get NOERROR with an empty answer;
//   - an unknown name gets NXDOMAIN;
//   - while SetFailing(true) is in effect, every query gets SERVFAIL.
//
// Every response has the AA bit set (Go's resolver treats an empty
// NOERROR answer without AA or RA as a lame referral and moves on). UDP
// responses that do not fit the client's advertised EDNS0 buffer (512 bytes
// without EDNS0) are truncated with the TC bit set, so that a large record
// set (more than about 70 A records) makes Go's resolver retry over TCP, on
// the same port.
//
// # Go's resolver, as seen through Resolver
//
//   - Names are looked up in /etc/hosts first (nsswitch "files dns"), so a
//     name listed there (localhost, the host name) never reaches the server.
//   - A name that is not rooted and has fewer dots than ndots
//     (/etc/resolv.conf, 1 by default, 5 in Kubernetes pods) is first tried
//     with each search domain appended, then as is. Those suffixed queries
//     also reach this server (Resolver's Dial ignores the nameserver
//     address), get NXDOMAIN unless the test Set the suffixed name, and
//     count in Queries. A name with at least ndots dots is tried as is
//     first. Tests should therefore not expect an exact Queries count unless
//     they look up a rooted name ("name.").
//   - Go's resolver does not cache: a change made with Set or Remove is seen
//     by the next lookup. Concurrent identical lookups on one Resolver are
//     merged (singleflight), however.
//   - LookupNetIP and LookupHost sort the addresses (RFC 6724), so the
//     order given to Set is not preserved; compare sets.
//   - NXDOMAIN and an empty NOERROR answer both give a *net.DNSError with
//     IsNotFound set. SERVFAIL gives a *net.DNSError with IsTemporary set
//     (after the resolver retried every nameserver line "attempts" times).
//   - Error messages name the nameserver from /etc/resolv.conf that Go
//     thinks it asked ("lookup x on 10.96.0.10:53: no such host"), not
//     this server.
//   - With the default (non-strict) errors, "ip" lookups return the records
//     of one family even if the query for the other family failed.
package dnstest

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// TTL is the TTL of every record the server returns.
const TTL = 1 * time.Second

// shutdownTimeout bounds how long Cleanup waits for the servers to stop.
const shutdownTimeout = 10 * time.Second

// Server is an authoritative DNS server on 127.0.0.1 that answers A and AAAA
// queries for the names it was given, over UDP and TCP on one port. Unknown
// names get NXDOMAIN. Answers carry a TTL of 1 second (TTL).
//
// Its methods may be called from any goroutine.
type Server struct {
	addr string

	udp, tcp *dns.Server
	wg       sync.WaitGroup // the two ActivateAndServe goroutines
	exited   chan error     // their results

	mu      sync.Mutex
	names   map[string][]netip.Addr // canonical FQDN -> addresses; present = exists
	failing bool

	queries atomic.Int64
}

// Start starts a Server listening on 127.0.0.1:0, UDP and TCP on the same
// port. It must be called from the test goroutine (it calls t.Fatal on
// failure). t.Cleanup stops the server and waits for all its goroutines,
// including those serving in-flight queries.
func Start(t testing.TB) *Server {
	t.Helper()
	pc, ln, err := listenBoth()
	if err != nil {
		t.Fatalf("dnstest: %v", err)
	}
	s := &Server{
		addr:   ln.Addr().String(),
		names:  make(map[string][]netip.Addr),
		exited: make(chan error, 2),
	}
	ready := make(chan struct{}, 2)
	notify := func() { ready <- struct{}{} }
	s.udp = &dns.Server{
		PacketConn:        pc,
		Handler:           dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) { s.serve(w, r, false) }),
		NotifyStartedFunc: notify,
	}
	s.tcp = &dns.Server{
		Listener:          ln,
		Handler:           dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) { s.serve(w, r, true) }),
		NotifyStartedFunc: notify,
	}
	for _, srv := range []*dns.Server{s.udp, s.tcp} {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.exited <- srv.ActivateAndServe()
		}()
	}
	for range 2 {
		select {
		case <-ready:
		case err := <-s.exited:
			// One server could not start. Closing the sockets makes the
			// other one (started or not) return.
			_ = pc.Close()
			_ = ln.Close()
			s.wg.Wait()
			t.Fatalf("dnstest: starting the server: %v", err)
		}
	}
	t.Cleanup(func() { s.stop(t) })
	return s
}

// listenBoth listens on TCP 127.0.0.1:0 and on UDP on the same port,
// retrying with another port if the UDP one is taken.
func listenBoth() (net.PacketConn, net.Listener, error) {
	var lastErr error
	for range 20 {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			return nil, nil, fmt.Errorf("listening on TCP: %w", err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		pc, err := net.ListenPacket("udp4", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err == nil {
			return pc, ln, nil
		}
		_ = ln.Close()
		lastErr = err
	}
	return nil, nil, fmt.Errorf("no port free for both TCP and UDP on 127.0.0.1: %w", lastErr)
}

// stop shuts both servers down and waits for their goroutines.
func (s *Server) stop(t testing.TB) {
	ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer cancel()
	if err := s.udp.ShutdownContext(ctx); err != nil {
		t.Errorf("dnstest: shutting down the UDP server: %v", err)
	}
	if err := s.tcp.ShutdownContext(ctx); err != nil {
		t.Errorf("dnstest: shutting down the TCP server: %v", err)
	}
	s.wg.Wait()
	for range 2 {
		if err := <-s.exited; err != nil {
			t.Errorf("dnstest: server stopped with an error: %v", err)
		}
	}
}

// Addr returns the host:port the server listens on (UDP and TCP).
func (s *Server) Addr() string { return s.addr }

// canonical returns name as a lower-case FQDN, or panics if it is not a
// valid domain name.
func canonical(name string) string {
	if name == "" {
		panic("dnstest: empty name")
	}
	if _, ok := dns.IsDomainName(name); !ok {
		panic(fmt.Sprintf("dnstest: invalid domain name %q", name))
	}
	return dns.CanonicalName(name)
}

// Set replaces the records of name with addrs (an IPv4 address gives an A
// record, any other an AAAA record; the order is kept in the answer). name
// may be fully qualified or not and is case-insensitive. With no addrs the
// name exists without records: queries get NOERROR with an empty answer.
// Set panics on an invalid name or an invalid or zoned address.
func (s *Server) Set(name string, addrs ...netip.Addr) {
	fqdn := canonical(name)
	for _, a := range addrs {
		if !a.IsValid() || a.Zone() != "" {
			panic(fmt.Sprintf("dnstest: Set(%q): address %v cannot be served", name, a))
		}
	}
	recs := append(make([]netip.Addr, 0, len(addrs)), addrs...)
	s.mu.Lock()
	s.names[fqdn] = recs
	s.mu.Unlock()
}

// Remove makes name unknown: queries for it get NXDOMAIN. Removing a name
// that does not exist is a no-op.
func (s *Server) Remove(name string) {
	fqdn := canonical(name)
	s.mu.Lock()
	delete(s.names, fqdn)
	s.mu.Unlock()
}

// SetFailing makes every query get SERVFAIL while failing is true (a broken
// DNS server); the records are kept and served again once it is false.
func (s *Server) SetFailing(failing bool) {
	s.mu.Lock()
	s.failing = failing
	s.mu.Unlock()
}

// Queries returns the number of queries answered so far, over UDP and TCP,
// whatever the answer (including NXDOMAIN for search-suffixed names and
// SERVFAIL). A query is counted before its response is sent, so a lookup
// that has returned is always counted.
func (s *Server) Queries() int64 { return s.queries.Load() }

// Resolver returns a Go resolver (PreferGo) that sends every query to this
// server, whatever nameserver /etc/resolv.conf names, over UDP and, for
// truncated answers, TCP. The search domains, ndots, timeout and attempts
// of /etc/resolv.conf still apply (see the package documentation).
func (s *Server) Resolver() *net.Resolver {
	addr := s.addr
	return &net.Resolver{
		PreferGo: true,
		Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		},
	}
}

// serve answers one query.
func (s *Server) serve(w dns.ResponseWriter, req *dns.Msg, tcp bool) {
	m := new(dns.Msg)
	m.SetReply(req)
	m.Authoritative = true

	s.mu.Lock()
	failing := s.failing
	var (
		addrs []netip.Addr
		known bool
	)
	if len(req.Question) == 1 { // always: dns.DefaultMsgAcceptFunc rejects others
		addrs, known = s.names[dns.CanonicalName(req.Question[0].Name)]
	}
	s.mu.Unlock()

	switch {
	case failing:
		m.Rcode = dns.RcodeServerFailure
	case len(req.Question) != 1:
		m.Rcode = dns.RcodeFormatError
	case req.Question[0].Qclass != dns.ClassINET:
		m.Rcode = dns.RcodeRefused
	case !known:
		m.Rcode = dns.RcodeNameError
	default:
		m.Answer = answer(req.Question[0], addrs)
	}

	size := dns.MaxMsgSize
	if opt := req.IsEdns0(); opt != nil {
		m.SetEdns0(opt.UDPSize(), false)
		if !tcp {
			size = int(opt.UDPSize()) // Truncate treats < 512 as 512
		}
	} else if !tcp {
		size = dns.MinMsgSize
	}
	m.Truncate(size)

	s.queries.Add(1)
	_ = w.WriteMsg(m) // the client may have gone; nothing to do about it
}

// answer returns the records of addrs that match q's type.
func answer(q dns.Question, addrs []netip.Addr) []dns.RR {
	var rrs []dns.RR
	hdr := dns.RR_Header{Name: q.Name, Class: dns.ClassINET, Ttl: uint32(TTL / time.Second)}
	for _, a := range addrs {
		switch {
		case q.Qtype == dns.TypeA && a.Is4():
			h := hdr
			h.Rrtype = dns.TypeA
			rrs = append(rrs, &dns.A{Hdr: h, A: a.AsSlice()})
		case q.Qtype == dns.TypeAAAA && !a.Is4():
			h := hdr
			h.Rrtype = dns.TypeAAAA
			rrs = append(rrs, &dns.AAAA{Hdr: h, AAAA: a.AsSlice()})
		}
	}
	return rrs
}
