package bench

import (
	"os"
	"strconv"
	"syscall"
	"time"
)

// ProcessCPU returns the CPU time (user + system, all threads) the process
// pid has used so far, from utime and stime of /proc/<pid>/stat, in
// clock-tick resolution (10 ms at USER_HZ 100). It fails when the file
// cannot be read or parsed (for example when the process is gone).
func ProcessCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	return parseStatCPU(b)
}

// selfCPU returns this process's CPU time (user + system) from
// getrusage(RUSAGE_SELF), in microsecond resolution.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// ProcessRSS returns the resident memory of process pid (VmRSS of
// /proc/<pid>/status), in bytes. It fails when the file cannot be read or
// has no VmRSS line.
func ProcessRSS(pid int) (int64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, err
	}
	return parseStatusRSS(b)
}
