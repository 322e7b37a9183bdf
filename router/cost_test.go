package router

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/schemas"
)

// costBody is a chat request of testModel with system prompt system.
func costBody(system, q string) string {
	return `{"model":"` + testModel + `","max_tokens":2,"messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"` + q + `"}]}`
}

// promptHashes returns the block hashes the router computes for body.
func promptHashes(t *testing.T, body string) []uint64 {
	t.Helper()
	r, err := schemas.ParseRequest(schemas.EndpointChat, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return prefix.AppendHashes(nil, r.AppendPromptPrefix(nil, prefix.MaxBlocks*prefix.BlockBytes))
}

// TestCorrectionCutsDeniedPrefixRPLACE3 proves R-PLACE-3's correction
// with a simulated producer whose KV cache holds one prompt: prompt A is
// placed there, prompt B evicts it from the engine's cache (not from
// the index), and A's next prefill reports fewer cached tokens than the
// index predicted: the index's chain of A is cut where the engine's
// cache ended, so the next placement of A does not follow it; the
// predicted and cached tokens and the error are counted per engine. It
// holds for a nixl producer (its JSON answer) and an SGLang one (its
// stream read to the end).
func TestCorrectionCutsDeniedPrefixRPLACE3(t *testing.T) {
	t.Run("nixl", func(t *testing.T) {
		testCorrectionCuts(t, sim.Config{KVCacheBlocks: 20}, sim.Config{})
	})
	t.Run("sglang", func(t *testing.T) {
		testCorrectionCuts(t, sim.Config{KVCacheBlocks: 20, Connector: sim.ConnectorSGLang, KVTimeout: sglangKVTimeout},
			sim.Config{Connector: sim.ConnectorSGLang, KVTimeout: sglangKVTimeout})
	})
}

func testCorrectionCuts(t *testing.T, producer, consumer sim.Config) {
	// The engines' /metrics are not read: the index is not sized from the
	// producer's KV cache (which would foresee this eviction itself), so
	// it over-predicts as it does for an engine that reports no capacity,
	// and only the answer's cached_tokens can tell it.
	s := newStack(t, []engineDef{{id: "p1", role: "prefill", cfg: producer}, {id: "d1", role: "decode", cfg: consumer}},
		func(c *config.Config) { c.Placement.EngineMetricsIntervalS = 0 })
	s.waitModels()
	a := costBody(strings.Repeat("Tenant A's long context about narwhal tusks. ", 40), "q")
	b := costBody(strings.Repeat("Tenant B's other long context about belugas. ", 40), "q")
	ha := promptHashes(t, a)
	for i, body := range []string{a, a, b} {
		if resp, out := s.post(schemas.EndpointChat, body); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, out)
		}
	}
	ix := s.rt.PrefixIndex()
	if m := ix.Match("p1", ha); m != len(ha) {
		t.Fatalf("before the correction the index matches %d of A's %d blocks on p1, want all (it does not know of the eviction)", m, len(ha))
	}
	reg := s.rt.reg
	cuts := testkit.GatheredSum(t, reg, "narwhal_prefix_index_cuts_total")
	if cuts != 0 {
		t.Fatalf("%v cuts before the eviction", cuts)
	}
	// A again: the engine evicted it for B; its answer says so.
	if resp, out := s.post(schemas.EndpointChat, a); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, out)
	}
	if m := ix.Match("p1", ha); m > len(ha)/4 {
		t.Fatalf("after the engine denied A's prefix the index still matches %d of its %d blocks on p1", m, len(ha))
	}
	if n := testkit.GatheredSum(t, reg, "narwhal_prefix_index_cuts_total"); n != 1 {
		t.Fatalf("narwhal_prefix_index_cuts_total %v, want 1", n)
	}
	predicted := testkit.GatheredSum(t, reg, "narwhal_prefix_predicted_tokens_total", "engine", "p1")
	cached := testkit.GatheredSum(t, reg, "narwhal_prefix_cached_tokens_total", "engine", "p1")
	if predicted <= cached || cached <= 0 {
		t.Fatalf("predicted %v, cached %v: want an over-prediction counted (and A's second request's hit)", predicted, cached)
	}
	if n := testkit.GatheredSum(t, reg, "narwhal_prefix_uncorrected_total"); n != 0 {
		t.Fatalf("uncorrected %v", n)
	}
}

// TestCorrectionOffWithoutCachedTokensRPLACE3: a producer that reports
// no prompt_tokens_details is not corrected: its answers are counted in
// narwhal_prefix_uncorrected_total and the index keeps what it placed.
func TestCorrectionOffWithoutCachedTokensRPLACE3(t *testing.T) {
	s := newStack(t, []engineDef{{id: "p1", role: "prefill", cfg: sim.Config{KVCacheBlocks: 40, NoPromptTokensDetails: true}}, {id: "d1", role: "decode"}}, nil)
	s.waitModels()
	a := costBody(strings.Repeat("Tenant A's long context about narwhal tusks. ", 40), "q")
	b := costBody(strings.Repeat("Tenant B's other long context about belugas. ", 40), "q")
	for i, body := range []string{a, b, a} {
		if resp, out := s.post(schemas.EndpointChat, body); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, out)
		}
	}
	reg := s.rt.reg
	if n := testkit.GatheredSum(t, reg, "narwhal_prefix_uncorrected_total"); n != 3 {
		t.Fatalf("narwhal_prefix_uncorrected_total %v, want 3", n)
	}
	if n := testkit.GatheredSum(t, reg, "narwhal_prefix_index_cuts_total"); n != 0 {
		t.Fatalf("%v cuts without cached_tokens", n)
	}
	if ha := promptHashes(t, a); s.rt.PrefixIndex().Match("p1", ha) != len(ha) {
		t.Fatal("the index lost A without a correction")
	}
}

// TestPrefillTokensNeverLeakRPLACE3: the uncached tokens each producer
// attempt reserves on its engine are released on every path — success,
// a failed prefill retried elsewhere, a failed decode, a client that
// goes away during the prefill — so that no engine keeps phantom work.
func TestPrefillTokensNeverLeakRPLACE3(t *testing.T) {
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "p2", role: "prefill"}, {id: "d1", role: "decode"}}, nil)
	s.waitModels()
	body := costBody(strings.Repeat("A context long enough to weigh. ", 30), "q")
	idle := func(what string) {
		t.Helper()
		testkit.WaitFor(t, 5*time.Second, what+": every engine's tokens and slots released", func() bool {
			for _, m := range s.rt.fleet().Members() {
				if m.Tokens() != 0 || m.Legs() != 0 {
					return false
				}
			}
			return true
		})
	}
	// During a prefill the producer holds the attempt's tokens.
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultHeaderDelay, Phase: sim.PhasePrefill, DelayMS: 300, Count: 1})
	s.sims["p2"].Arm(sim.Fault{Kind: sim.FaultHeaderDelay, Phase: sim.PhasePrefill, DelayMS: 300, Count: 1})
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, _ := s.post(schemas.EndpointChat, body)
		if resp.StatusCode != 200 {
			t.Errorf("status %d", resp.StatusCode)
		}
	}()
	testkit.WaitFor(t, 5*time.Second, "the prefill's tokens reserved", func() bool {
		return s.rt.fleet().Member("p1").Tokens()+s.rt.fleet().Member("p2").Tokens() > 100
	})
	<-done
	idle("success")
	s.sims["p1"].Disarm()
	s.sims["p2"].Disarm()

	// A failed prefill (retried on the other producer where the retry
	// policy allows: then both fail).
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhasePrefill, Status: 500, Count: 1})
	s.sims["p2"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhasePrefill, Status: 500, Count: 1})
	if resp, _ := s.post(schemas.EndpointChat, body); resp.StatusCode == 200 {
		t.Fatal("a request whose prefills fail succeeded")
	}
	idle("failed prefills")
	s.sims["p1"].Disarm()
	s.sims["p2"].Disarm()

	// A failed decode, every attempt.
	s.sims["d1"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500})
	if resp, _ := s.post(schemas.EndpointChat, body); resp.StatusCode == 200 {
		t.Fatal("a request whose decodes all fail succeeded")
	}
	s.sims["d1"].Disarm()
	idle("failed decodes")

	// The client goes away during the prefill.
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultHeaderDelay, Phase: sim.PhasePrefill, DelayMS: 2000})
	s.sims["p2"].Arm(sim.Fault{Kind: sim.FaultHeaderDelay, Phase: sim.PhasePrefill, DelayMS: 2000})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	req, _ := http.NewRequestWithContext(ctx, "POST", s.url+schemas.EndpointChat, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
	}
	cancel()
	idle("a client gone during the prefill")
}

// TestHeadMeanFromAnsweredPrefillsRPLACE3: the mean prefill time the cost
// takes the computing attempt's progress from (meshview.Member.Head) is
// learned from the producer's prefills that answered — here each held
// 150 ms by the engine before its answer — and a prefill that failed
// does not move it, however fast it failed.
func TestHeadMeanFromAnsweredPrefillsRPLACE3(t *testing.T) {
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}, nil)
	s.waitModels()
	p1 := s.rt.fleet().Member("p1")
	mean := func() time.Duration {
		if !p1.TryReserve(prefillPhase) {
			t.Fatal("no prefill slot on p1")
		}
		defer p1.Release(prefillPhase)
		return p1.Head(time.Now().UnixNano()).Mean
	}
	if m := mean(); m != 0 {
		t.Fatalf("mean %v before any prefill", m)
	}
	body := costBody(strings.Repeat("A context long enough to weigh. ", 30), "q")
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultHeaderDelay, Phase: sim.PhasePrefill, DelayMS: 150})
	for range 3 {
		if resp, out := s.post(schemas.EndpointChat, body); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
	}
	learned := mean()
	if learned < 150*time.Millisecond || learned > 5*time.Second {
		t.Fatalf("mean %v after three prefills held 150 ms each", learned)
	}
	s.sims["p1"].Disarm()
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhasePrefill, Status: 500})
	for range 3 {
		if resp, _ := s.post(schemas.EndpointChat, body); resp.StatusCode == 200 {
			t.Fatal("a request whose prefill fails succeeded")
		}
	}
	if m := mean(); m != learned {
		t.Fatalf("failed prefills moved the mean from %v to %v", learned, m)
	}
}
