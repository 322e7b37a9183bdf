package router

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Tests of behaviour.md §7: one attempt by default (R-RETRY-1), fresh attempts
// before visible output (R-RETRY-2, R-RETRY-3, R-OWN-4), none after it
// (R-RETRY-4), the router-wide retry budget and the deadline, and the
// local half of quarantine (R-QUAR-1).

// phaseLegs returns the inference legs of phase ("prefill" or "decode")
// that srv recorded, oldest first; KV releases are not legs.
func phaseLegs(srv *sim.Server, phase string) []sim.RecordedRequest {
	var out []sim.RecordedRequest
	for _, r := range srv.Requests() {
		if r.Phase == phase {
			out = append(out, r)
		}
	}
	return out
}

// legCount counts the legs of phase recorded by every sim of the stack.
func (s *stack) legCount(phase string) int {
	n := 0
	for _, srv := range s.sims {
		n += len(phaseLegs(srv, phase))
	}
	return n
}

// legsOf returns, per engine id, the backend request ids of the legs of
// phase that belong to client request id (backend ids are derived from
// it, R-OWN-4).
func (s *stack) legsOf(phase, clientID string) map[string][]string {
	out := map[string][]string{}
	for id, srv := range s.sims {
		for _, r := range phaseLegs(srv, phase) {
			if strings.HasPrefix(r.RequestID, clientID+"-") {
				out[id] = append(out[id], r.RequestID)
			}
		}
	}
	return out
}

// metricSum sums the samples of the router's metric name whose labels
// include every name/value pair of match.
func (s *stack) metricSum(name string, match ...string) float64 {
	s.t.Helper()
	return testkit.GatheredSum(s.t, s.rt.Registry(), name, match...)
}

// requestEvent returns the request-completed event of client request id.
func (s *stack) requestEvent(id string) *schemas.RequestCompleted {
	s.t.Helper()
	for _, r := range s.events.requests() {
		if r.RequestID == id {
			return r
		}
	}
	s.t.Fatalf("no request event for %s", id)
	return nil
}

// armAll arms f on every listed engine.
func (s *stack) armAll(f sim.Fault, ids ...string) {
	for _, id := range ids {
		s.sims[id].Arm(f)
	}
}

// sseChunk is one data event of a client stream as the tests read it.
type sseChunk struct {
	ID      string `json:"id"`
	Choices []struct {
		Delta struct {
			Role    *string `json:"role"`
			Content string  `json:"content"`
		} `json:"delta"`
		Text         string  `json:"text"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Error *schemas.ErrorObject `json:"error"`
}

// parsedStream is a client SSE body taken apart.
type parsedStream struct {
	chunks []sseChunk // every JSON event, error events included
	text   string     // concatenated content / text deltas
	roles  int        // chunks carrying a delta role
	done   bool       // ended with [DONE]
	errors int        // error events
	last   *sseChunk  // the last JSON event
}

// parseStream reads an SSE body strictly: every event is JSON or the
// final [DONE]; nothing follows [DONE].
func parseStream(t *testing.T, b []byte) parsedStream {
	t.Helper()
	var p parsedStream
	var sb strings.Builder
	for _, ev := range sseEvents(b) {
		if p.done {
			t.Fatalf("data after [DONE]: %q in %s", ev, b)
		}
		if ev == "[DONE]" {
			p.done = true
			continue
		}
		var c sseChunk
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatalf("event %q is not JSON: %v", ev, err)
		}
		if c.Error != nil {
			p.errors++
		}
		for _, ch := range c.Choices {
			if ch.Delta.Role != nil {
				p.roles++
			}
			sb.WriteString(ch.Delta.Content)
			sb.WriteString(ch.Text)
		}
		p.chunks = append(p.chunks, c)
	}
	if n := len(p.chunks); n > 0 {
		p.last = &p.chunks[n-1]
	}
	p.text = sb.String()
	return p
}

// expectedText is what a sim generates for one user message (chat) or
// one prompt (completions).
func expectedText(t *testing.T, endpoint, content string, seed int64, maxTokens int) string {
	t.Helper()
	if endpoint == schemas.EndpointChat {
		return expectedChat(t, content, seed, maxTokens)
	}
	toks, _ := sim.Generate(content, seed, maxTokens, nil, false)
	return strings.Join(toks, "")
}

// requestBody builds a chat or completions body.
func requestBody(endpoint, content string, extra string) string {
	if endpoint == schemas.EndpointChat {
		return chatBody(content, extra)
	}
	b := fmt.Sprintf(`{"model":%q,"prompt":%q`, testModel, content)
	if extra != "" {
		b += "," + extra
	}
	return b + "}"
}

// retryStack is pd() with the given recovery settings and short engine
// timeouts.
func retryStack(t *testing.T, mutate func(*config.Config)) *stack {
	s := newStack(t, pd(), func(c *config.Config) {
		c.Engine.FirstTokenTimeoutS = 0.3
		c.Engine.DecodeReadTimeoutS = 0.3
		c.Engine.PrefillTimeoutS = 0.5
		if mutate != nil {
			mutate(c)
		}
	})
	s.waitModels()
	return s
}

// R-RETRY-1: with the default recovery settings a transient fault ends the
// request after exactly one attempt: one prefill leg, at most one decode
// leg, and the client gets the fault.
func TestOneAttemptByDefaultRRETRY1(t *testing.T) {
	cases := []struct {
		name     string
		fault    sim.Fault
		on       []string
		stream   bool
		status   int
		kind     engines.FaultKind
		decodes  int
		wantText string
	}{
		{"decode status 503", sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 503}, []string{"d1", "d2"}, false, 502, engines.KindUpstreamStatus, 1, ""},
		{"done before token", sim.Fault{Kind: sim.FaultDoneBeforeToken, Phase: sim.PhaseDecode}, []string{"d1", "d2"}, true, 502, engines.KindDoneBeforeToken, 1, engines.MsgDoneBeforeToken},
		{"first token delay", sim.Fault{Kind: sim.FaultFirstTokenDelay, Phase: sim.PhaseDecode, DelayMS: 2000}, []string{"d1", "d2"}, true, 504, engines.KindFirstTokenTimeout, 1, engines.MsgFirstTokenTimeout},
		{"prefill status 500", sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhasePrefill, Status: 500}, []string{"p1", "p2"}, true, 502, engines.KindPrefillStatus, 0, ""},
		{"prefill connection closed", sim.Fault{Kind: sim.FaultClose, Phase: sim.PhasePrefill}, []string{"p1", "p2"}, false, 502, engines.KindPrefillResponse, 0, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := retryStack(t, nil)
			if s.cfg.Recovery.RetryAttempts != 0 {
				t.Fatalf("default retry_attempts %d", s.cfg.Recovery.RetryAttempts)
			}
			s.armAll(tc.fault, tc.on...)
			extra := `"max_tokens":8`
			if tc.stream {
				extra += `,"stream":true`
			}
			resp, body := s.post(schemas.EndpointChat, chatBody("one attempt", extra), "X-Request-Id", "once")
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.status, body)
			}
			var e schemas.ErrorResponse
			if err := json.Unmarshal(body, &e); err != nil || e.Error.Code != tc.status || !strings.HasPrefix(e.Error.Message, tc.wantText) {
				t.Fatalf("error body %s", body)
			}
			s.idle()
			if n := s.legCount(sim.PhasePrefill); n != 1 {
				t.Fatalf("%d prefill legs, want 1", n)
			}
			if n := s.legCount(sim.PhaseDecode); n != tc.decodes {
				t.Fatalf("%d decode legs, want %d", n, tc.decodes)
			}
			ev := s.requestEvent("once")
			if ev.Attempts != 1 || ev.ErrorKind != string(tc.kind) || ev.Status != tc.status {
				t.Fatalf("request event %+v", ev)
			}
			if n := s.metricSum("narwhal_retries_total"); n != 0 {
				t.Fatalf("%v retries", n)
			}
		})
	}
}

// R-RETRY-2, R-RETRY-3, R-RETRY-4, R-OWN-4, R-OWN-6: with retries on and
// one faulty decode engine every request succeeds with exactly the output
// the model generates, from one attempt's stream only; a request that met
// the faulty engine first was retried once, with a fresh backend id, a new
// prefill (new descriptor) and the other decode engine.
func TestRetryBeforeOutputRRETRY2(t *testing.T) {
	cases := []struct {
		name       string
		fault      sim.Fault
		kind       engines.FaultKind
		released   bool    // the producer still held the blocks when the attempt failed
		firstToken float64 // engine.first_token_timeout_s
	}{
		{"done before token", sim.Fault{Kind: sim.FaultDoneBeforeToken, Phase: sim.PhaseDecode}, engines.KindDoneBeforeToken, false, 1},
		{"status 503", sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 503}, engines.KindUpstreamStatus, true, 1},
		{"first token delay", sim.Fault{Kind: sim.FaultFirstTokenDelay, Phase: sim.PhaseDecode, DelayMS: 3000, IntervalMS: 20}, engines.KindFirstTokenTimeout, false, 0.1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := retryStack(t, func(c *config.Config) {
				c.Recovery.RetryAttempts = 2
				c.Recovery.RetryBudgetRatio = 1
				c.Engine.FirstTokenTimeoutS = tc.firstToken
			})
			s.sims["d1"].Arm(tc.fault)
			const n = 20
			retried := 0
			for i := 0; i < n; i++ {
				endpoint := schemas.EndpointChat
				if i%2 == 1 {
					endpoint = schemas.EndpointCompletions
				}
				id := fmt.Sprintf("retry-%02d", i)
				content := "retried prompt " + id
				resp, body := s.post(endpoint, requestBody(endpoint, content, `"stream":true,"max_tokens":10,"seed":7`), "X-Request-Id", id)
				if resp.StatusCode != 200 {
					t.Fatalf("%s: status %d: %s", id, resp.StatusCode, body)
				}
				p := parseStream(t, body)
				if !p.done || p.errors != 0 {
					t.Fatalf("%s: done=%v errors=%d: %s", id, p.done, p.errors, body)
				}
				if want := expectedText(t, endpoint, content, 7, 10); p.text != want {
					t.Fatalf("%s: text %q, want %q (duplicated or spliced output)", id, p.text, want)
				}
				wantRoles := 0
				if endpoint == schemas.EndpointChat {
					wantRoles = 1
				}
				if p.roles != wantRoles {
					t.Fatalf("%s: %d role chunks, want %d: %s", id, p.roles, wantRoles, body)
				}
				s.idle()
				decodes := s.legsOf(sim.PhaseDecode, id)
				prefills := s.legsOf(sim.PhasePrefill, id)
				var prefillIDs []string
				for _, ids := range prefills {
					prefillIDs = append(prefillIDs, ids...)
				}
				ev := s.requestEvent(id)
				ok := decodes["d2"]
				if len(ok) != 1 {
					t.Fatalf("%s: d2 served decode legs %v, want exactly one", id, ok)
				}
				// Every chunk the client saw comes from the successful
				// attempt's stream (the sim names chunks after the backend id).
				for _, c := range p.chunks {
					if !strings.HasSuffix(c.ID, ok[0]) {
						t.Fatalf("%s: chunk id %q, want the last attempt's %q", id, c.ID, ok[0])
					}
				}
				switch failed := decodes["d1"]; len(failed) {
				case 0:
					if ev.Attempts != 1 || len(ok) != 1 || len(prefillIDs) != 1 || prefillIDs[0] != ok[0] {
						t.Fatalf("%s: no fault, yet attempts %d, decodes %v, prefills %v", id, ev.Attempts, decodes, prefills)
					}
				case 1:
					retried++
					// R-RETRY-3: the retry went to the other decode engine;
					// R-OWN-4: with a fresh backend id on both of its legs
					// and a fresh prefill.
					if ev.Attempts != 2 || len(ok) != 1 || ok[0] == failed[0] || ok[0] == id || failed[0] == id {
						t.Fatalf("%s: attempts %d, decode legs %v", id, ev.Attempts, decodes)
					}
					if len(prefillIDs) != 2 || !(prefillIDs[0] == failed[0] && prefillIDs[1] == ok[0] || prefillIDs[1] == failed[0] && prefillIDs[0] == ok[0]) {
						t.Fatalf("%s: prefill legs %v, want one per attempt (%s, %s)", id, prefills, failed[0], ok[0])
					}
					// A retry never reuses a descriptor: the second decode
					// names the blocks of the second prefill.
					d1 := descriptorOf(t, s.sims["d1"], failed[0])
					d2 := descriptorOf(t, s.sims["d2"], ok[0])
					if d1.RequestID == d2.RequestID || !strings.HasSuffix(d2.RequestID, ok[0]) {
						t.Fatalf("%s: descriptor reused: first %+v, retry %+v", id, d1, d2)
					}
				default:
					t.Fatalf("%s: the faulty engine served %d decode legs of one request: %v", id, len(failed), failed)
				}
			}
			if retried == 0 {
				t.Fatal("no request met the faulty engine first")
			}
			// One failure event per failed attempt, all on d1, first attempts.
			fails := s.events.failures()
			if len(fails) != retried {
				t.Fatalf("%d failure events, want %d", len(fails), retried)
			}
			for _, f := range fails {
				if f.EngineID != "d1" || f.Phase != schemas.PhaseDecode || f.Kind != string(tc.kind) || f.Attempt != 1 || !f.Counts {
					t.Fatalf("failure event %+v", f)
				}
			}
			// R-OWN-6: each failed attempt's handoff was abandoned, and
			// released where the producer still held it.
			hs := s.events.handoffs()
			if len(hs) != retried {
				t.Fatalf("%d handoff events, want %d", len(hs), retried)
			}
			for _, h := range hs {
				if h.Outcome != schemas.HandoffAbandoned || h.ConsumerID != "d1" || h.Released != tc.released {
					t.Fatalf("handoff event %+v", h)
				}
			}
			var held int64
			for _, id := range []string{"p1", "p2"} {
				held += s.sims[id].Stats().KVHeld
			}
			if held != 0 {
				t.Fatalf("producers still hold %d handoffs", held)
			}
			if got := s.metricSum("narwhal_retries_total"); got != float64(retried) {
				t.Fatalf("narwhal_retries_total %v, want %d", got, retried)
			}
		})
	}
}

// kvDescriptor is the part of a nixl descriptor the tests compare.
type kvDescriptor struct {
	EngineID  string `json:"remote_engine_id"`
	RequestID string `json:"remote_request_id"`
}

// descriptorOf returns the kv_transfer_params of the decode leg srv
// recorded with backend id.
func descriptorOf(t *testing.T, srv *sim.Server, backendID string) kvDescriptor {
	t.Helper()
	for _, r := range phaseLegs(srv, sim.PhaseDecode) {
		if r.RequestID != backendID {
			continue
		}
		var body struct {
			KV *kvDescriptor `json:"kv_transfer_params"`
		}
		if err := json.Unmarshal(r.Body, &body); err != nil || body.KV == nil || body.KV.RequestID == "" {
			t.Fatalf("decode leg %s carries no descriptor: %s", backendID, r.Body)
		}
		return *body.KV
	}
	t.Fatalf("no decode leg %s", backendID)
	return kvDescriptor{}
}

// R-RETRY-4, R-FAIL-5: a fault after visible output is never retried: the
// client keeps what it got, then one terminal error event and no [DONE].
func TestNoRetryAfterOutputRRETRY4(t *testing.T) {
	cases := []struct {
		name   string
		fault  sim.Fault
		kind   engines.FaultKind
		status int
	}{
		{"close", sim.Fault{Kind: sim.FaultClose, Phase: sim.PhaseDecode, AfterTokens: 3}, engines.KindClosedBeforeDone, 502},
		{"abort", sim.Fault{Kind: sim.FaultAbort, Phase: sim.PhaseDecode, AfterTokens: 3}, engines.KindClosedBeforeDone, 502},
		{"silence", sim.Fault{Kind: sim.FaultSilence, Phase: sim.PhaseDecode, AfterTokens: 3}, engines.KindMidStreamSilence, 504},
		{"error object", sim.Fault{Kind: sim.FaultErrorObject, Phase: sim.PhaseDecode, AfterTokens: 3, Status: 503}, engines.KindErrorObject, 503},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := retryStack(t, func(c *config.Config) {
				c.Recovery.RetryAttempts = 3
				c.Recovery.RetryBudgetRatio = 1
			})
			s.armAll(tc.fault, "d1", "d2")
			resp, body := s.post(schemas.EndpointChat, chatBody("no retry after output", `"stream":true,"max_tokens":12`), "X-Request-Id", "late")
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			p := parseStream(t, body)
			if p.done || p.errors != 1 || p.last.Error == nil || p.last.Error.Code != tc.status || p.last.Error.Message == "" || p.last.Error.Type == "" {
				t.Fatalf("want one terminal error event with code %d and no [DONE]: %s", tc.status, body)
			}
			toks, _ := sim.Generate(mustRender(t, "no retry after output"), 0, 12, nil, false)
			if want := strings.Join(toks[:3], ""); p.text != want {
				t.Fatalf("text %q, want the first 3 tokens %q", p.text, want)
			}
			s.idle()
			if n := s.legCount(sim.PhaseDecode); n != 1 {
				t.Fatalf("%d decode legs, want 1", n)
			}
			if n := s.legCount(sim.PhasePrefill); n != 1 {
				t.Fatalf("%d prefill legs, want 1", n)
			}
			ev := s.requestEvent("late")
			if ev.Attempts != 1 || ev.ErrorKind != string(tc.kind) {
				t.Fatalf("request event %+v", ev)
			}
			if fs := s.events.failures(); len(fs) != 1 || fs[0].Kind != string(tc.kind) {
				t.Fatalf("failure events %+v", fs)
			}
			if n := s.metricSum("narwhal_retries_total"); n != 0 {
				t.Fatalf("%v retries", n)
			}
		})
	}
}

func mustRender(t *testing.T, content string) string {
	t.Helper()
	msgs, _ := json.Marshal([]map[string]string{{"role": "user", "content": content}})
	p, err := sim.RenderChat(msgs)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// R-RETRY-2: the router-wide budget caps retries at
// recovery.retry_budget_ratio of recent requests (with a floor of 3 in a
// quiet window) so that an outage does not multiply the load on engines.
func TestRetryBudgetRRETRY2(t *testing.T) {
	t.Run("ratio 0.2", func(t *testing.T) {
		s := retryStack(t, func(c *config.Config) {
			c.Recovery.RetryAttempts = 3
			c.Recovery.RetryBudgetRatio = 0.2
		})
		s.armAll(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500}, "d1", "d2")
		const n = 60
		for i := 0; i < n; i++ {
			resp, body := s.post(schemas.EndpointChat, chatBody(fmt.Sprintf("outage %d", i), `"max_tokens":4`))
			if resp.StatusCode != 502 {
				t.Fatalf("request %d: status %d: %s", i, resp.StatusCode, body)
			}
		}
		s.idle()
		decodes := s.legCount(sim.PhaseDecode)
		// Without a budget: n×4 legs. With it: every request once, plus at
		// most ratio×n retries, plus the floor.
		if limit := n + n/5 + 3; decodes > limit || decodes <= n {
			t.Fatalf("%d decode legs for %d requests, want more than %d and at most %d", decodes, n, n, limit)
		}
		retries := s.metricSum("narwhal_retries_total")
		if int(retries) != decodes-n {
			t.Fatalf("narwhal_retries_total %v, want %d", retries, decodes-n)
		}
		if d := s.metricSum("narwhal_retries_denied_total", "reason", "budget"); d == 0 {
			t.Fatal("no retry denied by the budget")
		}
		attempts := 0
		for _, ev := range s.events.requests() {
			attempts += ev.Attempts
		}
		if attempts != decodes {
			t.Fatalf("request events count %d attempts, engines saw %d decode legs", attempts, decodes)
		}
		t.Logf("%d requests, %d decode legs, %v retries denied by the budget", n, decodes, s.metricSum("narwhal_retries_denied_total", "reason", "budget"))
	})
	t.Run("ratio 0", func(t *testing.T) {
		s := retryStack(t, func(c *config.Config) {
			c.Recovery.RetryAttempts = 3
			c.Recovery.RetryBudgetRatio = 0
		})
		s.armAll(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500}, "d1", "d2")
		const n = 10
		for i := 0; i < n; i++ {
			if resp, body := s.post(schemas.EndpointChat, chatBody(fmt.Sprintf("no budget %d", i), `"max_tokens":4`)); resp.StatusCode != 502 {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
		}
		s.idle()
		if d := s.legCount(sim.PhaseDecode); d != n {
			t.Fatalf("%d decode legs for %d requests: ratio 0 must allow no retry", d, n)
		}
		if d := s.metricSum("narwhal_retries_denied_total", "reason", "budget"); d != n {
			t.Fatalf("%v retries denied by the budget, want %d", d, n)
		}
	})
}

// R-RETRY-2, R-TMO-5: a retry needs room in the original deadline. The
// decode engines answer 503 after 100 ms; a deadline of 110 ms (from the
// config or from the client's X-Request-Timeout) leaves under 10 ms, so
// the fault is not retried although retries and budget remain.
func TestRetryNeedsDeadlineRRETRY2(t *testing.T) {
	cases := []struct {
		name   string
		mutate func(*config.Config)
		header []string
	}{
		{"request.timeout_s", func(c *config.Config) { c.Request.TimeoutS = 0.11 }, nil},
		{"X-Request-Timeout", nil, []string{"X-Request-Timeout", "0.11"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := retryStack(t, func(c *config.Config) {
				c.Recovery.RetryAttempts = 3
				c.Recovery.RetryBudgetRatio = 1
				c.Engine.FirstTokenTimeoutS = 5
				if tc.mutate != nil {
					tc.mutate(c)
				}
			})
			s.armAll(sim.Fault{Kind: sim.FaultHeaderDelay, Phase: sim.PhaseDecode, DelayMS: 100}, "d1", "d2")
			s.armAll(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 503}, "d1", "d2")
			// The 503 must come back before the deadline for the retry
			// decision to be the router's; a loaded machine may miss the
			// window now and then, so a few tries are allowed.
			for try := 0; try < 5; try++ {
				id := fmt.Sprintf("deadline-%d", try)
				resp, body := s.post(schemas.EndpointChat, chatBody("tight deadline", `"max_tokens":4`), append([]string{"X-Request-Id", id}, tc.header...)...)
				s.idle()
				ev := s.requestEvent(id)
				if ev.Attempts != 1 {
					t.Fatalf("attempts %d: a retry started with the deadline spent (%d %s)", ev.Attempts, resp.StatusCode, body)
				}
				if n := len(s.legsOf(sim.PhaseDecode, id)["d1"]) + len(s.legsOf(sim.PhaseDecode, id)["d2"]); n != 1 {
					t.Fatalf("%d decode legs", n)
				}
				switch ev.ErrorKind {
				case string(engines.KindUpstreamStatus):
					if resp.StatusCode != 502 {
						t.Fatalf("status %d: %s", resp.StatusCode, body)
					}
					if d := s.metricSum("narwhal_retries_denied_total", "reason", "deadline"); d != 1 {
						t.Fatalf("retries denied for the deadline %v, want 1", d)
					}
					return
				case string(engines.KindRequestTimeout):
					if resp.StatusCode != 504 {
						t.Fatalf("status %d: %s", resp.StatusCode, body)
					}
				default:
					t.Fatalf("outcome %s (%d %s)", ev.ErrorKind, resp.StatusCode, body)
				}
			}
			t.Fatal("the engine's 503 never came back within the deadline")
		})
	}
}

// R-QUAR-1 (the local half): with recovery.failure_quarantine_s set, an
// engine that failed an attempt leaves this router's placement at once,
// for that long, and a quarantine event says so; with 0 (the default) it
// keeps getting traffic.
func TestLocalQuarantineRQUAR1(t *testing.T) {
	run := func(t *testing.T, quarantine float64, fault sim.Fault) (*stack, int) {
		s := retryStack(t, func(c *config.Config) { c.Recovery.FailureQuarantineS = quarantine })
		s.sims["d1"].Arm(fault)
		// Send the first request to d1: the breaker's verdict keeps d2 out
		// of placement for that one request.
		s.rt.SetEligible("d2", false)
		resp, body := s.post(schemas.EndpointChat, chatBody("meet the fault", `"max_tokens":4`))
		if resp.StatusCode < 400 {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		s.rt.SetEligible("d2", true)
		before := len(phaseLegs(s.sims["d1"], sim.PhaseDecode))
		if before != 1 {
			t.Fatalf("d1 served %d decode legs, want 1", before)
		}
		for i := 0; i < 20; i++ {
			if resp, body := s.post(schemas.EndpointChat, chatBody(fmt.Sprintf("after %d", i), `"max_tokens":4`)); resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
		}
		s.idle()
		return s, len(phaseLegs(s.sims["d1"], sim.PhaseDecode)) - before
	}
	t.Run("quarantined", func(t *testing.T) {
		start := time.Now()
		s, after := run(t, 5, sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500, Count: 1})
		if after != 0 {
			t.Fatalf("d1 served %d of the next 20 requests while quarantined", after)
		}
		var qs []*schemas.Quarantine
		s.events.mu.Lock()
		for _, ev := range s.events.all {
			if q, ok := ev.(*schemas.Quarantine); ok {
				qs = append(qs, q)
			}
		}
		s.events.mu.Unlock()
		if len(qs) != 1 {
			t.Fatalf("%d quarantine events, want 1", len(qs))
		}
		q := qs[0]
		if q.EngineID != "d1" || q.DurationSeconds != 5 || q.Reason != string(engines.KindUpstreamStatus) || q.RouterID != s.rt.ID() ||
			q.Until.Before(start.Add(5*time.Second)) || q.Until.After(time.Now().Add(5*time.Second)) {
			t.Fatalf("quarantine event %+v", q)
		}
		if n := s.metricSum("narwhal_engine_available", "engine", "d1"); n != 0 {
			t.Fatalf("narwhal_engine_available{engine=d1} %v while quarantined", n)
		}
	})
	t.Run("off by default", func(t *testing.T) {
		_, after := run(t, 0, sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500, Count: 1})
		if after == 0 {
			t.Fatal("d1 got none of the next 20 requests although quarantine is off")
		}
	})
	t.Run("overload is not a failure", func(t *testing.T) {
		s, after := run(t, 5, sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 429, Count: 1})
		if after == 0 {
			t.Fatal("a 429 quarantined d1")
		}
		if n := s.metricSum("narwhal_quarantines_total"); n != 0 {
			t.Fatalf("%v quarantines after a 429", n)
		}
	})
}

// TestRetryAvoidsTheFailedProducerRRETRY3 is R-RETRY-3 for the prefill
// phase: a retry after a prefill fault never goes back to the producer that
// failed while another is eligible.
func TestRetryAvoidsTheFailedProducerRRETRY3(t *testing.T) {
	s := newStack(t, pd(), func(c *config.Config) {
		c.Recovery.RetryAttempts = 2
		c.Recovery.RetryBudgetRatio = 1 // the budget is not what this test is about
	})
	s.waitModels()
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhasePrefill, Status: 503})
	retried := 0
	for i := 0; i < 20; i++ {
		id := fmt.Sprintf("prefill-retry-%d", i)
		resp, body := s.post(schemas.EndpointChat, chatBody("avoid p1", `"stream":true,"max_tokens":3`), "X-Request-Id", id)
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
		legs := s.legsOf("prefill", id)
		if n := len(legs["p1"]); n > 1 {
			t.Fatalf("request %d went back to the failed producer: %v", i, legs)
		}
		if len(legs["p1"]) == 1 {
			retried++
			if len(legs["p2"]) != 1 {
				t.Fatalf("request %d: after p1 failed, prefills %v", i, legs)
			}
		}
	}
	if retried == 0 {
		t.Fatal("no request was placed on p1 first: the test proved nothing")
	}
	t.Logf("%d of 20 requests retried away from p1", retried)
}
