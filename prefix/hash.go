// Package prefix is prefix-aware placement (behaviour.md R-PLACE-2): a prompt
// turned into chained hashes of fixed-size blocks (AppendHashes), a
// bounded per-engine index of the blocks recently sent to each engine
// (Index), and the scorer that weighs the leading blocks an engine
// already holds against its load, with the imbalance guard (Choose).
//
// The index is approximate: it knows what was sent where, not what an
// engine still holds in its KV cache.
package prefix

import (
	"encoding/binary"
	"math/bits"
)

// BlockBytes is the size of one block, in bytes of the rendered prompt
// (schemas.Request.AppendPrompt). A block is bytes, not tokens: the
// router has no tokenizer, bytes need none, and two prompts that share N
// leading bytes share N/BlockBytes leading blocks whatever the model's
// tokenizer does with them. 64 bytes is llm-d's block and roughly 16
// tokens of English text (vLLM's default KV block).
const BlockBytes = 64

// MinScoredBlocks is the shortest prompt, in blocks, whose match is worth
// weighing against load (256 bytes, about 64 tokens): a hit on a shorter
// prompt saves too little prefill to matter, so Choose places it by load
// alone and identical short prompts still spread over the engines.
const MinScoredBlocks = 4

// MaxBlocks bounds the blocks hashed per prompt (256 KiB of rendered
// prompt): the bytes after them are not hashed, so the work of one
// placement is bounded whatever the prompt's size.
const MaxBlocks = 4096

// The multipliers of xxHash64 (public constants of a published hash).
const (
	prime1 uint64 = 11400714785074694791
	prime2 uint64 = 14029467366897019727
	prime3 uint64 = 1609587929392839161
	prime4 uint64 = 9650029242287828579
)

// Seed is the chain's starting value: every router must use the same
// one, so that the hashes they publish on the bus mean the same blocks.
const Seed uint64 = 0x6e617277_68616c31 // "narwhal1"

// AppendHashes appends to dst the chained hashes of the full BlockBytes
// blocks of prompt (at most MaxBlocks of them; a partial last block is not
// hashed, as an engine caches only full blocks) and returns the extended
// slice. Hash i depends on blocks 0…i, so two prompts have equal hash i
// exactly when (up to 64-bit collisions) their first i+1 blocks are equal.
// The function is deterministic across processes and versions of Go (a
// fixed seed, no per-process randomness) and does not allocate when dst
// has room for len(prompt)/BlockBytes more hashes.
func AppendHashes(dst []uint64, prompt []byte) []uint64 {
	n := len(prompt) / BlockBytes
	if n > MaxBlocks {
		n = MaxBlocks
	}
	h := Seed
	for i := 0; i < n; i++ {
		h = chain(h, blockHash(prompt[i*BlockBytes:(i+1)*BlockBytes:(i+1)*BlockBytes]))
		dst = append(dst, h)
	}
	return dst
}

// chain folds one block's hash into the hash of the blocks before it:
// xxHash64's avalanche of their exclusive or, a bijection of either one
// for a fixed other, so equal blocks after different prefixes hash
// differently. Only this step is serial; the blocks' own hashes are
// independent of each other, so the processor overlaps them.
func chain(prev, block uint64) uint64 {
	h := prev ^ block
	h ^= h >> 33
	h *= prime2
	h ^= h >> 29
	h *= prime3
	h ^= h >> 32
	return h
}

// Blocks returns how many hashes AppendHashes makes of a prompt of n
// bytes.
func Blocks(n int) int {
	return min(n/BlockBytes, MaxBlocks)
}

// blockHash is xxHash64 of one 64-byte block, seeded with Seed: four
// independent lanes of two rounds each, merged and avalanched as xxHash64
// does.
func blockHash(b []byte) uint64 {
	seed := Seed
	_ = b[63]
	v1 := seed + prime1 + prime2
	v2 := seed + prime2
	v3 := seed
	v4 := seed - prime1
	v1 = round(v1, binary.LittleEndian.Uint64(b[0:]))
	v2 = round(v2, binary.LittleEndian.Uint64(b[8:]))
	v3 = round(v3, binary.LittleEndian.Uint64(b[16:]))
	v4 = round(v4, binary.LittleEndian.Uint64(b[24:]))
	v1 = round(v1, binary.LittleEndian.Uint64(b[32:]))
	v2 = round(v2, binary.LittleEndian.Uint64(b[40:]))
	v3 = round(v3, binary.LittleEndian.Uint64(b[48:]))
	v4 = round(v4, binary.LittleEndian.Uint64(b[56:]))
	h := bits.RotateLeft64(v1, 1) + bits.RotateLeft64(v2, 7) + bits.RotateLeft64(v3, 12) + bits.RotateLeft64(v4, 18)
	h = mergeRound(h, v1)
	h = mergeRound(h, v2)
	h = mergeRound(h, v3)
	h = mergeRound(h, v4)
	h += BlockBytes
	h ^= h >> 33
	h *= prime2
	h ^= h >> 29
	h *= prime3
	h ^= h >> 32
	return h
}

func round(acc, input uint64) uint64 {
	acc += input * prime2
	acc = bits.RotateLeft64(acc, 31)
	return acc * prime1
}

func mergeRound(acc, val uint64) uint64 {
	val = round(0, val)
	acc ^= val
	return acc*prime1 + prime4
}
