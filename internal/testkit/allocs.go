package testkit

import (
	"math"
	"testing"
)

// allocRounds is how many testing.AllocsPerRun measurements LeastAllocs
// takes the least of.
const allocRounds = 5

// LeastAllocs returns the least of five testing.AllocsPerRun(runs, f)
// measurements: the average number of heap allocations of one call of f.
// AllocsPerRun counts every allocation of the process, so goroutines of
// earlier tests still winding down on a loaded machine add to it, and so
// does a sync.Pool that the race detector makes drop a quarter of what is
// put back, or that a GC empties; all of these only ever add. An
// allocation that f itself makes on every call is in every measurement,
// so the least of them still shows it. f must not call t.Parallel.
func LeastAllocs(runs int, f func()) float64 {
	least := math.Inf(1)
	for range allocRounds {
		least = min(least, testing.AllocsPerRun(runs, f))
	}
	return least
}
