package meshview

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/internal/promreg"
	"github.com/narwhalmesh/narwhal/prefix"
)

// indexCheckEvery is how often the prefix index is checked against the
// fleet: an engine that left it, was ejected or is not active (draining,
// drained) has its entries dropped within this.
const indexCheckEvery = 250 * time.Millisecond

// maxEngineMetricsWait bounds one read of an engine's /metrics.
const maxEngineMetricsWait = 2 * time.Second

// Reasons of narwhal_prefix_index_drops_total.
const (
	indexDropRemoved   = "removed"
	indexDropEjected   = "ejected"
	indexDropInactive  = "inactive"
	indexDropRestarted = "restarted"
)

// engineLife is what the router last read of one engine's /metrics: its
// start time and prompt-token counter, to see it restart.
type engineLife struct {
	start, prompt       float64
	hasStart, hasPrompt bool
}

// engineWatch keeps the prefix index true to the engines' caches (behaviour.md
// R-PLACE-2): the entries of an engine that left the fleet, was ejected,
// is draining or drained, or restarted (its cache is gone) are dropped;
// and it reads each prefill engine's queue for the prefix scorer.
type engineWatch struct {
	v     *View
	drops *prometheus.CounterVec
	mu    sync.Mutex
	life  map[string]*engineLife // by engine id; fleet members only
	// exactDrops is narwhal_prefix_exact_drops_total{reason}, nil
	// without an exact index; exactSeen is what checkExact last saw of
	// each engine the exact index has an entry for (the watch's
	// goroutine only).
	exactDrops *prometheus.CounterVec
	exactSeen  map[string]exactSeen
}

// exactSeen is an engine as checkExact last saw it: its member (a new
// one is a new engine behind the id: its URL or spec changed), whether it
// was eligible and active.
type exactSeen struct {
	m                *Member
	eligible, active bool
}

func newEngineWatch(v *View) *engineWatch {
	w := &engineWatch{v: v, life: map[string]*engineLife{},
		drops: promreg.Register(v.reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_prefix_index_drops_total",
			Help: "Engines whose prefix index entries were dropped, by reason: removed (left the fleet), ejected, inactive (draining, drained, joining), restarted (its start time changed or its prompt-token counter went back).",
		}, []string{"reason"}))}
	for _, r := range []string{indexDropRemoved, indexDropEjected, indexDropInactive, indexDropRestarted} {
		w.drops.WithLabelValues(r)
	}
	if v.exact != nil {
		w.exactSeen = map[string]exactSeen{}
		w.exactDrops = promreg.Register(v.reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_prefix_exact_drops_total",
			Help: "Engines whose exact prefix index was dropped (placed by the approximate index until it is exact again: a KVCleared of each rank, or an agent run read from its first batch), by reason: removed (left the fleet), ejected, inactive (draining, drained), restarted (a new URL or spec in the fleet, its start time changed or its prompt-token counter went back).",
		}, []string{"reason"}))
		for _, r := range []string{indexDropRemoved, indexDropEjected, indexDropInactive, indexDropRestarted} {
			w.exactDrops.WithLabelValues(r)
		}
	}
	return w
}

// dropExact drops the exact index of engine id, for reason, when it held
// something or was exact.
func (w *engineWatch) dropExact(id, reason string) {
	if w.v.exact == nil || !w.v.exact.Drop(id) {
		return
	}
	w.exactDrops.WithLabelValues(reason).Inc()
	w.v.log.Info("exact prefix index dropped", "engine_id", id, "reason", reason)
}

// checkExact drops the exact index of every engine that was ejected,
// stopped being active (draining, drained) or restarted (another member
// behind its id) since the last check, and forgets the engines that left
// the fleet (behaviour.md R-PLACE-4). An engine dropped is placed by the
// approximate index until its exact index is exact again.
func (w *engineWatch) checkExact() {
	if w.v.exact == nil {
		return
	}
	fl := w.v.Fleet()
	var gone []string
	w.v.exact.Engines(func(id string, _ *prefix.ExactEngine) {
		if m := fl.byID[id]; m == nil || !m.Can(Prefill) {
			gone = append(gone, id)
		}
	})
	for _, id := range gone {
		if w.v.exact.Drop(id) {
			w.exactDrops.WithLabelValues(indexDropRemoved).Inc()
		}
		w.v.exact.Forget(id)
		delete(w.exactSeen, id)
	}
	for id := range w.exactSeen {
		if w.v.exact.Lookup(id) == nil {
			delete(w.exactSeen, id)
		}
	}
	for _, m := range fl.members {
		if !m.Can(Prefill) || w.v.exact.Lookup(m.ID) == nil {
			continue
		}
		now := exactSeen{m: m, eligible: m.eligible.Load(), active: m.active.Load()}
		prev, seen := w.exactSeen[m.ID]
		if !seen {
			// First seen since its entry was made: placeable then (an
			// entry is made by a batch, which any state takes).
			prev = exactSeen{m: m, eligible: true, active: true}
		}
		w.exactSeen[m.ID] = now
		switch {
		case prev.m != m:
			w.dropExact(m.ID, indexDropRestarted)
		case prev.eligible && !now.eligible:
			w.dropExact(m.ID, indexDropEjected)
			m.clearInflight()
		case prev.active && !now.active:
			w.dropExact(m.ID, indexDropInactive)
			m.clearInflight()
		}
	}
}

// drop forgets what the index holds for engine id, for reason.
func (w *engineWatch) drop(id, reason string) {
	w.v.index.Drop(id)
	w.drops.WithLabelValues(reason).Inc()
	w.v.log.Info("prefix index entries dropped", "engine_id", id, "reason", reason)
}

// checkIndex drops the entries of every engine the index holds blocks
// for that is not a placeable member of the fleet any more, and every
// engine outside the fleet, so that narwhal_prefix_index_blocks names no
// engine that left (behaviour.md R-FLEET-5).
func (w *engineWatch) checkIndex() {
	fl := w.v.Fleet()
	type gone struct{ id, reason string }
	var drop []gone
	var empty []string
	w.v.index.Engines(func(id string, blocks int) {
		m := fl.byID[id]
		switch {
		case m == nil && blocks == 0:
			empty = append(empty, id) // nothing to count, but its series goes (R-FLEET-5)
		case blocks == 0:
		case m == nil:
			drop = append(drop, gone{id, indexDropRemoved})
		case !m.eligible.Load():
			drop = append(drop, gone{id, indexDropEjected})
		case !m.active.Load():
			drop = append(drop, gone{id, indexDropInactive})
		}
	})
	for _, g := range drop {
		w.drop(g.id, g.reason)
	}
	for _, id := range empty {
		w.v.index.Drop(id)
		w.v.index.Forget(id)
	}
}

// poll reads every prefill engine's /metrics once, concurrently: it sets
// the engine's queue for the scorer (0 when unknown) and drops its index
// entries when it restarted.
func (w *engineWatch) poll(wait time.Duration) {
	fl := w.v.Fleet()
	var wg sync.WaitGroup
	w.mu.Lock()
	for id := range w.life {
		if fl.byID[id] == nil {
			delete(w.life, id)
		}
	}
	for _, m := range fl.members {
		if !m.Can(Prefill) {
			continue
		}
		life := w.life[m.ID]
		if life == nil {
			life = &engineLife{}
			w.life[m.ID] = life
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.pollOne(m, life, wait)
		}()
	}
	w.mu.Unlock()
	wg.Wait()
}

// pollOne reads m's /metrics (bounded by wait) into life.
func (w *engineWatch) pollOne(m *Member, life *engineLife, wait time.Duration) {
	ctx, cancel := context.WithTimeout(w.v.base, wait)
	defer cancel()
	l, err := engines.ReadLoad(ctx, w.v.http, &m.Engine)
	if err != nil {
		w.v.SetEngineWaiting(m.ID, 0)
		m.SetRunning(0)
		return
	}
	w.v.SetEngineWaiting(m.ID, l.Waiting)
	m.SetRunning(l.Running)
	if l.KVBlocks > 0 {
		w.v.sizeIndex(m, l.KVBlocks*l.KVBlockTokens)
		w.v.sizeExact(m, l.KVBlocks)
	}
	restarted := false
	if l.HasStartTime {
		restarted = life.hasStart && l.StartTime != life.start
		life.start, life.hasStart = l.StartTime, true
	}
	if l.HasPromptTokens {
		restarted = restarted || life.hasPrompt && l.PromptTokens < life.prompt
		life.prompt, life.hasPrompt = l.PromptTokens, true
	}
	// An engine the index holds nothing for has nothing to drop: one
	// whose start time flaps (lying, or restarting in a loop) is not
	// counted and logged at every read.
	if restarted && w.v.index.Blocks(m.ID) > 0 {
		w.drop(m.ID, indexDropRestarted)
	}
	if restarted {
		w.dropExact(m.ID, indexDropRestarted)
	}
}

// exactPerGPUBlock is how many exact-index blocks an engine may hold per
// block of its GPU KV cache: room for a second data-parallel rank's, or
// an offloading tier as large as the GPU's (past it, stored blocks are
// not kept: the index holds less than the engine, never more).
const exactPerGPUBlock = 2

// sizeExact bounds the exact index of m to exactPerGPUBlock × its GPU KV
// cache of kvBlocks blocks (vLLM's num_gpu_blocks, behaviour.md
// R-PLACE-4).
func (v *View) sizeExact(m *Member, kvBlocks int64) {
	if v.exact == nil {
		return
	}
	blocks := int(min(min(kvBlocks, 1<<40)*exactPerGPUBlock, prefix.MaxExactBlocksPerEngine))
	if v.exact.EngineCapacity(m.ID) != blocks {
		v.exact.SetCapacity(m.ID, blocks)
		v.log.Info("exact prefix index sized from the engine's KV cache", "engine_id", m.ID, "gpu_blocks", kvBlocks, "blocks", blocks)
	}
}

// sizeIndex bounds the prefix index of m to its KV cache of kvTokens
// tokens (behaviour.md R-PLACE-3), in blocks of rendered prompt at the
// bytes per token learned for the first model it lists, never above
// placement.prefix_index_blocks.
func (v *View) sizeIndex(m *Member, kvTokens int64) {
	ratio := prefix.DefaultTokenRatio
	if ms := m.Models(); len(ms) > 0 {
		ratio, _ = v.TokenWork(ms[0])
	}
	kvTokens = min(kvTokens, 1<<40)
	blocks := kvTokens * int64(ratio) / 256 / prefix.BlockBytes
	blocks = min(max(blocks, 1), int64(v.index.Capacity()))
	// A learned ratio moves a little with every answer: only a change of
	// more than 1/16 re-bounds the index.
	if cur := int64(v.index.EngineCapacity(m.ID)); blocks < cur-cur/16 || blocks > cur+cur/16 {
		v.index.SetCapacity(m.ID, int(blocks))
		v.log.Info("prefix index sized from the engine's KV cache", "engine_id", m.ID, "kv_tokens", kvTokens, "blocks", blocks)
	}
}

// run checks the index every indexCheckEvery and, when interval > 0
// (placement.engine_metrics_interval_s), reads the engines' /metrics
// every interval, until the router shuts down.
func (w *engineWatch) run(interval time.Duration) {
	check := time.NewTicker(indexCheckEvery)
	defer check.Stop()
	var pollC <-chan time.Time
	if interval > 0 {
		p := time.NewTicker(interval)
		defer p.Stop()
		pollC = p.C
		w.poll(min(interval, maxEngineMetricsWait))
	}
	for {
		select {
		case <-w.v.base.Done():
			return
		case <-check.C:
			w.checkIndex()
			w.checkExact()
		case <-pollC:
			w.poll(min(interval, maxEngineMetricsWait))
		}
	}
}
