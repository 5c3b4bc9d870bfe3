package admin

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// unixPeer names a Unix socket's peer by its credentials (SO_PEERCRED).
func unixPeer(c *net.UnixConn) string {
	raw, err := c.SyscallConn()
	if err != nil {
		return "unix"
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil || cerr != nil {
		return "unix"
	}
	return fmt.Sprintf("unix:pid=%d,uid=%d,gid=%d", cred.Pid, cred.Uid, cred.Gid)
}
