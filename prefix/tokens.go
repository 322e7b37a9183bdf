package prefix

import "math/bits"

// TokenSeed starts every chain of token-block keys (AppendTokenKeys): the
// exact index's keys (behaviour.md R-PLACE-4) are a space of their own,
// apart from the byte-block hashes of AppendHashes.
const TokenSeed uint64 = 0x6e617277_6b763031 // "narwkv01"

// MaxTokenBlockSize bounds the tokens of one KV block a key is made of:
// vLLM's block sizes are 1…256 tokens (16 by default); a larger block is
// refused (TokenBlockKey's callers check it).
const MaxTokenBlockSize = 1024

// TokenBlockKey returns the key of one KV block of an engine's cache for
// the exact index (behaviour.md R-PLACE-4): a 64-bit hash of the key of
// the block before it (parent; 0 for a chain's first block), the block's
// token ids, in order, and salt (BlockSalt: the block's LoRA adapter and
// cache salt; 0 for the base model without salt). It is our own hash, not
// the engine's: every router and every agent computes the same key from
// the same token ids, whatever hash function or seed the engine uses, so
// two chains share a key exactly when (up to 64-bit collisions) their
// blocks up to it are equal. It allocates nothing.
func TokenBlockKey(parent uint64, tokens []uint32, salt uint64) uint64 {
	h := TokenSeed ^ salt*prime1 ^ uint64(len(tokens))*prime4
	h = chain(h, parent)
	i := 0
	for ; i+1 < len(tokens); i += 2 {
		h = round(h, uint64(tokens[i])|uint64(tokens[i+1])<<32)
		h = bits.RotateLeft64(h, 27)*prime1 + prime4
	}
	if i < len(tokens) {
		h = round(h, uint64(tokens[i])|1<<63)
	}
	h ^= h >> 33
	h *= prime2
	h ^= h >> 29
	h *= prime3
	h ^= h >> 32
	if h == 0 {
		// 0 means "no parent": no block has it as its key.
		h = prime5
	}
	return h
}

// prime5 is xxHash64's fifth multiplier, the key a block gets in the
// (one in 2^64) case its hash is 0.
const prime5 uint64 = 2870177450012600261

// AppendTokenKeys appends to dst the keys (TokenBlockKey) of the full
// blocks of tokens, blockSize tokens each, chained from the first block,
// with salt, and returns the extended slice; a partial last block gets no
// key, as an engine caches only full blocks. At most MaxBlocks keys are
// made. A blockSize below 1 or above MaxTokenBlockSize makes none. It
// does not allocate when dst has room for the keys.
func AppendTokenKeys(dst []uint64, tokens []uint32, blockSize int, salt uint64) []uint64 {
	if blockSize < 1 || blockSize > MaxTokenBlockSize {
		return dst
	}
	n := min(len(tokens)/blockSize, MaxBlocks)
	var parent uint64
	for i := 0; i < n; i++ {
		parent = TokenBlockKey(parent, tokens[i*blockSize:(i+1)*blockSize], salt)
		dst = append(dst, parent)
	}
	return dst
}

// BlockSalt returns the salt of a KV block's key (TokenBlockKey): a hash
// of the LoRA adapter's name (lora; empty for the base model) and the
// block's extra keys as the engine encodes them (extra; vLLM's
// extra_keys, e.g. a request's cache_salt, as their msgpack bytes; nil
// for none), so that the same tokens under another adapter or salt are a
// different block, as they are in the engine's cache. It returns 0 when
// both are empty.
func BlockSalt(lora string, extra []byte) uint64 {
	if lora == "" && len(extra) == 0 {
		return 0
	}
	h := TokenSeed ^ prime3
	for i := 0; i < len(lora); i++ {
		h = (h ^ uint64(lora[i])) * 0x100000001b3
	}
	h = chain(h, uint64(len(lora)))
	for i := 0; i < len(extra); i++ {
		h = (h ^ uint64(extra[i])) * 0x100000001b3
	}
	h = chain(h, uint64(len(extra))|1<<62)
	if h == 0 {
		h = prime5
	}
	return h
}
