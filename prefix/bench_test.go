package prefix

import (
	"fmt"
	"testing"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// BenchmarkPrefixScore2000Tokens measures one placement's prefix work
// for a 2,000-token prompt (8,000 bytes, about 4 bytes a token): hashing
// it into a reused buffer, matching it against 4 engines' full indexes
// (one holding the prompt's first half) and choosing by the cost
// (R-PLACE-2, R-PLACE-3). Target: at most 5 µs, 0 allocs/op.
func BenchmarkPrefixScore2000Tokens(b *testing.B) {
	p := prompt(1, 8000)
	ix := NewIndex(DefaultBlocksPerEngine)
	ids := []string{"prefill-0", "prefill-1", "prefill-2", "prefill-3"}
	for i, id := range ids {
		// Fill each engine's index to its bound with other prompts.
		for j := 0; ix.Blocks(id) < DefaultBlocksPerEngine; j++ {
			ix.Record(id, AppendHashes(nil, prompt(uint64(1000*i+j+10), 125*BlockBytes)), nil)
		}
	}
	ix.Record(ids[2], AppendHashes(nil, p)[:60], nil)
	hashes := make([]uint64, 0, Blocks(len(p)))
	cands := make([]Candidate, len(ids))
	bal := Balance{Abs: 32, Rel: 1.5}
	b.ReportAllocs()
	b.ResetTimer()
	chosen := -1
	cpu := testkit.CPUTime()
	for b.Loop() {
		hashes = AppendHashes(hashes[:0], p)
		for i, id := range ids {
			cands[i] = Candidate{Matched: ix.Match(id, hashes), Outstanding: int64(i & 1), Legs: int64(i & 1), Tokens: int64(i&1) * 500}
		}
		w := Work{Blocks: len(hashes), PromptBytes: int64(len(p)), Ratio: DefaultTokenRatio, PerRequest: 2000}
		chosen, _ = Choose(cands, &w, bal)
	}
	testkit.ReportCPUPerOp(b, cpu)
	if chosen != 2 {
		b.Fatal(fmt.Sprint("chose ", chosen, ", want the engine holding the prefix"))
	}
}

// BenchmarkHash8000Bytes is the hashing alone.
func BenchmarkHash8000Bytes(b *testing.B) {
	p := prompt(1, 8000)
	hashes := make([]uint64, 0, Blocks(len(p)))
	b.SetBytes(int64(len(p)))
	b.ReportAllocs()
	for b.Loop() {
		hashes = AppendHashes(hashes[:0], p)
	}
}

// BenchmarkRecord2000Tokens records a 2,000-token prompt (125 blocks)
// already held, at an engine whose index is full: the index's work after
// each placement.
func BenchmarkRecord2000Tokens(b *testing.B) {
	ix := NewIndex(DefaultBlocksPerEngine)
	for j := 0; ix.Blocks("e") < DefaultBlocksPerEngine; j++ {
		ix.Record("e", AppendHashes(nil, prompt(uint64(j+10), 125*BlockBytes)), nil)
	}
	hashes := AppendHashes(nil, prompt(1, 8000))
	fresh := make([]uint64, 0, len(hashes))
	ix.Record("e", hashes, nil)
	b.ReportAllocs()
	cpu := testkit.CPUTime()
	for b.Loop() {
		fresh = ix.Record("e", hashes, fresh[:0])
	}
	testkit.ReportCPUPerOp(b, cpu)
}

// BenchmarkRecordInterleaved2000Tokens records two 2,000-token prompts in
// turn that share nothing, at a full index: neither opens the recency
// list when it comes back, so every block is moved (the path Record takes
// when tenants interleave).
func BenchmarkRecordInterleaved2000Tokens(b *testing.B) {
	ix := NewIndex(DefaultBlocksPerEngine)
	for j := 0; ix.Blocks("e") < DefaultBlocksPerEngine; j++ {
		ix.Record("e", AppendHashes(nil, prompt(uint64(j+10), 125*BlockBytes)), nil)
	}
	two := [2][]uint64{AppendHashes(nil, prompt(1, 8000)), AppendHashes(nil, prompt(2, 8000))}
	fresh := make([]uint64, 0, 125)
	b.ReportAllocs()
	cpu := testkit.CPUTime()
	i := 0
	for b.Loop() {
		fresh = ix.Record("e", two[i&1], fresh[:0])
		i++
	}
	testkit.ReportCPUPerOp(b, cpu)
}
