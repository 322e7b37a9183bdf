package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// words returns n distinct words "<tag>0 <tag>1 …".
func words(tag string, n int) string {
	w := make([]string, n)
	for i := range w {
		w[i] = tag + strconv.Itoa(i)
	}
	return strings.Join(w, " ")
}

// completionHashes is the block hashes of a completions prompt.
func completionHashes(prompt string, blockSize int) []uint64 {
	return appendBlockHashes(nil, appendTokenIDs(nil, prompt, nil), blockSize)
}

// TestBlockHashesChain: a prompt's full blocks hash in a chain, so two
// prompts share leading hashes exactly as far as they share leading full
// blocks; a trailing partial block has none; a chat's role markers keep
// it apart from a completions prompt of the same text; whitespace between
// tokens does not matter (the prefix cache behind R-PLACE-2's placement).
func TestBlockHashesChain(t *testing.T) {
	a := completionHashes(words("a", 40), 16)
	if len(a) != 2 {
		t.Fatalf("40 tokens in blocks of 16: %d hashes, want 2", len(a))
	}
	b := completionHashes(words("a", 20)+" x y z w v u t s r q p o", 16)
	if len(b) != 2 || b[0] != a[0] || b[1] == a[1] {
		t.Fatalf("shared first block only: %x vs %x", a, b)
	}
	c := completionHashes("zz "+words("a", 39), 16)
	if c[0] == a[0] || c[1] == a[1] {
		t.Fatalf("a different first token changes every hash: %x vs %x", a, c)
	}
	msgs, _ := json.Marshal([]map[string]string{{"role": "user", "content": words("a", 40)}})
	chat, headers, err := renderChat(msgs, nil)
	if err != nil {
		t.Fatal(err)
	}
	asChat := appendBlockHashes(nil, appendTokenIDs(nil, chat, headers), 16)
	asText := completionHashes(chat, 16)
	if len(asChat) != 2 || len(asText) != 2 || asChat[0] == asText[0] || asChat[1] == asText[1] {
		t.Fatalf("chat and completions of the same text share a hash: %x vs %x", asChat, asText)
	}
	spaced := strings.ReplaceAll(words("a", 40), " ", " \n\t ")
	if e := completionHashes("  "+spaced+"  ", 16); len(e) != 2 || e[0] != a[0] || e[1] != a[1] {
		t.Fatalf("whitespace changed the hashes: %x vs %x", a, e)
	}
	if f := completionHashes(words("a", 15), 16); len(f) != 0 {
		t.Fatalf("a partial block has a hash: %x", f)
	}
	if g := completionHashes(words("a", 32), 16); len(g) != 2 || g[1] != a[1] {
		t.Fatalf("a prompt ending on a block boundary: %x vs %x", g, a)
	}
	// "ab c" and "a bc" are different tokens.
	if x, y := completionHashes("ab c", 2), completionHashes("a bc", 2); x[0] == y[0] {
		t.Fatal("token boundaries are not part of the hash")
	}
	buf, ids, long := make([]uint64, 0, 8), make([]uint32, 0, 128), words("a", 100)
	if n := testkit.LeastAllocs(100, func() {
		ids = appendTokenIDs(ids[:0], long, headers)
		buf = appendBlockHashes(buf[:0], ids, 16)
	}); n != 0 {
		t.Fatalf("tokenising and hashing allocate %v times", n)
	}
}

// TestPrefixCacheLRUBound: however many distinct blocks pass through it,
// the cache holds at most its capacity, evicts least recently used first,
// and keeps a prompt's head longer than its tail.
func TestPrefixCacheLRUBound(t *testing.T) {
	var c prefixCache
	c.init(64)
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		hashes := make([]uint64, 1+rng.IntN(20))
		for i := range hashes {
			hashes[i] = rng.Uint64N(500)
		}
		c.lookup(hashes, nil, len(hashes)*4+1, 4, true)
		if n := len(c.index); n > 64 {
			t.Fatalf("%d blocks cached, capacity 64", n)
		}
	}
	if st := c.stats(); st.blocks != 64 || st.evicted == 0 || st.maxOccupancy != 64 {
		t.Fatalf("stats %+v", st)
	}

	c.init(4)
	c.lookup([]uint64{1, 2, 3}, nil, 7, 2, true) // most recent first: 1 2 3
	c.lookup([]uint64{7, 8, 9}, nil, 7, 2, true) // 9 fills the fourth slot, 8 evicts 3, 7 evicts 2
	for h, want := range map[uint64]bool{1: true, 2: false, 3: false, 7: true, 8: true, 9: true} {
		if c.contains(h) != want {
			t.Fatalf("block %d cached = %v, want %v", h, !want, want)
		}
	}
	if got := c.lookup([]uint64{1, 2, 3}, nil, 7, 2, true); got != 2 {
		t.Fatalf("head block only still cached: %d cached tokens, want 2", got)
	}
}

// completion sends a non-streaming completions request and returns its
// usage.
func completion(t testing.TB, c *http.Client, url, prompt string, fields ...any) usage {
	t.Helper()
	resp := post(t, c, url+"/v1/completions", completionBody(prompt, append([]any{"max_tokens", 1}, fields...)...))
	b := readBody(t, resp)
	var out struct {
		Usage usage `json:"usage"`
	}
	if err := json.Unmarshal(b, &out); err != nil || resp.StatusCode != 200 || out.Usage.Details == nil {
		t.Fatalf("completion %d %s", resp.StatusCode, b)
	}
	return out.Usage
}

// scrape returns the value of one sample of /metrics, by its exact name
// and labels as printed.
func scrape(t testing.TB, c *http.Client, url, sample string) float64 {
	t.Helper()
	st, b := get(t, c, url+"/metrics")
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(sample) + ` (\S+)$`).FindSubmatch(b)
	if st != 200 || m == nil {
		t.Fatalf("/metrics lacks %s:\n%s", sample, b)
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestPrefixCacheAgainstItsCounters: the same prefix hits, a different
// prefix misses, a partly shared prefix hits its shared full blocks; the
// cached_tokens every response reported add up to
// vllm:prefix_cache_hits_total, the prompt tokens to
// vllm:prefix_cache_queries_total (the signal R-PLACE-2's placement is
// measured by, and the cached_tokens R-FAIL-8 reads).
func TestPrefixCacheAgainstItsCounters(t *testing.T) {
	s, url := startEngine(t, Config{})
	c := newClient(t)
	prompts := []struct {
		prompt string
		cached int
	}{
		{words("a", 40), 0},                         // cold
		{words("a", 40), 32},                        // two full blocks; the partial one is computed
		{words("a", 32), 16},                        // the last token is always computed: one block
		{words("a", 20) + " " + words("z", 30), 16}, // first block shared
		{words("b", 40), 0},                         // another prefix
		{words("a", 33), 32},
		{"short", 0},
	}
	var sumPrompt, sumCached int
	for i, p := range prompts {
		u := completion(t, c, url, p.prompt)
		if u.Details.CachedTokens != p.cached || u.PromptTokens != PromptTokens(p.prompt) {
			t.Fatalf("request %d: cached %d of %d, want %d", i, u.Details.CachedTokens, u.PromptTokens, p.cached)
		}
		sumPrompt += u.PromptTokens
		sumCached += u.Details.CachedTokens
	}
	lbl := `{model_name="m"}`
	if q, h := scrape(t, c, url, "vllm:prefix_cache_queries_total"+lbl), scrape(t, c, url, "vllm:prefix_cache_hits_total"+lbl); int(q) != sumPrompt || int(h) != sumCached {
		t.Fatalf("counters queries %v hits %v, responses reported %d and %d", q, h, sumPrompt, sumCached)
	}
	st := s.Stats()
	if st.PrefixCacheQueries != int64(sumPrompt) || st.PrefixCacheHits != int64(sumCached) || st.ExternalPrefixCacheQueries != 0 {
		t.Fatalf("stats %+v", st)
	}

	// Streams report it too, in the usage chunk; chat renders the messages.
	for i, want := range []int{0, 32} {
		evs := streamEvents(t, c, url+"/v1/chat/completions", chatBody(words("c", 40), "stream", true, "stream_options", map[string]any{"include_usage": true}, "max_tokens", 2))
		u := decodeChunk(t, evs[len(evs)-2]).Usage
		if u == nil || u.Details == nil || u.Details.CachedTokens != want {
			t.Fatalf("chat stream %d: usage %s, want %d cached", i, evs[len(evs)-2].data, want)
		}
	}
}

// TestPrefixCacheEvictsAtItsBound: with room for 4 blocks, the blocks of a
// later prompt evict an earlier one's tail first, and the cache never
// holds more than 4.
func TestPrefixCacheEvictsAtItsBound(t *testing.T) {
	s, url := startEngine(t, Config{BlockSize: 2, KVCacheBlocks: 4})
	c := newClient(t)
	a, b := words("a", 7), words("b", 7) // three full blocks each
	completion(t, c, url, a)
	completion(t, c, url, b)
	if st := s.Stats(); st.PrefixCacheBlocks != 4 || st.PrefixCacheEvicted != 2 {
		t.Fatalf("stats %+v, want 4 blocks held, 2 evicted", st)
	}
	if u := completion(t, c, url, a); u.Details.CachedTokens != 2 {
		t.Fatalf("a's head block only: %d cached, want 2", u.Details.CachedTokens)
	}
	if st := s.Stats(); st.PrefixCacheBlocks != 4 {
		t.Fatalf("%d blocks held, capacity 4", st.PrefixCacheBlocks)
	}
}

// TestPrefillComputesUncachedTokensOnly: PrefillPerToken is spent on the
// tokens the cache did not hold (lower bound on the cold request, and the
// warm one far below it).
func TestPrefillComputesUncachedTokensOnly(t *testing.T) {
	_, url := startEngine(t, Config{PrefillPerToken: 4 * time.Millisecond})
	c := newClient(t)
	prompt := words("a", 161) // 160 cached when warm, 1 computed
	cold := time.Now()
	completion(t, c, url, prompt)
	full := 161 * 4 * time.Millisecond
	if el := time.Since(cold); el < full {
		t.Fatalf("cold prefill took %v, want at least %v", el, full)
	}
	warm := time.Now()
	completion(t, c, url, prompt)
	if el := time.Since(warm); el >= full {
		t.Fatalf("warm prefill took %v, as long as a cold one (%v)", el, full)
	}
}

// TestDecodePullCountsAsCached: a decode leg whose KV was pulled reports
// every prompt token as cached (what R-FAIL-8 compares against the
// transferred prompt), counted apart as external on the consumer; the
// producer counts its own lookup on the prefill leg.
func TestDecodePullCountsAsCached(t *testing.T) {
	p, pURL := startEngine(t, Config{Role: RolePrefill, EngineID: "p1"})
	d, dURL := startEngine(t, Config{Role: RoleDecode, EngineID: "d1"})
	c := newClient(t)
	client := chatBody(longPrompt, "stream", true, "stream_options", map[string]any{"include_usage": true}, "max_tokens", 4)
	for round := range 2 {
		desc := runPrefill(t, c, pURL, "/v1/chat/completions", client, fmt.Sprintf("att-%d", round))
		evs := streamEvents(t, c, dURL+"/v1/chat/completions", decodeBody(client, desc))
		u := decodeChunk(t, evs[len(evs)-2]).Usage
		if u == nil || u.Details == nil || u.Details.CachedTokens != 41 || u.PromptTokens != 41 {
			t.Fatalf("round %d: decode usage %s, want all 41 prompt tokens cached", round, evs[len(evs)-2].data)
		}
	}
	if st := d.Stats(); st.ExternalPrefixCacheQueries != 82 || st.ExternalPrefixCacheHits != 82 || st.PrefixCacheQueries != 0 || st.PrefixCacheHits != 0 {
		t.Fatalf("consumer stats %+v", st)
	}
	if st := p.Stats(); st.PrefixCacheQueries != 82 || st.PrefixCacheHits != 32 || st.ExternalPrefixCacheQueries != 0 {
		t.Fatalf("producer stats %+v: the second prefill hits two blocks", st)
	}
	lbl := `{model_name="m"}`
	if v := scrape(t, c, dURL, "vllm:external_prefix_cache_hits_total"+lbl); v != 82 {
		t.Fatalf("consumer external hits %v", v)
	}
	if v := scrape(t, c, dURL, "vllm:external_prefix_cache_queries_total"+lbl); v != 82 {
		t.Fatalf("consumer external queries %v", v)
	}
}

// TestMaxNumSeqsQueues: beyond MaxNumSeqs running requests the others wait
// (vllm:num_requests_waiting > 0) and run, in order, once one ends; a
// waiting request whose client leaves is no longer counted.
func TestMaxNumSeqsQueues(t *testing.T) {
	// The first request stays silent until its client leaves.
	s, url := startEngine(t, Config{MaxNumSeqs: 1, Faults: []Fault{{Kind: FaultSilence, Count: 1}}})
	c := newClient(t)
	lbl := `{model_name="m"}`
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first, err := postCtx(ctx, c, url+"/v1/chat/completions", chatBody("hold", "stream", true))
	if err != nil {
		t.Fatal(err)
	}
	defer first.Body.Close()
	if _, err := newSSEReader(first.Body).next(); err != nil { // running: its role chunk came
		t.Fatal(err)
	}

	done := make(chan usage, 1)
	go func() {
		resp, err := c.Post(url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"next","max_tokens":1}`))
		if err != nil {
			done <- usage{}
			return
		}
		defer resp.Body.Close()
		var out struct {
			Usage usage `json:"usage"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&out)
		done <- out.Usage
	}()
	testkit.WaitFor(t, 5*time.Second, "the second request to wait", func() bool {
		return scrape(t, c, url, "vllm:num_requests_waiting"+lbl) == 1
	})
	if r := scrape(t, c, url, "vllm:num_requests_running"+lbl); r != 1 {
		t.Fatalf("%v running, want 1", r)
	}
	select {
	case <-done:
		t.Fatal("the second request ran beyond max num seqs")
	default:
	}

	// A third whose client gives up leaves the queue.
	ctx3, cancel3 := context.WithCancel(context.Background())
	go func() {
		resp, err := postCtx(ctx3, c, url+"/v1/completions", completionBody("third"))
		if err == nil {
			resp.Body.Close()
		}
	}()
	testkit.WaitFor(t, 5*time.Second, "the third request to wait", func() bool { return s.Stats().Waiting == 2 })
	cancel3()
	testkit.WaitFor(t, 5*time.Second, "the third request to leave the queue", func() bool { return s.Stats().Waiting == 1 })

	cancel() // the first ends; the second runs
	select {
	case u := <-done:
		if u.PromptTokens == 0 {
			t.Fatal("the second request failed")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the second request never ran")
	}
	testkit.WaitFor(t, 5*time.Second, "the queue to drain", func() bool {
		st := s.Stats()
		return st.Waiting == 0 && st.Running == 0
	})
}

// TestProcessStartTime: every Server of a process reports its own
// process_start_time_seconds, and a new Server (a restart) a later one —
// how a router learns that an engine's prefix cache is gone.
func TestProcessStartTime(t *testing.T) {
	c := newClient(t)
	s1, url1 := startEngine(t, Config{EngineID: "e1"})
	s2, url2 := startEngine(t, Config{EngineID: "e1"})
	v1, v2 := scrape(t, c, url1, "process_start_time_seconds"), scrape(t, c, url2, "process_start_time_seconds")
	if v1 == v2 || v2 < v1 {
		t.Fatalf("start times %v and %v", v1, v2)
	}
	if want := float64(s1.StartTime().UnixMicro()) / 1e6; v1 != want {
		t.Fatalf("reported %v, StartTime %v", v1, want)
	}
	if d := time.Since(s2.StartTime()); d < 0 || d > time.Minute {
		t.Fatalf("start time %v is not now", s2.StartTime())
	}
}
