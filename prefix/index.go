package prefix

import (
	"sync"
	"sync/atomic"
)

// DefaultBlocksPerEngine is placement.prefix_index_blocks' default: the
// blocks the index keeps per engine (65,536 blocks of BlockBytes are
// 4 MiB of prompt; the index spends about 40 bytes per block).
const DefaultBlocksPerEngine = 65536

// MaxBlocksPerEngine is the largest bound NewIndex accepts (slots are
// 32-bit).
const MaxBlocksPerEngine = 1 << 24

// MaxEngines bounds the engines one Index tracks: a Record or Learn for
// a new engine beyond it is ignored, so hostile engine ids (from the bus)
// cannot grow it without bound. Callers should still learn only engines
// of their fleet.
const MaxEngines = 1024

// Index is, per engine, a bounded LRU set of the block hashes recently
// placed there (behaviour.md R-PLACE-2): this router's own placements (Record)
// and the other routers' (Learn). It is safe for concurrent use. Match,
// the placement path's call, takes no lock of the index as a whole: the
// engines' table is read through an atomic pointer (copied on the rare
// write: a new engine, a Drop), and each engine has its own
// reader/writer lock, held for one engine at a time.
type Index struct {
	capacity int
	mu       sync.Mutex // serialises writers of engines; guards sized
	engines  atomic.Pointer[map[string]*engineLRU]
	// sized is each engine's own bound set by SetCapacity (at most
	// capacity), kept across a Drop so that the engine's next entries
	// are bounded alike.
	sized map[string]int
}

// NewIndex returns an empty index that keeps at most blocksPerEngine
// hashes per engine (placement.prefix_index_blocks), clamped to
// [1, MaxBlocksPerEngine].
func NewIndex(blocksPerEngine int) *Index {
	blocksPerEngine = max(1, min(blocksPerEngine, MaxBlocksPerEngine))
	ix := &Index{capacity: blocksPerEngine, sized: map[string]int{}}
	m := map[string]*engineLRU{}
	ix.engines.Store(&m)
	return ix
}

// Capacity returns the bound per engine, in blocks.
func (ix *Index) Capacity() int { return ix.capacity }

// lookup returns the engine's LRU, nil when the index has none.
func (ix *Index) lookup(engineID string) *engineLRU {
	return (*ix.engines.Load())[engineID]
}

// get returns the engine's LRU, created when missing; nil when the index
// already tracks MaxEngines engines.
func (ix *Index) get(engineID string) *engineLRU {
	if e := ix.lookup(engineID); e != nil {
		return e
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	old := *ix.engines.Load()
	if e := old[engineID]; e != nil {
		return e
	}
	if len(old) >= MaxEngines {
		return nil
	}
	next := make(map[string]*engineLRU, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	capacity := ix.capacity
	if c, ok := ix.sized[engineID]; ok {
		capacity = c
	}
	e := newEngineLRU(capacity)
	next[engineID] = e
	ix.engines.Store(&next)
	return e
}

// Record notes that a prompt with the chained block hashes hashes was
// placed on engineID. It appends to fresh the hashes the index did not
// hold for that engine before (in the order of hashes) and returns it;
// Learn does the same without them. Every hash of hashes becomes recent, the leading ones most recent, so
// that eviction takes a prompt's tail before its head and the hashes held
// for an engine stay, chain by chain, a prefix (what Match relies on). It
// does not allocate once the engine's set is full and fresh has room.
func (ix *Index) Record(engineID string, hashes, fresh []uint64) []uint64 {
	e := ix.get(engineID)
	if e == nil || len(hashes) == 0 {
		return fresh
	}
	start := len(fresh)
	e.mu.Lock()
	fresh = e.touchChain(hashes, fresh, true)
	e.mu.Unlock()
	added := fresh[start:]
	for i, j := 0, len(added)-1; i < j; i, j = i+1, j-1 {
		added[i], added[j] = added[j], added[i]
	}
	return fresh
}

// Learn applies a placement — this router's own, or one another router
// published: the hashes (in chain order) become recent for engineID, the
// leading ones most recent, as Record makes them, without listing the
// ones the index lacked. At most the index's capacity of them are
// applied (the first ones; Record of a longer chain ends with the same
// ones held). It does not allocate.
func (ix *Index) Learn(engineID string, hashes []uint64) {
	if len(hashes) > ix.capacity {
		hashes = hashes[:ix.capacity]
	}
	e := ix.get(engineID)
	if e == nil || len(hashes) == 0 {
		return
	}
	e.mu.Lock()
	e.touchChain(hashes, nil, false)
	e.mu.Unlock()
}

// Drop forgets everything the index holds for engineID (an engine ejected,
// drained, restarted or removed: its cache is gone or unreachable).
func (ix *Index) Drop(engineID string) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	old := *ix.engines.Load()
	if _, ok := old[engineID]; !ok {
		return
	}
	next := make(map[string]*engineLRU, len(old))
	for k, v := range old {
		if k != engineID {
			next[k] = v
		}
	}
	ix.engines.Store(&next)
}

// Cut removes hashes from what the index holds for engineID (behaviour.md
// R-PLACE-3): the blocks of a chain the engine said it did not hold —
// the caller passes the chain from the block where the engine's cache
// ended — so that the next Match of that prompt on the engine stops
// there. Hashes the index does not hold are skipped. It is O(len(hashes)),
// takes the engine's write lock only and does not allocate; it reports
// how many hashes it removed.
func (ix *Index) Cut(engineID string, hashes []uint64) int {
	e := ix.lookup(engineID)
	if e == nil || len(hashes) == 0 {
		return 0
	}
	n := 0
	e.mu.Lock()
	for _, h := range hashes {
		if e.remove(h) {
			n++
		}
	}
	e.mu.Unlock()
	return n
}

// SetCapacity bounds what the index keeps for engineID to blocks
// (clamped to [1, Capacity()]): an engine's own KV cache size, where it
// reports one (vLLM's cache_config_info). When the engine holds more,
// its least recent hashes are evicted at once. The bound stays for the
// engine's entries after a Drop. It returns the bound applied; an
// engine beyond MaxEngines is not bounded and 0 is returned.
func (ix *Index) SetCapacity(engineID string, blocks int) int {
	blocks = max(1, min(blocks, ix.capacity))
	ix.mu.Lock()
	if _, ok := ix.sized[engineID]; !ok && len(ix.sized) >= MaxEngines {
		ix.mu.Unlock()
		return 0
	}
	ix.sized[engineID] = blocks
	ix.mu.Unlock()
	e := ix.get(engineID)
	if e == nil {
		return 0
	}
	e.mu.Lock()
	e.capacity = blocks
	for e.size.Load() > int64(blocks) && e.tail >= 0 {
		e.remove(e.hash[e.tail])
	}
	e.mu.Unlock()
	return blocks
}

// EngineCapacity returns the bound of what the index keeps for
// engineID: SetCapacity's, else Capacity().
func (ix *Index) EngineCapacity(engineID string) int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if c, ok := ix.sized[engineID]; ok {
		return c
	}
	return ix.capacity
}

// Forget removes engineID's own bound (SetCapacity), for an engine that
// left the fleet; what the index holds for it is Drop's.
func (ix *Index) Forget(engineID string) {
	ix.mu.Lock()
	delete(ix.sized, engineID)
	ix.mu.Unlock()
}

// Match returns how many leading hashes of hashes the index holds for
// engineID: the blocks of the prompt's prefix recently placed there. It
// relies on what Record and Learn keep true — for a chain, the hashes
// held are a prefix of it — and so probes O(log n) hashes, not n; when
// that does not hold (a remote placement learned without the blocks
// before it, or a Cut of another prompt's chain through blocks this one
// shares), it may count a block the index does not hold. It takes the
// engine's read lock only, and does not allocate.
func (ix *Index) Match(engineID string, hashes []uint64) int {
	e := ix.lookup(engineID)
	if e == nil || len(hashes) == 0 {
		return 0
	}
	e.mu.RLock()
	defer e.mu.RUnlock()
	if _, ok := e.slot.get(hashes[0]); !ok {
		return 0
	}
	// hashes[lo-1] is held; the answer is in [lo, hi].
	lo, hi := 1, len(hashes)
	for lo < hi {
		mid := (lo + hi + 1) / 2
		if _, ok := e.slot.get(hashes[mid-1]); ok {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	return lo
}

// Blocks returns how many hashes the index holds for engineID (at most
// Capacity): the value of narwhal_prefix_index_blocks{engine}.
func (ix *Index) Blocks(engineID string) int {
	e := ix.lookup(engineID)
	if e == nil {
		return 0
	}
	return int(e.size.Load())
}

// Engines calls fn with each engine the index holds hashes for and their
// count, in no particular order.
func (ix *Index) Engines(fn func(engineID string, blocks int)) {
	for id, e := range *ix.engines.Load() {
		fn(id, int(e.size.Load()))
	}
}

// engineLRU is one engine's bounded LRU set of hashes: a table from hash
// to slot and a doubly linked list through the slots, in arrays, so that
// once full it never allocates (an evicted slot is reused).
type engineLRU struct {
	mu         sync.RWMutex
	capacity   int
	slot       *table
	hash       []uint64
	prev, next []int32
	head, tail int32 // most and least recent slot; -1 when empty
	free       int32 // first slot of the free list (linked through next); -1 when none
	size       atomic.Int64
}

func newEngineLRU(capacity int) *engineLRU {
	return &engineLRU{capacity: capacity, slot: newTable(), head: -1, tail: -1, free: -1}
}

// remove takes h out of the set, its slot onto the free list, and
// reports whether h was held. The caller holds e.mu.
func (e *engineLRU) remove(h uint64) bool {
	s, ok := e.slot.get(h)
	if !ok {
		return false
	}
	e.slot.del(h)
	e.unlink(s)
	e.next[s] = e.free
	e.free = s
	e.size.Add(-1)
	return true
}

// touchChain makes the chain hashes (in chain order) the most recent
// hashes, hashes[0] the most recent of all, as touching each from the last
// to the first would; when collect is set it appends to fresh the hashes
// not held before, the last first, and returns it. The leading hashes that already follow each
// other in the recency list in chain order (a prompt placed before, or one
// sharing a placed prompt's head: what Record itself leaves behind) move
// to the front as one segment, and the rest go in behind them: the same
// order as moving every one, with one table look-up for the segment. A chain longer than the set takes the slow
// path. The caller holds e.mu.
func (e *engineLRU) touchChain(hashes, fresh []uint64, collect bool) []uint64 {
	k, after := 0, int32(-1)
	if len(hashes) <= e.capacity {
		if first, ok := e.slot.get(hashes[0]); ok {
			last := first
			for k = 1; k < len(hashes); k++ {
				s := e.next[last]
				if s < 0 || e.hash[s] != hashes[k] {
					break
				}
				last = s
			}
			e.spliceFront(first, last)
			after = last
		}
	}
	for i := len(hashes) - 1; i >= k; i-- {
		var held bool
		if held, after = e.touchAfter(hashes[i], after); !held && collect {
			fresh = append(fresh, hashes[i])
		}
	}
	return fresh
}

// touchAfter places h right behind slot after in the recency list (at its
// front when after is -1), inserting it (and evicting the least recent
// when full) if absent. It reports whether h was held, and the slot to
// insert behind from now on: after, or its predecessor when after itself
// was the one evicted (hostile input may repeat a hash). The caller holds
// e.mu.
func (e *engineLRU) touchAfter(h uint64, after int32) (bool, int32) {
	if s, ok := e.slot.get(h); ok {
		if s == after || (after < 0 && s == e.head) || (after >= 0 && e.next[after] == s) {
			return true, after
		}
		e.unlink(s)
		e.insertAfter(s, after)
		return true, after
	}
	var s int32
	switch {
	case e.size.Load() < int64(e.capacity) && e.free >= 0:
		s = e.free
		e.free = e.next[s]
		e.hash[s] = h
		e.prev[s], e.next[s] = -1, -1
		e.size.Add(1)
	case e.size.Load() < int64(e.capacity):
		s = int32(len(e.hash))
		e.hash = append(e.hash, h)
		e.prev = append(e.prev, -1)
		e.next = append(e.next, -1)
		e.size.Add(1)
	default:
		s = e.tail
		if s == after {
			after = e.prev[s]
		}
		e.slot.del(e.hash[s])
		e.unlink(s)
		e.hash[s] = h
	}
	e.slot.put(h, s)
	e.insertAfter(s, after)
	return false, after
}

// spliceFront moves the segment of the recency list from slot first to
// slot last (last at or after first) to the front, in its order.
func (e *engineLRU) spliceFront(first, last int32) {
	if first == e.head {
		return
	}
	p, n := e.prev[first], e.next[last]
	e.next[p] = n
	if n >= 0 {
		e.prev[n] = p
	} else {
		e.tail = p
	}
	e.prev[first] = -1
	e.next[last] = e.head
	e.prev[e.head] = last
	e.head = first
}

// insertAfter links the unlinked slot s right behind slot p, or at the
// front when p is -1.
func (e *engineLRU) insertAfter(s, p int32) {
	if p < 0 {
		e.pushFront(s)
		return
	}
	n := e.next[p]
	e.prev[s], e.next[s] = p, n
	e.next[p] = s
	if n >= 0 {
		e.prev[n] = s
	} else {
		e.tail = s
	}
}

func (e *engineLRU) unlink(s int32) {
	p, n := e.prev[s], e.next[s]
	if p >= 0 {
		e.next[p] = n
	} else {
		e.head = n
	}
	if n >= 0 {
		e.prev[n] = p
	} else {
		e.tail = p
	}
	e.prev[s], e.next[s] = -1, -1
}

func (e *engineLRU) pushFront(s int32) {
	e.prev[s] = -1
	e.next[s] = e.head
	if e.head >= 0 {
		e.prev[e.head] = s
	}
	e.head = s
	if e.tail < 0 {
		e.tail = s
	}
}
