package router

import (
	"sync/atomic"
	"time"
)

// retryBudget is the router-wide retry budget of R-RETRY-2, in the manner
// of Envoy's retry budgets: over a sliding window, retries may be at most
// ratio × requests, with a small floor so that a quiet router can still
// retry at all. A ratio of 0 allows no retry. Counters are per-second buckets of atomics: no lock.
type retryBudget struct {
	ratio   float64
	min     int64
	buckets []budgetBucket
	width   int64 // bucket width in ns
}

type budgetBucket struct {
	epoch    atomic.Int64 // bucket start / width
	requests atomic.Int64
	retries  atomic.Int64
}

func newRetryBudget(ratio float64, window time.Duration, min int64) *retryBudget {
	n := int(window / time.Second)
	if n < 1 {
		n = 1
	}
	return &retryBudget{ratio: ratio, min: min, buckets: make([]budgetBucket, n), width: int64(time.Second)}
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
	if limit < b.min {
		limit = b.min
	}
	if retries >= limit {
		return false
	}
	b.bucket(now).retries.Add(1)
	return true
}
