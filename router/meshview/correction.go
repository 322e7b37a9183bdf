package meshview

import (
	"sync"
	"sync/atomic"

	"github.com/narwhalmesh/narwhal/prefix"
)

// maxTokenModels bounds the models whose prompts the view learns the
// bytes per token of: a client naming ever new models cannot grow the
// router's memory (a model beyond it uses the defaults).
const maxTokenModels = 256

// tokenEWMAShift is the learning rate of the per-model figures: each
// prefill answer moves them 1/8 of the way to what it showed.
const tokenEWMAShift = 3

// tokenModel is what the view learned of one model's prompts from the
// producers' usage (behaviour.md R-PLACE-3): its bytes of rendered prompt
// per token (a prefix.TokenRatio) and the mean uncached prefill, in
// tokens; 0 until the first answer.
type tokenModel struct {
	ratio      atomic.Int64
	perRequest atomic.Int64
}

// ewma moves a toward sample by 1/2^tokenEWMAShift; the first sample
// (a at 0) is taken as it is.
func ewma(a *atomic.Int64, sample int64) {
	for {
		old := a.Load()
		next := sample
		if old > 0 {
			next = old + (sample-old)>>tokenEWMAShift
		}
		if a.CompareAndSwap(old, max(next, 1)) {
			return
		}
	}
}

// tokenTable is the view's tokenModel per model, read without a lock
// (copied on the rare write: a new model).
type tokenTable struct {
	mu     sync.Mutex
	models atomic.Pointer[map[string]*tokenModel]
}

func (t *tokenTable) lookup(model string) *tokenModel {
	if m := t.models.Load(); m != nil {
		return (*m)[model]
	}
	return nil
}

// get returns model's entry, created when missing; nil beyond
// maxTokenModels.
func (t *tokenTable) get(model string) *tokenModel {
	if e := t.lookup(model); e != nil {
		return e
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	var old map[string]*tokenModel
	if m := t.models.Load(); m != nil {
		old = *m
	}
	if e := old[model]; e != nil {
		return e
	}
	if len(old) >= maxTokenModels {
		return nil
	}
	next := make(map[string]*tokenModel, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	e := &tokenModel{}
	next[model] = e
	t.models.Store(&next)
	return e
}

// TokenWork returns what the view learned of model's prompts (behaviour.md
// R-PLACE-3): its bytes of rendered prompt per token
// (prefix.DefaultTokenRatio until a producer answered with
// usage.prompt_tokens) and its mean uncached prefill in tokens (0 until
// one answered: the caller then takes the prompt's own). It does not
// allocate.
func (v *View) TokenWork(model string) (prefix.TokenRatio, int64) {
	e := v.tokens.lookup(model)
	if e == nil {
		return prefix.DefaultTokenRatio, 0
	}
	r := prefix.TokenRatio(e.ratio.Load())
	if r == 0 {
		r = prefix.DefaultTokenRatio
	}
	return r, e.perRequest.Load()
}

// PrefillUsage is the usage a producer's prefill answer reported.
type PrefillUsage struct {
	// Usage reports that the answer had a usage object; PromptTokens is
	// its prompt_tokens (0 when absent).
	Usage        bool
	PromptTokens int
	// Cached reports that it had prompt_tokens_details.cached_tokens;
	// CachedTokens is its value.
	Cached       bool
	CachedTokens int
}

// Prediction is what the placement predicted of one producer attempt:
// the prompt's block hashes, the leading blocks the index held for the
// producer when it was chosen (Matched), the rendered prompt's length and
// whether it was rendered whole (not cut at prefix.MaxBlocks blocks).
//
// Exact says the producer was weighed by its exact index (behaviour.md
// R-PLACE-4), ExactTokens the prompt's tokens it reported it held then.
type Prediction struct {
	Model       string
	Hashes      []uint64
	Matched     int
	PromptBytes int
	Whole       bool
	Exact       bool
	ExactTokens int64
}

// Predicted returns the tokens the placement predicted the engine holds
// of the prompt: ExactTokens when Exact, else Matched blocks at ratio r.
func (p *Prediction) Predicted(r prefix.TokenRatio) int64 {
	if p.Exact {
		return p.ExactTokens
	}
	return r.Tokens(int64(p.Matched) * prefix.BlockBytes)
}

// correctionSlack is how many blocks short of the prediction the
// engine's cache may end before the chain is cut, at the least: the
// rendering is not the engine's chat template and the engine caches
// whole blocks of its own, so a cache that ends a block or two early is
// the same cache.
const correctionSlack = 2

// CorrectPrefix applies a producer's prefill answer to what the view
// knows (behaviour.md R-PLACE-3): the model's bytes per token and mean
// uncached prefill learn from usage.prompt_tokens, and when the answer
// has usage.prompt_tokens_details.cached_tokens it is compared with the
// prediction — counted in narwhal_prefix_predicted_tokens_total,
// narwhal_prefix_cached_tokens_total and
// narwhal_prefix_prediction_error_tokens — and a chain predicted but not
// cached is cut from the index where the engine's cache ended (more
// than max(correctionSlack, Matched/16) blocks short), so the next
// placement of the prompt does not follow it. An engine that answers
// without cached_tokens is not corrected: counted in
// narwhal_prefix_uncorrected_total, said once in the log. It does not
// allocate once the model is known.
func (v *View) CorrectPrefix(m *Member, p *Prediction, u PrefillUsage) {
	if !u.Usage {
		return
	}
	tm := v.tokens.get(p.Model)
	if tm != nil && u.PromptTokens > 0 {
		if p.Whole && p.PromptBytes > 0 {
			r := int64(p.PromptBytes) * 256 / int64(u.PromptTokens)
			ewma(&tm.ratio, min(max(r, int64(prefix.MinTokenRatio)), int64(prefix.MaxTokenRatio)))
		}
		uncached := int64(u.PromptTokens)
		if u.Cached {
			uncached = max(uncached-int64(u.CachedTokens), 1)
		}
		ewma(&tm.perRequest, min(uncached, 1<<17))
	}
	if !u.Cached {
		v.metrics.uncorrected.Inc()
		if m.MarkUncorrected() {
			v.log.Warn("prefill engine reports no usage.prompt_tokens_details.cached_tokens: the prefix index is not corrected for it (vLLM: --enable-prompt-tokens-details; SGLang: --enable-cache-report)",
				"engine_id", m.ID)
		}
		return
	}
	ratio, _ := v.TokenWork(p.Model)
	predicted := p.Predicted(ratio)
	cached := int64(max(u.CachedTokens, 0))
	v.metrics.prediction(m, predicted, cached)
	// The blocks of rendered prompt the engine's cache covered.
	keep := int(min(cached*int64(ratio)/256/prefix.BlockBytes, int64(p.Matched)))
	if p.Matched-keep > max(correctionSlack, p.Matched/16) && keep < len(p.Hashes) {
		v.index.Cut(m.ID, p.Hashes[keep:])
		v.metrics.cuts.Inc()
	}
}
