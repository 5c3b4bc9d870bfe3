// Package intercept builds and installs the nftables rules that send a pod's
// outgoing TCP connections to the livenessproxy sidecar (the "redirect" init
// container).
//
// The rules are built as plain data first (Build returns a Ruleset), which
// Render prints as an nft -f script (for --dry-run and golden-file tests) and
// Apply installs through netlink with github.com/google/nftables. Everything
// lives in one table the project owns (inet livenessproxy); Remove deletes
// exactly that table. Apply replaces the table in one transaction, so running
// it twice leaves one set of rules.
//
// With Config.ExcludedSet the table also holds the sets excluded4 and
// excluded6 (address . port); connections to their elements are rejected with
// a TCP reset before the redirect. The running proxy maintains them through
// OpenSet / AddExcluded / RemoveExcluded.
package intercept

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// Names of the objects the project owns.
const (
	TableName = "livenessproxy" // family inet
	ChainName = "output"        // type nat hook output priority -100
	Set4Name  = "excluded4"     // type ipv4_addr . inet_service
	Set6Name  = "excluded6"     // type ipv6_addr . inet_service

	// ChainPriority is the priority of the output nat chain (dstnat).
	ChainPriority = -100
	// DefaultProxyUID is the uid the sidecar runs as by default.
	DefaultProxyUID = 1337
	// NoUID disables the uid exemption in Config.ProxyUID.
	NoUID = -1
)

// ErrUnsupported is returned by everything that programs nftables on
// systems other than Linux.
var ErrUnsupported = errors.New("intercept: nftables needs Linux")

// Config is what the redirect command's flags describe.
type Config struct {
	// ProxyPort is the local port the proxy listens on (127.0.0.1 and ::1).
	ProxyPort uint16
	// CIDRs are the destinations to intercept (IPv4 and/or IPv6).
	CIDRs []netip.Prefix
	// Ports restricts interception to these destination ports (empty: all).
	Ports []uint16
	// ExcludePorts are destination ports never intercepted.
	ExcludePorts []uint16
	// ProxyUID exempts the proxy's own sockets by owner uid; NoUID (or any
	// negative value) disables it.
	ProxyUID int64
	// ProxyMark exempts the proxy's own sockets by SO_MARK; 0 disables it.
	ProxyMark uint32
	// ExcludedSet adds the excluded4/excluded6 sets and their reject rules.
	ExcludedSet bool
}

// Family restricts a rule to one address family.
type Family uint8

// Address families of a Rule.
const (
	AnyFamily Family = 0
	IPv4      Family = 4
	IPv6      Family = 6
)

// Verdict is what a matching rule does.
type Verdict uint8

// Verdicts.
const (
	// Return leaves the chain: the connection goes where it was addressed.
	Return Verdict = iota
	// RejectTCPReset refuses the connection with a TCP reset.
	RejectTCPReset
	// Redirect rewrites the destination to the local ToPort.
	Redirect
)

// Rule is one rule of the output chain. All set match fields must match
// (logical and); the zero value of a field means "not matched".
type Rule struct {
	Comment string
	// Family is the address family the rule applies to; it is implied by
	// DAddr and required with DAddrPortSet.
	Family Family
	// UID matches the socket owner (meta skuid) when non-nil.
	UID *uint32
	// Mark matches the packet mark (meta mark) when non-nil.
	Mark *uint32
	// DAddr matches the destination address prefix when valid.
	DAddr netip.Prefix
	// TCP matches TCP (meta l4proto tcp); implied by DPorts and DAddrPortSet.
	TCP bool
	// DPorts matches the TCP destination port against this list.
	DPorts []uint16
	// DAddrPortSet matches destination address . TCP port against a named
	// set of the table.
	DAddrPortSet string
	Verdict      Verdict
	// ToPort is the redirect target port (Verdict Redirect).
	ToPort uint16
}

// Set is a named set of the table: destination address . TCP port.
type Set struct {
	Name    string
	Family  Family
	Comment string
}

// Ruleset is everything Apply installs: the table, its sets and the rules of
// its output chain, in order.
type Ruleset struct {
	Table string
	Chain string
	Sets  []Set
	Rules []Rule
}

// Validate reports every problem of c, joined.
func (c Config) Validate() error {
	var errs []error
	if c.ProxyPort == 0 {
		errs = append(errs, errors.New("proxy port: required (1-65535)"))
	}
	if len(c.CIDRs) == 0 {
		errs = append(errs, errors.New("cidr: at least one destination CIDR is required"))
	}
	for _, p := range c.CIDRs {
		if err := checkPrefix(p); err != nil {
			errs = append(errs, fmt.Errorf("cidr %s: %w", p, err))
		}
	}
	for _, p := range c.Ports {
		if p == 0 {
			errs = append(errs, errors.New("ports: port 0 is not a valid destination port"))
		}
	}
	for _, p := range c.ExcludePorts {
		if p == 0 {
			errs = append(errs, errors.New("exclude ports: port 0 is not a valid destination port"))
		}
	}
	if c.ProxyUID > 1<<32-2 {
		errs = append(errs, fmt.Errorf("proxy uid %d: out of range", c.ProxyUID))
	}
	if c.ProxyUID < 0 && c.ProxyMark == 0 {
		errs = append(errs, errors.New("the proxy's own traffic must be exempt: set a proxy uid or a proxy mark (or both)"))
	}
	return errors.Join(errs...)
}

func checkPrefix(p netip.Prefix) error {
	switch {
	case !p.IsValid():
		return errors.New("invalid prefix")
	case p.Addr().Is4In6():
		return errors.New("IPv4-mapped IPv6 prefixes are not supported; use the IPv4 form")
	case p.Addr().Zone() != "":
		return errors.New("zones are not supported")
	case p != p.Masked():
		return fmt.Errorf("host bits set; did you mean %s?", p.Masked())
	}
	return nil
}

// Build validates c and returns the rules it describes.
func Build(c Config) (*Ruleset, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	rs := &Ruleset{Table: TableName, Chain: ChainName}
	if c.ProxyUID >= 0 {
		uid := uint32(c.ProxyUID)
		rs.Rules = append(rs.Rules, Rule{
			Comment: "livenessproxy: proxy's own traffic (uid)",
			UID:     &uid,
			Verdict: Return,
		})
	}
	if c.ProxyMark != 0 {
		mark := c.ProxyMark
		rs.Rules = append(rs.Rules, Rule{
			Comment: "livenessproxy: proxy's own traffic (mark)",
			Mark:    &mark,
			Verdict: Return,
		})
	}
	rs.Rules = append(rs.Rules,
		Rule{
			Comment: "livenessproxy: loopback destinations (IPv4)",
			Family:  IPv4,
			DAddr:   netip.MustParsePrefix("127.0.0.0/8"),
			Verdict: Return,
		},
		Rule{
			Comment: "livenessproxy: loopback destinations (IPv6)",
			Family:  IPv6,
			DAddr:   netip.MustParsePrefix("::1/128"),
			Verdict: Return,
		},
	)
	if len(c.ExcludePorts) > 0 {
		rs.Rules = append(rs.Rules, Rule{
			Comment: "livenessproxy: excluded ports",
			TCP:     true,
			DPorts:  sortedUnique(c.ExcludePorts),
			Verdict: Return,
		})
	}
	if c.ExcludedSet {
		rs.Sets = []Set{
			{Name: Set4Name, Family: IPv4, Comment: "livenessproxy: endpoints excluded by the proxy (IPv4)"},
			{Name: Set6Name, Family: IPv6, Comment: "livenessproxy: endpoints excluded by the proxy (IPv6)"},
		}
		for _, s := range rs.Sets {
			rs.Rules = append(rs.Rules, Rule{
				Comment:      "livenessproxy: refuse excluded endpoints (" + s.Name + ")",
				Family:       s.Family,
				TCP:          true,
				DAddrPortSet: s.Name,
				Verdict:      RejectTCPReset,
			})
		}
	}
	ports := sortedUnique(c.Ports)
	for _, p := range c.CIDRs {
		fam := IPv4
		if p.Addr().Is6() {
			fam = IPv6
		}
		rs.Rules = append(rs.Rules, Rule{
			Comment: "livenessproxy: intercept " + p.String(),
			Family:  fam,
			DAddr:   p,
			TCP:     true,
			DPorts:  ports,
			Verdict: Redirect,
			ToPort:  c.ProxyPort,
		})
	}
	return rs, nil
}

func sortedUnique(ports []uint16) []uint16 {
	if len(ports) == 0 {
		return nil
	}
	out := slices.Clone(ports)
	slices.Sort(out)
	return slices.Compact(out)
}

// RemoveScript is the nft -f script equivalent of Remove: it deletes the
// table whether or not it exists.
func RemoveScript() string {
	return fmt.Sprintf("table inet %[1]s\ndelete table inet %[1]s\n", TableName)
}

// Render prints rs as an nft -f script. Like Apply, the script replaces the
// table if it exists (creating an empty one first so that the delete cannot
// fail).
func (rs *Ruleset) Render() string {
	var b strings.Builder
	fmt.Fprintf(&b, "# livenessproxy redirect: apply with nft -f\n")
	fmt.Fprintf(&b, "table inet %s\n", rs.Table)
	fmt.Fprintf(&b, "delete table inet %s\n", rs.Table)
	fmt.Fprintf(&b, "table inet %s {\n", rs.Table)
	for _, s := range rs.Sets {
		fmt.Fprintf(&b, "\tset %s {\n", s.Name)
		fmt.Fprintf(&b, "\t\ttype %s . inet_service\n", addrType(s.Family))
		fmt.Fprintf(&b, "\t\tcomment %q\n", s.Comment)
		fmt.Fprintf(&b, "\t}\n\n")
	}
	fmt.Fprintf(&b, "\tchain %s {\n", rs.Chain)
	fmt.Fprintf(&b, "\t\ttype nat hook output priority %d; policy accept;\n", ChainPriority)
	for _, r := range rs.Rules {
		fmt.Fprintf(&b, "\t\t%s\n", r.String())
	}
	fmt.Fprintf(&b, "\t}\n}\n")
	return b.String()
}

func addrType(f Family) string {
	if f == IPv6 {
		return "ipv6_addr"
	}
	return "ipv4_addr"
}

func ipKeyword(f Family) string {
	if f == IPv6 {
		return "ip6"
	}
	return "ip"
}

// String prints r in nft syntax.
func (r Rule) String() string {
	var parts []string
	if r.UID != nil {
		parts = append(parts, fmt.Sprintf("meta skuid %d", *r.UID))
	}
	if r.Mark != nil {
		parts = append(parts, fmt.Sprintf("meta mark 0x%08x", *r.Mark))
	}
	if r.DAddr.IsValid() {
		parts = append(parts, fmt.Sprintf("%s daddr %s", ipKeyword(r.Family), prefixString(r.DAddr)))
	}
	if r.DAddrPortSet != "" {
		parts = append(parts, fmt.Sprintf("%s daddr . tcp dport @%s", ipKeyword(r.Family), r.DAddrPortSet))
	}
	switch {
	case len(r.DPorts) == 1:
		parts = append(parts, fmt.Sprintf("tcp dport %d", r.DPorts[0]))
	case len(r.DPorts) > 1:
		ps := make([]string, len(r.DPorts))
		for i, p := range r.DPorts {
			ps[i] = fmt.Sprint(p)
		}
		parts = append(parts, "tcp dport { "+strings.Join(ps, ", ")+" }")
	case r.TCP && r.DAddrPortSet == "":
		parts = append(parts, "meta l4proto tcp")
	}
	switch r.Verdict {
	case Return:
		parts = append(parts, "return")
	case RejectTCPReset:
		parts = append(parts, "reject with tcp reset")
	case Redirect:
		parts = append(parts, fmt.Sprintf("redirect to :%d", r.ToPort))
	}
	if r.Comment != "" {
		parts = append(parts, fmt.Sprintf("comment %q", r.Comment))
	}
	return strings.Join(parts, " ")
}

func prefixString(p netip.Prefix) string {
	if p.IsSingleIP() {
		return p.Addr().String()
	}
	return p.String()
}
