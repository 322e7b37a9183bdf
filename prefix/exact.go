package prefix

import (
	"sync"
	"sync/atomic"
)

// Medium is where an engine holds a KV block, as its KV events say
// (behaviour.md R-PLACE-4): its GPU memory or a tier an offloading
// connector loads from. Its values are those of bus.KVMedium.
type Medium uint8

const (
	// MediumGPU is a block in the engine's GPU memory.
	MediumGPU Medium = 0
	// MediumCPU is a block in host memory (an offloading connector's CPU
	// tier).
	MediumCPU Medium = 1
	// MediumDisk is a block on local disk or in remote storage.
	MediumDisk Medium = 2
	// media is how many there are.
	media = 3
)

// MaxExactRanks bounds an engine's data-parallel ranks in the exact index
// (0…63, as bus.KVMaxRanks): each block holds one bit per rank.
const MaxExactRanks = 64

// MaxExactBlocksPerEngine is the largest bound of one engine's exact
// index (SetCapacity clamps to it): 2^21 blocks, 32 Mi tokens at 16
// tokens a block — more than any engine's GPU holds today — and up to
// about 180 MiB of router memory at the index's 60 to 85 bytes a block.
const MaxExactBlocksPerEngine = 1 << 21

// Sequence is what a batch's epoch and seq say of the engine's stream of
// batches, relative to the last the exact index applied (ExactEngine.Check).
type Sequence uint8

const (
	// SeqNext is the batch that follows the last one applied: applied as
	// it is.
	SeqNext Sequence = iota
	// SeqDuplicate is a batch at or before the last one applied (a
	// warm-up's overlap with the live batches): skipped.
	SeqDuplicate
	// SeqGap is a batch of the same epoch after a gap: batches between
	// were missed. Applied, it first drops what the index held of the
	// engine (its removals may be among the missed).
	SeqGap
	// SeqNewEpoch is a batch of another epoch than the last one applied
	// (the agent started again), or the first batch seen of the engine.
	// Applied, it first drops what the index held; seq 1 makes the index
	// exact (the run read from its start), a later seq leaves it inexact
	// (what the run said before it is unknown).
	SeqNewEpoch
)

// ExactMatch is how many leading blocks of a prompt's key chain an
// engine holds by its exact index (ExactIndex.Match), per tier: each
// count is the longest prefix of the chain that one data-parallel rank
// holds whole on those media, the best rank's.
type ExactMatch struct {
	// GPU is the leading blocks some rank holds in GPU memory.
	GPU int
	// Host is the leading blocks some rank holds on GPU or in host
	// memory (CPU offload); Host >= GPU.
	Host int
	// Any is the leading blocks some rank holds on any medium (disk
	// and remote tiers too); Any >= Host.
	Any int
}

// Offloaded hits weigh less than GPU hits in the cost (behaviour.md
// R-PLACE-4): a block in an offloading tier saves its computation but
// still has to be loaded into GPU memory first. OffloadCost is the share
// of a block's prefill work, in 1/256, that a hit in host memory still
// costs, DiskCost a hit on disk or remote storage. Copying a token's KV
// (about 128 KiB for an 8B model in bf16) over PCIe at some 25 GB/s takes
// about 5 µs where computing it takes about 20 µs on a current GPU: a
// quarter. Disk and network tiers read at a few GB/s: half.
const (
	OffloadCost = 64  // a CPU hit costs 1/4 of computing the block
	DiskCost    = 128 // a disk hit costs 1/2
)

// CachedTokens returns what m saves of a prompt's prefill at blockSize
// tokens a block, in tokens of computation: its GPU blocks whole, its
// blocks only in host memory at 1−OffloadCost/256 and those only on disk
// at 1−DiskCost/256.
func (m ExactMatch) CachedTokens(blockSize int) int64 {
	gpu := int64(max(m.GPU, 0))
	host := max(int64(m.Host)-gpu, 0)
	disk := max(int64(m.Any)-gpu-host, 0)
	bs := int64(max(blockSize, 0))
	return bs * (gpu*256 + host*(256-OffloadCost) + disk*(256-DiskCost)) / 256
}

// ExactIndex is, per engine, the set of KV blocks the engine reports it
// holds (behaviour.md R-PLACE-4): keys of our own (TokenBlockKey, so that
// no router needs the engine's hash function or seed), each with the
// data-parallel ranks holding it on each medium, applied from the
// engine's KV events (stored, removed, cleared, lost) batch by batch in
// the order of their seq. It is bounded per engine (SetCapacity, else
// the index's capacity) and safe for concurrent use: Match, the
// placement path's call, reads the engines' table through an atomic
// pointer and takes one engine's read lock.
//
// It never over-predicts on purpose: whatever it cannot vouch for (a gap
// in an engine's batches, a new epoch read from its middle, a rank's
// lost events, Drop) is dropped, and the engine is not Exact until the
// index can say again everything it holds — a KVCleared of each rank it
// has seen, or an epoch read from its first batch.
type ExactIndex struct {
	capacity int
	mu       sync.Mutex // serialises writers of engines; guards sized
	engines  atomic.Pointer[map[string]*ExactEngine]
	sized    map[string]int
}

// NewExactIndex returns an empty exact index whose engines keep at most
// blocksPerEngine keys each until SetCapacity says otherwise
// (placement.prefix_index_blocks), clamped to [1,
// MaxExactBlocksPerEngine].
func NewExactIndex(blocksPerEngine int) *ExactIndex {
	x := &ExactIndex{capacity: max(1, min(blocksPerEngine, MaxExactBlocksPerEngine)), sized: map[string]int{}}
	m := map[string]*ExactEngine{}
	x.engines.Store(&m)
	return x
}

// Lookup returns engineID's entry, nil when the index has none.
func (x *ExactIndex) Lookup(engineID string) *ExactEngine {
	return (*x.engines.Load())[engineID]
}

// Engine returns engineID's entry, created empty (not Exact) when
// missing; nil when the index already tracks MaxEngines engines.
func (x *ExactIndex) Engine(engineID string) *ExactEngine {
	if e := x.Lookup(engineID); e != nil {
		return e
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	old := *x.engines.Load()
	if e := old[engineID]; e != nil {
		return e
	}
	if len(old) >= MaxEngines {
		return nil
	}
	next := make(map[string]*ExactEngine, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	capacity := x.capacity
	if c, ok := x.sized[engineID]; ok {
		capacity = c
	}
	e := &ExactEngine{capacity: capacity, slot: newTable()}
	next[engineID] = e
	x.engines.Store(&next)
	return e
}

// SetCapacity bounds engineID's keys to blocks (clamped to [1,
// MaxExactBlocksPerEngine]): the engine's own KV cache in blocks, where
// it reports one (vLLM's cache_config_info num_gpu_blocks). Keys held
// beyond a smaller bound are dropped at once and the engine is not Exact
// any more (which keys the engine still holds is not known). The bound
// stays for the engine until Forget. It returns the bound applied, 0 for
// an engine beyond MaxEngines.
func (x *ExactIndex) SetCapacity(engineID string, blocks int) int {
	blocks = max(1, min(blocks, MaxExactBlocksPerEngine))
	x.mu.Lock()
	if _, ok := x.sized[engineID]; !ok && len(x.sized) >= MaxEngines {
		x.mu.Unlock()
		return 0
	}
	x.sized[engineID] = blocks
	x.mu.Unlock()
	e := x.Engine(engineID)
	if e == nil {
		return 0
	}
	e.mu.Lock()
	e.capacity = blocks
	if e.size.Load() > int64(blocks) {
		e.dropLocked()
	}
	e.mu.Unlock()
	return blocks
}

// EngineCapacity returns the bound of engineID's keys: SetCapacity's,
// else the index's.
func (x *ExactIndex) EngineCapacity(engineID string) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	if c, ok := x.sized[engineID]; ok {
		return c
	}
	return x.capacity
}

// Drop forgets every key engineID holds and makes it not Exact (an
// engine ejected, drained, restarted: its cache is gone, or what it did
// meanwhile is not known); the epoch and seq of its last batch are kept,
// so that its next batches apply in order. It reports whether the engine
// held a key or was Exact.
func (x *ExactIndex) Drop(engineID string) bool {
	e := x.Lookup(engineID)
	if e == nil {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	was := e.size.Load() > 0 || e.exact.Load()
	e.dropLocked()
	return was
}

// Forget removes engineID from the index, its bound too (an engine that
// left the fleet).
func (x *ExactIndex) Forget(engineID string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	delete(x.sized, engineID)
	old := *x.engines.Load()
	if _, ok := old[engineID]; !ok {
		return
	}
	next := make(map[string]*ExactEngine, len(old))
	for k, v := range old {
		if k != engineID {
			next[k] = v
		}
	}
	x.engines.Store(&next)
}

// Engines calls fn with each engine the index has an entry for and its
// entry, in no particular order.
func (x *ExactIndex) Engines(fn func(engineID string, e *ExactEngine)) {
	for id, e := range *x.engines.Load() {
		fn(id, e)
	}
}

// ExactCount returns how many engines are Exact.
func (x *ExactIndex) ExactCount() int {
	n := 0
	for _, e := range *x.engines.Load() {
		if e.exact.Load() {
			n++
		}
	}
	return n
}

// Match returns how many leading keys of keys (a prompt's chain,
// AppendTokenKeys at the engine's BlockSize) engineID holds, per tier,
// and whether its index is Exact (ok false: the counts are 0 and say
// nothing). It probes the chain from its start until no rank holds the
// block on any medium: O(matched blocks), one engine's read lock, no
// allocation.
func (x *ExactIndex) Match(engineID string, keys []uint64) (m ExactMatch, ok bool) {
	e := x.Lookup(engineID)
	if e == nil || !e.exact.Load() {
		return ExactMatch{}, false
	}
	e.mu.RLock()
	defer e.mu.RUnlock()
	if !e.exact.Load() {
		return ExactMatch{}, false
	}
	gpu, host, any := ^uint64(0), ^uint64(0), ^uint64(0)
	for i, k := range keys {
		s, held := e.slot.get(k)
		if !held {
			break
		}
		r := &e.ranks[s]
		gpu &= r[MediumGPU]
		host &= r[MediumGPU] | r[MediumCPU]
		any &= r[MediumGPU] | r[MediumCPU] | r[MediumDisk]
		if gpu != 0 {
			m.GPU = i + 1
		}
		if host != 0 {
			m.Host = i + 1
		}
		if any == 0 {
			break
		}
		m.Any = i + 1
	}
	return m, true
}

// ExactEngine is one engine's part of an ExactIndex. Its writer applies
// one batch at a time: Begin, then Store, Remove, Clear and Lose for the
// batch's ops, then End; every other method may be called at any time.
type ExactEngine struct {
	mu       sync.RWMutex
	capacity int
	slot     *table      // key → slot
	keys     []uint64    // by slot
	ranks    [][3]uint64 // by slot: the ranks holding the block, per medium
	free     []int32     // slots free for reuse
	size     atomic.Int64
	refused  atomic.Int64 // keys stored while full, not kept

	blockSize atomic.Int32
	epoch     uint64
	seq       uint64
	// seen and exactRanks are bit sets of ranks: those a batch named
	// since the last drop, and those whose blocks the index knows whole
	// (since a KVCleared of the rank, or an epoch read from its start).
	seen, exactRanks uint64
	exact            atomic.Bool
}

// allRanks is every rank's bit.
const allRanks = ^uint64(0)

// Blocks returns how many keys the engine holds (at most its bound): the
// value of narwhal_prefix_index_blocks{engine,index="exact"}.
func (e *ExactEngine) Blocks() int { return int(e.size.Load()) }

// Exact reports whether the index says everything the engine holds: no
// drop since an epoch read from its first batch or a KVCleared of each
// rank seen.
func (e *ExactEngine) Exact() bool { return e.exact.Load() }

// BlockSize returns the engine's tokens per KV block, from its last
// batch; 0 before any.
func (e *ExactEngine) BlockSize() int { return int(e.blockSize.Load()) }

// Refused returns how many stored keys were not kept because the engine
// held its bound of keys.
func (e *ExactEngine) Refused() int64 { return e.refused.Load() }

// Check returns what a batch of epoch and seq is to the engine's
// stream (Sequence), without changing anything.
func (e *ExactEngine) Check(epoch, seq uint64) Sequence {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.check(epoch, seq)
}

func (e *ExactEngine) check(epoch, seq uint64) Sequence {
	switch {
	case e.epoch == 0 || epoch != e.epoch:
		return SeqNewEpoch
	case seq <= e.seq:
		return SeqDuplicate
	case seq == e.seq+1:
		return SeqNext
	}
	return SeqGap
}

// Begin starts applying a batch of epoch, seq and blockSize tokens a
// block: it takes the engine's write lock, which End releases, and
// returns what the batch is to the stream. For SeqDuplicate the caller
// applies no op; SeqGap and SeqNewEpoch have dropped what the engine
// held first (SeqNewEpoch at seq 1 makes every rank exact: the run is
// read from its start). A block size other than the last batch's drops
// too (the keys of one block size are not those of another).
func (e *ExactEngine) Begin(epoch, seq uint64, blockSize int) Sequence {
	e.mu.Lock()
	v := e.check(epoch, seq)
	if v == SeqDuplicate {
		return v
	}
	if bs := int(e.blockSize.Load()); bs != 0 && bs != blockSize {
		e.dropLocked()
	}
	e.blockSize.Store(int32(blockSize))
	switch v {
	case SeqGap:
		e.dropLocked()
	case SeqNewEpoch:
		e.dropLocked()
		if seq == 1 {
			e.exactRanks = allRanks
		}
	}
	e.epoch, e.seq = epoch, seq
	return v
}

// End ends the batch Begin started: the engine is Exact when some rank
// is exact and every rank seen is.
func (e *ExactEngine) End() {
	e.exact.Store(e.exactRanks != 0 && e.seen&^e.exactRanks == 0)
	e.mu.Unlock()
}

// Store notes that rank holds the blocks of keys on medium. A key
// beyond the engine's bound is not kept (counted in Refused): the index
// then holds less than the engine, never more. Between Begin and End
// only; it allocates only while the engine's arrays grow.
func (e *ExactEngine) Store(rank int, medium Medium, keys []uint64) {
	if rank < 0 || rank >= MaxExactRanks || medium >= media {
		return
	}
	bit := uint64(1) << rank
	e.seen |= bit
	for _, k := range keys {
		if s, ok := e.slot.get(k); ok {
			e.ranks[s][medium] |= bit
			continue
		}
		if e.size.Load() >= int64(e.capacity) {
			e.refused.Add(1)
			continue
		}
		var s int32
		if n := len(e.free); n > 0 {
			s = e.free[n-1]
			e.free = e.free[:n-1]
			e.keys[s] = k
			e.ranks[s] = [3]uint64{}
		} else {
			s = int32(len(e.keys))
			e.keys = append(e.keys, k)
			e.ranks = append(e.ranks, [3]uint64{})
		}
		e.ranks[s][medium] = bit
		e.slot.put(k, s)
		e.size.Add(1)
	}
}

// Remove notes that rank no longer holds the blocks of keys on medium;
// a block no rank holds on any medium any more leaves the index. Keys
// the index does not hold are ignored. Between Begin and End only; it
// does not allocate.
func (e *ExactEngine) Remove(rank int, medium Medium, keys []uint64) {
	if rank < 0 || rank >= MaxExactRanks || medium >= media {
		return
	}
	bit := uint64(1) << rank
	e.seen |= bit
	for _, k := range keys {
		s, ok := e.slot.get(k)
		if !ok {
			continue
		}
		r := &e.ranks[s]
		r[medium] &^= bit
		if r[MediumGPU]|r[MediumCPU]|r[MediumDisk] == 0 {
			e.removeSlot(k, s)
		}
	}
}

// Clear notes that rank holds nothing on any medium (vLLM's
// AllBlocksCleared, an engine restart): its blocks go, and the rank is
// exact from now on. Between Begin and End only.
func (e *ExactEngine) Clear(rank int) {
	if rank < 0 || rank >= MaxExactRanks {
		return
	}
	e.dropRank(rank)
	bit := uint64(1) << rank
	e.seen |= bit
	e.exactRanks |= bit
}

// Lose notes that rank's events were lost (the agent could not get them
// again): its blocks go and the rank is not exact until a Clear of it or
// a new epoch read from its start. Between Begin and End only.
func (e *ExactEngine) Lose(rank int) {
	if rank < 0 || rank >= MaxExactRanks {
		return
	}
	e.dropRank(rank)
	bit := uint64(1) << rank
	e.seen |= bit
	e.exactRanks &^= bit
}

// dropRank takes rank out of every block, removing the blocks no rank
// holds any more. The caller holds e.mu.
func (e *ExactEngine) dropRank(rank int) {
	bit := uint64(1) << rank
	for s := range e.keys {
		r := &e.ranks[s]
		if r[MediumGPU]|r[MediumCPU]|r[MediumDisk] == 0 {
			continue // a free slot
		}
		r[MediumGPU] &^= bit
		r[MediumCPU] &^= bit
		r[MediumDisk] &^= bit
		if r[MediumGPU]|r[MediumCPU]|r[MediumDisk] == 0 {
			e.removeSlot(e.keys[s], int32(s))
		}
	}
}

// removeSlot takes key k, at slot s, out of the index. The caller holds
// e.mu.
func (e *ExactEngine) removeSlot(k uint64, s int32) {
	e.slot.del(k)
	e.ranks[s] = [3]uint64{}
	e.free = append(e.free, s)
	e.size.Add(-1)
}

// dropLocked forgets every key and every rank's exactness. Its arrays
// are kept for reuse (a drop allocates nothing). The caller holds e.mu.
func (e *ExactEngine) dropLocked() {
	if e.size.Load() > 0 {
		e.slot.clear()
		e.keys, e.ranks, e.free = e.keys[:0], e.ranks[:0], e.free[:0]
		e.size.Store(0)
	}
	e.seen, e.exactRanks = 0, 0
	e.exact.Store(false)
}
