package meshview

import (
	"testing"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/prefix"
)

// TestCorrectPrefixCutsAndLearnsRPLACE3 proves the view's side of
// R-PLACE-3's correction: the bytes per token and the mean uncached
// prefill are learned from usage.prompt_tokens (4 bytes a token until
// then); an answer whose cached tokens fall short of the prediction cuts
// the chain where the engine's cache ended, one within the slack does
// not; an answer without cached_tokens corrects nothing and is counted.
func TestCorrectPrefixCutsAndLearnsRPLACE3(t *testing.T) {
	s := newStack(t, prefixFleet(), nil)
	p1 := s.v.Fleet().Member("p1")
	if r, per := s.v.TokenWork("m"); r != prefix.DefaultTokenRatio || per != 0 {
		t.Fatalf("before any answer: ratio %d, per request %d", r, per)
	}
	h := make([]uint64, 100)
	for i := range h {
		h[i] = uint64(i + 1)
	}
	s.v.PrefixIndex().Record("p1", h, nil)
	// 6,400 bytes in 3,200 tokens: 2 bytes a token, taken whole at first.
	pred := &Prediction{Model: "m", Hashes: h, Matched: 100, PromptBytes: 6400, Whole: true}
	s.v.CorrectPrefix(p1, pred, PrefillUsage{Usage: true, PromptTokens: 3200, Cached: true, CachedTokens: 3200 - 96})
	if r, per := s.v.TokenWork("m"); r != 512 || per != 96 {
		t.Fatalf("after one answer: ratio %d (want 512: 2 bytes a token), per request %d (want 96)", r, per)
	}
	if m := s.v.PrefixIndex().Match("p1", h); m != 100 {
		t.Fatalf("an answer within the slack cut the chain to %d", m)
	}
	// The engine had 40 blocks' worth (1,280 tokens at 2 bytes a token).
	s.v.CorrectPrefix(p1, pred, PrefillUsage{Usage: true, PromptTokens: 3200, Cached: true, CachedTokens: 1280})
	if m := s.v.PrefixIndex().Match("p1", h); m != 40 {
		t.Fatalf("after the engine denied blocks 40…: match %d, want 40", m)
	}
	if n := testkit.GatheredSum(t, s.reg, "narwhal_prefix_index_cuts_total"); n != 1 {
		t.Fatalf("cuts %v", n)
	}
	if n := testkit.GatheredSum(t, s.reg, "narwhal_prefix_predicted_tokens_total", "engine", "p1"); n != 6400 {
		t.Fatalf("predicted %v, want 2 × 3,200", n)
	}
	s.v.CorrectPrefix(p1, &Prediction{Model: "m", Hashes: h, Matched: 40, PromptBytes: 6400, Whole: true}, PrefillUsage{Usage: true, PromptTokens: 3200})
	if m := s.v.PrefixIndex().Match("p1", h); m != 40 {
		t.Fatalf("an answer without cached_tokens changed the index: %d", m)
	}
	if n := testkit.GatheredSum(t, s.reg, "narwhal_prefix_uncorrected_total"); n != 1 {
		t.Fatalf("uncorrected %v", n)
	}
	if a := testkit.LeastAllocs(100, func() {
		s.v.CorrectPrefix(p1, pred, PrefillUsage{Usage: true, PromptTokens: 3200, Cached: true, CachedTokens: 3200})
	}); a != 0 {
		t.Fatalf("a correction allocates %v times", a)
	}
}

// TestIndexSizedFromTheEngineRPLACE3: an engine that reports its KV
// cache (vLLM's cache_config_info) bounds its prefix index by it, in
// blocks of rendered prompt at the learned ratio; the configured bound
// stays the ceiling.
func TestIndexSizedFromTheEngineRPLACE3(t *testing.T) {
	// The engines' /metrics are not read: the simulator's own cache would
	// size the index too, at the same time.
	s := newStack(t, prefixFleet(), func(c *config.Config) {
		c.Placement.PrefixIndexBlocks = 4096
		c.Placement.EngineMetricsIntervalS = 0
	})
	s.waitModels()
	p1 := s.v.Fleet().Member("p1")
	s.v.sizeIndex(p1, 1000*16) // 16,000 tokens at 4 bytes a token: 1,000 blocks of 64 bytes
	if c := s.v.PrefixIndex().EngineCapacity("p1"); c != 1000 {
		t.Fatalf("bound %d, want 1,000", c)
	}
	s.v.sizeIndex(p1, 1<<30)
	if c := s.v.PrefixIndex().EngineCapacity("p1"); c != 4096 {
		t.Fatalf("bound %d, want the configured 4,096", c)
	}
	if c := s.v.PrefixIndex().EngineCapacity("p2"); c != 4096 {
		t.Fatalf("an engine that reports nothing: %d", c)
	}
}
