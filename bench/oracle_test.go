package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
)

// fakeSim answers POST /sim/cached with a set answer after a set delay
// and keeps the bodies it was asked about.
type fakeSim struct {
	mu     sync.Mutex
	answer sim.Cached
	delay  time.Duration
	bodies [][]byte
	srv    *httptest.Server
}

func startFakeSim(t *testing.T) *fakeSim {
	f := &fakeSim{}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/sim/cached" {
			http.NotFound(w, r)
			return
		}
		b, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.bodies = append(f.bodies, b)
		a, d := f.answer, f.delay
		f.mu.Unlock()
		time.Sleep(d)
		_ = json.NewEncoder(w).Encode(a)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeSim) set(a sim.Cached) {
	f.mu.Lock()
	f.answer = a
	f.mu.Unlock()
}

// TestOracleChoosesLeastExpectedWait: the oracle sends a request to the
// engine with the least queued uncached work plus this prompt's uncached
// tokens there: a loaded engine holding the prefix loses to an idle one
// exactly when its queue exceeds the tokens the idle one must compute; a
// tie goes to the engine with fewer requests; an engine that does not
// answer is left out, and with none answering the choice goes in turn.
// Every engine is asked about the request's own body.
func TestOracleChoosesLeastExpectedWait(t *testing.T) {
	warm, idle, down := startFakeSim(t), startFakeSim(t), startFakeSim(t)
	down.srv.Close()
	o := NewOracleTarget(make([]Target, 3), []string{warm.srv.URL, idle.srv.URL, down.srv.URL})
	defer o.Close()
	ctx := context.Background()
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"a b c"}]}`)
	idle.set(sim.Cached{PromptTokens: 500})
	for _, tc := range []struct {
		queued int64
		want   int
	}{
		{queued: 1000, want: 1}, // 1000 + 20 > 500
		{queued: 481, want: 1},  // 481 + 20 > 500
		{queued: 479, want: 0},  // 479 + 20 < 500
		{queued: 0, want: 0},
	} {
		warm.set(sim.Cached{PromptTokens: 500, CachedTokens: 480, QueuedPromptTokens: tc.queued, Running: 2, Waiting: 3})
		if got := o.Choose(ctx, body); got != tc.want {
			t.Errorf("warm engine queued %d: chose %d, want %d", tc.queued, got, tc.want)
		}
	}
	// Equal waits: the engine with fewer requests waiting and running.
	warm.set(sim.Cached{PromptTokens: 500, CachedTokens: 480, QueuedPromptTokens: 480, Running: 2})
	idle.set(sim.Cached{PromptTokens: 500, Running: 1})
	for range 3 {
		if got := o.Choose(ctx, body); got != 1 {
			t.Fatalf("tie: chose %d, want the engine with fewer requests", got)
		}
	}
	for _, f := range []*fakeSim{warm, idle} {
		f.mu.Lock()
		for _, b := range f.bodies {
			if string(b) != string(body) {
				t.Fatalf("asked about %s, want the request's body", b)
			}
		}
		f.mu.Unlock()
	}
	warm.srv.Close()
	idle.srv.Close()
	seen := map[int]bool{}
	for range 3 {
		seen[o.Choose(ctx, body)] = true
	}
	if len(seen) != 3 {
		t.Fatalf("no engine answering: chose %v, want each in turn", seen)
	}
	rounds, _, failed := o.LookupStats()
	if rounds != 10 || failed != 3 {
		t.Fatalf("%d rounds, %d failed, want 10 and 3", rounds, failed)
	}
}

// TestOracleFollowsTheSimulatorsCache: against real simulators the
// oracle's look-ups find the engine that computed a prompt before and
// send the request there (its prefill then hits), while a prompt nobody
// holds goes to an idle engine.
func TestOracleFollowsTheSimulatorsCache(t *testing.T) {
	var sims []*sim.Server
	var targets []Target
	var urls []string
	for i := range 3 {
		s := simtest.Start(t, sim.Config{Role: "both", EngineID: "e" + string(rune('1'+i)), Model: "m"})
		sims = append(sims, s)
		rt := NewRouterTarget(s.URL(), 1)
		t.Cleanup(rt.Close)
		targets = append(targets, rt)
		urls = append(urls, s.URL())
	}
	o := NewOracleTarget(targets, urls)
	defer o.Close()
	wl := testWorkload("m", 2)
	tr, err := NewTrace(PrefixWorkload{Shape: ShapeHotTenant, Model: "m", Tenants: 1, ContextTokens: 64, UsersPerTenant: 4,
		QueriesPerUser: 1, QueryTokens: 4, MaxTokens: 2, Rate: 10, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	var live counters
	first := -1
	for i, r := range tr.Requests {
		w := newWorker(wl.shape(), &wl, uint64(i+1), &live)
		w.fixed = r.Body
		before := make([]int64, len(sims))
		for k, s := range sims {
			before[k] = s.Stats().Decodes
		}
		o.do(context.Background(), w, time.Now())
		if w.rec.ok != 1 {
			t.Fatalf("request %d failed: %v", i, w.rec.errors)
		}
		got := -1
		for k, s := range sims {
			if s.Stats().Decodes > before[k] {
				got = k
			}
		}
		if first < 0 {
			first = got
		} else if got != first {
			t.Fatalf("request %d of the shared context went to engine %d, not %d which holds it", i, got, first)
		}
	}
	if st := sims[first].Stats(); st.PrefixCacheHits < 3*64 {
		t.Fatalf("the engine holding the context hit %d tokens, want ≥ %d", st.PrefixCacheHits, 3*64)
	}
}

// TestOracleLookupsLeftOutOfTTFT: the time the oracle spends asking the
// engines is not counted in the request's latencies.
func TestOracleLookupsLeftOutOfTTFT(t *testing.T) {
	s := simtest.Start(t, sim.Config{Role: "both", EngineID: "e1", Model: "m"})
	slow := startFakeSim(t)
	slow.delay = 300 * time.Millisecond
	rt := NewRouterTarget(s.URL(), 1)
	defer rt.Close()
	o := NewOracleTarget([]Target{rt}, []string{slow.srv.URL})
	defer o.Close()
	began := time.Now()
	rec := oneRequest(t, o, testWorkload("m", 2))
	if time.Since(began) < 300*time.Millisecond {
		t.Fatal("the look-up did not take its 300 ms")
	}
	if rec.ok != 1 || rec.ttft[0] >= 300*time.Millisecond || rec.e2e[0] >= 300*time.Millisecond {
		t.Fatalf("ok %d, TTFT %v, e2e %v: the look-up's 300 ms counted", rec.ok, rec.ttft, rec.e2e)
	}
	if _, spent, _ := o.LookupStats(); spent < 300*time.Millisecond {
		t.Fatalf("look-ups took %v, want ≥ 300 ms", spent)
	}
}

// TestComparePoliciesOracleLane: the oracle variant runs one router per
// producer, each with that producer alone and every decode in its fleet
// (and a router policy the routers know), answers every request of the
// trace through them and reports its look-ups.
func TestComparePoliciesOracleLane(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	w := testPrefixWorkload()
	w.QueriesPerUser, w.Rate = 2, 200 // 12 requests
	tr, err := NewTrace(w)
	if err != nil {
		t.Fatal(err)
	}
	fleets := map[string][]config.EngineSpec{}
	var mu sync.Mutex
	pc, err := ComparePolicies(context.Background(), tr, PolicyCompareOptions{
		Variants: []PolicyVariant{{Policy: "least_loaded", Routers: 1}, {Policy: PolicyOracle, Routers: 3}},
		Sims:     PolicySims{Prefill: 2, Decode: 1, BlockSize: 4, KVCacheBlocks: 64},
		Windows:  2,
		Timeout:  20 * time.Second,
		Router: func(ctx context.Context, id string, fleet []config.EngineSpec, env []string) (*RouterProcess, error) {
			mu.Lock()
			fleets[id] = fleet
			mu.Unlock()
			if !slices.Contains(env, "NARWHAL_PLACEMENT_POLICY=least_loaded") {
				return nil, fmt.Errorf("router %s: env %v lacks a placement policy routers know", id, env)
			}
			return StartRouterProcess(ctx, RouterProcessOptions{Exe: exe, ID: id, Fleet: fleet, Env: append(env, childRouterEnv+"=1")})
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(fleets) != 3 {
		t.Fatalf("routers %v, want one for least_loaded and one per producer for the oracle", fleets)
	}
	for i, id := range []string{"bench-b-1", "bench-b-2"} {
		f := fleets[id]
		if len(f) != 2 || f[0].Role != "prefill" || f[0].ID != fmt.Sprintf("b-prefill-%d", i+1) || f[1].Role != "decode" {
			t.Fatalf("oracle router %s fleet %+v, want its producer and the decode", id, f)
		}
	}
	o := pc.Policies[1]
	if o.Name != "oracle" || o.Run.OK != 12 || o.OracleLookupMeanS <= 0 || o.OracleLookupFailed != 0 {
		t.Fatalf("oracle: %s, %d ok, look-up mean %v, failed %d", o.Name, o.Run.OK, o.OracleLookupMeanS, o.OracleLookupFailed)
	}
	var n float64
	for _, s := range o.PrefillShares {
		n += s
	}
	if len(o.PrefillShares) != 2 || n < 0.999 || n > 1.001 || o.QueryTokens != tr.PromptTokens() {
		t.Fatalf("oracle shares %v, queries %d of %d", o.PrefillShares, o.QueryTokens, tr.PromptTokens())
	}
}
