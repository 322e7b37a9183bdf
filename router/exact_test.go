package router

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/maphash"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/schemas"
)

// fakeTokens is the tokenizer of these tests: one token id a 4 bytes of
// the prompt (a partial last one padded), the id the 4 bytes'
// little-endian value.
func fakeTokens(prompt string) []uint32 {
	b := []byte(prompt)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	out := make([]uint32, len(b)/4)
	for i := range out {
		out[i] = binary.LittleEndian.Uint32(b[4*i:])
	}
	return out
}

// tokenizingEngine is a prefill engine's front: POST /tokenize answers
// fakeTokens of the completion's prompt (or hangs while hang is set);
// every other request goes to the simulator behind it. It records when
// each prefill arrived.
type tokenizingEngine struct {
	srv   *httptest.Server
	hang  atomic.Bool
	stop  chan struct{} // closed when the test ends: a hanging answer ends
	calls atomic.Int64
	// gate, while set, holds each completion at the front (after its
	// arrival is recorded) until the channel is closed.
	gate atomic.Pointer[chan struct{}]
	// fail, while set, answers each completion 500 (after recording it).
	fail     atomic.Bool
	mu       sync.Mutex
	prefills []time.Time
}

func newTokenizingEngine(t testing.TB, simURL string) *tokenizingEngine {
	u, err := url.Parse(simURL)
	if err != nil {
		t.Fatal(err)
	}
	te := &tokenizingEngine{stop: make(chan struct{})}
	proxy := httputil.NewSingleHostReverseProxy(u)
	te.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/tokenize" {
			if r.URL.Path == schemas.EndpointCompletions || r.URL.Path == schemas.EndpointChat {
				te.mu.Lock()
				te.prefills = append(te.prefills, time.Now())
				te.mu.Unlock()
				if te.fail.Load() {
					http.Error(w, `{"error":{"message":"engine fault","type":"InternalServerError","param":null,"code":500}}`, http.StatusInternalServerError)
					return
				}
				if g := te.gate.Load(); g != nil {
					select {
					case <-*g:
					case <-r.Context().Done():
						return
					case <-te.stop:
						return
					}
				}
			}
			proxy.ServeHTTP(w, r)
			return
		}
		te.calls.Add(1)
		raw, _ := io.ReadAll(r.Body) // read whole: the server then sees the client go
		if te.hang.Load() {
			select { // never answers
			case <-r.Context().Done():
			case <-te.stop:
			}
			return
		}
		var body struct {
			Prompt string `json:"prompt"`
		}
		if err := json.Unmarshal(raw, &body); err != nil || body.Prompt == "" {
			http.Error(w, "want a completion's prompt", http.StatusBadRequest)
			return
		}
		toks := fakeTokens(body.Prompt)
		out, _ := json.Marshal(map[string]any{"count": len(toks), "max_model_len": 32768, "tokens": toks})
		_, _ = w.Write(out)
	}))
	t.Cleanup(te.srv.Close)
	t.Cleanup(func() { close(te.stop) }) // before Close, which waits for the handlers
	return te
}

// arrived returns how many completions reached the engine.
func (te *tokenizingEngine) arrived() int {
	te.mu.Lock()
	defer te.mu.Unlock()
	return len(te.prefills)
}

// firstPrefill returns when the first prefill reached the engine, zero
// when none did.
func (te *tokenizingEngine) firstPrefill() time.Time {
	te.mu.Lock()
	defer te.mu.Unlock()
	if len(te.prefills) == 0 {
		return time.Time{}
	}
	return te.prefills[0]
}

// exactStack is a router over prefill engines p1 and p2, each behind a
// tokenizingEngine, and decode engine d1.
func exactStack(t testing.TB, mutate func(*config.Config)) (*stack, map[string]*tokenizingEngine) {
	fronts := map[string]*tokenizingEngine{}
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "p2", role: "prefill"}, {id: "d1", role: "decode"}}, func(c *config.Config) {
		for i := range c.Fleet {
			if c.Fleet[i].Role == "prefill" {
				te := newTokenizingEngine(t, c.Fleet[i].URL)
				fronts[c.Fleet[i].ID] = te
				c.Fleet[i].URL = te.srv.URL
			}
		}
		if mutate != nil {
			mutate(c)
		}
	})
	s.waitModels()
	return s, fronts
}

// setPace makes m's mean prefill, as the cost's work ahead reads it
// (meshview.Member.Head), d for tokens reserved tokens: one prefill
// reserved on the idle engine and ended, answered, d later.
func setPace(t testing.TB, m *member, d time.Duration, tokens int64) {
	t.Helper()
	if !m.TryReserve(prefillPhase) {
		t.Fatalf("no prefill slot on %s", m.ID)
	}
	m.PrefillEnded(time.Now().Add(d).UnixNano(), true, tokens)
	m.Release(prefillPhase)
	if !m.TryReserve(prefillPhase) {
		t.Fatalf("no prefill slot on %s", m.ID)
	}
	defer m.Release(prefillPhase)
	if got := m.Head(time.Now().UnixNano()); got.Mean < d || got.Mean > d+time.Second || got.MeanTokens != tokens {
		t.Fatalf("%s's pace %+v, want %v for %d tokens", m.ID, got, d, tokens)
	}
}

// exactPrompt is a completion prompt of n bytes seeded by seed.
func exactPrompt(seed, n int) string {
	var b strings.Builder
	for b.Len() < n {
		fmt.Fprintf(&b, "narwhal %d tusk %d. ", seed, b.Len())
	}
	return b.String()[:n]
}

func completionBody(prompt string) string {
	return `{"model":"` + testModel + `","max_tokens":2,"prompt":"` + prompt + `"}`
}

// holds makes engine id's exact index hold, on GPU rank 0, the first
// blocks of prompt's token keys (16 tokens a block), as its KV batches
// would: an agent run from its first batch, its next batch removing
// removed of them.
func holds(t testing.TB, s *stack, id, prompt string, blocks, removed int) {
	keys := prefix.AppendTokenKeys(nil, fakeTokens(prompt), 16, 0)
	if blocks > len(keys) {
		t.Fatalf("the prompt has %d blocks, not %d", len(keys), blocks)
	}
	e := s.rt.view.ExactIndex().Engine(id)
	e.Begin(77, 1, 16)
	e.Clear(0)
	if blocks > 0 {
		e.Store(0, prefix.MediumGPU, keys[:blocks])
	}
	e.End()
	if removed > 0 {
		e.Begin(77, 2, 16)
		e.Remove(0, prefix.MediumGPU, keys[:removed])
		e.End()
	}
}

// approxHolds records prompt, as the router renders and hashes it, in
// the approximate index at engine id.
func approxHolds(t testing.TB, s *stack, id, prompt string) []uint64 {
	req, err := schemas.ParseRequest(schemas.EndpointCompletions, []byte(completionBody(prompt)))
	if err != nil {
		t.Fatal(err)
	}
	h := prefix.AppendHashes(nil, req.AppendPrompt(nil))
	s.rt.PrefixIndex().Record(id, h, nil)
	return h
}

func prefilledOn(t testing.TB, s *stack, prompt string) string {
	t.Helper()
	resp, b := s.post(schemas.EndpointCompletions, completionBody(prompt))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	return resp.Header.Get("X-Narwhal-Prefill-Engine")
}

func tokenizeCount(t testing.TB, s *stack, outcome string) float64 {
	return testkit.GatheredSum(t, s.rt.reg, "narwhal_tokenize_total", "outcome", outcome)
}

// TestExactIndexDecidesWhereItHasAMatchRPLACE4: a prompt whose tokens
// engine p1 reports it holds is placed on p1 even though the approximate
// index says p2 holds it (one /tokenize call; the same prompt again costs
// none: a cache hit); a prompt whose blocks p1 reported removed is not
// placed on p1, though the approximate index alone says p1 holds it
// whole, but on p2, which reports a part of it.
func TestExactIndexDecidesWhereItHasAMatchRPLACE4(t *testing.T) {
	s, fronts := exactStack(t, nil)
	a := exactPrompt(1, 4000) // 1,000 tokens: 62 blocks
	approxHolds(t, s, "p2", a)
	holds(t, s, "p1", a, 60, 0)
	holds(t, s, "p2", a, 0, 0)
	for i := range 3 {
		if got := prefilledOn(t, s, a); got != "p1" {
			t.Fatalf("request %d prefilled on %s, want p1 (its exact index holds the prompt)", i, got)
		}
	}
	if ok, hit := tokenizeCount(t, s, "ok"), tokenizeCount(t, s, "hit"); ok != 1 || hit != 2 {
		t.Fatalf("tokenize ok %v, hit %v; want one call, then two cache hits", ok, hit)
	}
	if n := fronts["p1"].calls.Load() + fronts["p2"].calls.Load(); n != 1 {
		t.Fatalf("%d /tokenize calls, want 1", n)
	}

	b := exactPrompt(2, 4000)
	hb := approxHolds(t, s, "p1", b)
	holds(t, s, "p1", b, 62, 62) // stored, then removed
	holds(t, s, "p2", b, 10, 0)
	if m := s.rt.view.MatchPrefix("p1", hb); m != len(hb) {
		t.Fatalf("the approximate index matches %d of %d blocks on p1, want all", m, len(hb))
	}
	for i := range 3 {
		if got := prefilledOn(t, s, b); got != "p2" {
			t.Fatalf("request %d of a prompt p1 reported removed prefilled on %s, want p2", i, got)
		}
	}
}

// TestInflightPromptFollowsItsEngineRPLACE4: a prompt placed on an exact
// engine whose events have not reported its blocks yet (its prefill is
// still in flight) draws the same prompt again to that engine, though the
// engine has the first one's work queued and the other engine is idle:
// both exact, both reporting nothing of it. The first is under way at the
// engine's pace (1,000 tokens in 30 ms, as if learned from earlier
// prefills: placement.md, the cost), so less of it is left than the idle
// engine would compute; without the credit the second would cost the
// whole prompt more there. Once the first attempts end and the grace
// passes, the credit is gone: a third request goes where the exact index
// says a part of the prompt is.
func TestInflightPromptFollowsItsEngineRPLACE4(t *testing.T) {
	s, fronts := exactStack(t, nil)
	a := exactPrompt(9, 4000) // 62 blocks
	for _, id := range []string{"p1", "p2"} {
		setPace(t, s.rt.view.Fleet().Member(id), 30*time.Millisecond, 1000)
	}
	holds(t, s, "p1", a, 0, 0)
	holds(t, s, "p2", a, 0, 0)
	gate := make(chan struct{})
	for _, te := range fronts {
		te.gate.Store(&gate)
	}
	arrived := func() int { return fronts["p1"].arrived() + fronts["p2"].arrived() }
	type answer struct {
		status int
		engine string
		body   []byte
	}
	answers := make(chan answer, 2)
	send := func() {
		resp, b := s.post(schemas.EndpointCompletions, completionBody(a))
		answers <- answer{resp.StatusCode, resp.Header.Get("X-Narwhal-Prefill-Engine"), b}
	}
	go send()
	testkit.WaitFor(t, 5*time.Second, "the first prefill held at its engine", func() bool { return arrived() == 1 })
	go send()
	testkit.WaitFor(t, 5*time.Second, "the second prefill held at its engine", func() bool { return arrived() == 2 })
	if fronts["p1"].arrived() != 2 && fronts["p2"].arrived() != 2 {
		t.Fatalf("the two requests of one prompt were prefilled on p1 %d and p2 %d times; want both on one engine",
			fronts["p1"].arrived(), fronts["p2"].arrived())
	}
	close(gate)
	one, two := <-answers, <-answers
	if one.status != 200 || two.status != 200 || one.engine != two.engine {
		t.Fatalf("answers %d from %s (%s) and %d from %s (%s); want 200 from one engine", one.status, one.engine, one.body, two.status, two.engine, two.body)
	}
	first := one.engine
	other := map[string]string{"p1": "p2", "p2": "p1"}[first]
	m := s.rt.view.Fleet().Member(first)
	keys := prefix.AppendTokenKeys(nil, fakeTokens(a), 16, 0)
	testkit.WaitFor(t, 5*time.Second, "the credit of the ended attempts to run out", func() bool {
		return m.Inflight().Match(keys, time.Now().UnixNano()) == 0
	})
	holds(t, s, other, a, 10, 0)
	if got := prefilledOn(t, s, a); got != other {
		t.Fatalf("after the grace a request went to %s, want %s (its exact index holds 10 blocks; %s reports none)", got, other, first)
	}
}

// TestFailedPrefillDropsItsCreditRPLACE4: a prefill attempt that fails
// before completing (the engine answers 500; the request is retried on
// the other engine) leaves no credit at its engine: the engine may hold
// nothing of the prompt, and the next request of it must not be drawn
// there by the failed attempt. The retry's own credit stands.
func TestFailedPrefillDropsItsCreditRPLACE4(t *testing.T) {
	s, fronts := exactStack(t, func(c *config.Config) {
		c.Recovery.RetryAttempts = 1
		c.Recovery.RetryBudgetRatio = 1 // the budget is not what this test is about
	})
	a := exactPrompt(10, 4000)
	holds(t, s, "p1", a, 30, 0) // the first attempt goes to p1
	holds(t, s, "p2", a, 0, 0)
	fronts["p1"].fail.Store(true)
	if got := prefilledOn(t, s, a); got != "p2" {
		t.Fatalf("prefilled on %s, want p2 (the retry after p1's 500)", got)
	}
	if fronts["p1"].arrived() != 1 {
		t.Fatalf("p1 got %d prefills, want the failed first attempt", fronts["p1"].arrived())
	}
	keys := prefix.AppendTokenKeys(nil, fakeTokens(a), 16, 0)
	now := time.Now().UnixNano()
	if n := s.rt.view.Fleet().Member("p1").Inflight().Match(keys, now); n != 0 {
		t.Fatalf("the failed attempt still credits p1 with %d blocks", n)
	}
	if n := s.rt.view.Fleet().Member("p2").Inflight().Match(keys, now); n == 0 {
		t.Fatal("the retry that prefilled on p2 left no credit there")
	}
}

// TestApproximateIndexWhenTokenizeFailsRPLACE4: without the prompt's
// tokens (placement.index approximate: no call at all; auto with an
// engine that answers /tokenize with an error) the request is placed as
// before, by the approximate index.
func TestApproximateIndexWhenTokenizeFailsRPLACE4(t *testing.T) {
	s, fronts := exactStack(t, func(c *config.Config) { c.Placement.Index = config.IndexApproximate })
	a := exactPrompt(3, 4000)
	approxHolds(t, s, "p2", a)
	if s.rt.view.ExactIndex() != nil {
		t.Fatal("placement.index approximate keeps an exact index")
	}
	if got := prefilledOn(t, s, a); got != "p2" || fronts["p1"].calls.Load()+fronts["p2"].calls.Load() != 0 {
		t.Fatalf("approximate: prefilled on %s (want p2), %d /tokenize calls (want 0)", got, fronts["p1"].calls.Load()+fronts["p2"].calls.Load())
	}

	s2, _ := exactStack(t, nil)
	chat := `{"model":"` + testModel + `","max_tokens":2,"messages":[{"role":"user","content":"` + a + `"}]}`
	req, err := schemas.ParseRequest(schemas.EndpointChat, []byte(chat))
	if err != nil {
		t.Fatal(err)
	}
	s2.rt.PrefixIndex().Record("p2", prefix.AppendHashes(nil, req.AppendPrompt(nil)), nil)
	holds(t, s2, "p1", a, 60, 0)
	// The fronts answer a chat's /tokenize 400 (they tokenize prompts).
	resp, body := s2.post(schemas.EndpointChat, chat)
	if resp.StatusCode != 200 || resp.Header.Get("X-Narwhal-Prefill-Engine") != "p2" {
		t.Fatalf("status %d on %s: %s; want 200 on p2", resp.StatusCode, resp.Header.Get("X-Narwhal-Prefill-Engine"), body)
	}
	if n := tokenizeCount(t, s2, "error"); n != 1 {
		t.Fatalf("tokenize errors %v, want 1", n)
	}
}

// TestExactModeWeighsEnginesWithoutAnIndexAsEmptyRPLACE4: under
// placement.index exact an engine without an exact index is placed as
// if it held nothing: p1, which the approximate index says holds the
// prompt whole, loses to p2, which reports a part of it.
func TestExactModeWeighsEnginesWithoutAnIndexAsEmptyRPLACE4(t *testing.T) {
	s, _ := exactStack(t, func(c *config.Config) { c.Placement.Index = config.IndexExact })
	a := exactPrompt(4, 4000)
	approxHolds(t, s, "p1", a)
	holds(t, s, "p2", a, 10, 0)
	for i := range 3 {
		if got := prefilledOn(t, s, a); got != "p2" {
			t.Fatalf("request %d prefilled on %s, want p2", i, got)
		}
	}
}

// TestHangingTokenizerDelaysNoRequestPastItsTimeoutRPLACE4: engines
// whose /tokenize never answers delay a request's placement by
// placement.tokenize_timeout_s at most: the prefill reaches an engine
// within the timeout and a small margin of the request, the request is
// answered, and the timeout is counted.
func TestHangingTokenizerDelaysNoRequestPastItsTimeoutRPLACE4(t *testing.T) {
	const timeout = 150 * time.Millisecond
	const margin = 350 * time.Millisecond // the router's own work and a loaded machine
	s, fronts := exactStack(t, func(c *config.Config) { c.Placement.TokenizeTimeoutS = timeout.Seconds() })
	for _, f := range fronts {
		f.hang.Store(true)
	}
	a := exactPrompt(5, 4000)
	holds(t, s, "p1", a, 60, 0)
	start := time.Now()
	got := prefilledOn(t, s, a)
	if got == "" {
		t.Fatal("no prefill engine named")
	}
	arrived := fronts[got].firstPrefill()
	if arrived.IsZero() {
		t.Fatalf("%s saw no prefill", got)
	}
	if d := arrived.Sub(start); d > timeout+margin {
		t.Fatalf("the prefill reached %s %v after the request: more than the tokenize timeout %v and %v", got, d, timeout, margin)
	}
	if n := tokenizeCount(t, s, "timeout"); n != 1 {
		t.Fatalf("tokenize timeouts %v, want 1", n)
	}
}

// TestTokenizeBody: the body of /tokenize is the request's model and
// what decides its tokens; a cache_salt or a batch of prompts is not
// tokenized; token ids given are taken as they are.
func TestTokenizeBody(t *testing.T) {
	for _, c := range []struct {
		endpoint, body, want string
		ids                  []uint32
		ok                   bool
	}{
		{schemas.EndpointCompletions, `{"model":"m","prompt":"hi","max_tokens":3}`, `{"model":"m","prompt":"hi"}`, nil, true},
		{schemas.EndpointCompletions, `{"model":"m","prompt":"hi","add_special_tokens":false}`, `{"model":"m","prompt":"hi","add_special_tokens":false}`, nil, true},
		{schemas.EndpointCompletions, `{"model":"m","prompt":[1, 2,3]}`, "", []uint32{1, 2, 3}, true},
		{schemas.EndpointCompletions, `{"model":"m","prompt":["a","b"]}`, "", nil, false},
		{schemas.EndpointCompletions, `{"model":"m","prompt":[1,-2]}`, "", nil, false},
		{schemas.EndpointCompletions, `{"model":"m","prompt":"hi","cache_salt":"s"}`, "", nil, false},
		{schemas.EndpointChat, `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}],"tools":[],"chat_template_kwargs":{"k":1}}`,
			`{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[],"chat_template_kwargs":{"k":1}}`, nil, true},
	} {
		req, err := schemas.ParseRequest(c.endpoint, []byte(c.body))
		if err != nil {
			t.Fatal(err)
		}
		body, ids, ok := appendTokenizeBody(nil, req, nil)
		if ok != c.ok || (c.ok && c.ids == nil && string(body) != c.want) || fmt.Sprint(ids) != fmt.Sprint(c.ids) {
			t.Errorf("%s: body %s, ids %v, ok %v; want %s, %v, %v", c.body, body, ids, ok, c.want, c.ids, c.ok)
		}
	}
}

// BenchmarkTokenizeCacheHit is the placement's tokenization of a
// 4,000-byte prompt tokenized before: the /tokenize body built, hashed
// and found in the cache. Target: 0 allocs/op.
func BenchmarkTokenizeCacheHit(b *testing.B) {
	tk := newTokenizer(http.DefaultClient, time.Second, time.Minute)
	req, err := schemas.ParseRequest(schemas.EndpointCompletions, []byte(completionBody(exactPrompt(6, 4000))))
	if err != nil {
		b.Fatal(err)
	}
	body, _, _ := appendTokenizeBody(nil, req, nil)
	tk.cache.put(maphashOf(tk, body), len(body), fakeTokens(exactPrompt(6, 4000)))
	dst := make([]uint32, 0, 2048)
	b.ReportAllocs()
	for b.Loop() {
		if _, _, ok := tk.tokens(b.Context(), req, nil, dst); !ok {
			b.Fatal("no hit")
		}
	}
}

// BenchmarkExactPlacementFirstByte measures what the exact index costs
// a request at concurrency 1: the p50 and p99 of the time to the first
// byte of 4,000-byte completions (1,000 tokens) through a router over
// simulators, with placement.index approximate and auto (one engine
// exact), each prompt new (under auto, a /tokenize call to a loopback
// engine) or the same (under auto, a hit of the tokenizer's cache).
func BenchmarkExactPlacementFirstByte(b *testing.B) {
	for _, c := range []struct {
		name, index string
		repeat      bool
	}{{"approximate-new", config.IndexApproximate, false}, {"auto-new", config.IndexAuto, false},
		{"approximate-repeated", config.IndexApproximate, true}, {"auto-repeated", config.IndexAuto, true}} {
		b.Run(c.name, func(b *testing.B) {
			s, _ := exactStack(b, func(cfg *config.Config) { cfg.Placement.Index = c.index })
			if c.index != config.IndexApproximate {
				holds(b, s, "p1", exactPrompt(0, 4000), 60, 0)
			}
			var lat []time.Duration
			for i := 0; b.Loop(); i++ {
				seed := i + 1000
				if c.repeat {
					seed = 7
				}
				body := completionBody(exactPrompt(seed, 4000))
				start := time.Now()
				resp, err := http.Post(s.url+schemas.EndpointCompletions, "application/json", strings.NewReader(body))
				if err != nil {
					b.Fatal(err)
				}
				var one [1]byte
				_, _ = io.ReadFull(resp.Body, one[:])
				lat = append(lat, time.Since(start))
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Fatalf("status %d", resp.StatusCode)
				}
			}
			sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
			b.ReportMetric(tokenizeCount(b, s, "ok")/float64(len(lat)), "tokenize-calls/op")
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
			b.ReportMetric(float64(lat[min(len(lat)-1, len(lat)*99/100)].Microseconds())/1000, "p99-ms")
		})
	}
}

// maphashOf is the tokenizer cache's key of body.
func maphashOf(tk *tokenizer, body []byte) uint64 { return maphash.Bytes(tk.cache.seed, body) }

// TestAttemptEndsSharedRPLACE4: a router joined to the mesh tells the
// other routers, on its load subject, of each placement by its exact
// index and of how its attempt ended, naming the same prompt: a prefill
// that failed (p1 answers 500) with PlacedFailed, so that their credit
// of p1 is dropped at once, and the retry's completed prefill on p2 with
// PlacedCompleted. Each attempt's end is told once.
func TestAttemptEndsSharedRPLACE4(t *testing.T) {
	s, fronts := exactStack(t, func(c *config.Config) {
		c.Router.ID = "rt-a"
		c.Recovery.RetryAttempts = 1
		c.Recovery.RetryBudgetRatio = 1
	})
	m := newMeshBus(t)
	if err := s.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	msgs := make(chan *nats.Msg, 1024)
	sub, err := m.B.Conn().ChanSubscribe(bus.LoadSubject("rt-a"), msgs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := m.B.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	a := exactPrompt(11, 4000)
	holds(t, s, "p1", a, 30, 0)
	holds(t, s, "p2", a, 0, 0)
	fronts["p1"].fail.Store(true)
	if got := prefilledOn(t, s, a); got != "p2" {
		t.Fatalf("prefilled on %s, want p2 (the retry after p1's 500)", got)
	}
	count, last := bus.PlacedChain(prefix.AppendTokenKeys(nil, fakeTokens(a), 16, 0))
	placed := map[string]int{}
	ends := map[string][]bus.PlacedOutcome{}
	deadline := time.After(5 * time.Second)
	for len(ends["p1"])+len(ends["p2"]) < 2 {
		select {
		case msg := <-msgs:
			if bus.IsPlaced(msg.Data) {
				_, engine, keys, err := bus.ParsePlaced(msg.Data, nil)
				if err != nil || len(keys) != count || keys[count-1] != last {
					t.Fatalf("a placement of another prompt or malformed: %d keys, %v", len(keys), err)
				}
				placed[string(engine)]++
			}
			if bus.IsPlacedEnd(msg.Data) {
				e, err := bus.ParsePlacedEnd(msg.Data)
				if err != nil || string(e.RouterID) != "rt-a" || e.Count != count || e.Last != last {
					t.Fatalf("an end naming another prompt or router, or malformed: %+v, %v", e, err)
				}
				ends[string(e.EngineID)] = append(ends[string(e.EngineID)], e.Outcome)
			}
		case <-deadline:
			t.Fatalf("placements %v and ends %v heard within 5 s; want both attempts and both ends", placed, ends)
		}
	}
	if placed["p1"] != 1 || placed["p2"] != 1 {
		t.Fatalf("placements heard %v, want one on each engine", placed)
	}
	if len(ends["p1"]) != 1 || ends["p1"][0] != bus.PlacedFailed || len(ends["p2"]) != 1 || ends["p2"][0] != bus.PlacedCompleted {
		t.Fatalf("ends heard %v, want p1 failed and p2 completed, once each", ends)
	}
	// Nothing more comes of the two attempts.
	if err := m.B.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	for len(msgs) > 0 {
		if msg := <-msgs; bus.IsPlacedEnd(msg.Data) {
			t.Fatal("an attempt's end told twice")
		}
	}
	if v := testkit.GatheredSum(t, s.rt.reg, "narwhal_prefix_inflight_shared_total", "outcome", "end_published"); v != 2 {
		t.Fatalf("end_published %v, want 2", v)
	}
}
