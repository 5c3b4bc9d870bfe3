//go:build linux

package flow

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// enableInq turns on TCP_INQ: each recvmsg then says how many bytes are
// left in the receive queue (1 when none but a FIN is).
func enableInq(fd int) bool {
	return setsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_INQ, 1) == nil
}

// readInq reads fd into p. With inq (TCP_INQ on) it uses recvmsg and
// returns how much the kernel left queued after the read (bytes, or 1
// for a FIN); otherwise, or when the kernel did not say, queued is -1.
// Nothing escapes to the heap: the message header lives on the stack.
func readInq(fd int, p []byte, inq bool) (n, queued int, err error) {
	if !inq {
		n, err = SysRead(fd, p)
		return n, -1, err
	}
	var oob [unix.SizeofCmsghdr + 8]byte // CMSG_SPACE(sizeof(int))
	iov := unix.Iovec{Base: &p[0]}
	iov.SetLen(len(p))
	msg := unix.Msghdr{Iov: &iov, Iovlen: 1, Control: &oob[0]}
	msg.SetControllen(len(oob))
	// Raw, as SysRead is (see there).
	r, _, e := unix.RawSyscall(unix.SYS_RECVMSG, uintptr(fd), uintptr(unsafe.Pointer(&msg)), 0)
	if e != 0 {
		return 0, -1, e
	}
	raceAcquireIO()
	raceWrote(p[:r])
	n, queued = int(r), -1
	if int(msg.Controllen) >= unix.SizeofCmsghdr+4 {
		h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
		if h.Level == unix.IPPROTO_TCP && h.Type == unix.TCP_CM_INQ {
			queued = int(*(*int32)(unsafe.Pointer(&oob[unix.SizeofCmsghdr])))
		}
	}
	return n, queued, nil
}
