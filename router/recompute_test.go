package router

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/schemas"
)

// recomputeStack is one producer and one consumer of connector conn
// ("nixl" or "sglang"), with handoff.on_recompute onRecompute; noDetails
// makes the decode report usage without prompt_tokens_details.
func recomputeStack(t *testing.T, conn, onRecompute string, noDetails bool, logw *syncBuffer) *stack {
	cfg := sim.Config{NoPromptTokensDetails: noDetails}
	pcfg := sim.Config{}
	if conn == "sglang" {
		cfg.Connector, cfg.KVTimeout = sim.ConnectorSGLang, sglangKVTimeout
		pcfg.Connector, pcfg.KVTimeout = sim.ConnectorSGLang, sglangKVTimeout
	}
	defs := []engineDef{{id: "p1", role: "prefill", cfg: pcfg}, {id: "d1", role: "decode", cfg: cfg}}
	s := newStackLogged(t, defs, func(c *config.Config) {
		c.Engine.PrefillTimeoutS = 2
		c.Handoff.OnRecompute = onRecompute
	}, nil, logw)
	s.waitModels()
	return s
}

func (s *stack) recomputes() []*schemas.KVRecomputed {
	s.events.mu.Lock()
	defer s.events.mu.Unlock()
	var out []*schemas.KVRecomputed
	for _, ev := range s.events.all {
		if r, ok := ev.(*schemas.KVRecomputed); ok {
			out = append(out, r)
		}
	}
	return out
}

// TestRecomputeDetectedRFAIL8 proves R-FAIL-8 on both connectors, streamed
// and not: a decode engine that reports no cached prompt tokens after a
// handoff is a kv_recomputed event (schema-valid) and counts in
// narwhal_kv_recomputed_total{producer,consumer}; the client still gets
// its answer; with the default (count) nothing counts towards ejection,
// with fail_pair a counted decode failure naming the producer is
// published. A decode that loaded the KV (cached = prompt) is not flagged.
func TestRecomputeDetectedRFAIL8(t *testing.T) {
	for _, conn := range []string{"nixl", "sglang"} {
		for _, mode := range []string{config.OnRecomputeCount, config.OnRecomputeFailPair} {
			for _, stream := range []bool{true, false} {
				name := conn + " " + mode + " unary"
				extra := `"max_tokens":4`
				if stream {
					name = conn + " " + mode + " stream"
					extra += `,"stream":true`
				}
				t.Run(name, func(t *testing.T) {
					s := recomputeStack(t, conn, mode, false, &syncBuffer{})
					// The KV arrives: no false positive.
					resp, body := s.post(schemas.EndpointChat, chatBody("load the handed-off KV please", extra))
					if resp.StatusCode != 200 {
						t.Fatalf("status %d: %s", resp.StatusCode, body)
					}
					s.idle()
					if rs := s.recomputes(); len(rs) != 0 {
						t.Fatalf("a decode that loaded the KV was flagged: %+v", rs[0])
					}
					s.sims["d1"].Arm(sim.Fault{Kind: sim.FaultKVRecompute, Phase: sim.PhaseDecode, Count: 1})
					resp, body = s.post(schemas.EndpointChat, chatBody("recompute this prompt instead", extra))
					if resp.StatusCode != 200 {
						t.Fatalf("status %d after a silent recompute: %s", resp.StatusCode, body)
					}
					s.idle()
					rs := s.recomputes()
					if len(rs) != 1 {
						t.Fatalf("%d kv_recomputed events, want 1", len(rs))
					}
					r := rs[0]
					failPair := mode == config.OnRecomputeFailPair
					if r.EngineID != "d1" || r.ProducerID != "p1" || r.Connector != conn || r.CachedTokens != 0 || r.PromptTokens < minJudgedPrompt ||
						r.Counts != failPair || r.Subject() != "narwhal.events.kv_recomputed.d1."+s.rt.id {
						t.Fatalf("kv_recomputed event %+v", r)
					}
					if n := testutil.ToFloat64(s.rt.metrics.kvRecomputed.WithLabelValues("p1", "d1")); n != 1 {
						t.Fatalf("narwhal_kv_recomputed_total{producer=p1,consumer=d1} = %v, want 1", n)
					}
					reqs := s.events.requests()
					if len(reqs) != 2 || reqs[0].KVRecomputed || !reqs[1].KVRecomputed || reqs[1].Status != 200 {
						t.Fatalf("request events %+v", reqs)
					}
					fs := s.events.failures()
					if !failPair {
						if len(fs) != 0 {
							t.Fatalf("on_recompute count published failures: %+v", fs)
						}
					} else {
						f := s.oneFailure("d1", schemas.PhaseDecode, "kv_recomputed", true)
						if f.ProducerID != "p1" || f.ConsumerID != "d1" || !strings.Contains(f.Message, "recomputed") {
							t.Fatalf("failure event %+v", f)
						}
					}
					s.validEvents()
				})
			}
		}
	}
}

// TestRecomputeUnverifiableLoggedOnceRFAIL8 proves that a decode engine
// whose usage has no prompt_tokens_details is said once in the log and is
// never flagged (R-FAIL-8: nothing can be verified there).
func TestRecomputeUnverifiableLoggedOnceRFAIL8(t *testing.T) {
	logw := &syncBuffer{}
	s := recomputeStack(t, "nixl", config.OnRecomputeFailPair, true, logw)
	s.sims["d1"].Arm(sim.Fault{Kind: sim.FaultKVRecompute, Phase: sim.PhaseDecode})
	for range 3 {
		resp, body := s.post(schemas.EndpointChat, chatBody("no details here", `"stream":true,"max_tokens":3`))
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
	}
	s.idle()
	if n := strings.Count(logw.String(), "reports no usage.prompt_tokens_details.cached_tokens"); n != 1 {
		t.Fatalf("logged %d times, want once:\n%s", n, logw.String())
	}
	if !strings.Contains(logw.String(), "engine_id=d1") {
		t.Fatalf("the log line does not name the engine:\n%s", logw.String())
	}
	if rs := s.recomputes(); len(rs) != 0 {
		t.Fatalf("flagged without details: %+v", rs)
	}
	if fs := s.events.failures(); len(fs) != 0 {
		t.Fatalf("failures without details: %+v", fs)
	}
}

// TestKVPullErrorRFAIL8 proves the simulator's kv-pull-error (vLLM's
// kv_load_failure_policy=fail) is an engine fault of the decode: its
// error object's code (500) to the client (R-FAIL-4), counted.
func TestKVPullErrorRFAIL8(t *testing.T) {
	for _, conn := range []string{"nixl", "sglang"} {
		for _, stream := range []bool{true, false} {
			t.Run(conn+" stream="+map[bool]string{true: "yes", false: "no"}[stream], func(t *testing.T) {
				s := recomputeStack(t, conn, config.OnRecomputeCount, false, &syncBuffer{})
				s.sims["d1"].Arm(sim.Fault{Kind: sim.FaultKVPullError, Phase: sim.PhaseDecode, Count: 1})
				extra := `"max_tokens":3`
				if stream {
					extra += `,"stream":true`
				}
				resp, body := s.post(schemas.EndpointChat, chatBody("the pull fails", extra))
				if resp.StatusCode != 500 || !strings.Contains(string(body), "KV transfer failed") {
					t.Fatalf("status %d, want 500 with the engine's message: %s", resp.StatusCode, body)
				}
				s.idle()
				fs := s.events.failures()
				if len(fs) != 1 || fs[0].EngineID != "d1" || fs[0].Phase != schemas.PhaseDecode || fs[0].Kind != "error_object" || !fs[0].Counts {
					t.Fatalf("failure events %+v", fs)
				}
				if rs := s.recomputes(); len(rs) != 0 {
					t.Fatalf("a failed pull was a recompute: %+v", rs)
				}
				s.validEvents()
			})
		}
	}
}

// TestRecomputedKVThresholdRFAIL8 pins the rule: fewer than half of the
// prompt tokens cached, on prompts of at least minJudgedPrompt tokens.
func TestRecomputedKVThresholdRFAIL8(t *testing.T) {
	for _, c := range []struct {
		prompt, cached int
		want           bool
	}{{40, 0, true}, {40, 19, true}, {40, 20, false}, {40, 39, false}, {40, 40, false}, {3, 0, false}, {4, 1, true}, {0, 0, false}} {
		if got := recomputedKV(c.prompt, c.cached); got != c.want {
			t.Errorf("recomputedKV(%d, %d) = %v, want %v", c.prompt, c.cached, got, c.want)
		}
	}
}
