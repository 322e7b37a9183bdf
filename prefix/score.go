package prefix

import (
	"math/rand/v2"
	"time"
)

// Candidate is one engine placement may choose (eligibility, quarantine,
// drain and slot limits already applied by the caller: behaviour.md R-PLACE-1 —
// the scorer only orders what it is given). Every count is the mesh's:
// this router's plus what the other routers last reported of the engine
// (the load exchange, behaviour.md R-PLACE-3).
type Candidate struct {
	// Matched is the leading blocks of the prompt the index holds for the
	// engine (Index.Match).
	Matched int
	// Exact reports that the engine is weighed by its exact index
	// (behaviour.md R-PLACE-4): when the Work has the prompt's Tokens,
	// CachedTokens then stands for Matched in the cost.
	Exact bool
	// CachedTokens is, when Exact, the prompt's leading tokens the
	// engine reports it holds (ExactMatch.CachedTokens: blocks in an
	// offloading tier weighted less), 0 for none.
	CachedTokens int64
	// Outstanding is the attempts in flight on the engine for the phase
	// being placed, the mesh's. The imbalance guard weighs it.
	Outstanding int64
	// Waiting is the engine's own queue (vLLM's num_requests_waiting),
	// 0 when unknown.
	Waiting int64
	// Running is the engine's own running requests (vLLM's
	// num_requests_running), 0 when unknown.
	Running int64
	// Legs is the mesh's legs in flight on the engine, both phases, when
	// Waiting and Running were read: the requests of those counts the
	// mesh knows the work of (taken at the same moment, so that a count
	// read seconds ago is not set against the legs of now).
	Legs int64
	// Tokens is the uncached prefill work in flight on the engine, in
	// tokens: the sum of every producer attempt's estimate at its
	// reservation, the mesh's. Outstanding attempts hold it; the cost
	// takes off what the one computing has done (Head, Cost).
	Tokens int64
	// DecodeLegs is the decode legs in flight on the engine when it also
	// decodes (role both), the mesh's; 0 for a prefill engine.
	DecodeLegs int64
	// Head is what the mesh knows of the prefill the engine computes
	// now (meshview.Member.Head): the zero Progress when no router that
	// reports the head has an attempt there.
	Head Progress
}

// Progress is what the mesh knows of the prefill an engine computes at
// the head of its queue (behaviour.md R-PLACE-3), from this router's
// attempts there and the other routers' load reports.
type Progress struct {
	// Age is how long that prefill has been computing: since the last
	// prefill there ended (any router's), or since the first attempt of
	// the mesh's in flight there was reserved while none was, whichever
	// is later. 0 when unknown.
	Age time.Duration
	// Mean is the mean of that time over the prefills that answered
	// there, MeanTokens the mean of their reserved uncached tokens (at
	// least 1 once one answered): the engine's pace, this router's or,
	// until it has one, the other routers'. Both 0 when none answered
	// yet; a MeanTokens of 0 takes the pace as Mean a prefill.
	Mean       time.Duration
	MeanTokens int64
}

// maxLoad bounds each count of a candidate: Waiting and Running come from
// the engine's /metrics and the other routers' counts from the bus, and
// may be anything; bounded terms keep every sum far from wrapping, so the
// most loaded engine never looks the least.
const maxLoad = 1 << 40

// maxPerRequest bounds Work.PerRequest, so that maxLoad × it stays far
// below the int64 range.
const maxPerRequest = 1 << 17

func bound(n int64) int64 { return min(max(n, 0), maxLoad) }

// load is what the imbalance guard's fallback orders by: the mesh's
// outstanding attempts plus the engine's own queue.
func (c *Candidate) load() int64 {
	return bound(c.Outstanding) + bound(c.Waiting)
}

// TokenRatio is a bytes-per-token ratio of rendered prompt, in 1/256
// bytes (fixed point: 1024 is 4 bytes a token). The router learns it per
// model from the producers' usage.prompt_tokens (behaviour.md R-PLACE-3).
type TokenRatio int64

// DefaultTokenRatio is the ratio used until one is learned: 4 bytes a
// token, English text through a BPE tokenizer.
const DefaultTokenRatio TokenRatio = 4 * 256

// Bounds of a learned ratio: 1 and 16 bytes a token.
const (
	MinTokenRatio TokenRatio = 256
	MaxTokenRatio TokenRatio = 16 * 256
)

// Tokens returns n bytes of rendered prompt in tokens (rounded down; n < 0
// is 0). A ratio outside [MinTokenRatio, MaxTokenRatio] is taken as the
// nearest bound.
func (r TokenRatio) Tokens(n int64) int64 {
	r = min(max(r, MinTokenRatio), MaxTokenRatio)
	return min(max(n, 0), maxLoad) * 256 / int64(r)
}

// Work is what a prefill costs, the request's side of the cost
// (behaviour.md R-PLACE-3).
type Work struct {
	// Blocks is the prompt's length in blocks (the hashes Match was given).
	Blocks int
	// PromptBytes is the rendered prompt's length in bytes (at least
	// Blocks × BlockBytes when the prompt was hashed whole).
	PromptBytes int64
	// Tokens is the prompt's length in tokens when the engine's
	// tokenizer said it (POST /tokenize, behaviour.md R-PLACE-4); 0 when
	// unknown: the length is then PromptBytes at Ratio.
	Tokens int64
	// Ratio is the model's bytes per token.
	Ratio TokenRatio
	// PerRequest is the work, in tokens, counted for each request an
	// engine says it has (Waiting + Running) beyond the mesh's Legs on it:
	// work the mesh did not send, of unknown size (the mean uncached
	// prefill the router has seen, or this prompt's tokens until one is
	// seen).
	PerRequest int64
}

// Cost returns candidate c's expected prefill work for w in tokens
// (behaviour.md R-PLACE-3): the prompt's uncached part there (its tokens
// beyond the Matched leading blocks, or beyond its CachedTokens when c
// is Exact and w has the prompt's Tokens, R-PLACE-4) plus the work it
// already has — the
// mesh's uncached prefill tokens in flight on it, less what the
// attempt computing has done (ahead), one token per decode leg of a role-both
// engine (a decode sequence adds a token to each of the engine's
// steps), and PerRequest for each request the
// engine counts beyond the mesh's legs on it. A prompt shorter than
// MinScoredBlocks counts as wholly uncached. It does not allocate.
func (c *Candidate) Cost(w *Work) int64 {
	matched := int64(min(max(c.Matched, 0), max(w.Blocks, 0)))
	if w.Blocks < MinScoredBlocks {
		matched = 0
	}
	var uncached int64
	tokens := min(w.Tokens, maxLoad)
	switch {
	case tokens > 0 && c.Exact:
		cached := min(max(c.CachedTokens, 0), tokens)
		if w.Blocks < MinScoredBlocks {
			cached = 0
		}
		uncached = tokens - cached
	case tokens > 0:
		uncached = max(tokens-w.Ratio.Tokens(matched*BlockBytes), 0)
	default:
		uncached = w.Ratio.Tokens(w.PromptBytes - matched*BlockBytes)
	}
	decode := bound(c.DecodeLegs)
	extra := max(bound(c.Waiting)+bound(c.Running)-bound(c.Legs), 0)
	return uncached + c.ahead() + decode + extra*min(max(w.PerRequest, 0), maxPerRequest)
}

// ahead returns the prefill work in flight on c that a request placed
// now expects to wait for, in tokens (behaviour.md R-PLACE-3): Tokens less
// what the prefill the engine computes has done of one Outstanding
// attempt's mean reservation (the share). At the engine's pace
// (Head.Mean for Head.MeanTokens) the share takes an expected time; the
// part done is Head.Age over it. Past that time the prefill is overdue —
// stalled, or longer than its reservation said — and the part counted
// done falls back as the expected time over Age: a prefill that hangs
// comes to count whole again. Nothing is taken off while the head has
// no age or the pace is unknown, so an engine that has just begun a long
// prefill — a cold context, whichever router sent it — counts all of
// it. With the zero Head — attempts only of routers that do not report
// the head (an older version) — the request arrives at a moment
// unrelated to the head's start, and the head counts half done (the
// mean residual of a computation seen at a random moment). With no
// Outstanding attempt it is Tokens.
func (c *Candidate) ahead() int64 {
	tokens := bound(c.Tokens)
	n := bound(c.Outstanding)
	h := c.Head
	if n == 0 {
		return tokens
	}
	if h == (Progress{}) {
		return tokens - tokens/(2*n)
	}
	if h.Age <= 0 || h.Mean <= 0 {
		return tokens
	}
	share := tokens / n
	if share == 0 {
		return tokens
	}
	expected := float64(h.Mean)
	if mt := bound(h.MeanTokens); mt > 0 {
		expected *= float64(share) / float64(mt)
	}
	done := float64(h.Age) / expected
	if done > 1 {
		done = 1 / done
	}
	return tokens - int64(done*float64(share))
}

// Balance is the imbalance guard's setting (behaviour.md R-PLACE-2).
type Balance struct {
	// Abs is placement.balance_abs_threshold: the guard needs max − min
	// outstanding above it.
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
// cands is empty; guarded reports that the imbalance guard decided.
//
// When the guard holds (Imbalanced, the last resort) the least loaded
// candidate wins (Outstanding + Waiting). Otherwise the candidate of the
// least Cost wins (behaviour.md R-PLACE-3): a loaded engine that holds
// the prefix loses to an idle one exactly when the work waiting there
// exceeds the work its match saves. Ties — among them every candidate of
// a prompt no engine has seen on an idle mesh — are broken uniformly at
// random. It does not allocate.
func Choose(cands []Candidate, w *Work, b Balance) (i int, guarded bool) {
	if len(cands) == 0 {
		return -1, false
	}
	if b.Imbalanced(cands) {
		return leastLoaded(cands), true
	}
	best, ties := -1, 0
	var bestCost int64
	for i := range cands {
		c := cands[i].Cost(w)
		switch {
		case best < 0 || c < bestCost:
			best, bestCost, ties = i, c, 1
		case c == bestCost:
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
