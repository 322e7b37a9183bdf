// Package testkit is the test machinery every package of the module
// shares: a bounded poll (WaitFor, and Poll, which fails nothing), the
// goroutine-leak check (CheckLeaks) and the goroutines it ignores by
// design (NATSLongLived, FasthttpLongLived), a buffer safe to read while
// another goroutine writes it (LockedBuffer), a benchmark's CPU time per
// operation (CPUTime, ReportCPUPerOp), readers of Prometheus
// series, from a registry or from a /metrics page served over HTTP, a
// certificate authority made in the test (CA) for real TLS, and a client
// connection with a small TCP window (DialSmallWindow) for slow readers.
//
// It imports no package of the module, so that every package's tests,
// the simulator's own included, can use it. Starting a simulator lives
// beside the simulator, in engines/sim/simtest, and starting an embedded
// bus beside the bus, in bus/bustest.
package testkit
