package policy

import (
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// boundAddr is an address the process binds, for the clash check.
type boundAddr struct {
	key  string // the key path, such as listeners[2].listen
	raw  string // as written
	norm string // canonical host:port (listenCanonical)
}

// listenCanonical returns a normalised listen host:port with its host
// canonical: an IP address in its shortest form, localhost as 127.0.0.1
// (what Go binds for it), a wildcard as written ("" or 0.0.0.0 or ::).
func listenCanonical(norm string) string {
	host, port, _ := net.SplitHostPort(norm)
	if strings.EqualFold(host, "localhost") {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(canonicalHost(host), port)
}

// clashes checks that no two of the addresses the process binds (the
// listeners', admin.listen and a host:port admin.control_listen) take the
// same port on a common address, so that a config `check` passes never
// fails in `run` with "address already in use" for its own settings: the
// same address twice, or a wildcard beside any address on its port
// (sameListen). Port 0 picks a free port and never clashes. Each clash is
// reported once, at the later key.
func (v *validator) clashes(addrs []boundAddr) {
	idx := newBoundIndex()
	for _, b := range addrs {
		if a, ok := idx.firstClash(b); ok {
			switch {
			case a.key == "admin.listen" && b.key == "admin.control_listen":
				v.add(b.key, "%q is the address of admin.listen (%s): the control server needs its own port", b.raw, a.raw)
			case a.norm == b.norm && strings.HasPrefix(a.key, "listeners[") && strings.HasPrefix(b.key, "listeners["):
				v.add(b.key, "duplicate listen address %q (also %s)", b.raw, strings.TrimSuffix(a.key, ".listen"))
			case a.norm == b.norm:
				v.add(b.key, "%q is also %s: each needs its own address", b.raw, a.key)
			default:
				v.add(b.key, "%q clashes with %s %q: a wildcard address takes the port on every address it covers, so run would fail with \"address already in use\"", b.raw, a.key, a.raw)
			}
		}
		idx.add(b)
	}
}

// boundIndex finds, among the bound addresses added to it, the first that
// sameListen pairs with a given one, in constant time (a config of many
// listeners is checked in linear time).
type boundIndex struct {
	n      int
	exact  map[string]indexed // by canonical host:port
	wild   map[string]indexed // the first wildcard, by port
	byPort map[string]indexed // the first of any host, by port
}

type indexed struct {
	boundAddr
	i int
}

func newBoundIndex() *boundIndex {
	return &boundIndex{exact: map[string]indexed{}, wild: map[string]indexed{}, byPort: map[string]indexed{}}
}

func isWildcardHost(h string) bool { return h == "" || h == "::" || h == "0.0.0.0" }

func (x *boundIndex) add(b boundAddr) {
	h, port, _ := net.SplitHostPort(b.norm)
	e := indexed{b, x.n}
	x.n++
	if _, ok := x.exact[b.norm]; !ok {
		x.exact[b.norm] = e
	}
	if _, ok := x.byPort[port]; !ok {
		x.byPort[port] = e
	}
	if _, ok := x.wild[port]; !ok && isWildcardHost(h) {
		x.wild[port] = e
	}
}

// firstClash is the first address added that b clashes with (sameListen).
func (x *boundIndex) firstClash(b boundAddr) (boundAddr, bool) {
	h, port, _ := net.SplitHostPort(b.norm)
	if port == "0" {
		return boundAddr{}, false
	}
	var cands []indexed
	if isWildcardHost(h) {
		if e, ok := x.byPort[port]; ok {
			cands = append(cands, e)
		}
	} else {
		if e, ok := x.exact[b.norm]; ok {
			cands = append(cands, e)
		}
		if e, ok := x.wild[port]; ok {
			cands = append(cands, e)
		}
	}
	if len(cands) == 0 {
		return boundAddr{}, false
	}
	best := cands[0]
	for _, c := range cands[1:] {
		if c.i < best.i {
			best = c
		}
	}
	return best.boundAddr, true
}

// boundAddrs lists the addresses c binds that are valid host:ports (the
// others are reported by their own checks): admin.listen, a host:port
// admin.control_listen, then each listener's listen.
func boundAddrs(c *Config) []boundAddr {
	var out []boundAddr
	add := func(key, raw string) {
		if raw == "" {
			return
		}
		if norm, why := hostPort(raw, false); why == "" {
			out = append(out, boundAddr{key: key, raw: raw, norm: listenCanonical(norm)})
		}
	}
	add("admin.listen", c.Admin.Listen)
	if !strings.HasPrefix(c.Admin.ControlListen, "unix:") {
		add("admin.control_listen", c.Admin.ControlListen)
	}
	for i, l := range c.Listeners {
		add("listeners["+strconv.Itoa(i)+"].listen", l.Listen)
	}
	return out
}

// selfTargets checks that no listener dials an address the process itself
// binds: its upstream, a literal pool entry or an ingress's local server
// that is one of the listeners' (or the admin servers') addresses, which
// is a loop (each link dials the proxy, which accepts another link, which
// dials again, until max_links or the descriptors run out, and every
// listener waits). A target is the proxy's when a bound address has its
// port and its host, or is a wildcard and the target's host is a loopback
// or unspecified address. (A name, or an address of this host's other
// interfaces, cannot be told from a remote one here.)
func (v *validator) selfTargets(c *Config, bound []boundAddr) {
	idx := newBoundIndex()
	for _, b := range bound {
		idx.add(b)
	}
	check := func(key, raw string) {
		norm, why := endpoint(raw)
		if why != "" {
			return // reported by its own check
		}
		target := listenCanonical(norm)
		th, tp, _ := net.SplitHostPort(target)
		ta, err := netip.ParseAddr(th)
		if err != nil || tp == "0" {
			return // a name
		}
		b, ok := idx.exact[target]
		if w, wok := idx.wild[tp]; wok && (ta.IsLoopback() || ta.IsUnspecified()) && (!ok || w.i < b.i) {
			b, ok = w, true
		}
		if ok {
			v.add(key, "%q is %s (%q): the proxy would dial itself, a loop that takes every link the process may hold", raw, b.key, b.raw)
		}
	}
	for i, l := range c.Listeners {
		p := "listeners[" + strconv.Itoa(i) + "]."
		switch {
		case l.Upstream != "":
			check(p+"upstream", l.Upstream)
		case l.Ingress.Local != "":
			check(p+"ingress.local", l.Ingress.Local)
		}
		for j, ep := range l.Pool.Endpoints {
			check(p+"pool.endpoints["+strconv.Itoa(j)+"]", ep)
		}
	}
}
