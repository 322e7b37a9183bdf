package sim

import (
	"unicode"
	"unicode/utf8"
)

// The simulator's tokeniser. A token is a whitespace-separated word of the
// prompt as the engine sees it (PromptTokens counts them); its id is a
// 32-bit FNV-1a hash of the word's bytes folded into a vocabulary of
// TokenVocabulary ids. The words that open a chat message (the role
// header RenderChat writes, "user:" or "tool[call_1]:") are role markers:
// their ids come from a range of their own, below FirstWordToken, that no
// word of a completions prompt reaches, as a chat template's special
// tokens are. So a chat request and a completions prompt of the same
// text never share a block, and the ids POST /tokenize answers are
// exactly the tokens whose blocks the prefix cache stores and publishes
// (kvevents.go).
const (
	// TokenVocabulary is the number of token ids: every id is in
	// [0, TokenVocabulary), so it fits a non-negative int32.
	TokenVocabulary = 1 << 31
	// FirstWordToken is the smallest id of a word; the ids below it are
	// role markers.
	FirstWordToken = 1 << 16
)

const (
	fnv32Offset = 2166136261
	fnv32Prime  = 16777619
)

// wordToken is the id of the word s (bytes, not runes), marker saying it
// is a role header.
func wordToken(s string, marker bool) uint32 {
	h := uint32(fnv32Offset)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= fnv32Prime
	}
	if marker {
		return 1 + h%(FirstWordToken-1)
	}
	return FirstWordToken + h%(TokenVocabulary-FirstWordToken)
}

// appendTokenIDs appends to dst the token ids of prompt and returns it.
// headers holds the byte spans of prompt's role headers as pairs
// [start, end) (renderChat's; nil for a completions prompt): a word that
// starts inside one is a role marker. It allocates nothing beyond growing
// dst.
func appendTokenIDs(dst []uint32, prompt string, headers []int) []uint32 {
	start, h := -1, 0
	for i := 0; i <= len(prompt); {
		r, size := ' ', 1
		if i < len(prompt) {
			r = rune(prompt[i])
			if r >= utf8.RuneSelf {
				r, size = utf8.DecodeRuneInString(prompt[i:])
			}
		}
		if unicode.IsSpace(r) {
			if start >= 0 {
				for h+1 < len(headers) && headers[h+1] <= start {
					h += 2
				}
				marker := h+1 < len(headers) && headers[h] <= start && start < headers[h+1]
				dst = append(dst, wordToken(prompt[start:i], marker))
				start = -1
			}
		} else if start < 0 {
			start = i
		}
		i += size
	}
	return dst
}

// appendBlockHashes appends to dst the chained hashes of the full blocks
// of tokens, blockSize tokens per block, and returns it. Hash i covers
// tokens [0, (i+1)·blockSize): it chains block i's token ids onto hash
// i-1, so two prompts share leading hashes exactly as far as they share
// leading full blocks of token ids, as vLLM's block hashes do. A trailing
// partial block has no hash. It allocates nothing beyond growing dst.
func appendBlockHashes(dst []uint64, tokens []uint32, blockSize int) []uint64 {
	h := uint64(fnvOffset64)
	for i := 0; i+blockSize <= len(tokens); i += blockSize {
		for _, t := range tokens[i : i+blockSize] {
			for k := 0; k < 4; k++ {
				h ^= uint64(t & 0xff)
				h *= fnvPrime64
				t >>= 8
			}
		}
		h = finalize(h)
		dst = append(dst, h)
	}
	return dst
}
