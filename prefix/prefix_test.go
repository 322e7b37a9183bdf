package prefix

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
)

// prompt returns n bytes of deterministic text seeded by seed.
func prompt(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := range b {
		b[i] = 'a' + byte(r.IntN(26))
	}
	return b
}

// TestHashSharedPrefixRPLACE2 proves R-PLACE-2's hashing: two prompts
// that share k whole blocks have equal hashes for those k blocks and
// different ones from the first block where they differ on (chained), a
// partial block is not hashed, and the function is deterministic.
func TestHashSharedPrefixRPLACE2(t *testing.T) {
	shared := prompt(1, 10*BlockBytes)
	a := append(append([]byte(nil), shared...), prompt(2, 5*BlockBytes+7)...)
	b := append(append([]byte(nil), shared...), prompt(3, 5*BlockBytes+7)...)
	// Differ only in the last byte of block 12: blocks 10, 11 still equal.
	copy(b[10*BlockBytes:], a[10*BlockBytes:12*BlockBytes+BlockBytes-1])
	ha, hb := AppendHashes(nil, a), AppendHashes(nil, b)
	if len(ha) != 15 || len(hb) != 15 || Blocks(len(a)) != 15 {
		t.Fatalf("blocks: %d, %d (Blocks %d), want 15 (the partial block unhashed)", len(ha), len(hb), Blocks(len(a)))
	}
	for i := range 12 {
		if ha[i] != hb[i] {
			t.Fatalf("block %d of a shared prefix hashes differently", i)
		}
	}
	for i := 12; i < 15; i++ {
		if ha[i] == hb[i] {
			t.Fatalf("block %d after the divergence hashes the same (not chained)", i)
		}
	}
	// Chained: the same block text after a different prefix differs.
	c := append(prompt(4, BlockBytes), a[BlockBytes:]...)
	hc := AppendHashes(nil, c)
	for i := range hc {
		if hc[i] == ha[i] {
			t.Fatalf("block %d: equal text after a different first block hashes the same", i)
		}
	}
	again := AppendHashes(make([]uint64, 0, 32), a)
	for i := range ha {
		if again[i] != ha[i] {
			t.Fatal("hashing is not deterministic")
		}
	}
	if got := AppendHashes(nil, prompt(5, (MaxBlocks+10)*BlockBytes)); len(got) != MaxBlocks {
		t.Fatalf("huge prompt: %d hashes, want MaxBlocks=%d", len(got), MaxBlocks)
	}
}

// TestHashFixedValuesRPLACE2: the hashes are part of the bus's contract
// between routers (R-PLACE-2: every router applies the placements the
// others publish): they must not change between builds or processes.
func TestHashFixedValuesRPLACE2(t *testing.T) {
	h := AppendHashes(nil, []byte(strings.Repeat("narwhal placement ", 8)))
	got := fmt.Sprintf("%016x %016x", h[0], h[1])
	const want = "66f71dad2ea13952 7eed1deeeacdea25"
	if got != want {
		t.Fatalf("hashes %s, want %s: changing them splits a mixed-version mesh's index", got, want)
	}
}

// TestIndexMatchRPLACE2 proves Record, Learn, Match, Drop and the fresh
// hashes Record returns.
func TestIndexMatchRPLACE2(t *testing.T) {
	ix := NewIndex(1000)
	a := AppendHashes(nil, prompt(1, 20*BlockBytes))
	b := append(append([]uint64(nil), a[:8]...), AppendHashes(nil, append(prompt(1, 20*BlockBytes)[:8*BlockBytes], prompt(9, 12*BlockBytes)...))[8:]...)
	if fresh := ix.Record("e1", a, nil); len(fresh) != 20 || fresh[0] != a[0] || fresh[19] != a[19] {
		t.Fatalf("first record: fresh %d hashes (in order?), want all 20", len(fresh))
	}
	if got := ix.Match("e1", a); got != 20 {
		t.Fatalf("match of the recorded prompt: %d, want 20", got)
	}
	if got := ix.Match("e1", b); got != 8 {
		t.Fatalf("match of a prompt sharing 8 blocks: %d, want 8", got)
	}
	if got := ix.Match("e2", a); got != 0 {
		t.Fatalf("match on an engine never placed on: %d", got)
	}
	fresh := ix.Record("e1", b, make([]uint64, 0, 32))
	if len(fresh) != 12 || fresh[0] != b[8] || fresh[11] != b[19] {
		t.Fatalf("record sharing 8 blocks: fresh %d, want the 12 new ones in order", len(fresh))
	}
	if ix.Blocks("e1") != 32 {
		t.Fatalf("blocks %d, want 32", ix.Blocks("e1"))
	}
	ix.Learn("e2", a[:5])
	if got := ix.Match("e2", a); got != 5 {
		t.Fatalf("match after learning 5 blocks: %d", got)
	}
	ix.Drop("e1")
	if ix.Match("e1", a) != 0 || ix.Blocks("e1") != 0 {
		t.Fatal("drop left hashes")
	}
	seen := map[string]int{}
	ix.Engines(func(id string, n int) { seen[id] = n })
	if len(seen) != 1 || seen["e2"] != 5 {
		t.Fatalf("engines %v, want e2:5", seen)
	}
	if ix.Match("e1", nil) != 0 {
		t.Fatal("empty prompt matched")
	}
}

// TestIndexBoundRPLACE2 proves the index's bound: it never holds more
// than its capacity per engine, evicts the least recent first, and
// evicts a prompt's tail before its head (so a hot shared prefix stays).
func TestIndexBoundRPLACE2(t *testing.T) {
	const capacity = 64
	ix := NewIndex(capacity)
	hot := AppendHashes(nil, prompt(1, 16*BlockBytes))
	ix.Record("e", hot, nil)
	for i := range 200 {
		p := append(prompt(1, 16*BlockBytes), prompt(uint64(100+i), 8*BlockBytes)...)
		h := AppendHashes(nil, p)
		ix.Record("e", h, nil)
		if n := ix.Blocks("e"); n > capacity {
			t.Fatalf("after %d records: %d blocks, above the bound %d", i, n, capacity)
		}
		if got := ix.Match("e", h); got != 24 {
			t.Fatalf("the prompt just recorded matches %d, want 24", got)
		}
	}
	if ix.Blocks("e") != capacity {
		t.Fatalf("blocks %d, want full at %d", ix.Blocks("e"), capacity)
	}
	if got := ix.Match("e", hot); got != 16 {
		t.Fatalf("the hot shared prefix matches %d, want 16 (its blocks were refreshed)", got)
	}
	// A prompt recorded long ago is evicted (least recent first).
	old := AppendHashes(nil, prompt(7, 8*BlockBytes))
	ix.Record("e", old, nil)
	for i := range 20 {
		ix.Record("e", AppendHashes(nil, prompt(uint64(1000+i), 8*BlockBytes)), nil)
	}
	if got := ix.Match("e", old); got != 0 {
		t.Fatalf("an old prompt still matches %d blocks after 160 newer ones in 64", got)
	}
	// Eviction takes the tail first: a 100-block prompt in 64 keeps its head.
	long := AppendHashes(nil, prompt(8, 100*BlockBytes))
	ix.Record("e", long, nil)
	if got := ix.Match("e", long); got != capacity {
		t.Fatalf("a prompt longer than the bound matches %d, want its first %d blocks", got, capacity)
	}
	if NewIndex(0).Capacity() != 1 || NewIndex(1<<30).Capacity() != MaxBlocksPerEngine {
		t.Fatal("capacity not clamped")
	}
}

// TestIndexEngineBound: hostile engine ids cannot grow the index past
// MaxEngines.
func TestIndexEngineBound(t *testing.T) {
	ix := NewIndex(4)
	h := []uint64{1, 2}
	for i := range MaxEngines + 10 {
		ix.Learn(fmt.Sprint("e", i), h)
	}
	n := 0
	ix.Engines(func(string, int) { n++ })
	if n != MaxEngines {
		t.Fatalf("%d engines, want the bound %d", n, MaxEngines)
	}
}

// TestIndexConcurrent runs records, learns, drops and matches at once
// (for -race).
func TestIndexConcurrent(t *testing.T) {
	ix := NewIndex(256)
	hs := make([][]uint64, 8)
	for i := range hs {
		hs[i] = AppendHashes(nil, prompt(uint64(i), 40*BlockBytes))
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fresh := make([]uint64, 0, 64)
			for i := range 500 {
				id := fmt.Sprint("e", (g+i)%3)
				h := hs[(g*7+i)%len(hs)]
				switch i % 5 {
				case 0:
					ix.Learn(id, h)
				case 1:
					if i%50 == 1 {
						ix.Drop(id)
					}
				default:
					if m := ix.Match(id, h); m < 0 || m > len(h) {
						t.Errorf("match %d", m)
					}
					fresh = ix.Record(id, h, fresh[:0])
				}
				if ix.Blocks(id) > 256 {
					t.Errorf("above the bound")
				}
			}
		}()
	}
	wg.Wait()
}

// TestChoosePrefersMatchRPLACE2: the engine that holds the prompt's
// prefix wins over idle engines while the load is even enough.
func TestChoosePrefersMatchRPLACE2(t *testing.T) {
	b := Balance{Abs: 32, Rel: 1.5}
	cands := []Candidate{{Matched: 0, Outstanding: 0}, {Matched: 90, Outstanding: 5}, {Matched: 10, Outstanding: 0}}
	for range 50 {
		if i, g := Choose(cands, 100, b); i != 1 || g {
			t.Fatalf("chose %d (guard %v), want the matched engine 1", i, g)
		}
	}
	// Load weighs: 0.9 share at 31 more attempts (0.9 − 31/32 < 0.1) loses
	// to 0.1 share on an idle engine.
	cands[1].Outstanding = 31
	if i, _ := Choose(cands, 100, b); i != 2 {
		t.Fatalf("chose %d, want 2: 31 extra attempts outweigh a 0.8 better share", i)
	}
	// The engine's own queue counts as load.
	cands = []Candidate{{Matched: 50, Waiting: 30}, {Matched: 40}}
	if i, _ := Choose(cands, 100, b); i != 1 {
		t.Fatalf("chose %d, want 1: 30 waiting on 0 outweigh 0.1 of share", i)
	}
}

// TestChooseNoMatchIsLeastLoadedRPLACE2: with nothing matched anywhere the
// scorer is least loaded, ties spread at random.
func TestChooseNoMatchIsLeastLoadedRPLACE2(t *testing.T) {
	b := Balance{Abs: 32, Rel: 1.5}
	cands := []Candidate{{Outstanding: 3}, {Outstanding: 1}, {Outstanding: 1}, {Outstanding: 2}}
	counts := [4]int{}
	for range 400 {
		i, _ := Choose(cands, 10, b)
		counts[i]++
	}
	if counts[0] != 0 || counts[3] != 0 || counts[1] < 100 || counts[2] < 100 {
		t.Fatalf("choices %v, want only 1 and 2, about evenly", counts)
	}
	if i, _ := Choose(cands, 0, b); i != 1 && i != 2 {
		t.Fatalf("prompt of no block: chose %d", i)
	}
	// A prompt shorter than MinScoredBlocks goes by load, matched or not.
	short := []Candidate{{Matched: MinScoredBlocks - 1, Outstanding: 1}, {Outstanding: 0}}
	if i, g := Choose(short, MinScoredBlocks-1, b); i != 1 || g {
		t.Fatalf("short prompt: chose %d (guard %v), want the least loaded 1", i, g)
	}
	short[0].Matched, short[1].Matched = MinScoredBlocks, 0
	if i, _ := Choose(short, MinScoredBlocks, b); i != 0 {
		t.Fatalf("prompt of MinScoredBlocks: chose %d, want the matched 0", i)
	}
	if i, _ := Choose(nil, 10, b); i != -1 {
		t.Fatalf("no candidate: %d", i)
	}
}

// TestChooseGuardRPLACE2 proves the imbalance guard: both thresholds
// must be crossed, and then the least loaded wins whatever the match.
func TestChooseGuardRPLACE2(t *testing.T) {
	b := Balance{Abs: 32, Rel: 1.5}
	// max − min = 33 > 32 and 43 > 1.5 × 10: guard.
	cands := []Candidate{{Matched: 100, Outstanding: 43}, {Outstanding: 10}, {Outstanding: 20}}
	if i, g := Choose(cands, 100, b); i != 1 || !g {
		t.Fatalf("chose %d (guard %v), want 1 by load", i, g)
	}
	// max − min = 32: not above the absolute threshold.
	cands[0].Outstanding = 42
	if b.Imbalanced(cands) {
		t.Fatal("guard at max − min = abs threshold")
	}
	// Difference 40 but 140 < 1.5 × 100: not above the relative one.
	cands = []Candidate{{Matched: 100, Outstanding: 140}, {Outstanding: 100}}
	if b.Imbalanced(cands) {
		t.Fatal("guard below the relative threshold")
	}
	if b.Imbalanced(cands[:1]) {
		t.Fatal("guard with one candidate")
	}
}

// TestChooseHostileQueueRPLACE2: an engine's own queue comes from its
// /metrics, which the router does not trust; a queue so large that
// adding the router's attempts would overflow still counts as the
// largest load, with the guard on and off, and never attracts the
// placement.
func TestChooseHostileQueueRPLACE2(t *testing.T) {
	b := Balance{Abs: 32, Rel: 1.5}
	for _, waiting := range []int64{math.MaxInt64 - 1, math.MaxInt64, 1 << 62} {
		cands := []Candidate{{Matched: 100, Outstanding: 5, Waiting: waiting}, {Outstanding: 0}}
		if i, _ := Choose(cands, 100, b); i != 1 {
			t.Fatalf("waiting %d: chose the engine that says it queues that many", waiting)
		}
		cands[0].Outstanding = 40 // guard: 40 − 0 > 32
		if i, g := Choose(cands, 100, b); i != 1 || !g {
			t.Fatalf("waiting %d, guard: chose %d (guard %v), want 1", waiting, i, g)
		}
	}
}

// TestChooseHugeAbsThresholdRPLACE2: a balance_abs_threshold of any
// size (an operator turning the guard off) does not overflow the score:
// the matched engine still wins.
func TestChooseHugeAbsThresholdRPLACE2(t *testing.T) {
	for _, abs := range []int64{1 << 40, 1 << 53, math.MaxInt64} {
		cands := []Candidate{{Matched: 0}, {Matched: 100, Outstanding: 3}}
		if i, _ := Choose(cands, 100, Balance{Abs: abs, Rel: 1.5}); i != 1 {
			t.Fatalf("abs %d: chose %d, want the matched engine 1", abs, i)
		}
	}
}
