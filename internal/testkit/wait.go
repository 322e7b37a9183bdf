package testkit

import (
	"testing"
	"time"
)

// PollEvery is the interval at which WaitFor checks its condition.
const PollEvery = 5 * time.Millisecond

// WaitFor checks cond every PollEvery until it returns true; when within
// (a time.Duration) passes first, it fails the test with "timed out after
// <within> waiting for <what>". cond runs on the test's goroutine, so it
// may call t.Fatal itself; WaitFor must not be called from another
// goroutine.
func WaitFor(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	WaitEvery(t, within, PollEvery, what, cond)
}

// WaitEvery is WaitFor with its own interval between checks, for
// conditions that cost something to check (a scrape of another process's
// /metrics).
func WaitEvery(t testing.TB, within, every time.Duration, what string, cond func() bool) {
	t.Helper()
	if !Poll(within, every, cond) {
		t.Fatalf("timed out after %v waiting for %s", within, what)
	}
}

// Poll checks cond every `every` until it returns true, and reports
// whether it did before within (a time.Duration) passed; the check that
// finds within passed is the last. It fails nothing, so that the caller
// can say what it saw instead, or go on, and it may run on any
// goroutine (then cond must not fail the test).
func Poll(within, every time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(every)
	}
	return true
}
