//go:build linux

package intercept

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"sync"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"golang.org/x/sys/unix"
)

// Registers as nft uses them: NFT_REG_1 is the 16-byte register that spans
// the 32-bit registers NFT_REG32_00..03; a concatenation puts each field in
// the next 32-bit register.
const (
	reg1 = unix.NFT_REG_1
)

var (
	setKey4 = nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeInetService)
	setKey6 = nftables.MustConcatSetType(nftables.TypeIP6Addr, nftables.TypeInetService)
)

func table(name string) *nftables.Table {
	return &nftables.Table{Name: name, Family: nftables.TableFamilyINet}
}

// Apply installs rs in the calling thread's network namespace, replacing the
// table if it exists, in one netlink transaction: either the whole new
// ruleset is in place afterwards or the old one is untouched.
func (rs *Ruleset) Apply() error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	t := table(rs.Table)
	// Add (no-op if present) then delete: the delete cannot fail with
	// ENOENT, and the table is recreated below in the same batch.
	c.AddTable(t)
	c.DelTable(t)
	c.AddTable(t)

	sets := make(map[string]*nftables.Set, len(rs.Sets))
	for _, s := range rs.Sets {
		ns := &nftables.Set{
			Table:         t,
			Name:          s.Name,
			KeyType:       setKey4,
			Concatenation: true,
			Comment:       s.Comment,
		}
		if s.Family == IPv6 {
			ns.KeyType = setKey6
		}
		if err := c.AddSet(ns, nil); err != nil {
			return fmt.Errorf("nftables: set %s: %w", s.Name, err)
		}
		sets[s.Name] = ns
	}

	accept := nftables.ChainPolicyAccept
	ch := c.AddChain(&nftables.Chain{
		Name:     rs.Chain,
		Table:    t,
		Type:     nftables.ChainTypeNAT,
		Hooknum:  nftables.ChainHookOutput,
		Priority: nftables.ChainPriorityRef(ChainPriority),
		Policy:   &accept,
	})
	for i, r := range rs.Rules {
		exprs, err := ruleExprs(c, t, r, sets)
		if err != nil {
			return fmt.Errorf("nftables: rule %d (%s): %w", i, r.Comment, err)
		}
		c.AddRule(&nftables.Rule{
			Table:    t,
			Chain:    ch,
			Exprs:    exprs,
			UserData: userdata.AppendString(nil, userdata.TypeComment, r.Comment),
		})
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: installing table inet %s: %w", rs.Table, err)
	}
	return nil
}

// Remove deletes the table inet livenessproxy (and with it everything Apply
// created) from the calling thread's network namespace. It succeeds if the
// table does not exist.
func Remove() error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	t := table(TableName)
	c.AddTable(t)
	c.DelTable(t)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: deleting table inet %s: %w", TableName, err)
	}
	return nil
}

// ruleExprs translates r into nftables expressions, the way nft compiles the
// same rule in an inet table: the meta matches, the destination address,
// the address-and-port set, the destination ports, then the verdict.
func ruleExprs(c *nftables.Conn, t *nftables.Table, r Rule, sets map[string]*nftables.Set) ([]expr.Any, error) {
	e := metaExprs(r)
	daddr, err := daddrExprs(r)
	if err != nil {
		return nil, err
	}
	e = append(e, daddr...)
	set, err := setExprs(r, sets)
	if err != nil {
		return nil, err
	}
	e = append(e, set...)
	dports, err := dportExprs(c, t, r)
	if err != nil {
		return nil, err
	}
	e = append(e, dports...)
	verdict, err := verdictExprs(r)
	if err != nil {
		return nil, err
	}
	return append(e, verdict...), nil
}

// metaExprs match r's socket owner, mark, address family and TCP.
func metaExprs(r Rule) []expr.Any {
	var e []expr.Any
	if r.UID != nil {
		e = append(e,
			&expr.Meta{Key: expr.MetaKeySKUID, Register: reg1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: binaryutil.NativeEndian.PutUint32(*r.UID)},
		)
	}
	if r.Mark != nil {
		e = append(e,
			&expr.Meta{Key: expr.MetaKeyMARK, Register: reg1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: binaryutil.NativeEndian.PutUint32(*r.Mark)},
		)
	}
	if r.Family != AnyFamily {
		proto := byte(unix.NFPROTO_IPV4)
		if r.Family == IPv6 {
			proto = unix.NFPROTO_IPV6
		}
		e = append(e,
			&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: reg1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: []byte{proto}},
		)
	}
	if r.TCP || len(r.DPorts) > 0 || r.DAddrPortSet != "" {
		e = append(e,
			&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: reg1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: []byte{unix.IPPROTO_TCP}},
		)
	}
	return e
}

// daddrExprs match r's destination address or prefix, if it has one.
func daddrExprs(r Rule) ([]expr.Any, error) {
	if !r.DAddr.IsValid() {
		return nil, nil
	}
	if r.DAddr.Addr().Is6() != (r.Family == IPv6) {
		return nil, fmt.Errorf("daddr %s does not match the rule's family", r.DAddr)
	}
	off, n := daddrPayload(r.Family)
	e := []expr.Any{&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: n}}
	addr := r.DAddr.Addr().AsSlice()
	if !r.DAddr.IsSingleIP() {
		mask := prefixMask(r.DAddr.Bits(), len(addr))
		e = append(e, &expr.Bitwise{SourceRegister: reg1, DestRegister: reg1, Len: n, Mask: mask, Xor: make([]byte, n)})
	}
	return append(e, &expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: addr}), nil
}

// setExprs look the destination address and port up in r's named set, if
// it has one.
func setExprs(r Rule, sets map[string]*nftables.Set) ([]expr.Any, error) {
	if r.DAddrPortSet == "" {
		return nil, nil
	}
	s, ok := sets[r.DAddrPortSet]
	if !ok {
		return nil, fmt.Errorf("unknown set %q", r.DAddrPortSet)
	}
	if r.Family != IPv4 && r.Family != IPv6 {
		return nil, errors.New("a set lookup needs an address family")
	}
	off, n := daddrPayload(r.Family)
	portReg := uint32(unix.NFT_REG32_00 + n/4) // the 32-bit register after the address
	return []expr.Any{
		&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: n},
		&expr.Payload{DestRegister: portReg, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Lookup{SourceRegister: reg1, SetName: s.Name, SetID: s.ID},
	}, nil
}

// dportExprs match r's destination ports: one by comparison, several by
// lookup in an anonymous set that it adds to c in table t.
func dportExprs(c *nftables.Conn, t *nftables.Table, r Rule) ([]expr.Any, error) {
	switch len(r.DPorts) {
	case 0:
		return nil, nil
	case 1:
		return []expr.Any{
			&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
			&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: binaryutil.BigEndian.PutUint16(r.DPorts[0])},
		}, nil
	}
	anon := &nftables.Set{
		Table:     t,
		Anonymous: true,
		Constant:  true,
		KeyType:   nftables.TypeInetService,
	}
	elems := make([]nftables.SetElement, len(r.DPorts))
	for i, p := range r.DPorts {
		elems[i] = nftables.SetElement{Key: binaryutil.BigEndian.PutUint16(p)}
	}
	if err := c.AddSet(anon, elems); err != nil {
		return nil, fmt.Errorf("port set: %w", err)
	}
	return []expr.Any{
		&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Lookup{SourceRegister: reg1, SetName: anon.Name, SetID: anon.ID},
	}, nil
}

// verdictExprs are r's verdict: return, a TCP reset, or a redirect to
// r.ToPort.
func verdictExprs(r Rule) ([]expr.Any, error) {
	switch r.Verdict {
	case Return:
		return []expr.Any{&expr.Verdict{Kind: expr.VerdictReturn}}, nil
	case RejectTCPReset:
		return []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_TCP_RST}}, nil
	case Redirect:
		if r.ToPort == 0 {
			return nil, errors.New("redirect without a port")
		}
		return []expr.Any{
			&expr.Immediate{Register: reg1, Data: binaryutil.BigEndian.PutUint16(r.ToPort)},
			&expr.Redir{RegisterProtoMin: reg1},
		}, nil
	}
	return nil, fmt.Errorf("unknown verdict %d", r.Verdict)
}

// daddrPayload returns the offset and length of the destination address in
// the network header.
func daddrPayload(f Family) (offset, length uint32) {
	if f == IPv6 {
		return 24, 16
	}
	return 16, 4
}

func prefixMask(bits, size int) []byte {
	m := make([]byte, size)
	for i := range m {
		switch {
		case bits >= 8:
			m[i] = 0xff
			bits -= 8
		case bits > 0:
			m[i] = byte(0xff << (8 - bits))
			bits = 0
		}
	}
	return m
}

// ExcludedSet is a handle on the excluded4/excluded6 sets of the installed
// table, for the running proxy (which needs CAP_NET_ADMIN in the pod's
// network namespace). It is safe for concurrent use.
type ExcludedSet struct {
	mu     sync.Mutex
	c      *nftables.Conn
	s4, s6 *nftables.Set
}

// OpenSet opens the excluded sets of table inet livenessproxy in the calling
// thread's network namespace. It fails if the table or its sets do not exist
// (the rules were installed without --excluded-set). Close releases it.
func OpenSet() (*ExcludedSet, error) {
	c, err := nftables.New(nftables.AsLasting())
	if err != nil {
		return nil, fmt.Errorf("nftables: %w", err)
	}
	t := table(TableName)
	h := &ExcludedSet{c: c}
	for _, name := range []string{Set4Name, Set6Name} {
		s, err := c.GetSetByName(t, name)
		if err != nil {
			_ = c.CloseLasting()
			return nil, fmt.Errorf("nftables: set %s in table inet %s: %w", name, TableName, err)
		}
		s.Table = t
		if name == Set4Name {
			h.s4 = s
		} else {
			h.s6 = s
		}
	}
	return h, nil
}

// Close releases the netlink socket. The set contents stay in place.
func (h *ExcludedSet) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.c.CloseLasting()
}

// AddExcluded makes new connections to ap fail with a TCP reset. Adding an
// element that is already there is not an error.
func (h *ExcludedSet) AddExcluded(ap netip.AddrPort) error {
	return h.update(ap, true)
}

// RemoveExcluded readmits ap. Removing an element that is not there is not
// an error.
func (h *ExcludedSet) RemoveExcluded(ap netip.AddrPort) error {
	return h.update(ap, false)
}

func (h *ExcludedSet) update(ap netip.AddrPort, add bool) error {
	s, key, err := h.element(ap)
	if err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	elems := []nftables.SetElement{{Key: key}}
	if add {
		err = h.c.SetAddElements(s, elems)
	} else {
		err = h.c.SetDeleteElements(s, elems)
	}
	if err == nil {
		err = h.c.Flush()
	}
	if err != nil && !add && errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		verb := "adding"
		if !add {
			verb = "removing"
		}
		return fmt.Errorf("nftables: %s %s in set %s: %w", verb, ap, s.Name, err)
	}
	return nil
}

// Clear empties both sets and returns how many elements they held. The
// proxy clears them as it starts: what an earlier process of the pod put
// there (one that crashed, or was killed, before its shutdown took its
// exclusions out) no process knows of, probes or takes out, and the rules
// would refuse those destinations for the life of the pod.
// The count is what a listing found first; -1 when the listing failed,
// which does not stop the flush.
func (h *ExcludedSet) Clear() (int, error) {
	held, err := h.Excluded()
	n := len(held)
	if err != nil {
		n = -1
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.c.FlushSet(h.s4)
	h.c.FlushSet(h.s6)
	if err := h.c.Flush(); err != nil {
		return 0, fmt.Errorf("nftables: emptying sets %s and %s: %w", h.s4.Name, h.s6.Name, err)
	}
	return n, nil
}

// Excluded lists the elements of both sets.
func (h *ExcludedSet) Excluded() ([]netip.AddrPort, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []netip.AddrPort
	for _, s := range []*nftables.Set{h.s4, h.s6} {
		elems, err := h.c.GetSetElements(s)
		if err != nil {
			return nil, fmt.Errorf("nftables: listing set %s: %w", s.Name, err)
		}
		for _, el := range elems {
			ap, err := decodeKey(el.Key)
			if err != nil {
				return nil, fmt.Errorf("set %s: %w", s.Name, err)
			}
			out = append(out, ap)
		}
	}
	return out, nil
}

// element returns the set for ap's family and ap encoded as its key: the
// address, then the port in network byte order padded to 4 bytes.
func (h *ExcludedSet) element(ap netip.AddrPort) (*nftables.Set, []byte, error) {
	if !ap.IsValid() || ap.Port() == 0 {
		return nil, nil, fmt.Errorf("excluded set: invalid address and port %s", ap)
	}
	addr := ap.Addr().Unmap()
	if addr.Zone() != "" {
		return nil, nil, fmt.Errorf("excluded set: zoned address %s", ap)
	}
	key := addr.AsSlice()
	key = binary.BigEndian.AppendUint16(key, ap.Port())
	key = append(key, 0, 0)
	if addr.Is4() {
		return h.s4, key, nil
	}
	return h.s6, key, nil
}

func decodeKey(k []byte) (netip.AddrPort, error) {
	switch len(k) {
	case 8, 20:
		a, _ := netip.AddrFromSlice(k[:len(k)-4])
		return netip.AddrPortFrom(a, binary.BigEndian.Uint16(k[len(k)-4:])), nil
	}
	return netip.AddrPort{}, fmt.Errorf("unexpected key length %d", len(k))
}
