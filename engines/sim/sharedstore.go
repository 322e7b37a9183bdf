package sim

import (
	"container/list"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
)

// This file is the simulator's side of a KV store that producer and
// consumer share (Config.Connector "shared-storage"; docs/connectors.md,
// behaviour.md R-DESC-8): vLLM's SharedStorageConnector, LMCache with a
// shared backend. Nothing travels between the engines but through the
// store: a producer (role prefill or both) writes one small file per full
// KV block of every prompt it computes, named by the block's chained hash
// (appendBlockHashes); a consumer (role decode or both) takes, beyond the
// leading blocks its own prefix cache holds, the leading run of the
// prompt's blocks it finds in the store as loaded — cached and external,
// as a real connector's load counts in vLLM. A consumer that finds nothing
// computes the prompt itself and reports so in cached_tokens: the silent
// recompute the router detects (R-FAIL-8).

// DefaultKVStoreBlocks is the default bound of the blocks one producer
// keeps in the shared KV store (Config.KVStoreBlocks).
const DefaultKVStoreBlocks = 65536

// storeSuffix ends the name of every block file; the rest of the name is
// the block hash as 16 lower-case hex digits, so no name a producer makes
// can leave the store's directory.
const storeSuffix = ".kv"

// storeRecordLimit bounds the size of a block file a consumer reads.
const storeRecordLimit = 1024

// sharedStore is one engine's handle on the shared KV store: the
// directory, the record every block file of its model and block size
// holds, and — as a producer — the blocks it keeps there, least recently
// used first out. Its methods are safe for concurrent use.
type sharedStore struct {
	dir    string
	record string // model and block size; the hash line follows

	mu       sync.Mutex // guards capacity, kept and lru
	capacity int
	kept     map[uint64]*list.Element // block hash → its element in lru
	lru      *list.List               // of uint64, most recently used first

	written, loaded, evicted, failed atomic.Int64
}

// openSharedStore prepares the store at dir (created when missing, with
// its parents) for an engine serving model with blockSize tokens per
// block, keeping at most capacity blocks of its own there. It fails when
// dir cannot be made a directory.
func openSharedStore(dir, model string, blockSize, capacity int) (*sharedStore, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("KV store %s: %w", dir, err)
	}
	fi, err := os.Stat(dir)
	if err != nil {
		return nil, fmt.Errorf("KV store %s: %w", dir, err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("KV store %s: not a directory", dir)
	}
	rec := "narwhal-sim KV block v1\nmodel " + strconv.Quote(model) + "\nblock_size " + strconv.Itoa(blockSize) + "\n"
	return &sharedStore{dir: dir, record: rec, capacity: capacity, kept: make(map[uint64]*list.Element), lru: list.New()}, nil
}

// path is the file of block hash.
func (st *sharedStore) path(hash uint64) string {
	var name [16 + len(storeSuffix)]byte
	b := appendHex64(name[:0], hash)
	b = append(b, storeSuffix...)
	return filepath.Join(st.dir, string(b))
}

// content is what the file of block hash holds: the store's record and
// the hash, so a file renamed or written for another model or block size
// is no hit.
func (st *sharedStore) content(hash uint64) []byte {
	b := make([]byte, 0, len(st.record)+24)
	b = append(b, st.record...)
	b = append(b, "hash "...)
	b = appendHex64(b, hash)
	return append(b, '\n')
}

// has reports whether the store holds block hash for this engine's model
// and block size: a regular file (never a link, a directory or a pipe) of
// the block's exact content.
func (st *sharedStore) has(hash uint64) bool {
	want := st.content(hash)
	p := st.path(hash)
	fi, err := os.Lstat(p)
	if err != nil || !fi.Mode().IsRegular() || fi.Size() != int64(len(want)) {
		return false
	}
	f, err := os.Open(p)
	if err != nil {
		return false
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return false
	}
	got, err := io.ReadAll(io.LimitReader(f, storeRecordLimit))
	return err == nil && string(got) == string(want)
}

// load is has for a consumer's lookup: a hit counts as a block loaded.
func (st *sharedStore) load(hash uint64) bool {
	if !st.has(hash) {
		return false
	}
	st.loaded.Add(1)
	return true
}

// save writes every block of hashes that the store does not hold yet,
// each atomically (a temporary file renamed into place, so a consumer
// never reads half a block), and keeps them, and those it found, as this
// producer's, the first block last so that a prompt's head is removed
// after its tail when the bound is reached. It returns the first write
// error (the other blocks are still tried); failures are counted.
func (st *sharedStore) save(hashes []uint64) error {
	var first error
	for i := len(hashes) - 1; i >= 0; i-- {
		h := hashes[i]
		if !st.has(h) {
			if err := st.write(h); err != nil {
				st.failed.Add(1)
				if first == nil {
					first = err
				}
				continue
			}
			st.written.Add(1)
		}
		st.keep(h)
	}
	return first
}

// write puts the file of block hash into the store atomically.
func (st *sharedStore) write(hash uint64) error {
	f, err := os.CreateTemp(st.dir, ".narwhal-sim-*.tmp")
	if err != nil {
		return err
	}
	tmp := f.Name()
	_, err = f.Write(st.content(hash))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp, 0o644)
	}
	if err == nil {
		err = os.Rename(tmp, st.path(hash))
	}
	if err != nil {
		_ = os.Remove(tmp)
	}
	return err
}

// keep makes hash this producer's most recently used block and, past the
// bound, removes the file of its least recently used one.
func (st *sharedStore) keep(hash uint64) {
	st.mu.Lock()
	if e, ok := st.kept[hash]; ok {
		st.lru.MoveToFront(e)
		st.mu.Unlock()
		return
	}
	st.kept[hash] = st.lru.PushFront(hash)
	var drop []uint64
	for st.lru.Len() > st.capacity {
		e := st.lru.Back()
		old := st.lru.Remove(e).(uint64)
		delete(st.kept, old)
		drop = append(drop, old)
	}
	st.mu.Unlock()
	for _, old := range drop {
		if err := os.Remove(st.path(old)); err == nil || errors.Is(err, fs.ErrNotExist) {
			st.evicted.Add(1)
		}
	}
}

// stats returns the store's counters: blocks written, loaded, evicted,
// and failed writes.
func (st *sharedStore) stats() (written, loaded, evicted, failed int64) {
	return st.written.Load(), st.loaded.Load(), st.evicted.Load(), st.failed.Load()
}

// prepareShared is prepare for a shared-storage engine (see the top of
// this file). A consumer first meets the kv-pull-error fault (the load
// fails loudly: an error, as vLLM's kv_load_failure_policy=fail answers)
// and the kv-recompute fault (it ignores the store: only its own prefix
// cache counts). It then computes the tokens neither held
// (PrefillPerToken each), and a producer writes the prompt's blocks to
// the store before it answers. False when the request ended.
func (x *exchange) prepareShared() bool {
	s := x.s
	var load func(uint64) bool
	if s.cfg.Role != RolePrefill {
		if f, hit := x.faults.get(fkKVPullError); hit {
			s.count.kvPullFailures.Add(1)
			x.fail(f.statusOr(http.StatusInternalServerError), f.messageOr("KV transfer failed: simulated load error from the shared KV store"))
			return false
		}
		if _, ignore := x.faults.get(fkKVRecompute); !ignore {
			load = s.store.load
		}
	}
	local, external := s.cache.lookupShared(x.hashes, x.tokens, x.promptTokens, s.cfg.BlockSize, load)
	if external > 0 {
		s.count.kvPulled.Add(1)
	}
	x.cachedTokens = local + external
	if !x.compute(x.promptTokens - x.cachedTokens) {
		x.abort()
		return false
	}
	if s.cfg.Role != RoleDecode {
		_ = s.store.save(x.hashes) // a failed write is counted; the consumer then misses, as with a store that lost it
	}
	return true
}
