package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"strconv"
	"strings"

	"github.com/livenessproxy/livenessproxy/internal/intercept"
)

const redirectUsage = `usage: livenessproxy redirect --proxy-port PORT --cidr CIDR[,CIDR...] [flags]
       livenessproxy redirect --remove [--dry-run]

Installs (or with --remove deletes) the nftables table inet livenessproxy
that redirects outgoing TCP connections to the proxy. Run it in the pod's
network namespace with CAP_NET_ADMIN (the init container). Idempotent.
`

// cmdRedirect implements "livenessproxy redirect". Exit codes: 0 success,
// 1 the rules could not be installed or removed, 2 bad flags.
func cmdRedirect(args []string, stdout, stderr io.Writer) int {
	var f redirectFlags
	cmd := newCommand("redirect", redirectUsage)
	f.register(cmd.fs)
	if code, ok := cmd.parse(args, stdout, stderr); !ok {
		return code
	}
	if f.remove {
		return removeRedirect(f.dryRun, stdout, stderr)
	}
	cfg, errs := f.config()
	if len(errs) > 0 {
		for _, e := range errs {
			fmt.Fprintln(stderr, "redirect:", e)
		}
		return 2
	}
	return installRedirect(cfg, f.dryRun, stdout, stderr)
}

// redirectFlags are the flags of "livenessproxy redirect" as given;
// config checks them and makes the rules' configuration.
type redirectFlags struct {
	cfg    intercept.Config // the flags stored as given (excluded-set)
	cidrs  listFlag
	ports  listFlag
	excl   listFlag
	port   int
	uid    int64
	mark   uint64
	dryRun bool
	remove bool
}

func (f *redirectFlags) register(fs *flag.FlagSet) {
	fs.IntVar(&f.port, "proxy-port", 0, "local `PORT` the proxy listens on (127.0.0.1 and ::1); required")
	fs.Var(&f.cidrs, "cidr", "destination `CIDR` to intercept, IPv4 or IPv6 (repeatable or comma-separated); required")
	fs.Var(&f.ports, "ports", "intercept only these destination `PORTS` (repeatable or comma-separated; default all)")
	fs.Var(&f.excl, "exclude-ports", "never intercept these destination `PORTS` (repeatable or comma-separated)")
	fs.Int64Var(&f.uid, "proxy-uid", intercept.DefaultProxyUID, "exempt sockets owned by this `UID` (the proxy's); -1 disables")
	fs.Uint64Var(&f.mark, "proxy-mark", 0, "exempt packets carrying this `MARK` (SO_MARK of the proxy's upstream sockets); 0 disables")
	fs.BoolVar(&f.cfg.ExcludedSet, "excluded-set", false, "add the sets excluded4/excluded6 whose destinations are refused with a TCP reset")
	fs.BoolVar(&f.dryRun, "dry-run", false, "print the nft script instead of installing it")
	fs.BoolVar(&f.remove, "remove", false, "delete the table inet livenessproxy")
}

// config checks the flags and returns the rules' configuration, or every
// problem found.
func (f *redirectFlags) config() (intercept.Config, []error) {
	cfg := f.cfg
	var errs []error
	switch {
	case f.port == 0:
		errs = append(errs, errors.New("--proxy-port is required"))
	case f.port < 1 || f.port > 65535:
		errs = append(errs, fmt.Errorf("--proxy-port %d: out of range (1-65535)", f.port))
	default:
		cfg.ProxyPort = uint16(f.port)
	}
	if len(f.cidrs) == 0 {
		errs = append(errs, errors.New("--cidr is required (at least one destination CIDR)"))
	}
	for _, s := range f.cidrs {
		p, err := parseCIDR(s)
		if err != nil {
			errs = append(errs, fmt.Errorf("--cidr %q: %w", s, err))
			continue
		}
		cfg.CIDRs = append(cfg.CIDRs, p)
	}
	var err error
	if cfg.Ports, err = parsePorts("--ports", f.ports); err != nil {
		errs = append(errs, err)
	}
	if cfg.ExcludePorts, err = parsePorts("--exclude-ports", f.excl); err != nil {
		errs = append(errs, err)
	}
	switch {
	case f.uid < -1 || f.uid > 1<<32-2:
		errs = append(errs, fmt.Errorf("--proxy-uid %d: out of range (-1 disables, else 0-%d)", f.uid, uint32(1<<32-2)))
	default:
		cfg.ProxyUID = f.uid
	}
	if f.mark > 1<<32-1 {
		errs = append(errs, fmt.Errorf("--proxy-mark %d: out of range (32 bits)", f.mark))
	} else {
		cfg.ProxyMark = uint32(f.mark)
	}
	if f.uid < 0 && f.mark == 0 {
		errs = append(errs, errors.New("the proxy's own traffic must be exempt: give --proxy-uid or --proxy-mark (or both)"))
	}
	return cfg, errs
}

// removeRedirect deletes the table (or prints the script that would).
func removeRedirect(dryRun bool, stdout, stderr io.Writer) int {
	if dryRun {
		fmt.Fprint(stdout, intercept.RemoveScript())
		return 0
	}
	if err := intercept.Remove(); err != nil {
		fmt.Fprintln(stderr, "redirect:", err)
		return 1
	}
	fmt.Fprintf(stdout, "removed table inet %s\n", intercept.TableName)
	return 0
}

// installRedirect builds the rules of cfg and installs them (or prints
// their script).
func installRedirect(cfg intercept.Config, dryRun bool, stdout, stderr io.Writer) int {
	rs, err := intercept.Build(cfg)
	if err != nil { // Validate repeats the checks of redirectFlags.config; kept as a safety net
		fmt.Fprintln(stderr, "redirect:", err)
		return 2
	}
	if dryRun {
		fmt.Fprint(stdout, rs.Render())
		return 0
	}
	if err := rs.Apply(); err != nil {
		fmt.Fprintln(stderr, "redirect:", err)
		return 1
	}
	fmt.Fprintf(stdout, "installed table inet %s (%d rules) redirecting to port %d\n",
		rs.Table, len(rs.Rules), cfg.ProxyPort)
	return 0
}

// listFlag collects a repeatable, comma-separated flag.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }

func (l *listFlag) Set(s string) error {
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			return fmt.Errorf("empty element in %q", s)
		}
		*l = append(*l, part)
	}
	return nil
}

// parseCIDR accepts a prefix in canonical form, or a bare address (a
// single host).
func parseCIDR(s string) (netip.Prefix, error) {
	if !strings.Contains(s, "/") {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return netip.Prefix{}, errors.New("not a CIDR or an IP address")
		}
		return a.Prefix(a.BitLen())
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, errors.New("not a valid CIDR")
	}
	switch {
	case p.Addr().Is4In6():
		return netip.Prefix{}, errors.New("IPv4-mapped IPv6 prefixes are not supported; use the IPv4 form")
	case p != p.Masked():
		return netip.Prefix{}, fmt.Errorf("host bits set; did you mean %s?", p.Masked())
	}
	return p, nil
}

func parsePorts(name string, l listFlag) ([]uint16, error) {
	var out []uint16
	var errs []error
	for _, s := range l {
		n, err := strconv.ParseInt(s, 10, 64)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s %q: not a port number", name, s))
		case n < 1 || n > 65535:
			errs = append(errs, fmt.Errorf("%s %d: out of range (1-65535)", name, n))
		default:
			out = append(out, uint16(n))
		}
	}
	return out, errors.Join(errs...)
}
