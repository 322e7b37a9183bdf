package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
)

func testPrefixWorkload() PrefixWorkload {
	return PrefixWorkload{
		Shape: ShapeSharedPrefix, Model: "m", Tenants: 3, ContextTokens: 40, UsersPerTenant: 2,
		QueriesPerUser: 5, QueryTokens: 6, MaxTokens: 4, Rate: 50, Seed: 7,
	}
}

// TestTraceDeterministic: the same workload and seed give the same trace
// byte for byte (the policies of a comparison, and two runs, send the same
// requests); another seed gives another.
func TestTraceDeterministic(t *testing.T) {
	a, err := NewTrace(testPrefixWorkload())
	if err != nil {
		t.Fatal(err)
	}
	b, _ := NewTrace(testPrefixWorkload())
	for i := range a.Requests {
		x, y := a.Requests[i], b.Requests[i]
		if x.At != y.At || !bytes.Equal(x.Body, y.Body) || x.Tenant != y.Tenant || x.User != y.User || x.Query != y.Query {
			t.Fatalf("request %d differs between two draws of the same seed", i)
		}
	}
	w := testPrefixWorkload()
	w.Seed = 8
	c, _ := NewTrace(w)
	same := 0
	for i := range a.Requests {
		if bytes.Equal(a.Requests[i].Body, c.Requests[i].Body) {
			same++
		}
	}
	if same == len(a.Requests) {
		t.Fatal("another seed drew the same trace")
	}
}

// TestTraceShape: tenants × users × queries requests, each user's queries
// in order, arrivals ascending at about the rate, every request of a
// tenant with the tenant's context as its system prompt and its own
// query, and prompt lengths as the simulator counts them.
func TestTraceShape(t *testing.T) {
	w := testPrefixWorkload()
	w.QueriesPerUser = 200
	w.Rate = 100
	tr, err := NewTrace(w)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := len(tr.Requests), 3*2*200; got != want {
		t.Fatalf("%d requests, want %d", got, want)
	}
	next := map[[2]int]int{}
	system := map[int]string{}
	queries := map[string]bool{}
	var prev time.Duration
	for i, r := range tr.Requests {
		if r.At < prev {
			t.Fatalf("request %d arrives at %v, before its predecessor at %v", i, r.At, prev)
		}
		prev = r.At
		k := [2]int{r.Tenant, r.User}
		if r.Query != next[k] {
			t.Fatalf("request %d: user %v query %d, want %d (a user's queries in order)", i, k, r.Query, next[k])
		}
		next[k]++
		var body struct {
			Model    string `json:"model"`
			Messages []struct {
				Role    string `json:"role"`
				Content string `json:"content"`
			} `json:"messages"`
			MaxTokens int  `json:"max_tokens"`
			Stream    bool `json:"stream"`
			IgnoreEOS bool `json:"ignore_eos"`
		}
		if err := json.Unmarshal(r.Body, &body); err != nil {
			t.Fatalf("request %d: body is not JSON: %v", i, err)
		}
		if body.Model != "m" || body.MaxTokens != 4 || !body.Stream || !body.IgnoreEOS || len(body.Messages) != 2 ||
			body.Messages[0].Role != "system" || body.Messages[1].Role != "user" {
			t.Fatalf("request %d: body %s", i, r.Body)
		}
		if s, ok := system[r.Tenant]; ok && s != body.Messages[0].Content {
			t.Fatalf("request %d: tenant %d's system prompt changed", i, r.Tenant)
		}
		system[r.Tenant] = body.Messages[0].Content
		if n := len(strings.Fields(body.Messages[0].Content)); n != 40 {
			t.Fatalf("context of %d words, want 40", n)
		}
		if n := len(strings.Fields(body.Messages[1].Content)); n != 6 {
			t.Fatalf("query of %d words, want 6", n)
		}
		if queries[body.Messages[1].Content] {
			t.Fatalf("request %d repeats a query", i)
		}
		queries[body.Messages[1].Content] = true
		// The simulator's view: "system:" + context + "user:" + query.
		var msgs struct {
			Messages json.RawMessage `json:"messages"`
		}
		_ = json.Unmarshal(r.Body, &msgs)
		prompt, err := sim.RenderChat(msgs.Messages)
		if err != nil {
			t.Fatal(err)
		}
		if len(r.Tokens) != 1+40+1+6 || len(r.Tokens) != sim.PromptTokens(prompt) {
			t.Fatalf("request %d: %d tokens, want %d = the simulator's %d", i, len(r.Tokens), 48, sim.PromptTokens(prompt))
		}
	}
	if len(system) != 3 || system[0] == system[1] || system[1] == system[2] {
		t.Fatal("want three distinct tenant contexts")
	}
	// 1,200 exponential gaps of mean 10 ms: the mean is within 15 %.
	mean := float64(prev) / float64(len(tr.Requests))
	if math.Abs(mean-float64(10*time.Millisecond)) > 0.15*float64(10*time.Millisecond) {
		t.Fatalf("mean gap %v, want about 10ms", time.Duration(mean))
	}
}

// TestTraceNoSharedPrefix: the no-shared-prefix shape keeps the lengths
// but shares no block: its ideal hit rate is 0.
func TestTraceNoSharedPrefix(t *testing.T) {
	w := testPrefixWorkload()
	w.Shape = ShapeNoSharedPrefix
	tr, err := NewTrace(w)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range tr.Requests {
		if len(r.Tokens) != 48 {
			t.Fatalf("%d tokens, want 48", len(r.Tokens))
		}
	}
	res, err := Oracle{BlockSize: 4, Engines: 4, CacheBlocks: 1000}.Run(tr)
	if err != nil {
		t.Fatal(err)
	}
	if res.HitTokens != 0 || res.HitRate != 0 || res.QueryTokens != int64(48*len(tr.Requests)) {
		t.Fatalf("oracle %+v, want no hit over %d tokens", res, 48*len(tr.Requests))
	}
	shared, _ := NewTrace(testPrefixWorkload())
	if r, _ := (Oracle{BlockSize: 4, Engines: 4, CacheBlocks: 1000}).Run(shared); r.HitRate <= 0.5 {
		t.Fatalf("shared-prefix oracle hit rate %.3f, want > 0.5", r.HitRate)
	}
}

func TestPrefixWorkloadValidate(t *testing.T) {
	for name, mut := range map[string]func(w *PrefixWorkload){
		"shape":   func(w *PrefixWorkload) { w.Shape = "zipf" },
		"model":   func(w *PrefixWorkload) { w.Model = "" },
		"tenants": func(w *PrefixWorkload) { w.Tenants = 0 },
		"users":   func(w *PrefixWorkload) { w.UsersPerTenant = 0 },
		"queries": func(w *PrefixWorkload) { w.QueriesPerUser = 0 },
		"context": func(w *PrefixWorkload) { w.ContextTokens = 0 },
		"query":   func(w *PrefixWorkload) { w.QueryTokens = 1 },
		"max":     func(w *PrefixWorkload) { w.MaxTokens = 0 },
		"rate":    func(w *PrefixWorkload) { w.Rate = 0 },
		"nan":     func(w *PrefixWorkload) { w.Rate = math.NaN() },
		"huge":    func(w *PrefixWorkload) { w.Tenants, w.UsersPerTenant, w.QueriesPerUser = 1000, 1000, 2 },
	} {
		w := testPrefixWorkload()
		mut(&w)
		if err := w.Validate(); err == nil {
			t.Errorf("%s: invalid workload accepted", name)
		}
	}
	w := testPrefixWorkload()
	if err := w.Validate(); err != nil {
		t.Fatal(err)
	}
}

// handTrace is a trace of the given prompts (tokens), as the oracle sees
// them.
func handTrace(prompts ...string) *Trace {
	tr := &Trace{}
	for _, p := range prompts {
		tr.Requests = append(tr.Requests, TraceRequest{Tokens: strings.Fields(p)})
	}
	return tr
}

// TestOracleHandComputed: block size 2, a hand-computed trace.
//
//	r0 a b c d e      5 tokens, blocks [ab][cd]: cold, 0 hit
//	r1 a b c d f      blocks [ab][cd] cached; limit (5−1)/2 = 2 → 4 hit
//	r2 a b x y z      [ab] cached, [xy] not → 2 hit
//	r3 a b c d        4 tokens: limit (4−1)/2 = 1 block → 2 hit (the last
//	                  token is always computed)
//	r4 q r a b        [qr] not cached → 0 hit (a prefix, not a substring)
//
// Hits 8 of 23 tokens.
func TestOracleHandComputed(t *testing.T) {
	tr := handTrace("a b c d e", "a b c d f", "a b x y z", "a b c d", "q r a b")
	res, err := Oracle{BlockSize: 2, Engines: 1, CacheBlocks: 100}.Run(tr)
	if err != nil {
		t.Fatal(err)
	}
	if res.QueryTokens != 23 || res.HitTokens != 8 || math.Abs(res.HitRate-8.0/23) > 1e-12 {
		t.Fatalf("oracle %+v, want 8 of 23 tokens", res)
	}
}

// TestOracleBoundedByCaches: the pooled cache holds Engines × CacheBlocks
// blocks, evicting the least recently used, a prompt's tail before its
// head. Blocks are chained, so with block size 1 the blocks of "a b c z"
// are a, ab, abc, abcz.
//
// 1 engine × 3 blocks:
//
//	r0 a b c z   cold; touches abcz abc ab a: abcz evicted, {abc ab a}
//	r1 a b c y   limit 3: a ab abc hit → 3; touching abcy abc ab a
//	             cycles the full cache and ends as {abc ab a}
//	r2 d e f w   cold: {def de d}
//	r3 a b c v   0 hit: r2 evicted them
//
// Hits 3 of 16. With 2 engines (6 blocks) r2's four blocks evict abcz,
// abcy and abc, so r3 finds a and ab: 5 of 16. With 3 (9 blocks) nothing
// is evicted: 6 of 16.
func TestOracleBoundedByCaches(t *testing.T) {
	tr := handTrace("a b c z", "a b c y", "d e f w", "a b c v")
	res, err := Oracle{BlockSize: 1, Engines: 1, CacheBlocks: 3}.Run(tr)
	if err != nil {
		t.Fatal(err)
	}
	if res.HitTokens != 3 || res.QueryTokens != 16 {
		t.Fatalf("1 engine: oracle %+v, want 3 of 16", res)
	}
	res, _ = Oracle{BlockSize: 1, Engines: 2, CacheBlocks: 3}.Run(tr)
	if res.HitTokens != 5 {
		t.Fatalf("2 engines: oracle %+v, want 5 of 16", res)
	}
	res, _ = Oracle{BlockSize: 1, Engines: 3, CacheBlocks: 3}.Run(tr)
	if res.HitTokens != 6 {
		t.Fatalf("3 engines: oracle %+v, want 6 of 16", res)
	}
	if _, err := (Oracle{BlockSize: 0, Engines: 1, CacheBlocks: 1}).Run(tr); err == nil {
		t.Fatal("block size 0 accepted")
	}
}

func TestParsePromCounters(t *testing.T) {
	text := `# HELP vllm:prefix_cache_queries_total Prefix cache queries, tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="m",engine="0"} 1000
vllm:prefix_cache_queries_total{model_name="m",engine="1"} 24
vllm:prefix_cache_hits{model_name="a}b"} 512 1764460000000
vllm:prefix_cache_hits_total_other 7
vllm:num_requests_running{model_name="m"} 3
vllm:prefix_cache_hits{model_name="m"} not-a-number
`
	m, err := ParsePromCounters(strings.NewReader(text), "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:absent")
	if err != nil {
		t.Fatal(err)
	}
	if m["vllm:prefix_cache_queries"] != 1024 || m["vllm:prefix_cache_hits"] != 512 {
		t.Fatalf("got %v", m)
	}
	if _, ok := m["vllm:absent"]; ok {
		t.Fatal("absent counter reported")
	}
	if len(m) != 2 {
		t.Fatalf("got %v, want the two counters only", m)
	}
}

// TestLoadSpread: samples with nothing in flight are ignored; max/mean
// and the guard's condition per sample.
func TestLoadSpread(t *testing.T) {
	var a spreadAcc
	a.add([]int64{0, 0, 0, 0}, 32, 1.5)    // ignored
	a.add([]int64{1, 1, 1, 1}, 32, 1.5)    // ratio 1
	a.add([]int64{4, 0, 0, 0}, 32, 1.5)    // ratio 4, over 1.5×; guard: 4−0 ≤ 32
	a.add([]int64{60, 10, 10, 0}, 32, 1.5) // mean 20, ratio 3; guard: 60−0 > 32, 60 > 0
	s := a.spread()
	if s.Samples != 3 || s.PeakMaxOverMean != 4 || math.Abs(s.MeanMaxOverMean-8.0/3) > 1e-12 {
		t.Fatalf("spread %+v", s)
	}
	if math.Abs(s.OverShare-2.0/3) > 1e-12 || s.GuardSamples != 1 || s.GuardPeakMaxOverMean != 3 || s.GuardOverShare != 1 {
		t.Fatalf("spread %+v", s)
	}
	if math.Abs(s.MeanOutstanding-(1+1+20)/3.0) > 1e-12 {
		t.Fatalf("mean outstanding %v", s.MeanOutstanding)
	}
}

// TestPolicyReportTable: the ratios against the first variant, and the
// table shows every variant and figure (n/a without cache counters).
func TestPolicyReportTable(t *testing.T) {
	pc := &PolicyComparison{
		Workload: testPrefixWorkload(), Requests: 30, Windows: 2,
		Sims:  PolicySims{Prefill: 4, Decode: 2, BlockSize: 16, KVCacheBlocks: 256, MaxNumSeqs: 2, PrefillPerToken: 200 * time.Microsecond},
		Ideal: OracleResult{QueryTokens: 1000, HitTokens: 800, HitRate: 0.8},
	}
	ll := &PolicyReport{Name: "least_loaded", Run: fakeReport("router", 1, 100, 40*time.Millisecond), CacheCounters: true, HitRate: 0.2, HitRateOfIdeal: 0.25}
	px := &PolicyReport{Name: "prefix ×3 shared", Run: fakeReport("router", 2, 100, 4*time.Millisecond), CacheCounters: true, HitRate: 0.76, HitRateOfIdeal: 0.95}
	none := &PolicyReport{Name: "random", Run: fakeReport("router", 3, 100, 40*time.Millisecond)}
	none.Run.RequestsPerS = ll.Run.RequestsPerS / 2
	pc.Policies = []*PolicyReport{ll, px, none}
	pc.compute()
	if ll.TTFTP50Ratio != 1 || ll.ThroughputRatio != 1 {
		t.Fatalf("first variant ratios %v %v, want 1", ll.TTFTP50Ratio, ll.ThroughputRatio)
	}
	if px.TTFTP50Ratio < 5 || px.TTFTP50Ratio > 20 {
		t.Fatalf("prefix TTFT p50 ratio %.2f, want about 10 (40 ms vs 4 ms scale)", px.TTFTP50Ratio)
	}
	if math.Abs(none.ThroughputRatio-0.5) > 1e-12 {
		t.Fatalf("throughput ratio %v, want 0.5", none.ThroughputRatio)
	}
	var b bytes.Buffer
	if err := WritePolicyTable(&b, pc); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"least_loaded", "prefix ×3 shared", "random", "TTFT p50", "TTFT p99", "hit rate / ideal", "0.950", "0.760", "n/a", "ideal hit rate (pooled LRU of 1024 blocks): 0.800", "guard samples", "requests/s"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if _, err := json.Marshal(pc); err != nil {
		t.Fatal(err)
	}
}

func TestPolicyVariantName(t *testing.T) {
	for v, want := range map[PolicyVariant]string{
		{Policy: "prefix", Routers: 1, ShareIndex: true}:                          "prefix",
		{Policy: "prefix", Routers: 3, ShareIndex: true}:                          "prefix ×3 shared",
		{Policy: "prefix", Routers: 3, ShareIndex: false}:                         "prefix ×3 isolated",
		{Policy: "least_loaded", Routers: 3}:                                      "least_loaded ×3",
		{Policy: PolicyOracle, Routers: 3}:                                        "oracle",
		{Policy: "prefix", Routers: 1, Index: IndexExact}:                         "prefix exact",
		{Policy: "prefix", Routers: 3, ShareIndex: true, Index: IndexApproximate}: "prefix ×3 shared approximate",
	} {
		if got := v.Name(); got != want {
			t.Errorf("%+v: %q, want %q", v, got, want)
		}
	}
}

// TestComparePoliciesRuns: two variants, each over its own sims (distinct
// engine ids) and router process, run every window of the same trace in
// alternating order; every request is answered, each variant's prefill
// legs add up to the trace, and the report carries the oracle's ideal.
func TestComparePoliciesRuns(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	w := testPrefixWorkload()
	w.QueriesPerUser = 2 // 12 requests
	w.Rate = 200
	tr, err := NewTrace(w)
	if err != nil {
		t.Fatal(err)
	}
	var progress bytes.Buffer
	var ids []string
	pc, err := ComparePolicies(context.Background(), tr, PolicyCompareOptions{
		Variants: []PolicyVariant{{Policy: "least_loaded", Routers: 1}, {Policy: "prefix", Routers: 2, ShareIndex: true}},
		Sims:     PolicySims{Prefill: 2, Decode: 1, BlockSize: 4, KVCacheBlocks: 64},
		Windows:  3,
		Timeout:  20 * time.Second,
		Progress: &progress,
		Router: func(ctx context.Context, id string, fleet []config.EngineSpec, env []string) (*RouterProcess, error) {
			ids = append(ids, id)
			for _, e := range env {
				if strings.HasPrefix(e, "NARWHAL_NATS_URL=") {
					return nil, fmt.Errorf("no bus was asked for, got %s", e)
				}
			}
			return StartRouterProcess(ctx, RouterProcessOptions{Exe: exe, ID: id, Fleet: fleet, Env: append(env, childRouterEnv+"=1")})
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(ids, " ") != "bench-a-1 bench-b-1 bench-b-2" {
		t.Fatalf("router ids %v", ids)
	}
	if len(pc.Policies) != 2 || pc.Requests != 12 || pc.Windows != 3 {
		t.Fatalf("comparison %+v", pc)
	}
	want, _ := Oracle{BlockSize: 4, Engines: 2, CacheBlocks: 64}.Run(tr)
	if pc.Ideal != want {
		t.Fatalf("ideal %+v, want %+v", pc.Ideal, want)
	}
	engines := map[string]bool{}
	for _, p := range pc.Policies {
		if p.Run.Requests != 12 || p.Run.OK != 12 || p.Run.TTFT.Count != 12 {
			t.Fatalf("%s: %d requests, %d ok, %v errors", p.Name, p.Run.Requests, p.Run.OK, p.Run.Errors)
		}
		var n int64
		for id, k := range p.PrefillsPerEngine {
			if engines[id] {
				t.Fatalf("engine id %s in two fleets", id)
			}
			engines[id] = true
			n += k
		}
		if n != 12 {
			t.Fatalf("%s: %d prefill legs, want 12", p.Name, n)
		}
		// Every prefill leg looked its whole prompt up once: the fleet's
		// queries are the trace's prompt tokens.
		if !p.CacheCounters || p.QueryTokens != tr.PromptTokens() || p.HitTokens < 0 || p.HitTokens > p.QueryTokens {
			t.Fatalf("%s: counters %v, %d hits of %d queries, want %d queries", p.Name, p.CacheCounters, p.HitTokens, p.QueryTokens, tr.PromptTokens())
		}
		if p.HitRate != float64(p.HitTokens)/float64(p.QueryTokens) || p.HitRateOfIdeal != p.HitRate/pc.Ideal.HitRate {
			t.Fatalf("%s: hit rate %v, of ideal %v", p.Name, p.HitRate, p.HitRateOfIdeal)
		}
	}
	// The sims ran with the asked cache settings.
	if pc.Sims.BlockSize != 4 || pc.Sims.KVCacheBlocks != 64 {
		t.Fatalf("sims %+v", pc.Sims)
	}
	// Windows alternate the order: a b, b a, a b.
	var order []string
	for _, l := range strings.Split(strings.TrimSpace(progress.String()), "\n") {
		f := strings.Fields(l)
		order = append(order, f[2])
	}
	if got := strings.Join(order, " "); got != "least_loaded prefix prefix least_loaded least_loaded prefix" {
		t.Fatalf("window order %q", got)
	}
}

// TestOracleMatchesSimulator: requests sent one at a time to a single
// simulator whose cache is small enough to evict get exactly the hits the
// oracle computes for one engine of that size: the oracle's blocks,
// chaining, last-token rule and eviction order are the simulator's.
func TestOracleMatchesSimulator(t *testing.T) {
	w := testPrefixWorkload()
	w.Tenants, w.QueriesPerUser = 4, 3 // 24 requests, 4 contexts of 10 blocks
	tr, err := NewTrace(w)
	if err != nil {
		t.Fatal(err)
	}
	s, err := sim.New(sim.Config{Role: sim.RoleBoth, EngineID: "e", Model: "m", BlockSize: 4, KVCacheBlocks: 25})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	url, err := s.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Timeout: 10 * time.Second}
	defer client.CloseIdleConnections()
	for i, r := range tr.Requests {
		resp, err := client.Post(url+"/v1/chat/completions", "application/json", bytes.NewReader(r.Body))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: status %d", i, resp.StatusCode)
		}
	}
	got, err := readCacheCounts(context.Background(), client, url)
	if err != nil || !got.ok {
		t.Fatalf("counters %+v, %v", got, err)
	}
	want, _ := Oracle{BlockSize: 4, Engines: 1, CacheBlocks: 25}.Run(tr)
	if got.queries != want.QueryTokens || got.hits != want.HitTokens {
		t.Fatalf("simulator %d hits of %d, oracle %d of %d", got.hits, got.queries, want.HitTokens, want.QueryTokens)
	}
	if want.HitTokens == 0 || want.HitRate > 0.9 {
		t.Fatalf("oracle %+v: the trace should both hit and evict", want)
	}
}
