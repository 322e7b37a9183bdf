package prefix

import "math/rand/v2"

// Candidate is one engine placement may choose (eligibility, quarantine,
// drain and slot limits already applied by the caller: behaviour.md R-PLACE-1 —
// the scorer only orders what it is given).
type Candidate struct {
	// Matched is the leading blocks of the prompt the index holds for the
	// engine (Index.Match).
	Matched int
	// Outstanding is the attempts in flight on the engine for the phase
	// being placed, on this router.
	Outstanding int64
	// Waiting is the engine's own queue (vLLM's num_requests_waiting),
	// 0 when unknown.
	Waiting int64
}

// maxLoad bounds each term of a candidate's load: Waiting comes from the
// engine's /metrics and may be anything, and an unbounded sum could wrap
// and make the most loaded engine look the least.
const maxLoad = 1 << 40

// load is what the score weighs against the match: the router's
// outstanding attempts plus the engine's own queue, each clamped to
// [0, maxLoad].
func (c *Candidate) load() int64 {
	return min(max(c.Outstanding, 0), maxLoad) + min(max(c.Waiting, 0), maxLoad)
}

// Balance is the imbalance guard's setting (behaviour.md R-PLACE-2).
type Balance struct {
	// Abs is placement.balance_abs_threshold: the guard needs max − min
	// outstanding above it. It is also the score's exchange rate: Abs
	// extra attempts in flight cost as much as a whole prompt matched.
	Abs int64
	// Rel is placement.balance_rel_threshold: the guard needs max above
	// Rel × min outstanding.
	Rel float64
}

// Imbalanced reports whether the guard holds over cands: the largest
// and the smallest Outstanding differ by more than b.Abs and the largest
// is above b.Rel × the smallest.
func (b Balance) Imbalanced(cands []Candidate) bool {
	if len(cands) < 2 {
		return false
	}
	lo, hi := cands[0].Outstanding, cands[0].Outstanding
	for i := 1; i < len(cands); i++ {
		lo = min(lo, cands[i].Outstanding)
		hi = max(hi, cands[i].Outstanding)
	}
	return hi-lo > b.Abs && float64(hi) > b.Rel*float64(lo)
}

// Choose returns the index in cands of the engine to place on, -1 when
// cands is empty; blocks is the prompt's length in blocks (the hashes
// Match was given). guarded reports that the imbalance guard decided.
//
// When the guard holds (Imbalanced), or the prompt is shorter than
// MinScoredBlocks, the least loaded candidate wins. Otherwise each
// candidate scores
//
//	Matched/blocks − (load − least load)/Abs
//
// (load = Outstanding + Waiting; Abs at least 1): the share of the
// prompt's leading blocks recently sent there, less 1/Abs per attempt
// it has beyond the least loaded one. The highest score wins; ties —
// among them every candidate of a prompt no engine has seen — are broken
// uniformly at random, so with no shared prefixes Choose is least loaded
// (a short prompt's ties go to the least loaded: same thing).
// It does not allocate.
func Choose(cands []Candidate, blocks int, b Balance) (i int, guarded bool) {
	if len(cands) == 0 {
		return -1, false
	}
	if b.Imbalanced(cands) {
		return leastLoaded(cands), true
	}
	if blocks < MinScoredBlocks {
		return leastLoaded(cands), false
	}
	least := cands[0].load()
	for i := 1; i < len(cands); i++ {
		least = min(least, cands[i].load())
	}
	// Scores in integers, scaled by blocks × abs: Matched × abs −
	// (load − least) × blocks. Matched ≤ MaxBlocks, blocks ≤ MaxBlocks and
	// load ≤ 2 × maxLoad keep it far from overflow.
	abs := min(max(b.Abs, 1), maxLoad)
	n := int64(max(blocks, 1))
	best, ties := -1, 0
	var bestScore int64
	for i := range cands {
		c := &cands[i]
		matched := int64(min(max(c.Matched, 0), max(blocks, 0)))
		s := matched*abs - (c.load()-least)*n
		switch {
		case best < 0 || s > bestScore:
			best, bestScore, ties = i, s, 1
		case s == bestScore:
			ties++
			if rand.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best, false
}

// leastLoaded returns the candidate with the least load, ties broken
// uniformly at random.
func leastLoaded(cands []Candidate) int {
	best, ties := 0, 1
	for i := 1; i < len(cands); i++ {
		switch l, bl := cands[i].load(), cands[best].load(); {
		case l < bl:
			best, ties = i, 1
		case l == bl:
			ties++
			if rand.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}
