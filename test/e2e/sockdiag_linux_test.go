package e2e

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// establishedAt returns the established IPv4 TCP connections whose local
// port is port, as local and remote addresses (/proc/net/tcp: read once,
// it may be long on a busy machine).
func establishedAt(t *testing.T, port int) (conns [][2]netip.AddrPort) {
	t.Helper()
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n")[1:] {
		fs := strings.Fields(line)
		if len(fs) < 4 || fs[3] != "01" {
			continue
		}
		local, remote := procAddr(t, fs[1]), procAddr(t, fs[2])
		if int(local.Port()) == port {
			conns = append(conns, [2]netip.AddrPort{local, remote})
		}
	}
	return conns
}

// procAddr parses /proc/net/tcp's IPv4 address form (hex, the address in
// host byte order).
func procAddr(t *testing.T, s string) netip.AddrPort {
	t.Helper()
	a, p, _ := strings.Cut(s, ":")
	ip, err1 := strconv.ParseUint(a, 16, 32)
	port, err2 := strconv.ParseUint(p, 16, 16)
	if err1 != nil || err2 != nil {
		t.Fatalf("/proc/net/tcp address %q", s)
	}
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], uint32(ip))
	return netip.AddrPortFrom(netip.AddrFrom4(b), uint16(port))
}

// unreadIn returns the bytes waiting unread in the established TCP socket
// local -> remote (IPv4), by the kernel's inet_diag lookup of that one
// socket (no dump of every socket on the host).
func unreadIn(t *testing.T, local, remote netip.AddrPort) int {
	t.Helper()
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_INET_DIAG)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	req := make([]byte, unix.SizeofNlMsghdr+56) // nlmsghdr, inet_diag_req_v2
	binary.NativeEndian.PutUint32(req[0:], uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:], unix.SOCK_DIAG_BY_FAMILY)
	binary.NativeEndian.PutUint16(req[6:], unix.NLM_F_REQUEST)
	r := req[unix.SizeofNlMsghdr:]
	r[0], r[1] = unix.AF_INET, unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(r[4:], 1<<1) // TCP_ESTABLISHED
	id := r[8:]                                // inet_diag_sockid
	binary.BigEndian.PutUint16(id[0:], local.Port())
	binary.BigEndian.PutUint16(id[2:], remote.Port())
	l4, r4 := local.Addr().As4(), remote.Addr().As4()
	copy(id[4:], l4[:])
	copy(id[20:], r4[:])
	binary.NativeEndian.PutUint32(id[40:], ^uint32(0)) // INET_DIAG_NOCOOKIE
	binary.NativeEndian.PutUint32(id[44:], ^uint32(0))
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		t.Fatal(err)
	}
	if n < unix.SizeofNlMsghdr+72 || binary.NativeEndian.Uint16(buf[4:]) != unix.SOCK_DIAG_BY_FAMILY {
		t.Fatalf("inet_diag of %v -> %v: %s", local, remote, diagErr(buf[:n]))
	}
	msg := buf[unix.SizeofNlMsghdr:] // inet_diag_msg: 4 bytes, sockid (48), expires, rqueue
	return int(binary.NativeEndian.Uint32(msg[56:]))
}

// diagErr describes an answer that is no inet_diag_msg.
func diagErr(b []byte) string {
	if len(b) >= unix.SizeofNlMsghdr+4 && binary.NativeEndian.Uint16(b[4:]) == unix.NLMSG_ERROR {
		return unix.Errno(-int32(binary.NativeEndian.Uint32(b[unix.SizeofNlMsghdr:]))).Error()
	}
	return fmt.Sprintf("an answer of %d bytes", len(b))
}
