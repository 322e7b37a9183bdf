//go:build unix

package router

import "syscall"

// descriptorLimit is the process's soft RLIMIT_NOFILE now (Go raised it to
// the hard limit at start), or 0 when it cannot be read.
func descriptorLimit() uint64 {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		return 0
	}
	return uint64(l.Cur)
}
