package sim

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// order returns the cached hashes from most to least recently used.
func (c *prefixCache) order() []uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]uint64, 0, len(c.index))
	for i := c.nodes[0].next; i != 0; i = c.nodes[i].next {
		out = append(out, c.nodes[i].hash)
	}
	return out
}

// askCached posts body to url's POST /sim/cached.
func askCached(t testing.TB, c *http.Client, url string, body any) Cached {
	t.Helper()
	resp := post(t, c, url+"/sim/cached", body)
	b := readBody(t, resp)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST /sim/cached: %d %s", resp.StatusCode, b)
	}
	var out Cached
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("POST /sim/cached: %v in %s", err, b)
	}
	return out
}

// TestSimCachedAnswersWithoutTouching: POST /sim/cached answers the
// cached_tokens the prefill of the same body then reports (the prefix
// cache behind R-PLACE-2's placement, as the bench's oracle reads it),
// for chat and completions bodies, and leaves the cache's recency,
// contents and counters as they were: the block it found is still the
// least recently used one and is the next evicted.
func TestSimCachedAnswersWithoutTouching(t *testing.T) {
	s, url := startEngine(t, Config{BlockSize: 2, KVCacheBlocks: 4})
	c := newClient(t)
	a, b := words("a", 7), words("b", 7) // three full blocks each
	if got := askCached(t, c, url, completionBody(a)); got.PromptTokens != 7 || got.CachedTokens != 0 {
		t.Fatalf("cold: %+v, want 7 prompt tokens, 0 cached", got)
	}
	completion(t, c, url, a)
	if got := askCached(t, c, url, completionBody(a)); got.CachedTokens != 6 {
		t.Fatalf("warm: %+v, want 6 cached (never the last token)", got)
	}
	completion(t, c, url, b) // a's head block is left, least recently used
	before, stats := s.cache.order(), s.Stats()
	got := askCached(t, c, url, completionBody(a))
	if got.CachedTokens != 2 {
		t.Fatalf("after b: %+v, want a's head block (2 tokens)", got)
	}
	if after := s.cache.order(); !slices.Equal(before, after) {
		t.Fatalf("the question changed the recency: %x → %x", before, after)
	}
	if st := s.Stats(); st.PrefixCacheQueries != stats.PrefixCacheQueries || st.PrefixCacheHits != stats.PrefixCacheHits || st.Prefills+st.Decodes != stats.Prefills+stats.Decodes {
		t.Fatalf("the question was counted: %+v → %+v", stats, st)
	}
	completion(t, c, url, words("c", 3)) // one block: evicts the least recently used
	if got := askCached(t, c, url, completionBody(a)); got.CachedTokens != 0 {
		t.Fatalf("a's head was still the least recently used: want it evicted, got %+v", got)
	}
	if u := completion(t, c, url, b); u.Details.CachedTokens != 6 {
		t.Fatalf("b is whole still: cached %d, want 6", u.Details.CachedTokens)
	}

	chat := chatBody(words("x", 40))
	pre := askCached(t, c, url, chat)
	resp := post(t, c, url+"/v1/chat/completions", chatBody(words("x", 40), "max_tokens", 1))
	var first struct {
		Usage usage `json:"usage"`
	}
	if err := json.Unmarshal(readBody(t, resp), &first); err != nil {
		t.Fatal(err)
	}
	if pre.PromptTokens != first.Usage.PromptTokens || pre.CachedTokens != first.Usage.Details.CachedTokens {
		t.Fatalf("chat: asked %+v, the prefill reported %+v", pre, first.Usage)
	}

	for _, bad := range []string{`{`, `{"model":"other","prompt":"a"}`, `{"model":"m"}`} {
		r := post(t, c, url+"/sim/cached", bad)
		if body := readBody(t, r); r.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), `"error"`) {
			t.Fatalf("%s: %d %s, want 400 with an error body", bad, r.StatusCode, body)
		}
	}
}

// TestSimCachedReportsTheQueue: a request waiting beyond --max-num-seqs
// counts in waiting and, with the prompt tokens its cache does not hold,
// in queued_prompt_tokens; a running request whose prefill is done counts
// in running only; the queue is empty again once both ended. Meanwhile
// vllm:kv_cache_usage_perc counts the running request's blocks.
func TestSimCachedReportsTheQueue(t *testing.T) {
	s, url := startEngine(t, Config{MaxNumSeqs: 1, KVCacheBlocks: 100})
	c := newClient(t)
	warm := words("w", 40)
	completion(t, c, url, warm) // two blocks of 16 cached
	s.Arm(Fault{Kind: FaultSilence, Count: 1})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first, err := postCtx(ctx, c, url+"/v1/chat/completions", chatBody(words("h", 33), "stream", true))
	if err != nil {
		t.Fatal(err)
	}
	defer first.Body.Close()
	if _, err := newSSEReader(first.Body).next(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		resp, err := c.Post(url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"`+warm+` q1 q2","max_tokens":1}`))
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		done <- err
	}()
	testkit.WaitFor(t, 5*time.Second, "the second request to wait", func() bool { return s.Stats().Waiting == 1 })
	got := askCached(t, c, url, completionBody(warm))
	if got.Waiting != 1 || got.Running != 1 || got.QueuedPromptTokens != 42-32 || got.CachedTokens != 32 {
		t.Fatalf("%+v: want 1 waiting with 10 uncached tokens, 1 running", got)
	}
	// The running chat prompt is "user: h0 … h32": 34 tokens, 3 blocks.
	if v := scrape(t, c, url, `vllm:kv_cache_usage_perc{model_name="m"}`); v != 0.03 {
		t.Fatalf("kv_cache_usage_perc %v, want 3 of 100 blocks", v)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 5*time.Second, "the queue to drain", func() bool {
		got := askCached(t, c, url, completionBody(warm))
		return got.Waiting == 0 && got.Running == 0 && got.QueuedPromptTokens == 0
	})
	if v := scrape(t, c, url, `vllm:kv_cache_usage_perc{model_name="m"}`); v != 0 {
		t.Fatalf("kv_cache_usage_perc %v with nothing running", v)
	}
}

// TestSimCachedCountsPrefillInProgress: a prefill counts the uncached
// tokens it has still to compute in queued_prompt_tokens, fewer as it
// goes on, and nothing once it is done.
func TestSimCachedCountsPrefillInProgress(t *testing.T) {
	s, url := startEngine(t, Config{PrefillPerToken: 20 * time.Millisecond})
	c := newClient(t)
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := c.Post(url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"`+words("p", 20)+`","max_tokens":1}`))
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	testkit.WaitFor(t, 5*time.Second, "the prefill to start", func() bool { return s.Stats().Running == 1 })
	got := askCached(t, c, url, completionBody("x"))
	if got.QueuedPromptTokens < 1 || got.QueuedPromptTokens > 20 {
		t.Fatalf("%+v: want the prefill's tokens left, 1…20", got)
	}
	testkit.WaitFor(t, 5*time.Second, "fewer tokens left", func() bool {
		return askCached(t, c, url, completionBody("x")).QueuedPromptTokens < got.QueuedPromptTokens
	})
	<-done
	if got := askCached(t, c, url, completionBody("x")); got.QueuedPromptTokens != 0 || got.Running != 0 {
		t.Fatalf("%+v after the prefill", got)
	}
}

// TestCacheConfigInfo: /metrics has vLLM's vllm:cache_config_info with
// the engine's num_gpu_blocks and block_size, which a router reads as the
// engine's cache capacity.
func TestCacheConfigInfo(t *testing.T) {
	_, url := startEngine(t, Config{BlockSize: 32, KVCacheBlocks: 777})
	c := newClient(t)
	if v := scrape(t, c, url, `vllm:cache_config_info{block_size="32",enable_prefix_caching="True",num_gpu_blocks="777"}`); v != 1 {
		t.Fatalf("cache_config_info %v", v)
	}
	if v := scrape(t, c, url, `vllm:kv_cache_usage_perc{model_name="m"}`); v != 0 {
		t.Fatalf("kv_cache_usage_perc %v on an idle engine", v)
	}
}
