// Package testkit is the test machinery every package of the module
// shares: a bounded poll (WaitFor), the goroutine-leak check (CheckLeaks),
// readers of Prometheus series, from a registry or from a /metrics page
// served over HTTP, and a certificate authority made in the test (CA) for
// real TLS.
//
// It imports no package of the module, so that every package's tests,
// the simulator's own included, can use it. Starting a simulator lives
// beside the simulator, in engines/sim/simtest.
package testkit
