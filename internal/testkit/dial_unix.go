//go:build unix

package testkit

import (
	"net"
	"syscall"
)

// DialSmallWindow connects over TCP to addr with a 4 KiB receive buffer
// (Linux reserves 8 KiB), set before the connection is made so that the
// TCP window the peer sees stays small: a client that then stops reading
// fills it, and the socket buffers behind it, within a few kilobytes — the
// slow reader of behaviour.md R-TMO-6. It returns the dial's error.
func DialSmallWindow(addr string) (net.Conn, error) {
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
		}); err != nil {
			return err
		}
		return serr
	}}
	return d.Dial("tcp", addr)
}
