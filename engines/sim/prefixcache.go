package sim

import (
	"sync"
	"unicode"
	"unicode/utf8"
)

// DefaultKVCacheBlocks is the default capacity of a Server's prefix cache
// in KV blocks (Config.KVCacheBlocks).
const DefaultKVCacheBlocks = 4096

// appendBlockHashes appends to dst the chained hashes of the full blocks of
// prompt's tokens (the words PromptTokens counts), blockSize tokens per
// block, and returns it. Hash i covers tokens [0, (i+1)·blockSize): it
// chains block i's tokens onto hash i-1, starting from the endpoint kind
// (chat and completions tokenise differently), so two prompts share
// leading hashes exactly as far as they share leading full blocks, as
// vLLM's block hashes do. A trailing partial block has no hash. It
// allocates nothing beyond growing dst.
func appendBlockHashes(dst []uint64, kind endpointKind, prompt string, blockSize int) []uint64 {
	h := fnvUint64(fnvOffset64, uint64(kind)+1)
	inWord, n := false, 0
	for i := 0; i < len(prompt); {
		r, size := rune(prompt[i]), 1
		if r >= utf8.RuneSelf {
			r, size = utf8.DecodeRuneInString(prompt[i:])
		}
		if unicode.IsSpace(r) {
			if inWord {
				inWord = false
				if n++; n == blockSize {
					h = finalize(h)
					dst = append(dst, h)
					n = 0
				}
			}
			i += size
			continue
		}
		if !inWord {
			inWord = true
			h ^= 0x20 // token separator
			h *= fnvPrime64
		}
		for k := i; k < i+size; k++ {
			h ^= uint64(prompt[k])
			h *= fnvPrime64
		}
		i += size
	}
	if inWord {
		if n++; n == blockSize {
			dst = append(dst, finalize(h))
		}
	}
	return dst
}

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
// evicting the least recently used block when full); the caller holds c.mu.
func (c *prefixCache) touch(hash uint64) {
	if i, ok := c.index[hash]; ok {
		c.unlink(i)
		c.pushFront(i)
		return
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
	}
	c.nodes[i].hash = hash
	c.index[hash] = i
	c.pushFront(i)
	c.maxOccupancy = max(c.maxOccupancy, int64(len(c.index)))
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
func (c *prefixCache) lookup(hashes []uint64, promptTokens, blockSize int, local bool) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !local {
		c.extQueries += int64(promptTokens)
		c.extHits += int64(promptTokens)
		c.insert(hashes)
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
	c.insert(hashes)
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
func (c *prefixCache) lookupShared(hashes []uint64, promptTokens, blockSize int, load func(uint64) bool) (local, external int) {
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
	c.insert(hashes)
	return local, external
}

// insert caches hashes, last first; the caller holds c.mu.
func (c *prefixCache) insert(hashes []uint64) {
	for i := len(hashes) - 1; i >= 0; i-- {
		c.touch(hashes[i])
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
