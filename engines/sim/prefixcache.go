package sim

import (
	"sync"
	"time"
)

// DefaultKVCacheBlocks is the default capacity of a Server's prefix cache
// in KV blocks (Config.KVCacheBlocks).
const DefaultKVCacheBlocks = 4096

// prefixCache is one engine's cache of computed KV blocks, keyed by chained
// block hash, bounded to capacity blocks and evicted least recently used
// first, like vLLM's automatic prefix caching. Its counters are vLLM's
// prefix-cache counters, in tokens. The zero value is unusable; call init.
type prefixCache struct {
	mu       sync.Mutex
	capacity int
	index    map[uint64]int32
	// nodes is the LRU list, a ring through nodes[0] (the sentinel):
	// nodes[0].next is the most recently used block, nodes[0].prev the
	// least.
	nodes []lruNode
	free  int32 // first unused slot of nodes (slots are never returned)

	// events, when set, receives one batch per operation that changed
	// the cache (kvevents.go), pushed under mu so batches are in cache
	// order; enc encodes them and change is its scratch.
	events *kvEventQueue
	enc    *kvEventEncoder
	change kvChange

	queries, hits         int64 // local lookups (vllm:prefix_cache_*)
	extQueries, extHits   int64 // KV pulled from a producer or loaded from the shared store (vllm:external_prefix_cache_*)
	evicted, maxOccupancy int64
}

type lruNode struct {
	hash       uint64
	prev, next int32
}

func (c *prefixCache) init(capacity int) {
	c.capacity = capacity
	c.index = make(map[uint64]int32, min(capacity, 1<<16))
	c.nodes = make([]lruNode, 1, min(capacity, 1<<16)+1)
	c.free = 1
}

// unlink removes node i from the list; the caller holds c.mu.
func (c *prefixCache) unlink(i int32) {
	n := &c.nodes[i]
	c.nodes[n.prev].next = n.next
	c.nodes[n.next].prev = n.prev
}

// pushFront makes node i the most recently used; the caller holds c.mu.
func (c *prefixCache) pushFront(i int32) {
	head := c.nodes[0].next
	c.nodes[i].prev, c.nodes[i].next = 0, head
	c.nodes[head].prev = i
	c.nodes[0].next = i
}

// touch makes hash the most recently used block, inserting it (and
// evicting the least recently used block when full), and reports whether
// it inserted it; with events, an evicted block is recorded in c.change.
// The caller holds c.mu.
func (c *prefixCache) touch(hash uint64) bool {
	if i, ok := c.index[hash]; ok {
		c.unlink(i)
		c.pushFront(i)
		return false
	}
	var i int32
	if len(c.index) < c.capacity {
		if int(c.free) == len(c.nodes) {
			c.nodes = append(c.nodes, lruNode{})
		}
		i = c.free
		c.free++
	} else {
		i = c.nodes[0].prev
		c.unlink(i)
		delete(c.index, c.nodes[i].hash)
		c.evicted++
		if c.events != nil {
			c.change.removed = append(c.change.removed, c.nodes[i].hash)
		}
	}
	c.nodes[i].hash = hash
	c.index[hash] = i
	c.pushFront(i)
	c.maxOccupancy = max(c.maxOccupancy, int64(len(c.index)))
	return true
}

// lookup serves one request's prompt of promptTokens tokens whose full
// blocks hash to hashes: it counts the leading blocks already cached (at
// most those before the prompt's last token, which vLLM always computes),
// then caches every block, touched last block first so that a prompt's
// tail is evicted before its head (vLLM frees a request's blocks in
// reverse order for the same reason). It returns the cached tokens.
// local says the lookup is the engine's own (a prefill leg or a plain
// request; counted in queries and hits); otherwise the blocks arrived from
// a producer and all promptTokens count as cached and as external.
func (c *prefixCache) lookup(hashes []uint64, tokens []uint32, promptTokens, blockSize int, local bool) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !local {
		c.extQueries += int64(promptTokens)
		c.extHits += int64(promptTokens)
		c.insert(hashes, tokens, blockSize)
		return promptTokens
	}
	limit := min(len(hashes), (promptTokens-1)/blockSize)
	matched := 0
	for matched < limit {
		if _, ok := c.index[hashes[matched]]; !ok {
			break
		}
		matched++
	}
	cached := matched * blockSize
	c.queries += int64(promptTokens)
	c.hits += int64(cached)
	c.insert(hashes, tokens, blockSize)
	return cached
}

// lookupShared serves one request of a shared-storage engine
// (sharedstore.go) whose full blocks hash to hashes: it counts the leading
// blocks its own cache holds, as a local lookup does (queries and hits);
// a consumer (load non-nil) then goes on with the blocks load finds in
// the shared store, for the tokens its cache did not hold (external
// queries, and the tokens loaded as external hits, as vLLM's scheduler
// asks its connector beyond the local hits). Both runs stop before the
// prompt's last token, which is always computed. Then every block is
// cached. It returns the cached tokens of each run. load is called
// without c.mu held.
func (c *prefixCache) lookupShared(hashes []uint64, tokens []uint32, promptTokens, blockSize int, load func(uint64) bool) (local, external int) {
	limit := min(len(hashes), max(promptTokens-1, 0)/blockSize)
	c.mu.Lock()
	matched := 0
	for matched < limit {
		if _, ok := c.index[hashes[matched]]; !ok {
			break
		}
		matched++
	}
	c.mu.Unlock()
	loaded := 0
	if load != nil {
		for matched+loaded < limit && load(hashes[matched+loaded]) {
			loaded++
		}
	}
	local, external = matched*blockSize, loaded*blockSize
	c.mu.Lock()
	defer c.mu.Unlock()
	c.queries += int64(promptTokens)
	c.hits += int64(local)
	if load != nil {
		c.extQueries += int64(promptTokens - local)
		c.extHits += int64(external)
	}
	c.insert(hashes, tokens, blockSize)
	return local, external
}

// insert caches the blocks hashes, last first, so that the prompt's head
// ends most recently used. The blocks it already holds are touched first:
// making room for the new ones never evicts the request's own blocks, as
// vLLM never frees the blocks of a request it is computing. Only the first
// capacity blocks are inserted when the prompt has more (the others would
// be evicted by its own head). With events, the change (evictions, then
// the new blocks, whose token ids are tokens': blockSize for each hash)
// is pushed as one batch.
// The caller holds c.mu.
func (c *prefixCache) insert(hashes []uint64, tokens []uint32, blockSize int) {
	hashes = hashes[:min(len(hashes), c.capacity)]
	for i := len(hashes) - 1; i >= 0; i-- {
		if k, ok := c.index[hashes[i]]; ok {
			c.unlink(k)
			c.pushFront(k)
		}
	}
	ch := &c.change
	for i := len(hashes) - 1; i >= 0; i-- {
		if c.touch(hashes[i]) && c.events != nil {
			ch.stored = append(ch.stored, int32(i))
		}
	}
	if c.events == nil {
		return
	}
	if len(ch.removed) > 0 || len(ch.stored) > 0 {
		for l, r := 0, len(ch.stored)-1; l < r; l, r = l+1, r-1 {
			ch.stored[l], ch.stored[r] = ch.stored[r], ch.stored[l]
		}
		ch.hashes, ch.tokens, ch.blockSize = hashes, tokens, blockSize
		c.events.push(c.enc.encode(eventTime(), ch))
	}
	*ch = kvChange{removed: ch.removed[:0], stored: ch.stored[:0]}
}

// eventTime is now as a KV event batch's ts: seconds since the epoch.
func eventTime() float64 { return float64(time.Now().UnixNano()) / 1e9 }

// reset empties the cache, as vLLM's POST /reset_prefix_cache does
// (counters are kept), and publishes AllBlocksCleared.
func (c *prefixCache) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	clear(c.index)
	c.nodes = c.nodes[:1]
	c.nodes[0] = lruNode{}
	c.free = 1
	if c.events != nil {
		c.events.push(c.enc.encode(eventTime(), &kvChange{cleared: true}))
	}
}

// cacheStats is a snapshot of a prefixCache's counters.
type cacheStats struct {
	queries, hits, extQueries, extHits int64
	blocks, evicted, maxOccupancy      int64
}

func (c *prefixCache) stats() cacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return cacheStats{
		queries: c.queries, hits: c.hits, extQueries: c.extQueries, extHits: c.extHits,
		blocks: int64(len(c.index)), evicted: c.evicted, maxOccupancy: c.maxOccupancy,
	}
}

// contains reports whether hash is cached, without touching it.
func (c *prefixCache) contains(hash uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.index[hash]
	return ok
}

// peek returns the tokens a local lookup of hashes would find cached now
// (the leading cached blocks, at most those before the prompt's last
// token), without touching the blocks' recency, inserting anything or
// counting a query: what GET-like questions (POST /sim/cached) and the
// queue's estimate of a waiting request's work need.
func (c *prefixCache) peek(hashes []uint64, promptTokens, blockSize int) int {
	limit := min(len(hashes), max(promptTokens-1, 0)/blockSize)
	c.mu.Lock()
	defer c.mu.Unlock()
	matched := 0
	for matched < limit {
		if _, ok := c.index[hashes[matched]]; !ok {
			break
		}
		matched++
	}
	return matched * blockSize
}
