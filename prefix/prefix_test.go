package prefix

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
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

// work is the Work of a prompt of blocks whole blocks at 4 bytes a
// token: 16 tokens a block.
func work(blocks int) *Work {
	return &Work{Blocks: blocks, PromptBytes: int64(blocks) * BlockBytes, Ratio: DefaultTokenRatio, PerRequest: int64(blocks) * 16}
}

// TestCostBoundaryRPLACE3 proves R-PLACE-3's cost around its boundary: an
// engine holding m of the prompt's blocks with n attempts of W tokens in
// all in flight loses to an idle engine that holds nothing exactly when
// the work ahead of the request there — W less what the attempt
// computing has done, here half of one attempt's mean (it began half a
// mean prefill ago) — exceeds the work the match saves (m blocks × 16
// tokens), for a whole and a partial match, whatever the order of the
// candidates; when the two are equal the two engines cost the same and
// share the placements.
func TestCostBoundaryRPLACE3(t *testing.T) {
	b := Balance{Abs: 32, Rel: 1.5}
	const blocks = 125 // a 2,000-token prompt
	for _, n := range []int64{1, 3} {
		ahead := func(w int64) int64 { return w - w/(2*n) }
		for _, m := range []int{blocks, 60, MinScoredBlocks} {
			saved := int64(m) * 16
			// tie: the least W whose work ahead is the saving.
			tie := saved
			for ahead(tie) < saved {
				tie++
			}
			for _, inFlight := range []int64{0, saved / 2, saved - 1, saved, tie - 1, tie + 1, tie + 2*n, 2 * tie, 100 * saved} {
				if ahead(inFlight) == saved {
					continue // a tie, below
				}
				loadedOK := ahead(inFlight) < saved // the loaded engine holding the prefix wins
				for _, order := range []bool{false, true} {
					cands := []Candidate{{Matched: m, Outstanding: n, Legs: n, Tokens: inFlight, Head: Progress{Age: time.Second, Mean: 2 * time.Second}}, {}}
					loaded, idle := 0, 1
					if order {
						cands[0], cands[1] = cands[1], cands[0]
						loaded, idle = 1, 0
					}
					w := work(blocks)
					want := idle
					if loadedOK {
						want = loaded
					}
					for range 20 {
						if i, g := Choose(cands, w, b); i != want || g {
							t.Fatalf("n %d, m %d, %d tokens in flight (%d ahead, saved %d): chose %d (guard %v), want %d", n, m, inFlight, ahead(inFlight), saved, i, g, want)
						}
					}
				}
			}
			if ahead(tie) != saved {
				continue // no W makes the work ahead exactly the saving
			}
			// At the boundary both cost the same: ties spread.
			cands := []Candidate{{Matched: m, Outstanding: n, Legs: n, Tokens: tie, Head: Progress{Age: time.Second, Mean: 2 * time.Second}}, {}}
			if c0, c1 := cands[0].Cost(work(blocks)), cands[1].Cost(work(blocks)); c0 != c1 {
				t.Fatalf("n %d, m %d: at the boundary costs %d and %d differ", n, m, c0, c1)
			}
			var counts [2]int
			for range 400 {
				i, _ := Choose(cands, work(blocks), b)
				counts[i]++
			}
			if counts[0] < 100 || counts[1] < 100 {
				t.Fatalf("n %d, m %d: ties at the boundary went %v, want both", n, m, counts)
			}
		}
	}
}

// TestCostCountsWhatTheComputingAttemptDidRPLACE3: the work in flight on
// an engine counts whole for the attempts queued and, for the one
// computing, less the part of one attempt's mean (the share) it has done:
// its age over the time the share takes at the engine's pace. With the
// pace a mean time alone (all cached), one attempt of 1,000 tokens begun
// a quarter of a mean ago adds 750, four of 4,000 in all half a mean in
// add 3,500. At a pace of 800 tokens in 20 ms, a cold 100,000-token
// prefill 40 ms in has done 1,600. Past its expected time a prefill is
// overdue and counts done as that time over its age: 3 means in, a
// third; one stalled 30 s, 1/12. With the age or the pace unknown — a
// router that has seen no prefill answer there, an engine that has just
// begun — it counts whole, as do tokens without an outstanding attempt
// (another router's, not yet counted). With no attempt of the router's
// own there (the zero Progress: other routers' only) the head counts
// half done, the request arriving at a moment unrelated to its start.
func TestCostCountsWhatTheComputingAttemptDidRPLACE3(t *testing.T) {
	w := work(100)
	base := (&Candidate{}).Cost(w)
	const mean = 400 * time.Millisecond
	for _, tc := range []struct {
		outstanding, tokens int64
		head                Progress
		want                int64
	}{
		{1, 1000, Progress{Age: mean / 4, Mean: mean}, 750},
		{4, 4000, Progress{Age: mean / 2, Mean: mean}, 3500},
		{2, 1001, Progress{Age: mean / 2, Mean: mean}, 751},
		{1, 1000, Progress{Age: mean, Mean: mean}, 0},
		{1, 1000, Progress{Age: 3 * mean, Mean: mean}, 667},
		{3, 3000, Progress{Age: 2 * mean, Mean: mean}, 2500},
		{1, 100000, Progress{Age: 40 * time.Millisecond, Mean: 20 * time.Millisecond, MeanTokens: 800}, 98400},
		{1, 100000, Progress{Age: 30 * time.Second, Mean: 20 * time.Millisecond, MeanTokens: 800}, 91667},
		{2, 1600, Progress{Age: 10 * time.Millisecond, Mean: 20 * time.Millisecond, MeanTokens: 800}, 1200},
		{1, 1000, Progress{Mean: mean}, 1000},
		{1, 1000, Progress{}, 500}, // only other routers' attempts: half done
		{4, 4000, Progress{}, 3500},
		{1, 1000, Progress{Age: mean / 2}, 1000},
		{1, 1000, Progress{Age: -mean, Mean: mean}, 1000},
		{0, 1000, Progress{Age: mean / 2, Mean: mean}, 1000},
		{1, 0, Progress{Age: mean / 2, Mean: mean}, 0},
		{1, 1 << 50, Progress{Age: 1 << 62, Mean: 1, MeanTokens: 1 << 50}, 1 << 40}, // bounded, far overdue: whole
	} {
		c := (&Candidate{Outstanding: tc.outstanding, Legs: tc.outstanding, Tokens: tc.tokens, Head: tc.head}).Cost(w)
		if c != base+tc.want {
			t.Errorf("%d attempts of %d tokens in all, head %+v: cost %d, want %d + %d", tc.outstanding, tc.tokens, tc.head, c, base, tc.want)
		}
	}
}

// TestColdPrefillJustBegunKeepsItsWholeCostRPLACE3: the engine that has
// begun computing a cold context — the only one holding it, its
// attempt's reservation the whole 800-token prompt, its pace learned
// from warm prompts (64 tokens in 20 ms, so 250 ms for it) — loses the
// next request of that context to an idle engine while what is left of
// it is more than the 768 tokens the match saves (the first 10 ms), wins
// it after, and loses it again when the prefill is long overdue (the
// engine stalled).
func TestColdPrefillJustBegunKeepsItsWholeCostRPLACE3(t *testing.T) {
	b := Balance{Abs: 32, Rel: 1.5}
	w := work(50) // 800 tokens, the context
	pace := Progress{Mean: 20 * time.Millisecond, MeanTokens: 64}
	holder := Candidate{Matched: 48, Outstanding: 1, Legs: 1, Tokens: 800, Head: pace}
	for _, tc := range []struct {
		age  time.Duration
		want int
	}{
		{time.Millisecond, 1},
		{5 * time.Millisecond, 1},
		{20 * time.Millisecond, 0},
		{190 * time.Millisecond, 0},
		{250 * time.Millisecond, 0},
		{10 * time.Second, 1}, // 40× overdue
	} {
		holder.Head.Age = tc.age
		for range 50 {
			if i, _ := Choose([]Candidate{holder, {}}, w, b); i != tc.want {
				t.Fatalf("holder %v into its 800-token prefill (cost %d) against an idle engine (cost %d): chose %d, want %d", tc.age, holder.Cost(w), (&Candidate{}).Cost(w), i, tc.want)
			}
		}
	}
}

// TestCostTermsRPLACE3 proves the cost's other terms: the engine's own
// requests beyond the mesh's legs on it count PerRequest each (the mesh's
// own legs are not counted twice), a role-both engine's decode legs a
// block each, the uncached part follows the learned ratio, and a prompt
// shorter than MinScoredBlocks counts as wholly uncached.
func TestCostTermsRPLACE3(t *testing.T) {
	w := work(100) // 1,600 tokens, PerRequest 1,600
	base := (&Candidate{}).Cost(w)
	if base != 1600 {
		t.Fatalf("idle engine: cost %d, want the prompt's 1,600 tokens", base)
	}
	if c := (&Candidate{Waiting: 2, Running: 3, Legs: 5, Tokens: 10}).Cost(w); c != base+10 {
		t.Fatalf("engine's requests all the mesh's: cost %d, want %d", c, base+10)
	}
	if c := (&Candidate{Waiting: 2, Running: 3, Legs: 1}).Cost(w); c != base+4*1600 {
		t.Fatalf("4 requests the mesh did not send: cost %d, want %d", c, base+4*1600)
	}
	if c := (&Candidate{DecodeLegs: 10}).Cost(w); c != base+10 {
		t.Fatalf("10 decode legs: cost %d, want %d (a token each)", c, base+10)
	}
	w2 := *w
	w2.Ratio = 2 * 256 // 2 bytes a token: twice the tokens
	if c := (&Candidate{Matched: 50}).Cost(&w2); c != 1600 {
		t.Fatalf("half matched at 2 bytes a token: cost %d, want 1,600", c)
	}
	short := work(MinScoredBlocks - 1)
	if c := (&Candidate{Matched: MinScoredBlocks - 1}).Cost(short); c != int64(MinScoredBlocks-1)*16 {
		t.Fatalf("short prompt: cost %d, want it wholly uncached", c)
	}
	if r := TokenRatio(0).Tokens(64); r != 64 {
		t.Fatalf("ratio 0 taken as %d tokens for 64 bytes, want the 1-byte bound: 64", r)
	}
}

// TestChooseNoMatchIsLeastWorkRPLACE3: with nothing matched anywhere the
// cost is the work in flight: the engine with the least wins, ties
// spread at random.
func TestChooseNoMatchIsLeastWorkRPLACE3(t *testing.T) {
	b := Balance{Abs: 32, Rel: 1.5}
	cands := []Candidate{{Outstanding: 3, Tokens: 300}, {Outstanding: 1, Tokens: 100}, {Outstanding: 1, Tokens: 100}, {Outstanding: 2, Tokens: 200}}
	counts := [4]int{}
	for range 400 {
		i, _ := Choose(cands, work(10), b)
		counts[i]++
	}
	if counts[0] != 0 || counts[3] != 0 || counts[1] < 100 || counts[2] < 100 {
		t.Fatalf("choices %v, want only 1 and 2, about evenly", counts)
	}
	if i, _ := Choose(cands, work(0), b); i != 1 && i != 2 {
		t.Fatalf("prompt of no block: chose %d", i)
	}
	// A prompt shorter than MinScoredBlocks goes by work, matched or not.
	short := []Candidate{{Matched: MinScoredBlocks - 1, Tokens: 1}, {}}
	if i, g := Choose(short, work(MinScoredBlocks-1), b); i != 1 || g {
		t.Fatalf("short prompt: chose %d (guard %v), want the idle 1", i, g)
	}
	short[0].Matched = MinScoredBlocks
	if i, _ := Choose(short, work(MinScoredBlocks), b); i != 0 {
		t.Fatalf("prompt of MinScoredBlocks: chose %d, want the matched 0", i)
	}
	if i, _ := Choose(nil, work(10), b); i != -1 {
		t.Fatalf("no candidate: %d", i)
	}
}

// TestChooseGuardRPLACE2 proves the imbalance guard: both thresholds
// must be crossed, and then the least loaded wins whatever the match.
func TestChooseGuardRPLACE2(t *testing.T) {
	b := Balance{Abs: 32, Rel: 1.5}
	// max − min = 33 > 32 and 43 > 1.5 × 10: guard.
	cands := []Candidate{{Matched: 100, Outstanding: 43}, {Outstanding: 10}, {Outstanding: 20}}
	if i, g := Choose(cands, work(100), b); i != 1 || !g {
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

// TestChooseHostileQueueRPLACE3: an engine's own queue comes from its
// /metrics and the other routers' counts from the bus, which the router
// does not trust; counts so large that a sum would overflow still make
// the largest cost, with the guard on and off, and never attract the
// placement.
func TestChooseHostileQueueRPLACE3(t *testing.T) {
	b := Balance{Abs: 32, Rel: 1.5}
	for _, n := range []int64{math.MaxInt64 - 1, math.MaxInt64, 1 << 62} {
		for _, c := range []Candidate{
			{Matched: 100, Outstanding: 5, Waiting: n, Running: n},
			{Matched: 100, Outstanding: 5, Tokens: n, DecodeLegs: n},
			{Matched: 100, Outstanding: 5, Waiting: n, Legs: -n},
		} {
			cands := []Candidate{c, {Outstanding: 0}}
			w := work(100)
			w.PerRequest = n
			if i, _ := Choose(cands, w, b); i != 1 {
				t.Fatalf("%+v: chose the engine that says it has that much", c)
			}
			cands[0].Outstanding = 40 // guard: 40 − 0 > 32
			if i, g := Choose(cands, w, b); i != 1 || !g {
				t.Fatalf("%+v, guard: chose %d (guard %v), want 1", c, i, g)
			}
		}
	}
}

// TestIndexCutRPLACE3 proves R-PLACE-3's correction in the index: a
// chain cut where the engine's cache ended matches only up to there on
// that engine (the other engines keep theirs), the cut blocks' slots are
// reused without growing the index, and cutting what is not held does
// nothing.
func TestIndexCutRPLACE3(t *testing.T) {
	ix := NewIndex(256)
	h := AppendHashes(nil, prompt(1, 100*BlockBytes))
	ix.Record("a", h, nil)
	ix.Record("b", h, nil)
	if n := ix.Cut("a", h[30:]); n != 70 {
		t.Fatalf("cut removed %d, want 70", n)
	}
	if m := ix.Match("a", h); m != 30 {
		t.Fatalf("after the cut at 30: match %d", m)
	}
	if m := ix.Match("b", h); m != 100 {
		t.Fatalf("other engine: match %d, want 100", m)
	}
	if ix.Blocks("a") != 30 {
		t.Fatalf("blocks %d, want 30", ix.Blocks("a"))
	}
	if n := ix.Cut("a", h[30:]); n != 0 || ix.Cut("none", h) != 0 {
		t.Fatal("cutting what is not held removed something")
	}
	// The freed slots are reused: fill to the bound, the arrays do not grow.
	for j := 0; ix.Blocks("a") < 256; j++ {
		ix.Record("a", AppendHashes(nil, prompt(uint64(j+10), 10*BlockBytes)), nil)
	}
	e := ix.lookup("a")
	if len(e.hash) != 256 {
		t.Fatalf("slots %d, want 256 (freed ones reused)", len(e.hash))
	}
	ix.Record("a", h, nil)
	if m := ix.Match("a", h); m != 100 || ix.Blocks("a") != 256 {
		t.Fatalf("recorded again: match %d blocks %d", m, ix.Blocks("a"))
	}
	fresh := make([]uint64, 0, len(h))
	if allocs := testkit.LeastAllocs(100, func() { ix.Cut("a", h[50:]); fresh = ix.Record("a", h, fresh[:0]) }); allocs != 0 {
		t.Fatalf("cut and record again: %v allocations", allocs)
	}
	// Learn lists nothing, so learning blocks the index lacks allocates
	// nothing either.
	if allocs := testkit.LeastAllocs(100, func() { ix.Cut("a", h[50:]); ix.Learn("a", h) }); allocs != 0 {
		t.Fatalf("cut and learn again: %v allocations", allocs)
	}
	if m := ix.Match("a", h); m != 100 {
		t.Fatalf("learned again: match %d, want 100", m)
	}
}

// TestIndexEngineCapacityRPLACE3: an engine's own bound (its reported KV
// cache size) evicts its least recent blocks at once, holds for new
// ones, survives a Drop, and never exceeds the index's bound.
func TestIndexEngineCapacityRPLACE3(t *testing.T) {
	ix := NewIndex(256)
	old := AppendHashes(nil, prompt(1, 100*BlockBytes))
	recent := AppendHashes(nil, prompt(2, 50*BlockBytes))
	ix.Record("a", old, nil)
	ix.Record("a", recent, nil)
	if got := ix.SetCapacity("a", 60); got != 60 || ix.Blocks("a") != 60 || ix.EngineCapacity("a") != 60 {
		t.Fatalf("bound %d, blocks %d, want 60", got, ix.Blocks("a"))
	}
	if ix.Match("a", recent) != 50 || ix.Match("a", old) != 10 {
		t.Fatalf("after shrinking: recent %d (want 50), old %d (want its 10 leading blocks)", ix.Match("a", recent), ix.Match("a", old))
	}
	ix.Record("a", AppendHashes(nil, prompt(3, 100*BlockBytes)), nil)
	if ix.Blocks("a") != 60 {
		t.Fatalf("blocks %d above the engine's bound", ix.Blocks("a"))
	}
	ix.Drop("a")
	ix.Record("a", old, nil)
	if ix.Blocks("a") != 60 {
		t.Fatalf("after a drop: blocks %d, want the engine's bound 60", ix.Blocks("a"))
	}
	if got := ix.SetCapacity("a", 1<<20); got != 256 {
		t.Fatalf("bound above the index's: %d", got)
	}
	ix.Forget("a")
	if ix.EngineCapacity("a") != 256 {
		t.Fatal("forgotten engine keeps its bound")
	}
}

// TestRecordKeepsExactLRUOrderRPLACE2 checks the fast path of Record
// against a plain LRU list: whatever the chains (a prompt placed again,
// chains sharing heads, chains longer than the set, hostile repeats of
// one hash), the recency order and the hashes reported fresh are those of
// touching every hash from the last to the first. The list is walked
// both ways, so a broken link fails too.
func TestRecordKeepsExactLRUOrderRPLACE2(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	for _, capacity := range []int{3, 8, 64} {
		ix := NewIndex(capacity)
		var model []uint64                                                  // most recent first
		heads := [][]uint64{{2, 3, 4, 5}, {2, 3, 19}, {6, 7, 8, 9, 10, 11}} // 0 and 1 are one key in the table
		for step := range 3000 {
			var chain []uint64
			switch rng.IntN(4) {
			case 0: // a known head with a new tail
				chain = append(chain, heads[rng.IntN(len(heads))]...)
				for range rng.IntN(4) {
					chain = append(chain, 100+uint64(rng.IntN(50)))
				}
			case 1: // anything, repeats included
				for range 1 + rng.IntN(capacity+3) {
					chain = append(chain, 2+uint64(rng.IntN(12)))
				}
			default: // the last chain again, or a head of it
				if len(model) > 0 {
					chain = append(chain, model[:1+rng.IntN(len(model))]...)
				}
			}
			var wantFresh, notHeld []uint64
			for _, h := range chain {
				if !slices.Contains(model, h) {
					notHeld = append(notHeld, h)
				}
			}
			for i := len(chain) - 1; i >= 0; i-- {
				h := chain[i]
				if at := slices.Index(model, h); at >= 0 {
					model = slices.Delete(model, at, at+1)
				} else {
					wantFresh = append(wantFresh, h)
					if len(model) == capacity {
						model = model[:capacity-1]
					}
				}
				model = slices.Insert(model, 0, h)
			}
			slices.Reverse(wantFresh)
			fresh := ix.Record("e", chain, nil)
			if len(chain) <= capacity && !repeats(chain) && isSubsequence(notHeld, fresh) && isSubsequence(fresh, chain) {
				// Fresh is at least what the set did not hold before, in
				// chain order; like touching one by one, Record may also
				// report a hash of the chain that the chain's own new
				// blocks evicted on the way (it sat last in a full set).
				wantFresh = fresh
			}
			e := ix.lookup("e")
			var got, back []uint64
			for s := e.head; s >= 0; s = e.next[s] {
				got = append(got, e.hash[s])
				if len(got) > capacity {
					break
				}
			}
			for s := e.tail; s >= 0; s = e.prev[s] {
				back = append(back, e.hash[s])
				if len(back) > capacity {
					break
				}
			}
			slices.Reverse(back)
			if repeats(chain) && slices.Equal(got, back) && len(got) == len(model) && ix.Blocks("e") == len(model) {
				// A chain that repeats a hash (a collision, or a hostile
				// peer) may leave its repeats in another order than a
				// plain LRU's; the list stays whole and holds as many.
				model = got
				continue
			}
			if !slices.Equal(got, model) || !slices.Equal(back, model) || !slices.Equal(fresh, wantFresh) || ix.Blocks("e") != len(model) {
				t.Fatalf("capacity %d step %d chain %v: order %v (backwards %v), fresh %v; want %v, fresh %v",
					capacity, step, chain, got, back, fresh, model, wantFresh)
			}
		}
	}
}

func repeats(chain []uint64) bool {
	for i, h := range chain {
		if slices.Contains(chain[:i], h) {
			return true
		}
	}
	return false
}

// isSubsequence reports whether a's elements occur in b in a's order.
func isSubsequence(a, b []uint64) bool {
	for _, h := range b {
		if len(a) > 0 && a[0] == h {
			a = a[1:]
		}
	}
	return len(a) == 0
}
