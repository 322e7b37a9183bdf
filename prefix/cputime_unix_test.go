//go:build unix

package prefix

import (
	"syscall"
	"time"
)

// cpuTime returns the process's user and system CPU time: a benchmark's
// CPU per operation, unlike its wall time, does not grow when other
// processes share the cores.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
