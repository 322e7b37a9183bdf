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
// ratio × requests, with a floor so that a quiet router can still retry at
// all. A ratio of 0 allows no retry. The window is per-second buckets of
// atomic words: no lock, on the request path or the retry path.
type retryBudget struct {
	ratio   float64
	floor   int64 // retries always allowed per window
	buckets []budgetBucket
	width   int64 // bucket width in ns
}

// budgetBucket is one second of the window. Each counter is one atomic
// word holding the bucket's epoch (now / width) in its high 32 bits and the
// count in its low 32 bits: an update that finds an older epoch starts the
// count afresh for its own in the same compare-and-swap, so renewing a
// bucket never loses a count made for the new second.
type budgetBucket struct {
	requests atomic.Uint64
	retries  atomic.Uint64
}

func newRetryBudget(ratio float64, window time.Duration, floor int64) *retryBudget {
	n := int(window / time.Second)
	if n < 1 {
		n = 1
	}
	return &retryBudget{ratio: ratio, floor: floor, buckets: make([]budgetBucket, n), width: int64(time.Second)}
}

// epochCount packs an epoch and a count into one counter word.
func epochCount(epoch uint32, count uint32) uint64 { return uint64(epoch)<<32 | uint64(count) }

// addAt adds delta to word's count for epoch: a word of an older epoch
// starts from 0. A negative delta applies only while the word is still
// of epoch (a renewed bucket has already dropped what it would take back).
func addAt(word *atomic.Uint64, epoch uint32, delta int32) {
	for {
		old := word.Load()
		e, n := uint32(old>>32), uint32(old)
		if e != epoch {
			if delta < 0 {
				return
			}
			n = 0
		}
		if delta < 0 && n == 0 {
			return
		}
		if word.CompareAndSwap(old, epochCount(epoch, n+uint32(delta))) {
			return
		}
	}
}

// countAt returns word's count when its epoch lies in the window that ends
// at epoch, else 0.
func (b *retryBudget) countAt(word *atomic.Uint64, epoch uint32) int64 {
	v := word.Load()
	if epoch-uint32(v>>32) >= uint32(len(b.buckets)) {
		return 0
	}
	return int64(uint32(v))
}

// epoch returns the bucket epoch of now (UnixNano) and its bucket.
func (b *retryBudget) epoch(now int64) (uint32, *budgetBucket) {
	e := now / b.width
	return uint32(e), &b.buckets[e%int64(len(b.buckets))]
}

// window returns the requests and retries counted in the window that ends
// at now (UnixNano).
func (b *retryBudget) window(now int64) (requests, retries int64) {
	epoch, _ := b.epoch(now)
	for i := range b.buckets {
		requests += b.countAt(&b.buckets[i].requests, epoch)
		retries += b.countAt(&b.buckets[i].retries, epoch)
	}
	return requests, retries
}

// request counts one admitted client request.
func (b *retryBudget) request() { b.requestAt(time.Now().UnixNano()) }

func (b *retryBudget) requestAt(now int64) {
	epoch, bk := b.epoch(now)
	addAt(&bk.requests, epoch, 1)
}

// allow takes one retry from the budget if the window allows it.
func (b *retryBudget) allow() bool { return b.allowAt(time.Now().UnixNano()) }

// allowAt takes the retry first and then checks the window with it
// counted, giving it back when that is over the limit: every granted retry
// saw, besides itself, every retry granted before it, so concurrent
// callers can never be granted more than the limit together (at worst,
// when k callers race at the limit, up to k of them are refused although
// some could have passed: the budget errs on the side of fewer retries).
func (b *retryBudget) allowAt(now int64) bool {
	if b.ratio <= 0 {
		return false
	}
	epoch, bk := b.epoch(now)
	addAt(&bk.retries, epoch, 1)
	requests, retries := b.window(now)
	limit := max(int64(b.ratio*float64(requests)), b.floor)
	if retries > limit {
		addAt(&bk.retries, epoch, -1)
		return false
	}
	return true
}
