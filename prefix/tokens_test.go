package prefix

import (
	"testing"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestTokenKeysChainRPLACE4 proves the exact index's keys: two token
// sequences share leading keys exactly as far as they share leading full
// blocks, a partial block gets no key, another salt or block size is
// another chain, and the values are fixed across processes (a router and
// an agent of different builds must agree).
func TestTokenKeysChainRPLACE4(t *testing.T) {
	a := make([]uint32, 50)
	for i := range a {
		a[i] = uint32(1000 + i)
	}
	b := append([]uint32(nil), a...)
	b[37] = 7 // third block (32…47) differs
	ka := AppendTokenKeys(nil, a, 16, 0)
	kb := AppendTokenKeys(nil, b, 16, 0)
	if len(ka) != 3 || len(kb) != 3 {
		t.Fatalf("keys: %d and %d, want 3 (50 tokens, 16 a block)", len(ka), len(kb))
	}
	if ka[0] != kb[0] || ka[1] != kb[1] || ka[2] == kb[2] {
		t.Fatalf("keys %x and %x: want the first two equal, the third apart", ka, kb)
	}
	if ka[1] != TokenBlockKey(ka[0], a[16:32], 0) {
		t.Fatal("AppendTokenKeys is not TokenBlockKey chained from 0")
	}
	if AppendTokenKeys(nil, a, 16, BlockSalt("adapter", nil))[0] == ka[0] {
		t.Error("a LoRA adapter's block has the base model's key")
	}
	if BlockSalt("", []byte{0x91, 0xa1, 'x'}) == BlockSalt("x", nil) || BlockSalt("", nil) != 0 {
		t.Error("salts of lora and extra keys are not kept apart, or the empty salt is not 0")
	}
	if k := AppendTokenKeys(nil, a, 10, 0); k[0] == ka[0] || len(k) != 5 {
		t.Errorf("block size 10: %d keys, first %x; want 5 keys of another chain", len(k), k[0])
	}
	if AppendTokenKeys(nil, a, 0, 0) != nil || AppendTokenKeys(nil, a, MaxTokenBlockSize+1, 0) != nil {
		t.Error("an invalid block size made keys")
	}
	// Fixed values: a change here changes every key on the bus.
	if got := TokenBlockKey(0, []uint32{1, 2, 3}, 0); got != 0x646ad31e7864fc71 {
		t.Errorf("TokenBlockKey(0, [1 2 3], 0) = %#x: the key function changed", got)
	}
	dst := make([]uint64, 0, 8)
	if n := testkit.LeastAllocs(100, func() { dst = AppendTokenKeys(dst[:0], a, 16, 0) }); n != 0 {
		t.Errorf("AppendTokenKeys allocates %.1f times a call with room in dst, want 0", n)
	}
}

// BenchmarkTokenKeys2000Tokens measures the keys of a 2,000-token prompt
// in 16-token blocks, what a router computes per placed request.
func BenchmarkTokenKeys2000Tokens(b *testing.B) {
	tokens := make([]uint32, 2000)
	for i := range tokens {
		tokens[i] = uint32(i * 7919)
	}
	dst := make([]uint64, 0, 128)
	b.ReportAllocs()
	for b.Loop() {
		dst = AppendTokenKeys(dst[:0], tokens, 16, 0)
	}
}
