package router

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestRetryBudgetNeverExceededRRETRY2: concurrent retries cannot take more
// from the router-wide budget than it holds (R-RETRY-2: retries must not
// multiply load during an outage). Many goroutines ask at once, many
// times over; the grants never pass the limit.
func TestRetryBudgetNeverExceededRRETRY2(t *testing.T) {
	const trials, askers = 300, 8
	for trial := 0; trial < trials; trial++ {
		b := newRetryBudget(0.5, 10*time.Second, 0)
		for i := 0; i < 10; i++ {
			b.request() // a limit of 5
		}
		var granted atomic.Int64
		var start, done sync.WaitGroup
		start.Add(1)
		for g := 0; g < askers; g++ {
			done.Add(1)
			go func() {
				defer done.Done()
				start.Wait()
				for i := 0; i < 2; i++ {
					if b.allow() {
						granted.Add(1)
					}
				}
			}()
		}
		start.Done()
		done.Wait()
		if n := granted.Load(); n > 5 {
			t.Fatalf("trial %d: %d retries granted from a budget of 5", trial, n)
		}
		if _, retries := b.window(time.Now().UnixNano()); retries != granted.Load() {
			t.Fatalf("trial %d: the window counts %d retries, %d were granted", trial, retries, granted.Load())
		}
	}
	// Asked one at a time, the budget gives exactly its limit.
	b := newRetryBudget(0.5, 10*time.Second, 0)
	for i := 0; i < 10; i++ {
		b.request()
	}
	n := 0
	for i := 0; i < 20; i++ {
		if b.allow() {
			n++
		}
	}
	if n != 5 {
		t.Fatalf("%d retries granted one at a time from a budget of 5", n)
	}
}

// TestRetryBudgetCountsEveryRequestRRETRY2: requests counted while a
// bucket of the window is being renewed are not lost (a lost count lowers
// the limit and denies retries the budget allows).
func TestRetryBudgetCountsEveryRequestRRETRY2(t *testing.T) {
	const trials, counters, each = 1000, 8, 25
	for trial := 0; trial < trials; trial++ {
		b := newRetryBudget(0.2, 10*time.Second, 3) // fresh: every bucket is stale
		var start, done sync.WaitGroup
		start.Add(1)
		for g := 0; g < counters; g++ {
			done.Add(1)
			go func() {
				defer done.Done()
				start.Wait()
				for i := 0; i < each; i++ {
					b.request()
				}
			}()
		}
		start.Done()
		done.Wait()
		if reqs, _ := b.window(time.Now().UnixNano()); reqs != counters*each {
			t.Fatalf("trial %d: %d requests in the window, %d were counted", trial, reqs, counters*each)
		}
	}
}

// TestRetryBudgetWindowSlides: counts leave the budget once their second
// is out of the window, and a renewed bucket starts from zero.
func TestRetryBudgetWindowSlides(t *testing.T) {
	b := newRetryBudget(0.5, 10*time.Second, 1)
	t0 := time.Date(2026, 12, 1, 8, 0, 0, 0, time.UTC).UnixNano()
	sec := int64(time.Second)
	for i := 0; i < 10; i++ {
		b.requestAt(t0)
	}
	for i := 0; i < 5; i++ {
		if !b.allowAt(t0 + 3*sec) {
			t.Fatalf("retry %d of 5 refused", i)
		}
	}
	if b.allowAt(t0 + 3*sec) {
		t.Fatal("a sixth retry from a budget of 5")
	}
	// At t0+10s the requests' second has left the window, the retries'
	// has not: only the floor, already spent.
	if reqs, retries := b.window(t0 + 10*sec); reqs != 0 || retries != 5 {
		t.Fatalf("window at t0+10s: %d requests, %d retries", reqs, retries)
	}
	if b.allowAt(t0 + 10*sec) {
		t.Fatal("a retry beyond the floor once the requests left the window")
	}
	// At t0+13s everything has left; the bucket of t0+3s is renewed by
	// the retry of t0+13s, which the floor allows.
	if !b.allowAt(t0 + 13*sec) {
		t.Fatal("the floor's retry refused in an empty window")
	}
	if reqs, retries := b.window(t0 + 13*sec); reqs != 0 || retries != 1 {
		t.Fatalf("window at t0+13s: %d requests, %d retries", reqs, retries)
	}
}
