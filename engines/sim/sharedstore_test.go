package sim

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// sharedPair starts a shared-storage producer p1 (role prefill) and
// consumer d1 (role decode) on the store dir; tweak changes each Config
// before it is started.
func sharedPair(t *testing.T, dir string, tweak func(*Config)) (p *Server, pURL string, d *Server, dURL string) {
	t.Helper()
	for _, role := range []string{RolePrefill, RoleDecode} {
		cfg := Config{Role: role, EngineID: role[:1] + "1", Connector: ConnectorSharedStorage, KVStore: dir}
		if tweak != nil {
			tweak(&cfg)
		}
		s, url := startEngine(t, cfg)
		if role == RolePrefill {
			p, pURL = s, url
		} else {
			d, dURL = s, url
		}
	}
	return p, pURL, d, dURL
}

// prefillLeg sends the router's shared-storage prefill leg (one token, not
// streamed, no kv_transfer_params, behaviour.md R-DESC-8) and returns its
// answer's usage and kv_transfer_params.
func prefillLeg(t *testing.T, url, prompt string, fields ...any) (usage, json.RawMessage) {
	t.Helper()
	c := newClient(t)
	resp := post(t, c, url+"/v1/completions", completionBody(prompt, append([]any{"max_tokens", 1, "stream", false}, fields...)...))
	b := readBody(t, resp)
	var out struct {
		Usage usage           `json:"usage"`
		KV    json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(b, &out); err != nil || resp.StatusCode != 200 {
		t.Fatalf("prefill leg: %d %s", resp.StatusCode, b)
	}
	return out.Usage, out.KV
}

// decodeLeg sends the router's shared-storage decode leg (the client's
// request, streamed with usage) and returns its tokens and usage.
func decodeLeg(t *testing.T, url, prompt string, fields ...any) ([]string, usage) {
	t.Helper()
	c := newClient(t)
	evs := streamEvents(t, c, url+"/v1/completions", completionBody(prompt, append([]any{"max_tokens", 5, "stream", true,
		"stream_options", map[string]any{"include_usage": true}}, fields...)...))
	var u *usage
	for _, ev := range evs {
		if ev.comment || ev.done() {
			continue
		}
		if ch := decodeChunk(t, ev); ch.Error != nil {
			t.Fatalf("decode leg failed: %s", ev.data)
		} else if ch.Usage != nil {
			u = ch.Usage
		}
	}
	if u == nil || u.Details == nil {
		t.Fatalf("decode leg without usage details: %v", evs)
	}
	return tokensOf(t, evs, 0), *u
}

var blockFileName = regexp.MustCompile(`^[0-9a-f]{16}\.kv$`)

// storeFiles lists the store's entries, failing on any that is not a
// block file.
func storeFiles(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if !blockFileName.MatchString(e.Name()) || !e.Type().IsRegular() {
			t.Fatalf("store holds %q (%v), not a block file", e.Name(), e.Type())
		}
		out = append(out, e.Name())
	}
	return out
}

// TestSharedStorageHandoffRDESC8: the producer's prefill leg writes the
// prompt's full blocks to the store (one file each, named by its hex
// block hash) and answers no descriptor; the consumer's decode leg finds
// them by the prompt's prefix and reports them cached and external (the
// prompt's last token always computed), generates what Generate says,
// and a prompt nobody produced is computed in full — the silent
// recompute the router sees in cached_tokens (behaviour.md R-DESC-8,
// R-FAIL-8).
func TestSharedStorageHandoffRDESC8(t *testing.T) {
	dir := t.TempDir()
	p, pURL, d, dURL := sharedPair(t, dir, nil)
	prompt := words("w", 40) // two full blocks of 16 and a partial one

	u, kv := prefillLeg(t, pURL, prompt)
	if u.PromptTokens != 40 || u.Details == nil || u.Details.CachedTokens != 0 || string(kv) != "null" {
		t.Fatalf("prefill leg: usage %+v, kv_transfer_params %s", u, kv)
	}
	files := storeFiles(t, dir)
	hashes := completionHashes(prompt, BlockSize)
	if len(files) != 2 || !slices.Contains(files, filepath.Base(p.store.path(hashes[0]))) || !slices.Contains(files, filepath.Base(p.store.path(hashes[1]))) {
		t.Fatalf("store files %v, want the prompt's two blocks %x", files, hashes)
	}
	if st := p.Stats(); st.Prefills != 1 || st.Decodes != 0 || st.KVStoreWritten != 2 || st.KVHeld != 0 || st.KVStoreErrors != 0 {
		t.Fatalf("producer stats %+v", st)
	}

	toks, u := decodeLeg(t, dURL, prompt)
	want, _ := Generate(prompt, 0, 5, nil, false)
	if !slices.Equal(toks, want) || u.PromptTokens != 40 || u.Details.CachedTokens != 32 {
		t.Fatalf("decode leg: tokens %q (want %q), usage %+v (want 32 of 40 cached)", toks, want, u)
	}
	st := d.Stats()
	if st.Decodes != 1 || st.Prefills != 0 || st.KVStoreLoaded != 2 || st.KVPulled != 1 || st.KVStoreWritten != 0 ||
		st.PrefixCacheQueries != 40 || st.PrefixCacheHits != 0 || st.ExternalPrefixCacheQueries != 40 || st.ExternalPrefixCacheHits != 32 {
		t.Fatalf("consumer stats %+v", st)
	}
	c := newClient(t)
	if v := scrape(t, c, dURL, `vllm:external_prefix_cache_hits_total{model_name="m"}`); v != 32 {
		t.Fatalf("vllm:external_prefix_cache_hits_total %v, want 32", v)
	}
	if v := scrape(t, c, dURL, `narwhal_sim_info{engine_id="d1",role="decode",connector="shared-storage"}`); v != 1 {
		t.Fatalf("narwhal_sim_info %v", v)
	}
	if r := p.Requests(); len(r) != 1 || r[0].Phase != PhasePrefill {
		t.Fatalf("producer recorded %+v", r)
	}
	if r := d.Requests(); len(r) != 1 || r[0].Phase != PhaseDecode {
		t.Fatalf("consumer recorded %+v", r)
	}

	// The same prompt again: the consumer's own prefix cache holds it now.
	if _, u := decodeLeg(t, dURL, prompt); u.Details.CachedTokens != 32 {
		t.Fatalf("again: usage %+v", u)
	}
	if st := d.Stats(); st.PrefixCacheHits != 32 || st.ExternalPrefixCacheHits != 32 || st.ExternalPrefixCacheQueries != 48 || st.KVStoreLoaded != 2 {
		t.Fatalf("consumer stats after a local hit %+v", st)
	}

	// A prompt sharing the first block only: that block is cached.
	if _, u := decodeLeg(t, dURL, words("w", 16)+" "+words("other", 24)); u.Details.CachedTokens != 16 {
		t.Fatalf("shared first block: usage %+v, want 16 cached", u)
	}
	// A prompt nobody produced: computed in full.
	if _, u := decodeLeg(t, dURL, words("never", 40)); u.Details.CachedTokens != 0 {
		t.Fatalf("store miss: usage %+v, want 0 cached", u)
	}
	// A prompt of one full block keeps its last token to compute: nothing
	// can be loaded; one token more and the block is cached.
	prefillLeg(t, pURL, words("short", 16))
	if _, u := decodeLeg(t, dURL, words("short", 16)); u.Details.CachedTokens != 0 {
		t.Fatalf("one-block prompt: usage %+v, want 0 cached", u)
	}
	if _, u := decodeLeg(t, dURL, words("short", 16)+" tail"); u.Details.CachedTokens != 16 {
		t.Fatalf("one block and a token: usage %+v, want 16 cached", u)
	}
}

// TestSharedStorageFaultsRFAIL8: kv-recompute makes a consumer ignore the
// store (a forced miss: cached_tokens counts only its own prefix cache,
// the silent recompute of R-FAIL-8); kv-pull-error fails its load loudly.
func TestSharedStorageFaultsRFAIL8(t *testing.T) {
	_, pURL, d, dURL := sharedPair(t, t.TempDir(), nil)
	prompt := words("f", 48)
	prefillLeg(t, pURL, prompt)
	d.Arm(Fault{Kind: FaultKVRecompute, Phase: PhaseDecode, Count: 1})
	if _, u := decodeLeg(t, dURL, prompt); u.Details.CachedTokens != 0 {
		t.Fatalf("forced store miss: usage %+v, want 0 cached", u)
	}
	if st := d.Stats(); st.KVStoreLoaded != 0 || st.KVPulled != 0 || st.ExternalPrefixCacheQueries != 0 {
		t.Fatalf("forced store miss stats %+v", st)
	}
	// Spent: the consumer computed the prompt, its own cache holds it now.
	if _, u := decodeLeg(t, dURL, prompt); u.Details.CachedTokens != 32 {
		t.Fatalf("after the miss: usage %+v", u)
	}
	if st := d.Stats(); st.PrefixCacheHits != 32 || st.KVStoreLoaded != 0 {
		t.Fatalf("after the miss: stats %+v", st)
	}

	d.Arm(Fault{Kind: FaultKVPullError, Count: 1})
	c := newClient(t)
	evs := streamEvents(t, c, dURL+"/v1/completions", completionBody(prompt, "stream", true))
	if len(evs) != 2 || !strings.Contains(evs[0].data, "KV transfer failed") || !evs[1].done() {
		t.Fatalf("load error stream %v", evs)
	}
	if st := d.Stats(); st.KVPullFailures != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestSharedStorageIgnoresTransferFieldsRDESC8: a shared-storage engine
// behaves as vLLM with SharedStorageConnector does with fields of other
// connectors: a nixl prefill's kv_transfer_params asks for nothing (no
// descriptor, the blocks still stored), a nixl decode's descriptor is not
// pulled (the store serves it), sglang's bootstrap fields are ignored; a
// kv_transfer_params that is not an object is still a 400.
func TestSharedStorageIgnoresTransferFieldsRDESC8(t *testing.T) {
	_, pURL, d, dURL := sharedPair(t, t.TempDir(), nil)
	prompt := words("x", 36)
	_, kv := prefillLeg(t, pURL, prompt, "kv_transfer_params", handoffRequest(),
		"bootstrap_host", "127.0.0.1", "bootstrap_port", 1, "bootstrap_room", 7)
	if string(kv) != "null" {
		t.Fatalf("a shared-storage producer answered a descriptor: %s", kv)
	}
	forged := map[string]any{"do_remote_prefill": true, "remote_engine_id": "nobody", "remote_request_id": "x",
		"remote_block_ids": []int{1}, "remote_host": "127.0.0.1", "remote_port": 1}
	toks, u := decodeLeg(t, dURL, prompt, "kv_transfer_params", forged, "bootstrap_host", "127.0.0.1", "bootstrap_port", 1, "bootstrap_room", 7)
	if want, _ := Generate(prompt, 0, 5, nil, false); !slices.Equal(toks, want) || u.Details.CachedTokens != 32 {
		t.Fatalf("decode with foreign fields: %q %+v", toks, u)
	}
	if st := d.Stats(); st.KVPullFailures != 0 || st.KVStoreLoaded != 2 {
		t.Fatalf("stats %+v", st)
	}
	c := newClient(t)
	resp := post(t, c, dURL+"/v1/completions", completionBody(prompt, "kv_transfer_params", []int{1}))
	if b := readBody(t, resp); resp.StatusCode != 400 {
		t.Fatalf("kv_transfer_params array: %d %s", resp.StatusCode, b)
	}
}

// TestSharedStorageRoleBoth: an engine of role both reads and writes the
// store (vLLM's kv_both): it loads what another produced, and what it
// computes itself another one loads; a block found there is not
// written again.
func TestSharedStorageRoleBoth(t *testing.T) {
	dir := t.TempDir()
	a, aURL := startEngine(t, Config{EngineID: "a", Connector: ConnectorSharedStorage, KVStore: dir})
	b, bURL := startEngine(t, Config{EngineID: "b", Connector: ConnectorSharedStorage, KVStore: dir})
	prompt := words("both", 40)
	if _, u := decodeLeg(t, aURL, prompt); u.Details.CachedTokens != 0 {
		t.Fatalf("first: %+v", u)
	}
	if _, u := decodeLeg(t, bURL, prompt); u.Details.CachedTokens != 32 {
		t.Fatalf("b loads what a computed: %+v", u)
	}
	if sa, sb := a.Stats(), b.Stats(); sa.KVStoreWritten != 2 || sb.KVStoreWritten != 0 || sb.KVStoreLoaded != 2 || sa.Decodes != 1 || sb.Decodes != 1 {
		t.Fatalf("stats a %+v, b %+v", sa, sb)
	}
	if r := b.Requests(); len(r) != 1 || r[0].Phase != PhaseDecode {
		t.Fatalf("role both recorded %+v", r)
	}
}

// TestSharedStorageStoreBounded: a producer keeps at most KVStoreBlocks of
// its blocks in the store, removing the least recently used one's file;
// the consumer then misses it.
func TestSharedStorageStoreBounded(t *testing.T) {
	dir := t.TempDir()
	p, pURL, _, dURL := sharedPair(t, dir, func(c *Config) { c.KVStoreBlocks = 2 })
	for i := range 3 {
		prefillLeg(t, pURL, words("b"+strconv.Itoa(i)+"-", 20)) // one full block each
		if n := len(storeFiles(t, dir)); n != min(i+1, 2) {
			t.Fatalf("after %d prompts the store holds %d files", i+1, n)
		}
	}
	if st := p.Stats(); st.KVStoreWritten != 3 || st.KVStoreEvicted != 1 {
		t.Fatalf("stats %+v", st)
	}
	if _, u := decodeLeg(t, dURL, words("b0-", 20)); u.Details.CachedTokens != 0 {
		t.Fatalf("evicted block loaded: %+v", u)
	}
	if _, u := decodeLeg(t, dURL, words("b2-", 20)); u.Details.CachedTokens != 16 {
		t.Fatalf("kept block missed: %+v", u)
	}
}

// TestSharedStorageForeignFiles: only a regular file with the block's own
// record is a hit — not one of another model (or block size), not a
// directory or a link in its place; the producer then writes its own;
// a consumer of another model misses the producer's blocks.
func TestSharedStorageForeignFiles(t *testing.T) {
	dir := t.TempDir()
	p, pURL, d, dURL := sharedPair(t, dir, nil)
	other, err := openSharedStore(dir, "another-model", BlockSize, 8)
	if err != nil {
		t.Fatal(err)
	}
	prompt := words("h", 50) // three full blocks
	hashes := completionHashes(prompt, BlockSize)
	if err := other.save(hashes[:1]); err != nil { // block 0: another model's record
		t.Fatal(err)
	}
	if err := os.Mkdir(p.store.path(hashes[1]), 0o755); err != nil { // block 1: a directory
		t.Fatal(err)
	}
	if err := os.Symlink(p.store.path(hashes[0]), p.store.path(hashes[2])); err != nil { // block 2: a link
		t.Fatal(err)
	}
	if d.store.has(hashes[0]) || d.store.has(hashes[1]) || d.store.has(hashes[2]) {
		t.Fatal("a foreign file counts as a block")
	}
	prefillLeg(t, pURL, prompt) // overwrites the record and the link; the directory stays
	if st := p.Stats(); st.KVStoreWritten != 2 || st.KVStoreErrors != 1 {
		t.Fatalf("producer stats %+v", st)
	}
	if !d.store.has(hashes[0]) || d.store.has(hashes[1]) || !d.store.has(hashes[2]) {
		t.Fatal("the producer's blocks are not in place")
	}
	if other.has(hashes[0]) {
		t.Fatal("another model's consumer finds this model's block")
	}
	if _, u := decodeLeg(t, dURL, prompt); u.Details.CachedTokens != 16 {
		t.Fatalf("the run stops at the directory: %+v", u)
	}
	for _, e := range must(os.ReadDir(dir)) {
		if strings.HasSuffix(e.Name(), ".tmp") {
			t.Fatalf("temporary file %s left behind", e.Name())
		}
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestSharedStorageConcurrent: producers and consumers on one store at
// once (-race): writes are atomic, so every load is whole, no write
// fails, and afterwards every prompt loads in full.
func TestSharedStorageConcurrent(t *testing.T) {
	dir := t.TempDir()
	_, p1, _, d1 := sharedPair(t, dir, nil)
	_, p2 := startEngine(t, Config{Role: RolePrefill, EngineID: "p2", Connector: ConnectorSharedStorage, KVStore: dir})
	prompts := make([]string, 6)
	for i := range prompts {
		prompts[i] = words("c"+strconv.Itoa(i)+"-", 33)
	}
	var wg sync.WaitGroup
	for i := range 12 {
		wg.Go(func() {
			prompt := prompts[i%len(prompts)]
			prefillLeg(t, []string{p1, p2}[i%2], prompt)
			if _, u := decodeLeg(t, d1, prompt); u.Details.CachedTokens != 32 {
				t.Errorf("%d: usage %+v after its prefill", i, u)
			}
		})
	}
	wg.Wait()
	if n := len(storeFiles(t, dir)); n != 2*len(prompts) {
		t.Fatalf("%d block files, want %d", n, 2*len(prompts))
	}
}

// TestSharedStorageConfigRDESC8: the shared-storage connector needs a KV
// store directory (created when missing) and takes no bootstrap port; a
// store is for that connector only.
func TestSharedStorageConfigRDESC8(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for name, cfg := range map[string]Config{
		"no store":           {Connector: ConnectorSharedStorage},
		"store for nixl":     {KVStore: dir},
		"store for sglang":   {Connector: ConnectorSGLang, Role: RoleDecode, KVStore: dir},
		"bootstrap port":     {Connector: ConnectorSharedStorage, KVStore: dir, BootstrapPort: 8998},
		"negative bound":     {Connector: ConnectorSharedStorage, KVStore: dir, KVStoreBlocks: -1},
		"store is a file":    {Connector: ConnectorSharedStorage, KVStore: file},
		"store below a file": {Connector: ConnectorSharedStorage, KVStore: filepath.Join(file, "kv")},
	} {
		cfg.EngineID, cfg.Model = "e", "m"
		if _, err := New(cfg); err == nil {
			t.Errorf("%s: New succeeded", name)
		}
	}
	nested := filepath.Join(dir, "a", "b")
	s, err := New(Config{EngineID: "e", Model: "m", Connector: ConnectorSharedStorage, KVStore: nested})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if fi, err := os.Stat(nested); err != nil || !fi.IsDir() {
		t.Fatalf("store directory not created: %v", err)
	}
	if c := s.Config(); c.KVStoreBlocks != DefaultKVStoreBlocks || c.Role != RoleBoth || c.KVStore != nested {
		t.Fatalf("config %+v", c)
	}
}
