package router

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/narwhalmesh/narwhal/engines"
)

// retryPolicy decides whether a request whose attempt failed gets another
// attempt (R-RETRY-1, R-RETRY-2). It is a value built once from the config
// and asked by the attempt loop after each failed attempt; it knows nothing
// of legs or placement, so it can be tested alone. Where the retry goes is
// not its business (R-RETRY-3 is the attempt loop's avoidSet).
type retryPolicy struct {
	// retries is how many attempts may follow the first
	// (recovery.retry_attempts); 0 means exactly one attempt.
	retries int
	// minLeft is the least time the request's deadline must still leave
	// for a fresh attempt to be worth starting.
	minLeft time.Duration
	// budget is the router-wide retry budget (recovery.retry_budget_ratio).
	budget *retryBudget
}

// retryDenial says why retryPolicy.tryAgain refused a retry.
type retryDenial string

const (
	// denyNotTransient: the fault is not one a fresh attempt may help.
	denyNotTransient retryDenial = "not_transient"
	// denyAttempts: the request used every attempt it may make.
	denyAttempts retryDenial = "attempts"
	// denyDeadline: the request's deadline leaves no room (or ran out).
	denyDeadline retryDenial = "deadline"
	// denyEnded: the request's context ended (client gone, shutdown).
	denyEnded retryDenial = "ended"
	// denyBudget: the router-wide budget is spent.
	denyBudget retryDenial = "budget"
)

// counted reports whether the denial is counted in
// narwhal_retries_denied_total: only a transient fault on a request with
// attempts left is a retry denied.
func (d retryDenial) counted() bool { return d == denyDeadline || d == denyBudget }

// tryAgain reports whether the request whose attempts-th attempt just
// failed with f may make another, and if not, why. ctx is the request's
// context: its deadline and its end. The budget is asked last, so only a
// granted retry takes from it.
func (p retryPolicy) tryAgain(ctx context.Context, f *engines.Fault, attempts int) (bool, retryDenial) {
	if !f.Transient() {
		return false, denyNotTransient
	}
	if attempts > p.retries {
		return false, denyAttempts
	}
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < p.minLeft {
		// Spent or nearly: also when it ran out while the fault came
		// back (the context is then done for the same reason).
		return false, denyDeadline
	}
	if ctx.Err() != nil {
		return false, denyEnded
	}
	if p.budget == nil || !p.budget.allow() {
		return false, denyBudget
	}
	return true, ""
}

// retryBudget is the router-wide retry budget of R-RETRY-2, in the manner
// of Envoy's retry budgets: over a sliding window, retries may be at most
// ratio × requests, with a small floor so that a quiet router can still
// retry at all. A ratio of 0 allows no retry. Counters are per-second buckets of atomics: no lock.
type retryBudget struct {
	ratio   float64
	floor   int64 // retries always allowed per window
	buckets []budgetBucket
	width   int64 // bucket width in ns
}

type budgetBucket struct {
	epoch    atomic.Int64 // bucket start / width
	requests atomic.Int64
	retries  atomic.Int64
}

func newRetryBudget(ratio float64, window time.Duration, floor int64) *retryBudget {
	n := int(window / time.Second)
	if n < 1 {
		n = 1
	}
	return &retryBudget{ratio: ratio, floor: floor, buckets: make([]budgetBucket, n), width: int64(time.Second)}
}

// bucket returns the current bucket, resetting it if it is stale.
func (b *retryBudget) bucket(now int64) *budgetBucket {
	epoch := now / b.width
	bk := &b.buckets[epoch%int64(len(b.buckets))]
	if old := bk.epoch.Load(); old != epoch && bk.epoch.CompareAndSwap(old, epoch) {
		bk.requests.Store(0)
		bk.retries.Store(0)
	}
	return bk
}

// request counts one admitted client request.
func (b *retryBudget) request() { b.bucket(time.Now().UnixNano()).requests.Add(1) }

// allow takes one retry from the budget if the window allows it.
func (b *retryBudget) allow() bool {
	if b.ratio <= 0 {
		return false
	}
	now := time.Now().UnixNano()
	epoch := now / b.width
	var reqs, retries int64
	for i := range b.buckets {
		bk := &b.buckets[i]
		if e := bk.epoch.Load(); epoch-e < int64(len(b.buckets)) {
			reqs += bk.requests.Load()
			retries += bk.retries.Load()
		}
	}
	limit := int64(b.ratio * float64(reqs))
	limit = max(limit, b.floor)
	if retries >= limit {
		return false
	}
	b.bucket(now).retries.Add(1)
	return true
}
