package router

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/schemas"
)

// faultStack is one producer and one consumer, with short timeouts, so a
// fault armed on either is certain to be hit.
func faultStack(t *testing.T, mutate func(*config.Config)) *stack {
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}, func(c *config.Config) {
		c.Engine.FirstTokenTimeoutS = 0.5
		c.Engine.DecodeReadTimeoutS = 0.4
		c.Engine.PrefillTimeoutS = 0.5
		if mutate != nil {
			mutate(c)
		}
	})
	s.waitModels()
	return s
}

// errorBody decodes an OpenAI error body and checks its shape (R-API-3).
func errorBody(t *testing.T, status int, b []byte) schemas.ErrorObject {
	t.Helper()
	var e struct {
		Error *schemas.ErrorObject `json:"error"`
	}
	if err := json.Unmarshal(b, &e); err != nil || e.Error == nil {
		t.Fatalf("not an error body: %s", b)
	}
	if e.Error.Code != status || e.Error.Type == "" {
		t.Fatalf("error %+v, want code %d", e.Error, status)
	}
	return *e.Error
}

// validEvents checks every published event against its JSON Schema
// (R-BUS-3).
func (s *stack) validEvents() {
	s.t.Helper()
	s.events.mu.Lock()
	defer s.events.mu.Unlock()
	for _, ev := range s.events.all {
		h := ev.Head()
		if h.ID == "" {
			h.ID = "test-" + newID()
		}
		if h.At.IsZero() {
			h.At = nowUTC()
		}
		b, _ := json.Marshal(ev)
		if err := bus.ValidateEvent(b); err != nil {
			s.t.Fatalf("event %s does not match its schema: %v", b, err)
		}
	}
}

// oneFailure returns the single failure event and checks it.
func (s *stack) oneFailure(engine, phase, kind string, counts bool) *schemas.Failure {
	s.t.Helper()
	fs := s.events.failures()
	if len(fs) != 1 {
		s.t.Fatalf("%d failure events, want 1: %+v", len(fs), fs)
	}
	f := fs[0]
	if f.EngineID != engine || f.Phase != phase || f.Kind != kind || f.Counts != counts || f.Subject() != "narwhal.events.failure."+engine+"."+s.rt.id {
		s.t.Fatalf("failure event %+v, want %s %s %s counts=%v", f, engine, phase, kind, counts)
	}
	return f
}

func (s *stack) decodeCalls() int {
	n := 0
	for _, r := range s.sims["d1"].Requests() {
		if strings.HasPrefix(r.Path, "/v1/") && r.Path != "/v1/kv/release" {
			n++
		}
	}
	return n
}

func TestPrefillFaultsRFAIL1(t *testing.T) {
	cases := []struct {
		name    string
		fault   sim.Fault
		status  int
		message string
		kind    string
		counts  bool
	}{
		{"5xx is 502", sim.Fault{Kind: sim.FaultStatus, Status: 500, Message: "prefill exploded"}, 502, "prefill engine p1 answered HTTP 500: prefill exploded", "prefill_status", true},
		{"upstream 504 is timeout-shaped", sim.Fault{Kind: sim.FaultStatus, Status: 504}, 504, "prefill engine p1 answered HTTP 504", "prefill_status", true},
		{"prefill timeout is 504", sim.Fault{Kind: sim.FaultHeaderDelay, DelayMS: 3000}, 504, "engine prefill timeout", "prefill_timeout", true},
		{"R-DESC-0 missing descriptor", sim.Fault{Kind: sim.FaultNoDescriptor}, 502, "handoff descriptor rejected: missing descriptor", "descriptor_rejected", true},
		{"R-DESC-1 missing engine identity", sim.Fault{Kind: sim.FaultDropEngineID}, 502, "handoff descriptor rejected: missing engine identity", "descriptor_rejected", true},
		{"R-DESC-2 malformed block ids", sim.Fault{Kind: sim.FaultGarbleBlockIDs}, 502, "handoff descriptor rejected: malformed block ids", "descriptor_rejected", true},
		{"R-DESC-3 connector shape", sim.Fault{Kind: sim.FaultChangeConnectorShape}, 502, "handoff descriptor rejected: connector mismatch", "descriptor_rejected", true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := faultStack(t, nil)
			c.fault.Phase = sim.PhasePrefill
			s.sims["p1"].Arm(c.fault)
			resp, body := s.post(schemas.EndpointChat, chatBody("fail the prefill", `"stream":true`))
			if resp.StatusCode != c.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, c.status, body)
			}
			if e := errorBody(t, c.status, body); !strings.HasPrefix(e.Message, c.message) {
				t.Fatalf("message %q, want %q…", e.Message, c.message)
			}
			if strings.Contains(string(body), "data: [DONE]") {
				t.Fatal("[DONE] in an error response")
			}
			// Decode is never called after a failed prefill or a rejected descriptor.
			if n := s.decodeCalls(); n != 0 {
				t.Fatalf("decode engine called %d times", n)
			}
			s.idle()
			s.oneFailure("p1", "prefill", c.kind, c.counts)
			if c.kind == "descriptor_rejected" && c.fault.Kind != sim.FaultNoDescriptor {
				hs := s.events.handoffs()
				if len(hs) != 1 || hs[0].Outcome != "abandoned" || hs[0].EngineID != "p1" || hs[0].Reason != "descriptor_rejected" {
					t.Fatalf("handoff events %+v", hs)
				}
			}
			s.validEvents()
		})
	}
}

func TestPassThroughClientFaultsRFAIL6(t *testing.T) {
	for _, phase := range []string{sim.PhasePrefill, sim.PhaseDecode} {
		for _, status := range []int{400, 404, 413, 422, 429} {
			t.Run(phase+" "+http3(status), func(t *testing.T) {
				s := faultStack(t, nil)
				engine := "p1"
				if phase == sim.PhaseDecode {
					engine = "d1"
				}
				s.sims[engine].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: phase, Status: status, Message: "engine says no"})
				resp, body := s.post(schemas.EndpointChat, chatBody("client fault", `"stream":true`))
				if resp.StatusCode != status {
					t.Fatalf("status %d, want %d: %s", resp.StatusCode, status, body)
				}
				// The engine's body is passed through.
				if e := errorBody(t, status, body); e.Message != "engine says no" {
					t.Fatalf("message %q", e.Message)
				}
				s.idle()
				fs := s.events.failures()
				if status == 429 {
					// Overload: published, never counted (R-BRK-2).
					if len(fs) != 1 || fs[0].Kind != "overload" || fs[0].Counts {
						t.Fatalf("failure events %+v", fs)
					}
				} else if len(fs) != 0 {
					t.Fatalf("a client fault was published as an engine failure: %+v", fs)
				}
			})
		}
	}
}

// TestBodyOverTheEngineLimitBlamesNoEngineRFAIL6 sends prompts the router
// accepts (under request.max_body_bytes) but the prefill engine does not:
// the engine answers 413 and closes the connection under the router's
// write. Each client gets that 413, no failure is published against the
// engine however many such prompts come, and the engine still serves the
// next request. Before, the cut write was a connect error that counted,
// and three large prompts could eject a healthy engine.
func TestBodyOverTheEngineLimitBlamesNoEngineRFAIL6(t *testing.T) {
	s := newStack(t, []engineDef{
		{id: "p1", role: "prefill", cfg: sim.Config{MaxBodyBytes: 1 << 20, MaxModelLen: 4 << 20}},
		{id: "d1", role: "decode", cfg: sim.Config{MaxModelLen: 4 << 20}},
	}, nil)
	s.waitModels()
	big := chatBody(strings.Repeat("abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz ", 6<<20/64), `"max_tokens":2`)
	for i := range 3 {
		resp, body := s.post(schemas.EndpointChat, big)
		if resp.StatusCode != 413 {
			t.Fatalf("prompt %d: status %d, want the engine's 413: %.300s", i, resp.StatusCode, body)
		}
		if e := errorBody(t, 413, body); !strings.Contains(e.Message, "exceeds 1048576 bytes") {
			t.Fatalf("prompt %d: message %q, want the engine's own", i, e.Message)
		}
	}
	s.idle()
	if fs := s.events.failures(); len(fs) != 0 {
		t.Fatalf("a body the engine refused was published as its failure: %+v", fs)
	}
	resp, body := s.post(schemas.EndpointChat, chatBody("small", `"max_tokens":2`))
	if resp.StatusCode != 200 {
		t.Fatalf("the next request: status %d: %s", resp.StatusCode, body)
	}
}

func http3(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}

func TestDecodeFaultsBeforeCommit(t *testing.T) {
	cases := []struct {
		name    string
		fault   sim.Fault
		status  int
		message string
		kind    string
	}{
		{"R-FAIL-6 5xx", sim.Fault{Kind: sim.FaultStatus, Status: 503, Message: "busy"}, 502, "decode engine d1 answered HTTP 503: busy", "upstream_status"},
		{"R-FAIL-6 upstream 408 is a timeout", sim.Fault{Kind: sim.FaultStatus, Status: 408}, 504, "decode engine d1 answered HTTP 408", "upstream_status"},
		{"R-TMO-1 headers late", sim.Fault{Kind: sim.FaultHeaderDelay, DelayMS: 3000}, 504, "engine first token timeout", "first_token_timeout"},
		{"R-TMO-1 token late", sim.Fault{Kind: sim.FaultFirstTokenDelay, DelayMS: 3000}, 504, "engine first token timeout", "first_token_timeout"},
		{"R-TMO-1 keep-alives do not count", sim.Fault{Kind: sim.FaultFirstTokenDelay, DelayMS: 3000, IntervalMS: 50}, 504, "engine first token timeout", "first_token_timeout"},
		{"R-FAIL-3 [DONE] before a token", sim.Fault{Kind: sim.FaultDoneBeforeToken}, 502, "stream ended with [DONE] before any token arrived", "done_before_token"},
		{"R-FAIL-4 error object before a token", sim.Fault{Kind: sim.FaultErrorObject, Status: 503, Message: "KV cache exhausted"}, 503, "KV cache exhausted", "error_object"},
		{"R-FAIL-2 closed before a token", sim.Fault{Kind: sim.FaultClose}, 502, "engine stream closed before [DONE]", "closed_before_done"},
		{"R-FAIL-2 aborted before a token", sim.Fault{Kind: sim.FaultAbort}, 502, "engine stream closed before [DONE]", "closed_before_done"},
	}
	for _, c := range cases {
		for _, stream := range []bool{true, false} {
			name := c.name + " stream"
			extra := `"stream":true,"max_tokens":4`
			if !stream {
				name = c.name + " non-stream"
				extra = `"max_tokens":4`
			}
			t.Run(name, func(t *testing.T) {
				s := faultStack(t, nil)
				c.fault.Phase = sim.PhaseDecode
				s.sims["d1"].Arm(c.fault)
				resp, body := s.post(schemas.EndpointChat, chatBody("fail the decode", extra))
				if resp.StatusCode != c.status {
					t.Fatalf("status %d, want %d: %s", resp.StatusCode, c.status, body)
				}
				if e := errorBody(t, c.status, body); !strings.HasPrefix(e.Message, c.message) {
					t.Fatalf("message %q, want %q…", e.Message, c.message)
				}
				if strings.Contains(string(body), "data: [DONE]") {
					t.Fatal("[DONE] in an error response")
				}
				s.idle()
				s.oneFailure("d1", "decode", c.kind, true)
				hs := s.events.handoffs()
				if len(hs) != 1 || hs[0].Outcome != "abandoned" || hs[0].EngineID != "p1" || hs[0].ConsumerID != "d1" {
					t.Fatalf("handoff events %+v", hs)
				}
				s.validEvents()
			})
		}
	}
}

func TestDecodeFaultsAfterCommitRFAIL5(t *testing.T) {
	cases := []struct {
		name    string
		fault   sim.Fault
		code    int
		message string
		kind    string
	}{
		{"R-TMO-3 silence", sim.Fault{Kind: sim.FaultSilence, AfterTokens: 3}, 504, "engine went silent between tokens", "mid_stream_silence"},
		{"R-FAIL-2 close", sim.Fault{Kind: sim.FaultClose, AfterTokens: 3}, 502, "engine stream closed before [DONE]", "closed_before_done"},
		{"R-FAIL-2 abort", sim.Fault{Kind: sim.FaultAbort, AfterTokens: 3}, 502, "engine stream closed before [DONE]", "closed_before_done"},
		{"R-FAIL-4 error object", sim.Fault{Kind: sim.FaultErrorObject, AfterTokens: 3, Status: 500, Message: "CUDA error"}, 500, "CUDA error", "error_object"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := faultStack(t, nil)
			c.fault.Phase = sim.PhaseDecode
			s.sims["d1"].Arm(c.fault)
			resp, body := s.post(schemas.EndpointChat, chatBody("fail mid-stream", `"stream":true,"max_tokens":10`))
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			text, done, errObj := streamText(t, body)
			if done {
				t.Fatalf("[DONE] after a failure: %s", body)
			}
			if errObj == nil || errObj.Code != c.code || !strings.HasPrefix(errObj.Message, c.message) || errObj.Type == "" {
				t.Fatalf("terminal event %+v, want code %d %q: %s", errObj, c.code, c.message, body)
			}
			events := sseEvents(body)
			if last := events[len(events)-1]; !strings.HasPrefix(last, `{"error":`) {
				t.Fatalf("the stream does not end with the error event: %q", last)
			}
			if want := expectedChat(t, "fail mid-stream", 0, 3); text != want {
				t.Fatalf("text before the failure %q, want %q", text, want)
			}
			s.idle()
			s.oneFailure("d1", "decode", c.kind, true)
			if hs := s.events.handoffs(); len(hs) != 0 {
				t.Fatalf("a consumed handoff was reported abandoned: %+v", hs)
			}
			reqs := s.events.requests()
			if len(reqs) != 1 || reqs[0].Status != 200 || reqs[0].ErrorKind != c.kind {
				t.Fatalf("request event %+v", reqs)
			}
			s.validEvents()
		})
	}
}

func TestConnectErrorRFAIL1(t *testing.T) {
	s := faultStack(t, nil)
	// The consumer dies after the router learnt its models.
	s.sims["d1"].Close()
	resp, body := s.post(schemas.EndpointChat, chatBody("nobody home", `"stream":true`))
	if resp.StatusCode != 502 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if e := errorBody(t, 502, body); !strings.HasPrefix(e.Message, "decode engine d1 unreachable") {
		t.Fatalf("message %q", e.Message)
	}
	s.idle()
	s.oneFailure("d1", "decode", "connect_error", true)
	// The producer's blocks will never be pulled: released and reported.
	hs := s.events.handoffs()
	if len(hs) != 1 || hs[0].Outcome != "abandoned" || hs[0].EngineID != "p1" || !hs[0].Released {
		t.Fatalf("handoff events %+v", hs)
	}
	s.validEvents()
}

func TestPrefillConnectErrorRFAIL1(t *testing.T) {
	s := faultStack(t, nil)
	s.sims["p1"].Close() // the producer dies after the router learnt its models
	resp, body := s.post(schemas.EndpointChat, chatBody("no producer", `"stream":true`))
	if resp.StatusCode != 502 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if e := errorBody(t, 502, body); !strings.HasPrefix(e.Message, "prefill engine p1 unreachable") {
		t.Fatalf("message %q", e.Message)
	}
	if n := s.decodeCalls(); n != 0 {
		t.Fatalf("decode called %d times after a failed prefill", n)
	}
	s.idle()
	s.oneFailure("p1", "prefill", "connect_error", true)
	s.validEvents()
}

func TestHandoffExpiredROWN2(t *testing.T) {
	// The producer takes ~100 ms; max age 50 ms counts from the start of
	// its HTTP leg, so the descriptor is already too old for decode.
	s := newStack(t, []engineDef{{id: "p1", role: "prefill", cfg: sim.Config{PrefillPerToken: 20 * millisecond}}, {id: "d1", role: "decode"}}, func(c *config.Config) {
		c.Handoff.MaxAgeS = 0.05
	})
	s.waitModels()
	resp, body := s.post(schemas.EndpointChat, chatBody("one two three four five", `"stream":true`))
	if resp.StatusCode != 504 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if e := errorBody(t, 504, body); !strings.HasPrefix(e.Message, "handoff expired") {
		t.Fatalf("message %q", e.Message)
	}
	if n := s.decodeCalls(); n != 0 {
		t.Fatalf("an expired descriptor was sent to decode (%d calls)", n)
	}
	s.idle()
	// Published, and not counted against either engine (docs/failures.md).
	s.oneFailure("p1", "decode", "handoff_expired", false)
	hs := s.events.handoffs()
	if len(hs) != 1 || hs[0].Reason != "handoff_expired" || !hs[0].Released || hs[0].AgeSeconds < 0.05 {
		t.Fatalf("handoff events %+v", hs)
	}
	if st := s.sims["p1"].Stats(); st.KVReleased != 1 || st.KVHeld != 0 {
		t.Fatalf("producer stats %+v", st)
	}
	s.validEvents()
}
