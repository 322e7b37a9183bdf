package router

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/router/meshview"
)

// PlacedFunc receives, after each prefix placement, the producer's
// engine id and the prompt's block hashes: what the other routers Learn
// (behaviour.md R-PLACE-2; meshview.PlacedFunc says why all of them). It
// runs on the request path: it must not block, and must copy the hashes
// to keep them (the slice is reused).
type PlacedFunc = meshview.PlacedFunc

// placer is the router's placement (behaviour.md R-PLACE-1, R-PLACE-2):
// the policy that chooses the producer and the pooled buffers of each
// request's placement.
type placer struct {
	policy  policy
	scratch sync.Pool // *placeScratch
	// decisions is narwhal_prefix_placements_total{decision}, registered
	// whatever the policy (only the prefix policy counts in it).
	decisions *prometheus.CounterVec
}

// placeScratch is one request's placement buffers, pooled so that a
// placement allocates nothing in steady state.
type placeScratch struct {
	prompt []byte
	hashes []uint64
	hashed bool // prompt and hashes are this request's
	// ms and cands are the last eligibility scan (eligible): the engines
	// that may take the leg, and their loads.
	ms    []*member
	cands []prefix.Candidate
	// chosen is the index in ms of the last choice, -1 when it was none
	// of them (an engine to avoid, R-RETRY-3).
	chosen int
	// work is the prompt's side of the cost (R-PLACE-3), set before a
	// prefix placement.
	work prefix.Work
	// tokens are the prompt's token ids for the exact index (R-PLACE-4),
	// nil when it has none; tokenized says they were looked for (once a
	// request: a retry reuses them). tokenBuf is the buffer they are
	// read into (tokens may instead be the tokenizer cache's, never
	// written). keys are tokens' block keys at keysBS tokens a block.
	tokens    []uint32
	tokenBuf  []uint32
	tokenized bool
	keys      []uint64
	keysBS    int
	// placed is the buffer the placement in flight is encoded into for
	// the other routers (meshview.View.SharePlaced).
	placed []byte
}

// keysFor returns the prompt's token-block keys at bs tokens a block
// (computed once per block size and request).
func (sc *placeScratch) keysFor(bs int) []uint64 {
	if sc.keysBS != bs {
		sc.keys = prefix.AppendTokenKeys(sc.keys[:0], sc.tokens, bs, 0)
		sc.keysBS = bs
	}
	return sc.keys
}

// weighExact sets, for each candidate mesh holds an exact index of, its
// exact match of the prompt's tokens (R-PLACE-4): Exact, and the tokens
// it holds (offloaded blocks weighted less). Under placement.index exact
// a candidate without an exact index is weighed as holding nothing.
// Nothing is set when the prompt has no tokens.
func (sc *placeScratch) weighExact(mesh meshView) {
	if len(sc.tokens) == 0 {
		return
	}
	exactOnly := mesh.IndexMode() == config.IndexExact
	var now int64
	for i, m := range sc.ms {
		if bs, ok := mesh.ExactBlockSize(m.ID); ok {
			keys := sc.keysFor(bs)
			if em, ok := mesh.MatchExact(m.ID, keys); ok {
				if now == 0 {
					now = time.Now().UnixNano()
				}
				if n := m.InflightMatch(keys, now); n > em.GPU {
					// Placed here and not reported yet: stored by the
					// time this request runs, as if in GPU memory.
					em.GPU, em.Host, em.Any = n, max(em.Host, n), max(em.Any, n)
				}
				sc.cands[i].Exact, sc.cands[i].CachedTokens = true, em.CachedTokens(bs)
				continue
			}
		}
		sc.cands[i].Exact = exactOnly
	}
}

// inflightGrace is how long after a prefill attempt ends placement still
// credits its prompt to its exact engine (prefix.Inflight, R-PLACE-4):
// the time its blocks' events take to reach the router, whose target is
// 100 ms at p99, with room to spare; after it the exact index alone says
// what the engine holds.
const inflightGrace = 250 * time.Millisecond

// maxPooledPrompt is the largest rendered-prompt buffer kept for reuse:
// a rare huge prompt does not pin its buffer in the pool.
const maxPooledPrompt = 1 << 20

// newPlacer builds the placement of cfg: its policy (newPolicy) and the
// prefix policy's counter, for the caller to register. It returns
// newPolicy's error.
func newPlacer(cfg config.Placement) (*placer, error) {
	decisions := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "narwhal_prefix_placements_total",
		Help: "Prefill placements of the prefix policy by what decided them: matched (the chosen engine held part of the prompt's prefix), unmatched (none did, or the prompt was too short to weigh: least loaded), guard (the imbalance guard chose by load).",
	}, []string{"decision"})
	pol, err := newPolicy(cfg, decisions)
	if err != nil {
		return nil, err
	}
	pl := &placer{policy: pol, decisions: decisions}
	pl.scratch.New = func() any { return new(placeScratch) }
	return pl, nil
}

// policy is a placement policy (behaviour.md R-PLACE-1, R-PLACE-2):
// which of the engines that may take the prefill leg gets it. It is a
// value built once from placement.policy (newPolicy) and chooses only
// among what the one eligibility scan (placeScratch.eligible) found.
type policy interface {
	// choose returns the index in sc.ms (never empty; sc.cands holds
	// their loads) of the producer. mesh is the router's view of the
	// mesh (the prefix index's matches); sc.hashes are the prompt's
	// blocks when weighsPrefix.
	choose(mesh meshView, sc *placeScratch) int
	// weighsPrefix reports whether the policy chooses by the prompt's
	// leading blocks: the prompt is hashed before the choice and
	// recorded at the chosen producer after, so the router keeps the
	// prefix index (shared with the mesh, kept true to the engines'
	// caches).
	weighsPrefix() bool
	// sameWorker reports whether a same-worker producer (role both)
	// keeps the decode leg when it can take it, so that the whole
	// attempt runs where the prefix is.
	sameWorker() bool
}

// newPolicy returns the policy named by cfg.Policy — config.PolicyPrefix,
// config.PolicyLeastLoaded or config.PolicyRandom — or an error for any
// other name, the empty one included: the default is config.Default's,
// never the router's. The prefix policy counts its decisions in
// decisions.
func newPolicy(cfg config.Placement, decisions *prometheus.CounterVec) (policy, error) {
	switch cfg.Policy {
	case config.PolicyPrefix:
		return &prefixPolicy{
			balance:   prefix.Balance{Abs: int64(cfg.BalanceAbsThreshold), Rel: cfg.BalanceRelThreshold},
			matched:   decisions.WithLabelValues("matched"),
			unmatched: decisions.WithLabelValues("unmatched"),
			guarded:   decisions.WithLabelValues("guard"),
		}, nil
	case config.PolicyLeastLoaded:
		return leastLoaded{}, nil
	case config.PolicyRandom:
		return randomPolicy{}, nil
	}
	return nil, fmt.Errorf("placement.policy must be one of %s, got %q", strings.Join(config.Policies, ", "), cfg.Policy)
}

// leastLoaded is policy least_loaded: the engine with the fewest of this
// router's attempts in the phase, ties broken uniformly at random so
// that idle engines share the load evenly (R-OWN-3). It is also how
// every decode leg is placed.
type leastLoaded struct{}

func (leastLoaded) choose(_ meshView, sc *placeScratch) int {
	best, ties := 0, 1
	for i := 1; i < len(sc.cands); i++ {
		switch load := sc.cands[i].Outstanding; {
		case load < sc.cands[best].Outstanding:
			best, ties = i, 1
		case load == sc.cands[best].Outstanding:
			ties++
			if rand.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}

func (leastLoaded) weighsPrefix() bool { return false }
func (leastLoaded) sameWorker() bool   { return false }

// randomPolicy is policy random: uniformly among the engines that may
// be chosen.
type randomPolicy struct{}

func (randomPolicy) choose(_ meshView, sc *placeScratch) int { return rand.IntN(len(sc.ms)) }
func (randomPolicy) weighsPrefix() bool                      { return false }
func (randomPolicy) sameWorker() bool                        { return false }

// prefixPolicy is policy prefix (R-PLACE-2, R-PLACE-3): the engine of
// the least expected prefill work — the prompt's part the prefix index
// does not hold for it plus the mesh's work in flight there — with the
// imbalance guard as the last resort (prefix.Choose); a prompt shorter
// than prefix.MinScoredBlocks counts as wholly uncached everywhere.
type prefixPolicy struct {
	balance prefix.Balance
	// matched, unmatched and guarded count the placements by what
	// decided them (narwhal_prefix_placements_total).
	matched, unmatched, guarded prometheus.Counter
}

func (p *prefixPolicy) choose(mesh meshView, sc *placeScratch) int {
	if len(sc.hashes) >= prefix.MinScoredBlocks {
		for i, m := range sc.ms {
			sc.cands[i].Matched = mesh.MatchPrefix(m.ID, sc.hashes)
		}
		sc.weighExact(mesh)
	}
	i, guarded := prefix.Choose(sc.cands, &sc.work, p.balance)
	switch {
	case guarded:
		p.guarded.Inc()
	case sc.cands[i].Exact && sc.cands[i].CachedTokens > 0, !sc.cands[i].Exact && sc.cands[i].Matched > 0:
		p.matched.Inc()
	default:
		p.unmatched.Inc()
	}
	return i
}

func (*prefixPolicy) weighsPrefix() bool { return true }
func (*prefixPolicy) sameWorker() bool   { return true }

// OnPlaced sets the function that receives each prefix placement's
// block hashes (for publishing them on the bus); nil removes it.
func (rt *Router) OnPlaced(fn PlacedFunc) { rt.view.OnPlaced(fn) }

// PrefixIndex returns the router's prefix index: what the mesh's other
// routers placed is applied to it with Learn, and an engine whose cache
// is gone (ejected, drained, restarted) is dropped from it with Drop.
func (rt *Router) PrefixIndex() *prefix.Index { return rt.view.PrefixIndex() }

// SetEngineWaiting records engineID's own queue (vLLM's
// num_requests_waiting, as last read from the engine) for placement: the
// prefix policy weighs it with the router's outstanding attempts. n < 0
// is taken as 0. Unknown engines are ignored.
func (rt *Router) SetEngineWaiting(engineID string, n int64) { rt.view.SetEngineWaiting(engineID, n) }

// placeLegs places both legs of an attempt (behaviour.md R-PLACE-1, R-PLACE-2,
// R-RETRY-3) and reserves their slots: the producer by the policy, the
// consumer least loaded among the engines of the producer's connector
// (R-DESC-3) — except that under a policy that keeps a same-worker
// producer's decode (prefix), a producer of role both keeps the decode
// when it can take it, so the whole attempt runs where the prefix is.
// It returns the fault of a phase no engine can take.
func (c *call) placeLegs(avoid *avoidSet) (prod, cons *member, f *engines.Fault) {
	fl := c.rt.fleet()
	prod, err := c.placeProducer(fl, avoid[prefillPhase])
	if err != nil {
		return nil, nil, noEngine(prefillPhase)
	}
	if c.rt.placer.policy.sameWorker() && prod.Can(decodePhase) && !slices.Contains(avoid[decodePhase], prod) &&
		prod.Available(time.Now().UnixNano()) && prod.TryReserve(decodePhase) {
		return prod, prod, nil
	}
	cons, err = place(fl, c.req.Model, decodePhase, avoid[decodePhase], prod.Connector.Name(), leastLoaded{}, c.rt.mesh, c.placeScratch())
	if err != nil {
		prod.Release(prefillPhase)
		prod.AddTokens(-c.prefillTokens)
		c.prefillTokens = 0
		c.dropInflight()
		return nil, nil, noEngine(decodePhase)
	}
	return prod, cons, nil
}

// placeProducer places the prefill leg by the router's policy; under a
// policy that weighs the prefix it records the prompt's blocks at the
// chosen producer, which hands them to the OnPlaced function.
func (c *call) placeProducer(fl *fleet, avoid []*member) (*member, error) {
	pol := c.rt.placer.policy
	sc := c.placeScratch()
	c.prefillTokens, c.prediction = 0, meshview.Prediction{}
	if c.inflightOn != nil {
		c.endShared(false) // an earlier attempt not yet ended is being retried
	}
	c.inflight, c.inflightOn = prefix.InflightTicket{}, nil
	if !pol.weighsPrefix() {
		return place(fl, c.req.Model, prefillPhase, avoid, "", pol, c.rt.mesh, sc)
	}
	if !sc.hashed {
		// Hashed once per request; a retry reuses the hashes.
		// Only the hashed head is rendered: a prompt of many MiB costs no
		// more than MaxBlocks blocks.
		sc.prompt = c.req.AppendPromptPrefix(sc.prompt[:0], prefix.MaxBlocks*prefix.BlockBytes)
		sc.hashes = prefix.AppendHashes(sc.hashes[:0], sc.prompt)
		sc.hashed = true
	}
	whole := len(sc.prompt) < prefix.MaxBlocks*prefix.BlockBytes
	promptBytes := len(sc.prompt)
	if !whole {
		promptBytes = max(promptBytes, c.req.Size()) // the body's size: the best guess past the rendered head
	}
	ratio, perRequest := c.rt.mesh.TokenWork(c.req.Model)
	if perRequest <= 0 {
		perRequest = ratio.Tokens(int64(promptBytes))
	}
	if c.rt.tokenizer != nil && !sc.tokenized && len(sc.hashes) >= prefix.MinScoredBlocks {
		sc.tokenized = true
		c.tokenizePrompt(fl, avoid, sc, ratio, promptBytes)
	}
	sc.work = prefix.Work{Blocks: len(sc.hashes), PromptBytes: int64(promptBytes), Ratio: ratio, PerRequest: perRequest, Tokens: int64(len(sc.tokens))}
	m, err := place(fl, c.req.Model, prefillPhase, avoid, "", pol, c.rt.mesh, sc)
	if err != nil {
		return m, err
	}
	matched, exact, cached := 0, false, int64(0)
	if sc.chosen >= 0 && sc.ms[sc.chosen] == m {
		cand := &sc.cands[sc.chosen]
		matched = cand.Matched
		exact, cached = cand.Exact && sc.work.Tokens > 0, min(max(cand.CachedTokens, 0), sc.work.Tokens)
	} else if len(sc.hashes) >= prefix.MinScoredBlocks {
		matched = c.rt.mesh.MatchPrefix(m.ID, sc.hashes)
	}
	// The attempt's work in flight on the producer until its prefill
	// slot is released (R-PLACE-3): by the exact match where it has one
	// (R-PLACE-4).
	c.prefillTokens = ratio.Tokens(int64(promptBytes - matched*prefix.BlockBytes))
	if exact {
		c.prefillTokens = sc.work.Tokens - cached
	}
	m.AddTokens(c.prefillTokens)
	if exact {
		if bs, ok := c.rt.mesh.ExactBlockSize(m.ID); ok {
			keys := sc.keysFor(bs)
			c.inflight, c.inflightOn = m.Inflight().Add(keys, time.Now().UnixNano()), m
			var shared bool
			sc.placed, shared = c.rt.mesh.SharePlaced(m, keys, sc.placed)
			c.sharedCount, c.sharedLast = bus.PlacedChain(keys)
			c.sharedOpen.Store(shared)
		}
	}
	c.prediction = meshview.Prediction{Model: c.req.Model, Hashes: sc.hashes, Matched: matched, PromptBytes: promptBytes, Whole: whole,
		Exact: exact, ExactTokens: cached}
	if len(sc.hashes) > 0 {
		c.rt.mesh.RecordPrefix(m.ID, sc.hashes)
	}
	return m, nil
}

// tokenizePrompt sets sc.tokens to the prompt's token ids for the exact
// index (R-PLACE-4), when some engine that may take the prefill has an
// exact index and the prompt is at least placement.tokenize_min_blocks
// of its blocks (its tokens estimated from promptBytes at ratio): read
// from the prompt, the tokenizer's cache, or one POST /tokenize to one
// of those engines, bounded by placement.tokenize_timeout_s. On a
// timeout or an error it leaves sc.tokens nil: the request is placed as
// without the exact index.
func (c *call) tokenizePrompt(fl *fleet, avoid []*member, sc *placeScratch, ratio prefix.TokenRatio, promptBytes int) {
	sc.tokens, sc.keysBS = nil, 0
	sc.eligible(fl, c.req.Model, prefillPhase, avoid, "", time.Now().UnixNano())
	bs := 0
	for _, m := range sc.ms {
		if b, ok := c.rt.mesh.ExactBlockSize(m.ID); ok && b > 0 {
			bs = b
			break
		}
	}
	if bs == 0 || ratio.Tokens(int64(promptBytes))/int64(bs) < int64(c.rt.cfg.Placement.TokenizeMinBlocks) {
		return
	}
	ms := sc.ms
	toks, owned, ok := c.rt.tokenizer.tokens(c.ctx, c.req, func(i uint64) *engines.Engine {
		return &ms[i%uint64(len(ms))].Engine
	}, sc.tokenBuf)
	if !ok {
		return
	}
	if owned {
		sc.tokenBuf = toks[:0]
	}
	sc.tokens = toks
}

// placeScratch returns the call's placement buffers, taken from the pool
// on first use; releasePlacement gives them back.
func (c *call) placeScratch() *placeScratch {
	if c.scratch == nil {
		c.scratch = c.rt.placer.scratch.Get().(*placeScratch)
		c.scratch.hashed, c.scratch.tokenized, c.scratch.tokens = false, false, nil
	}
	return c.scratch
}

// releasePlacement returns the call's placement buffers to the pool.
func (c *call) releasePlacement() {
	sc := c.scratch
	if sc == nil {
		return
	}
	c.scratch = nil
	clear(sc.ms[:cap(sc.ms)])
	sc.ms = sc.ms[:0]
	if cap(sc.prompt) > maxPooledPrompt {
		sc.prompt, sc.hashes = nil, nil
	}
	if cap(sc.tokenBuf) > maxPooledPrompt/4 {
		sc.tokenBuf, sc.keys = nil, nil
	}
	sc.tokens = nil
	sc.prompt = sc.prompt[:0]
	c.rt.placer.scratch.Put(sc)
}

// errNoEngine is returned by place when no engine can take a phase.
type errNoEngine struct{ phase phase }

func (e *errNoEngine) Error() string { return "no eligible engine for " + e.phase.String() }

// place chooses, among the engines of fl that may take phase p for
// model now — of connector conn unless conn is "" (a producer and a
// consumer of different connectors cannot hand off KV, R-DESC-3) — one
// by policy by, and reserves its slot (R-OWN-3). Engines in avoid (those
// that failed this phase in an earlier attempt of the request) are
// chosen only when no other engine can take the phase, and then the
// least loaded of them (R-RETRY-3). sc holds the scan's buffers. It
// returns *errNoEngine when none can take the phase.
func place(fl *fleet, model string, p phase, avoid []*member, conn string, by policy, mesh meshView, sc *placeScratch) (*member, error) {
	now := time.Now().UnixNano()
	for try := 0; try < 4; try++ {
		chosen := sc.eligible(fl, model, p, avoid, conn, now)
		sc.chosen = -1
		if len(sc.ms) > 0 {
			sc.chosen = by.choose(mesh, sc)
			chosen = sc.ms[sc.chosen]
		}
		if chosen == nil {
			return nil, &errNoEngine{p}
		}
		if chosen.TryReserve(p) {
			return chosen, nil
		}
	}
	return nil, &errNoEngine{p}
}

// eligible is placement's one eligibility scan (R-PLACE-1): it sets
// sc.ms to the engines of fl that may take phase p for model at nowNano
// (meshview.Member.Takes: eligible, active, not quarantined or backing
// off, credentials accepted, listing model, a slot free) — of connector
// conn unless conn is "" — that are not in avoid, and sc.cands to their
// loads (the mesh's reservations of p and work in flight, R-PLACE-3; the
// engine's own queue and running requests). It
// returns the least loaded of those in avoid that may take the phase,
// ties broken at random, nil when none may (R-RETRY-3).
func (sc *placeScratch) eligible(fl *fleet, model string, p phase, avoid []*member, conn string, nowNano int64) *member {
	ms, cands := sc.ms[:0], sc.cands[:0]
	var fallback pick
	for _, m := range fl.Members() {
		if conn != "" && m.Connector.Name() != conn {
			continue
		}
		load, ok := m.Takes(p, model, nowNano)
		if !ok {
			continue
		}
		if slices.Contains(avoid, m) {
			fallback.offer(m, load)
			continue
		}
		ms = append(ms, m)
		cand := prefix.Candidate{
			Outstanding: load + m.MeshReserved(p) - m.Reserved(p),
			Waiting:     m.Waiting(),
			Running:     m.Running(),
			Legs:        m.LegsAtRead(),
			Tokens:      m.MeshTokens(),
		}
		if m.Can(decodePhase) {
			cand.DecodeLegs = m.MeshReserved(decodePhase)
		}
		if p == prefillPhase {
			cand.Head = m.Head(nowNano)
		}
		cands = append(cands, cand)
	}
	sc.ms, sc.cands = ms, cands
	return fallback.m
}

// pick is the least-loaded member offered so far, ties broken uniformly at
// random.
type pick struct {
	m    *member
	load int64
	ties int
}

func (k *pick) offer(m *member, load int64) {
	switch {
	case k.m == nil || load < k.load:
		k.m, k.load, k.ties = m, load, 1
	case load == k.load:
		k.ties++
		if rand.IntN(k.ties) == 0 {
			k.m = m
		}
	}
}
