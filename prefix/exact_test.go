package prefix

import (
	"sync"
	"testing"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// chainKeys returns the keys of n blocks of 16 tokens seeded by seed.
func chainKeys(seed uint32, n int) []uint64 {
	tokens := make([]uint32, 16*n)
	for i := range tokens {
		tokens[i] = seed*100000 + uint32(i)
	}
	return AppendTokenKeys(nil, tokens, 16, 0)
}

// batch applies one batch of ops to e and returns its verdict.
func batch(e *ExactEngine, epoch, seq uint64, ops ...func(*ExactEngine)) Sequence {
	v := e.Begin(epoch, seq, 16)
	if v != SeqDuplicate {
		for _, op := range ops {
			op(e)
		}
	}
	e.End()
	return v
}

func store(rank int, m Medium, keys []uint64) func(*ExactEngine) {
	return func(e *ExactEngine) { e.Store(rank, m, keys) }
}

func remove(rank int, m Medium, keys []uint64) func(*ExactEngine) {
	return func(e *ExactEngine) { e.Remove(rank, m, keys) }
}

// TestExactIndexAppliesEventsRPLACE4 proves the exact index's ops:
// stored blocks match as the longest held prefix of the chain, removed
// ones stop it, a cleared rank holds nothing and is exact, a lost rank
// makes the engine inexact (Match says nothing) until it is cleared, a
// seq gap and a new epoch read from its middle drop everything and leave
// it inexact, a duplicate is skipped, and a new epoch from seq 1 is
// exact.
func TestExactIndexAppliesEventsRPLACE4(t *testing.T) {
	x := NewExactIndex(1024)
	e := x.Engine("p1")
	keys := chainKeys(1, 10)
	if _, ok := x.Match("p1", keys); ok {
		t.Fatal("an engine with no batch is exact")
	}
	if v := batch(e, 7, 1, store(0, MediumGPU, keys[:6])); v != SeqNewEpoch {
		t.Fatalf("first batch: %v, want SeqNewEpoch", v)
	}
	if m, ok := x.Match("p1", keys); !ok || m.GPU != 6 || m.Any != 6 {
		t.Fatalf("after 6 stored from the epoch's start: %+v %v, want 6 blocks, exact", m, ok)
	}
	batch(e, 7, 2, remove(0, MediumGPU, keys[3:4]))
	if m, _ := x.Match("p1", keys); m.GPU != 3 {
		t.Fatalf("block 3 removed: matched %+v, want 3", m)
	}
	if v := batch(e, 7, 2, store(0, MediumGPU, keys)); v != SeqDuplicate {
		t.Fatalf("a batch seen again: %v, want SeqDuplicate", v)
	}
	if m, _ := x.Match("p1", keys); m.GPU != 3 {
		t.Fatalf("a duplicate was applied: %+v", m)
	}
	batch(e, 7, 3, func(e *ExactEngine) { e.Lose(0) })
	if _, ok := x.Match("p1", keys); ok || e.Blocks() != 0 {
		t.Fatalf("after KVLost: exact %v, %d blocks; want inexact and empty", ok, e.Blocks())
	}
	batch(e, 7, 4, store(0, MediumGPU, keys[:2]))
	if _, ok := x.Match("p1", keys); ok {
		t.Fatal("a lost rank's engine is exact again without a KVCleared")
	}
	batch(e, 7, 5, func(e *ExactEngine) { e.Clear(0) }, store(0, MediumGPU, keys[:4]))
	if m, ok := x.Match("p1", keys); !ok || m.GPU != 4 {
		t.Fatalf("after KVCleared and 4 stored: %+v %v, want 4, exact", m, ok)
	}
	if v := batch(e, 7, 9, store(0, MediumGPU, keys)); v != SeqGap {
		t.Fatalf("seq 9 after 5: %v, want SeqGap", v)
	}
	if _, ok := x.Match("p1", keys); ok {
		t.Fatal("exact after a gap")
	}
	if v := batch(e, 8, 5, store(0, MediumGPU, keys)); v != SeqNewEpoch {
		t.Fatalf("another epoch: %v", v)
	}
	if _, ok := x.Match("p1", keys); ok {
		t.Fatal("exact from the middle of a new epoch")
	}
	batch(e, 9, 1, store(0, MediumGPU, keys[:5]))
	if m, ok := x.Match("p1", keys); !ok || m.GPU != 5 || e.Blocks() != 5 {
		t.Fatalf("a new epoch from seq 1: %+v %v (%d blocks), want 5 exact and nothing of before", m, ok, e.Blocks())
	}
	if !x.Drop("p1") {
		t.Fatal("Drop reports nothing dropped")
	}
	if _, ok := x.Match("p1", keys); ok || e.Blocks() != 0 {
		t.Fatal("exact or holding after Drop")
	}
	if v := batch(e, 9, 2, func(e *ExactEngine) { e.Clear(0) }); v != SeqNext {
		t.Fatalf("the next batch after a drop: %v, want SeqNext (epoch and seq kept)", v)
	}
	if _, ok := x.Match("p1", keys); !ok {
		t.Fatal("not exact after a drop and a KVCleared")
	}
}

// TestExactIndexRanksAndMediaRPLACE4: a data-parallel engine holds a
// prefix as far as one rank holds it whole; a block only offloaded (CPU,
// disk) counts in Host/Any and not GPU, and a removal on one medium or
// rank leaves the others; a cleared rank keeps the other's blocks; and
// an engine with a rank seen but not exact is not exact.
func TestExactIndexRanksAndMediaRPLACE4(t *testing.T) {
	x := NewExactIndex(1024)
	e := x.Engine("p1")
	keys := chainKeys(2, 8)
	batch(e, 1, 1,
		store(0, MediumGPU, keys[:3]),
		store(1, MediumGPU, keys[:2]), store(1, MediumGPU, keys[3:6]), // rank 1 misses block 2
		store(0, MediumCPU, keys[3:5]),
		store(0, MediumDisk, keys[5:7]))
	m, ok := x.Match("p1", keys)
	if !ok || m != (ExactMatch{GPU: 3, Host: 5, Any: 7}) {
		t.Fatalf("matched %+v %v, want GPU 3 (rank 0), Host 5, Any 7", m, ok)
	}
	if got, want := m.CachedTokens(16), int64(16*3+16*2*(256-OffloadCost)/256+16*2*(256-DiskCost)/256); got != want {
		t.Fatalf("cached tokens %d, want %d", got, want)
	}
	batch(e, 1, 2, remove(0, MediumCPU, keys[4:5]), remove(1, MediumGPU, keys[0:1]))
	if m, _ := x.Match("p1", keys); m != (ExactMatch{GPU: 3, Host: 4, Any: 4}) {
		t.Fatalf("after removals: %+v, want GPU 3, Host 4, Any 4", m)
	}
	batch(e, 1, 3, func(e *ExactEngine) { e.Clear(0) })
	if m, _ := x.Match("p1", keys); m != (ExactMatch{}) || e.Blocks() != 4 {
		t.Fatalf("rank 0 cleared: %+v with %d blocks, want nothing matched (rank 1 lacks block 0) and rank 1's 4 blocks kept", m, e.Blocks())
	}
	batch(e, 1, 4, func(e *ExactEngine) { e.Lose(1) })
	if _, ok := x.Match("p1", keys); ok || e.Blocks() != 0 {
		t.Fatal("rank 1 lost: want inexact, its blocks gone")
	}
	batch(e, 1, 5, func(e *ExactEngine) { e.Clear(1) })
	if _, ok := x.Match("p1", keys); !ok {
		t.Fatal("every rank seen cleared: want exact")
	}
}

// TestExactIndexBoundedRPLACE4: an engine's keys never exceed its bound
// (stores past it are refused and counted, never over-predicting), a
// smaller bound set later drops the engine, and MaxEngines bounds the
// engines.
func TestExactIndexBoundedRPLACE4(t *testing.T) {
	x := NewExactIndex(100)
	e := x.Engine("p1")
	batch(e, 1, 1, store(0, MediumGPU, chainKeys(3, 150)))
	if e.Blocks() != 100 || e.Refused() != 50 {
		t.Fatalf("%d blocks, %d refused; want 100 and 50", e.Blocks(), e.Refused())
	}
	if x.SetCapacity("p1", 10) != 10 || e.Blocks() != 0 || e.Exact() {
		t.Fatalf("a bound below what it holds: %d blocks, exact %v; want dropped", e.Blocks(), e.Exact())
	}
	if x.EngineCapacity("p1") != 10 || x.EngineCapacity("p2") != 100 {
		t.Fatal("per-engine bounds")
	}
	for i := range MaxEngines + 5 {
		x.Engine(string(rune('a'+i%26)) + string(rune(i)))
	}
	n := 0
	x.Engines(func(string, *ExactEngine) { n++ })
	if n != MaxEngines {
		t.Fatalf("%d engines, want MaxEngines", n)
	}
}

// TestExactCostRPLACE4: an exact candidate's cost counts the prompt's
// tokens beyond its CachedTokens; the approximate one the tokens beyond
// its matched bytes; the engine holding the prompt on GPU beats one
// holding it offloaded, which beats one holding nothing.
func TestExactCostRPLACE4(t *testing.T) {
	w := Work{Blocks: 100, PromptBytes: 6400, Ratio: DefaultTokenRatio, Tokens: 1600}
	gpu := Candidate{Exact: true, CachedTokens: ExactMatch{GPU: 90, Host: 90, Any: 90}.CachedTokens(16)}
	cpu := Candidate{Exact: true, CachedTokens: ExactMatch{Host: 90, Any: 90}.CachedTokens(16)}
	none := Candidate{Exact: true}
	approx := Candidate{Matched: 50}
	if c := gpu.Cost(&w); c != 1600-1440 {
		t.Fatalf("gpu cost %d, want 160", c)
	}
	if c := approx.Cost(&w); c != 1600-800 {
		t.Fatalf("approximate cost %d, want 800 (50 blocks of 64 bytes at 4 bytes a token)", c)
	}
	if !(gpu.Cost(&w) < cpu.Cost(&w) && cpu.Cost(&w) < none.Cost(&w)) {
		t.Fatalf("costs gpu %d, cpu %d, none %d: want increasing", gpu.Cost(&w), cpu.Cost(&w), none.Cost(&w))
	}
	cands := []Candidate{none, approx, gpu}
	if i, _ := Choose(cands, &w, Balance{Abs: 32, Rel: 1.5}); i != 2 {
		t.Fatalf("chose %d, want the engine holding the prompt", i)
	}
}

// TestExactIndexConcurrentRPLACE4 runs Match against a writer applying
// batches (under -race): no race, and every match is within the chain.
func TestExactIndexConcurrentRPLACE4(t *testing.T) {
	x := NewExactIndex(4096)
	e := x.Engine("p1")
	keys := chainKeys(4, 64)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for seq := uint64(1); seq <= 2000; seq++ {
			if seq%2 == 1 {
				batch(e, 1, seq, store(0, MediumGPU, keys[:seq%64]))
			} else {
				batch(e, 1, seq, remove(0, MediumGPU, keys[seq%64:]))
			}
		}
	}()
	for range 2000 {
		if m, _ := x.Match("p1", keys); m.GPU > len(keys) {
			t.Fatal("matched past the chain")
		}
	}
	wg.Wait()
}

// BenchmarkExactMatch2000Tokens is the exact index's placement cost for
// a 2,000-token prompt (125 blocks of 16) against an engine whose index
// holds 65,536 blocks, the prompt's first 100 among them. Target: a few
// µs, 0 allocs/op.
func BenchmarkExactMatch2000Tokens(b *testing.B) {
	x := NewExactIndex(DefaultBlocksPerEngine)
	e := x.Engine("p1")
	keys := chainKeys(5, 125)
	e.Begin(1, 1, 16)
	e.Store(0, MediumGPU, keys[:100])
	for i := uint32(0); e.Blocks() < DefaultBlocksPerEngine; i++ {
		e.Store(0, MediumGPU, chainKeys(10+i, 125))
	}
	e.End()
	b.ReportAllocs()
	cpu := testkit.CPUTime()
	var m ExactMatch
	for b.Loop() {
		m, _ = x.Match("p1", keys)
	}
	testkit.ReportCPUPerOp(b, cpu)
	if m.GPU != 100 {
		b.Fatalf("matched %d, want 100", m.GPU)
	}
}

// BenchmarkExactApplyBatch is one batch of 64 stored and 64 removed keys
// applied to a full engine (steady state: the engine stores as many
// blocks as it evicts). Target: 0 allocs/op.
func BenchmarkExactApplyBatch(b *testing.B) {
	x := NewExactIndex(DefaultBlocksPerEngine)
	e := x.Engine("p1")
	e.Begin(1, 1, 16)
	for i := uint32(0); e.Blocks() < DefaultBlocksPerEngine-64; i++ {
		e.Store(0, MediumGPU, chainKeys(10+i, 64))
	}
	e.End()
	keys := chainKeys(1, 64)
	seq := uint64(1)
	b.ReportAllocs()
	for b.Loop() {
		seq++
		e.Begin(1, seq, 16)
		e.Store(0, MediumGPU, keys)
		e.End()
		seq++
		e.Begin(1, seq, 16)
		e.Remove(0, MediumGPU, keys)
		e.End()
	}
	if e.Blocks() != DefaultBlocksPerEngine-64 || !e.Exact() {
		b.Fatalf("%d blocks, exact %v", e.Blocks(), e.Exact())
	}
}
