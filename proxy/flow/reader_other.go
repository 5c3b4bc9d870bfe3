//go:build !linux

package flow

// enableInq: TCP_INQ is Linux's; elsewhere every read that returns bytes
// is followed by another, as net.Conn.Read's are.
func enableInq(int) bool { return false }

func readInq(fd int, p []byte, _ bool) (n, queued int, err error) {
	n, err = SysRead(fd, p)
	return n, -1, err
}
