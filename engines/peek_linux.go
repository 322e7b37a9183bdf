//go:build linux

package engines

import "syscall"

// peek is the liveness check of an idle connection, run by raw.Read: a
// non-blocking one-byte MSG_PEEK. Alive means nothing to read yet (EAGAIN):
// not closed by the engine (EOF), not reset, and nothing sent unasked.
func (c *engineConn) peek(fd uintptr) bool {
	var b [1]byte
	n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
	c.peekAlive = n <= 0 && (err == syscall.EAGAIN || err == syscall.EWOULDBLOCK)
	return true
}
