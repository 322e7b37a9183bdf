//go:build unix

package testkit

import (
	"syscall"
	"time"
)

// CPUTime returns the process's user and system CPU time so far
// (getrusage): a benchmark's CPU per operation, unlike its wall time,
// does not grow when other processes share the cores. It returns 0 when
// the time cannot be read, and on platforms where it is not measured.
func CPUTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
