package testkit

import (
	"testing"
	"time"
)

// ReportCPUPerOp reports the process's CPU time since start (a CPUTime
// taken before the benchmark's loop) per operation of b, in nanoseconds,
// as the benchmark's metric cpu-ns/op.
func ReportCPUPerOp(b *testing.B, start time.Duration) {
	b.ReportMetric(float64(CPUTime()-start)/float64(b.N), "cpu-ns/op")
}
