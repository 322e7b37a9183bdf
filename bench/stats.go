package bench

import (
	"math"
	"slices"
	"time"
)

// Distribution summarises one latency sample (TTFT, ITL or end-to-end).
// Every _s figure is seconds as float64; percentiles are nearest-rank
// (see Percentile). An empty sample has Count 0 and every figure 0.
//
// JSON: {"count","min_s","mean_s","p50_s","p90_s","p99_s","max_s"}.
type Distribution struct {
	// Count is the number of samples.
	Count int `json:"count"`
	// MinS is the smallest sample, seconds.
	MinS float64 `json:"min_s"`
	// MeanS is the arithmetic mean, seconds.
	MeanS float64 `json:"mean_s"`
	// P50S is the median (nearest rank), seconds.
	P50S float64 `json:"p50_s"`
	// P90S is the 90th percentile (nearest rank), seconds.
	P90S float64 `json:"p90_s"`
	// P99S is the 99th percentile (nearest rank), seconds.
	P99S float64 `json:"p99_s"`
	// MaxS is the largest sample, seconds.
	MaxS float64 `json:"max_s"`
}

// Percentile returns the q-quantile of sorted (ascending) by the
// nearest-rank method: the smallest sample such that at least q·n samples
// are at or below it, i.e. sorted[ceil(q·n)−1]. q is clamped to (0, 1]; q
// ≤ 0 gives the minimum. An empty sample gives 0.
func Percentile(sorted []time.Duration, q float64) time.Duration {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	if q <= 0 {
		return sorted[0]
	}
	if q >= 1 {
		return sorted[n-1]
	}
	// A small tolerance so that e.g. 0.9·10 is rank 9, not 10, despite
	// binary floating point.
	rank := int(math.Ceil(q*float64(n) - 1e-9))
	if rank < 1 {
		rank = 1
	}
	return sorted[rank-1]
}

// Summarize sorts samples in place and returns their Distribution.
func Summarize(samples []time.Duration) Distribution {
	if len(samples) == 0 {
		return Distribution{}
	}
	slices.Sort(samples)
	var sum float64
	for _, s := range samples {
		sum += float64(s)
	}
	return Distribution{
		Count: len(samples),
		MinS:  samples[0].Seconds(),
		MeanS: sum / float64(len(samples)) / float64(time.Second),
		P50S:  Percentile(samples, 0.50).Seconds(),
		P90S:  Percentile(samples, 0.90).Seconds(),
		P99S:  Percentile(samples, 0.99).Seconds(),
		MaxS:  samples[len(samples)-1].Seconds(),
	}
}
