//go:build !linux

package bench

import (
	"errors"
	"time"
)

// ProcessCPU reads a process's CPU time from /proc/<pid>/stat, which only
// Linux has: elsewhere it always fails.
func ProcessCPU(pid int) (time.Duration, error) {
	return 0, errors.New("process CPU time needs Linux /proc")
}

// selfCPU is unknown outside Linux: 0.
func selfCPU() time.Duration { return 0 }

// ProcessRSS reads a process's resident memory from /proc, which only
// Linux has: elsewhere it always fails.
func ProcessRSS(pid int) (int64, error) {
	return 0, errors.New("process RSS needs Linux /proc")
}
