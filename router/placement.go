package router

import (
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/prefix"
)

// PlacedFunc receives, after each prefix placement, the producer's
// engine id and the block hashes of the prompt the router's index did
// not hold for that engine before: what the other routers need to Learn
// (behaviour.md R-PLACE-2). It runs on the request path: it must not block, and
// must copy fresh to keep it (the slice is reused).
type PlacedFunc func(engineID string, fresh []uint64)

// placer is the router's placement policy (behaviour.md R-PLACE-1, R-PLACE-2):
// which of the engines that may take a leg gets it.
type placer struct {
	policy  string
	balance prefix.Balance
	index   *prefix.Index
	placed  atomic.Pointer[PlacedFunc]
	scratch sync.Pool // *placeScratch

	// decisions counts prefix placements by what decided them.
	matched, unmatched, guarded prometheus.Counter
}

// placeScratch is one request's placement buffers, pooled so that a
// placement allocates nothing in steady state.
type placeScratch struct {
	prompt []byte
	hashes []uint64
	hashed bool // prompt and hashes are this request's
	fresh  []uint64
	ms     []*member
	cands  []prefix.Candidate
}

// maxPooledPrompt is the largest rendered-prompt buffer kept for reuse:
// a rare huge prompt does not pin its buffer in the pool.
const maxPooledPrompt = 1 << 20

func newPlacer(cfg config.Placement, reg prometheus.Registerer, f func() *fleet) *placer {
	pl := &placer{
		policy:  cfg.Policy,
		balance: prefix.Balance{Abs: int64(cfg.BalanceAbsThreshold), Rel: cfg.BalanceRelThreshold},
		index:   prefix.NewIndex(cfg.PrefixIndexBlocks),
	}
	if pl.policy == "" {
		pl.policy = config.PolicyLeastLoaded
	}
	pl.scratch.New = func() any { return new(placeScratch) }
	decisions := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "narwhal_prefix_placements_total",
		Help: "Prefill placements of the prefix policy by what decided them: matched (the chosen engine held part of the prompt's prefix), unmatched (none did, or the prompt was too short to weigh: least loaded), guard (the imbalance guard chose by load).",
	}, []string{"decision"})
	pl.matched = decisions.WithLabelValues("matched")
	pl.unmatched = decisions.WithLabelValues("unmatched")
	pl.guarded = decisions.WithLabelValues("guard")
	reg.MustRegister(decisions, &indexCollector{index: pl.index, f: f})
	return pl
}

// OnPlaced sets the function that receives each prefix placement's
// fresh block hashes (for publishing them on the bus); nil removes it.
func (rt *Router) OnPlaced(fn PlacedFunc) {
	if fn == nil {
		rt.placer.placed.Store(nil)
		return
	}
	rt.placer.placed.Store(&fn)
}

// PrefixIndex returns the router's prefix index: what the mesh's other
// routers placed is applied to it with Learn, and an engine whose cache
// is gone (ejected, drained, restarted) is dropped from it with Drop.
func (rt *Router) PrefixIndex() *prefix.Index { return rt.placer.index }

// SetEngineWaiting records engineID's own queue (vLLM's
// num_requests_waiting, as last read from the engine) for placement: the
// prefix policy weighs it with the router's outstanding attempts. n < 0
// is taken as 0. Unknown engines are ignored.
func (rt *Router) SetEngineWaiting(engineID string, n int64) {
	if m := rt.fleet().byID[engineID]; m != nil {
		m.waiting.Store(max(n, 0))
	}
}

// placeLegs places both legs of an attempt (behaviour.md R-PLACE-1, R-PLACE-2,
// R-RETRY-3) and reserves their slots: the producer by the policy, the
// consumer least loaded among the engines of the producer's connector
// (R-DESC-3) — except that under the prefix policy a
// same-worker producer (role both) keeps the decode when it can take it,
// so the whole attempt runs where the prefix is. It returns the fault of
// a phase no engine can take.
func (c *call) placeLegs(avoid *avoidSet) (prod, cons *member, f *engines.Fault) {
	rt := c.rt
	fl := rt.fleet()
	prod, err := c.placeProducer(fl, avoid[prefillPhase])
	if err != nil {
		return nil, nil, noEngine(prefillPhase)
	}
	if rt.placer.policy == config.PolicyPrefix && prod.can(decodePhase) && !slices.Contains(avoid[decodePhase], prod) &&
		prod.available(time.Now().UnixNano()) && prod.tryReserve(decodePhase) {
		return prod, prod, nil
	}
	cons, err = fl.placeConsumer(c.req.Model, avoid[decodePhase], prod.Connector.Name())
	if err != nil {
		prod.release(prefillPhase)
		return nil, nil, noEngine(decodePhase)
	}
	return prod, cons, nil
}

// placeProducer places the prefill leg by the router's policy; under the
// prefix policy it records the prompt's blocks at the chosen producer
// and hands the fresh ones to the OnPlaced function.
func (c *call) placeProducer(fl *fleet, avoid []*member) (*member, error) {
	pl := c.rt.placer
	switch pl.policy {
	case config.PolicyLeastLoaded:
		return fl.place(c.req.Model, prefillPhase, avoid)
	case config.PolicyRandom:
		return fl.placeBy(pl, c.req.Model, prefillPhase, avoid, nil, c.placeScratch())
	}
	sc := c.placeScratch()
	if !sc.hashed {
		// Hashed once per request; a retry reuses the hashes.
		// Only the hashed head is rendered: a prompt of many MiB costs no
		// more than MaxBlocks blocks.
		sc.prompt = c.req.AppendPromptPrefix(sc.prompt[:0], prefix.MaxBlocks*prefix.BlockBytes)
		sc.hashes = prefix.AppendHashes(sc.hashes[:0], sc.prompt)
		sc.hashed = true
	}
	m, err := fl.placeBy(pl, c.req.Model, prefillPhase, avoid, sc.hashes, sc)
	if err != nil || len(sc.hashes) == 0 {
		return m, err
	}
	sc.fresh = pl.index.Record(m.ID, sc.hashes, sc.fresh[:0])
	if fn := pl.placed.Load(); fn != nil && len(sc.fresh) > 0 {
		(*fn)(m.ID, sc.fresh)
	}
	return m, nil
}

// placeScratch returns the call's placement buffers, taken from the pool
// on first use; releasePlacement gives them back.
func (c *call) placeScratch() *placeScratch {
	if c.scratch == nil {
		c.scratch = c.rt.placer.scratch.Get().(*placeScratch)
		c.scratch.hashed = false
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
	sc.prompt = sc.prompt[:0]
	c.rt.placer.scratch.Put(sc)
}

// placeBy chooses, among the engines that may take phase p for model now
// (eligible, not quarantined, active, within their slot limit: R-PLACE-1),
// one by pl's policy and reserves its slot (R-OWN-3): prefix scores each
// by the leading blocks of hashes its index holds against its load, with
// the imbalance guard (R-PLACE-2); random picks uniformly. Engines in
// avoid are chosen only when no other engine can take the phase, and
// then the least loaded of them (R-RETRY-3). It returns *errNoEngine when
// none can take the phase.
func (f *fleet) placeBy(pl *placer, model string, p phase, avoid []*member, hashes []uint64, sc *placeScratch) (*member, error) {
	now := time.Now().UnixNano()
	for try := 0; try < 4; try++ {
		ms, cands := sc.ms[:0], sc.cands[:0]
		var fallback pick
		for _, m := range f.members {
			if !m.can(p) || !m.available(now) || !m.serves(model) {
				continue
			}
			load := m.reserved[p].Load()
			if m.limit[p] > 0 && load >= m.limit[p] {
				continue
			}
			if slices.Contains(avoid, m) {
				fallback.offer(m, load)
				continue
			}
			ms = append(ms, m)
			cands = append(cands, prefix.Candidate{Outstanding: load, Waiting: m.waiting.Load()})
		}
		sc.ms, sc.cands = ms, cands
		var chosen *member
		switch {
		case len(ms) == 0:
			chosen = fallback.m
		case pl.policy == config.PolicyRandom:
			chosen = ms[rand.IntN(len(ms))]
		default:
			if len(hashes) >= prefix.MinScoredBlocks {
				for i, m := range ms {
					cands[i].Matched = pl.index.Match(m.ID, hashes)
				}
			}
			i, guarded := prefix.Choose(cands, len(hashes), pl.balance)
			chosen = ms[i]
			switch {
			case guarded:
				pl.guarded.Inc()
			case cands[i].Matched > 0:
				pl.matched.Inc()
			default:
				pl.unmatched.Inc()
			}
		}
		if chosen == nil {
			return nil, &errNoEngine{p}
		}
		if chosen.tryReserve(p) {
			return chosen, nil
		}
	}
	return nil, &errNoEngine{p}
}

// indexCollector exports narwhal_prefix_index_blocks{engine}: the block
// hashes the prefix index holds per engine (each bounded by
// placement.prefix_index_blocks), for every fleet member and every
// other engine the index still holds blocks for.
type indexCollector struct {
	index *prefix.Index
	f     func() *fleet
}

var indexBlocksDesc = prometheus.NewDesc("narwhal_prefix_index_blocks",
	"Block hashes the prefix placement index holds per engine (bounded by placement.prefix_index_blocks).", []string{"engine"}, nil)

func (c *indexCollector) Describe(ch chan<- *prometheus.Desc) { ch <- indexBlocksDesc }

func (c *indexCollector) Collect(ch chan<- prometheus.Metric) {
	seen := map[string]bool{}
	c.index.Engines(func(id string, n int) {
		seen[id] = true
		ch <- prometheus.MustNewConstMetric(indexBlocksDesc, prometheus.GaugeValue, float64(n), id)
	})
	if fl := c.f(); fl != nil {
		for _, m := range fl.members {
			if !seen[m.ID] {
				ch <- prometheus.MustNewConstMetric(indexBlocksDesc, prometheus.GaugeValue, 0, m.ID)
			}
		}
	}
}
