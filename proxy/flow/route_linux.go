package flow

import (
	"encoding/binary"
	"net/netip"
	"syscall"

	"golang.org/x/sys/unix"
)

// RouteTo reports whether this host has a route now for an upstream
// socket's segments to dst with mark (SO_MARK, 0 for none): the lookup
// they make, asked of the kernel (rtnetlink's RTM_GETROUTE, as `ip route
// get ADDR ipproto tcp dport PORT mark MARK`), nothing sent. A policy
// rule by fwmark, protocol or destination port selects for it the table
// it selects for the upstream socket: a datagram to another port, looked
// up instead, finds no route where a rule routes only TCP or only that
// port. No route, or an unreachable, prohibit, blackhole or throw one, is
// none. known is false when it could not look (no descriptor, an address
// with a zone, no answer).
func RouteTo(dst netip.AddrPort, mark int) (route, known bool) {
	a := dst.Addr().Unmap()
	if !a.IsValid() || a.Zone() != "" {
		return false, false
	}
	s, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return false, false
	}
	defer unix.Close(s)
	if unix.Sendto(s, routeRequest(a, dst.Port(), mark), 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}) != nil {
		return false, false
	}
	// The kernel answers within the send: the answer waits already.
	var buf [1024]byte // a route's answer takes about 100 bytes; one cut short does not parse: no answer
	n, _, err := unix.Recvfrom(s, buf[:], unix.MSG_DONTWAIT)
	if err != nil {
		return false, false
	}
	return routeAnswer(buf[:n])
}

// routeRequest is an RTM_GETROUTE request for a TCP segment to a:port
// with mark.
func routeRequest(a netip.Addr, port uint16, mark int) []byte {
	b := make([]byte, unix.SizeofNlMsghdr+unix.SizeofRtMsg, 64)
	ne := binary.NativeEndian
	ne.PutUint16(b[4:], unix.RTM_GETROUTE)
	ne.PutUint16(b[6:], unix.NLM_F_REQUEST)
	ne.PutUint32(b[8:], 1) // sequence
	b[unix.SizeofNlMsghdr], b[unix.SizeofNlMsghdr+1] = unix.AF_INET6, 128
	if a.Is4() {
		b[unix.SizeofNlMsghdr], b[unix.SizeofNlMsghdr+1] = unix.AF_INET, 32
	}
	b = routeAttr(b, unix.RTA_DST, a.AsSlice())
	b = routeAttr(b, unix.RTA_IP_PROTO, []byte{unix.IPPROTO_TCP})
	if port != 0 {
		b = routeAttr(b, unix.RTA_DPORT, binary.BigEndian.AppendUint16(nil, port))
	}
	if mark != 0 {
		b = routeAttr(b, unix.RTA_MARK, ne.AppendUint32(nil, uint32(mark)))
	}
	ne.PutUint32(b[0:], uint32(len(b)))
	return b
}

// routeAttr appends the route attribute typ with value v to b, padded to
// four bytes.
func routeAttr(b []byte, typ uint16, v []byte) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(unix.SizeofRtAttr+len(v)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, v...)
	for len(b)%unix.RTA_ALIGNTO != 0 {
		b = append(b, 0)
	}
	return b
}

// routeAnswer reads the kernel's answer to routeRequest: a route (its
// type says whether it carries segments), or the lookup's error. The
// errors of a lookup that found no route are those a connect gets:
// ENETUNREACH (none), EHOSTUNREACH (an unreachable route), EACCES
// (prohibit), EINVAL (blackhole; a request the kernel could not read
// would give it too: the request is only ever this one, which
// TestRouteToIsTheTCPLookup has it read); any other is no answer.
func routeAnswer(b []byte) (route, known bool) {
	msgs, err := syscall.ParseNetlinkMessage(b)
	if err != nil || len(msgs) == 0 {
		return false, false
	}
	switch m := msgs[0]; m.Header.Type {
	case unix.NLMSG_ERROR:
		if len(m.Data) < 4 {
			return false, false
		}
		switch syscall.Errno(-int32(binary.NativeEndian.Uint32(m.Data))) {
		case unix.ENETUNREACH, unix.EHOSTUNREACH, unix.EINVAL, unix.EACCES:
			return false, true
		}
	case unix.RTM_NEWROUTE:
		if len(m.Data) < unix.SizeofRtMsg {
			return false, false
		}
		switch m.Data[7] { // rtm_type
		case unix.RTN_UNREACHABLE, unix.RTN_PROHIBIT, unix.RTN_BLACKHOLE, unix.RTN_THROW:
			return false, true
		}
		return true, true
	}
	return false, false
}
