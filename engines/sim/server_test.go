package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestChatStreamShapes checks a chat stream chunk by chunk against
// vLLM's "Streaming response" shape (R-API-1 include_usage, R-LEG-5):
// the role chunk, one content delta per token, the finish chunk with an
// empty delta, the usage-only chunk with "choices":[], then [DONE].
func TestChatStreamShapes(t *testing.T) {
	_, url := startEngine(t, Config{})
	c := newClient(t)
	evs := streamEvents(t, c, url+"/v1/chat/completions",
		chatBody("hello there", "stream", true, "stream_options", map[string]any{"include_usage": true}, "max_tokens", 5, "ignore_eos", true, "seed", 4),
		"X-Request-Id", "req-1")
	want, finish := Generate(chatPrompt(t, "hello there"), 4, 5, nil, true)
	if len(evs) != 1+len(want)+3 {
		t.Fatalf("got %d events, want %d: %v", len(evs), len(want)+4, evs)
	}
	first := decodeChunk(t, evs[0])
	head := fmt.Sprintf(`{"id":"chatcmpl-req-1","object":"chat.completion.chunk","created":%d,"model":"m","choices":[`, first.Created)
	exact := func(i int, rest string) {
		t.Helper()
		if evs[i].data != head+rest {
			t.Fatalf("event %d:\n got %s\nwant %s", i, evs[i].data, head+rest)
		}
	}
	exact(0, `{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`)
	for i, tok := range want {
		exact(1+i, `{"index":0,"delta":{"content":"`+tok+`"},"logprobs":null,"finish_reason":null}]}`)
	}
	exact(1+len(want), `{"index":0,"delta":{},"logprobs":null,"finish_reason":"`+finish+`"}]}`)
	p := PromptTokens(chatPrompt(t, "hello there"))
	exact(2+len(want), fmt.Sprintf(`],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":0}}}`, p, len(want), p+len(want)))
	if !evs[len(evs)-1].done() {
		t.Fatalf("last event %q, want [DONE]", evs[len(evs)-1].data)
	}
}

// TestCompletionsStreamShapes: /v1/completions chunks are text_completion
// objects with choices[].text; no role chunk; usage and [DONE] as in chat.
func TestCompletionsStreamShapes(t *testing.T) {
	_, url := startEngine(t, Config{})
	c := newClient(t)
	evs := streamEvents(t, c, url+"/v1/completions",
		completionBody("once upon a time", "stream", true, "stream_options", map[string]any{"include_usage": true}, "max_tokens", 6, "ignore_eos", true),
		"X-Request-Id", "r2")
	want, _ := Generate("once upon a time", 0, 6, nil, true)
	if len(evs) != len(want)+3 {
		t.Fatalf("got %d events, want %d", len(evs), len(want)+3)
	}
	first := decodeChunk(t, evs[0])
	head := fmt.Sprintf(`{"id":"cmpl-r2","object":"text_completion","created":%d,"model":"m","choices":[`, first.Created)
	for i, tok := range want {
		if w := head + `{"index":0,"text":"` + tok + `","logprobs":null,"finish_reason":null}]}`; evs[i].data != w {
			t.Fatalf("event %d:\n got %s\nwant %s", i, evs[i].data, w)
		}
	}
	if w := head + `{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]}`; evs[len(want)].data != w {
		t.Fatalf("finish chunk:\n got %s\nwant %s", evs[len(want)].data, w)
	}
	u := decodeChunk(t, evs[len(want)+1])
	if u.Usage == nil || len(u.Choices) != 0 || u.Usage.PromptTokens != 4 || u.Usage.CompletionTokens != 6 || u.Usage.TotalTokens != 10 {
		t.Fatalf("usage chunk %s", evs[len(want)+1].data)
	}
	if !evs[len(evs)-1].done() {
		t.Fatal("stream does not end with [DONE]")
	}
}

// TestStreamWithoutUsage: without include_usage there is no usage chunk.
func TestStreamWithoutUsage(t *testing.T) {
	_, url := startEngine(t, Config{})
	c := newClient(t)
	evs := streamEvents(t, c, url+"/v1/chat/completions", chatBody("hi", "stream", true, "max_tokens", 3, "ignore_eos", true))
	for _, ev := range evs {
		if strings.Contains(ev.data, `"usage"`) {
			t.Fatalf("usage chunk without include_usage: %s", ev.data)
		}
	}
	if len(evs) != 1+3+1+1 {
		t.Fatalf("got %d events", len(evs))
	}
}

// TestUnaryShapes checks non-streaming chat and completions bodies
// (vLLM's "Prefill response" shape, kv_transfer_params null for a
// plain request).
func TestUnaryShapes(t *testing.T) {
	_, url := startEngine(t, Config{})
	c := newClient(t)
	resp := post(t, c, url+"/v1/chat/completions", chatBody("hello there", "max_completion_tokens", 3, "ignore_eos", true), "X-Request-Id", "u1")
	body := readBody(t, resp)
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" || resp.Header.Get("X-Request-Id") != "u1" {
		t.Fatalf("status %d headers %v", resp.StatusCode, resp.Header)
	}
	want, _ := Generate(chatPrompt(t, "hello there"), 0, 3, nil, true)
	var created struct{ Created int64 }
	_ = json.Unmarshal(body, &created)
	exp := fmt.Sprintf(`{"id":"chatcmpl-u1","object":"chat.completion","created":%d,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"%s"},"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6,"prompt_tokens_details":{"cached_tokens":0}},"kv_transfer_params":null}`,
		created.Created, strings.Join(want, ""))
	if string(body) != exp {
		t.Fatalf("chat body\n got %s\nwant %s", body, exp)
	}

	resp = post(t, c, url+"/v1/completions", completionBody("a b", "max_tokens", 2, "ignore_eos", true), "X-Request-Id", "u2")
	body = readBody(t, resp)
	want, _ = Generate("a b", 0, 2, nil, true)
	_ = json.Unmarshal(body, &created)
	exp = fmt.Sprintf(`{"id":"cmpl-u2","object":"text_completion","created":%d,"model":"m","choices":[{"index":0,"text":"%s","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4,"prompt_tokens_details":{"cached_tokens":0}},"kv_transfer_params":null}`,
		created.Created, strings.Join(want, ""))
	if string(body) != exp {
		t.Fatalf("completions body\n got %s\nwant %s", body, exp)
	}
}

// TestStreamMatchesGenerate: streamed tokens are exactly Generate's, for
// every choice of n > 1 (seed+j), with stop strings, a list prompt, and
// max_completion_tokens winning over max_tokens on chat.
func TestStreamMatchesGenerate(t *testing.T) {
	_, url := startEngine(t, Config{})
	c := newClient(t)
	prompt := chatPrompt(t, "tell me about the sea")
	full, _ := Generate(prompt, 11, 20, nil, true)
	stop := strings.TrimSpace(full[5])
	evs := streamEvents(t, c, url+"/v1/chat/completions", chatBody("tell me about the sea",
		"stream", true, "n", 3, "seed", 11, "max_tokens", 99, "max_completion_tokens", 20, "stop", stop, "ignore_eos", true))
	finishes := map[int]string{}
	for _, ev := range evs {
		if ev.done() {
			continue
		}
		for _, ch := range decodeChunk(t, ev).Choices {
			if ch.FinishReason != nil {
				finishes[ch.Index] = *ch.FinishReason
			}
		}
	}
	for j := range 3 {
		want, finish := Generate(prompt, 11+int64(j), 20, []string{stop}, true)
		if got := tokensOf(t, evs, j); !slices.Equal(got, want) {
			t.Errorf("choice %d: tokens %q, want %q", j, got, want)
		}
		if finishes[j] != finish {
			t.Errorf("choice %d: finish %q, want %q", j, finishes[j], finish)
		}
	}
	// Choice 0 stops at the stop string found in its 20-token output.
	if want, finish := Generate(prompt, 11, 20, []string{stop}, true); finish != FinishStop || strings.Contains(strings.Join(want, ""), stop) {
		t.Fatalf("stop string %q did not stop choice 0: %q %s", stop, want, finish)
	}

	evs = streamEvents(t, c, url+"/v1/completions", completionBody("", "prompt", []string{"list prompt"}, "stream", true, "max_tokens", 7, "seed", -3))
	want, _ := Generate("list prompt", -3, 7, nil, false)
	if got := tokensOf(t, evs, 0); !slices.Equal(got, want) {
		t.Fatalf("completions tokens %q, want %q", got, want)
	}
}

// TestDefaultMaxTokens: without max_tokens a request generates at most 16.
func TestDefaultMaxTokens(t *testing.T) {
	_, url := startEngine(t, Config{})
	c := newClient(t)
	evs := streamEvents(t, c, url+"/v1/completions", completionBody("defaults", "stream", true, "ignore_eos", true))
	if got := tokensOf(t, evs, 0); len(got) != DefaultMaxTokens {
		t.Fatalf("%d tokens, want %d", len(got), DefaultMaxTokens)
	}
}

// TestLogprobs: chat logprobs with top_logprobs per token, and completions
// logprobs=k, both streamed and not.
func TestLogprobs(t *testing.T) {
	_, url := startEngine(t, Config{})
	c := newClient(t)
	evs := streamEvents(t, c, url+"/v1/chat/completions", chatBody("lp", "stream", true, "max_tokens", 3, "ignore_eos", true, "logprobs", true, "top_logprobs", 2))
	want, _ := Generate(chatPrompt(t, "lp"), 0, 3, nil, true)
	n := 0
	for _, ev := range evs[1:] {
		if ev.done() {
			continue
		}
		ch := decodeChunk(t, ev)
		if tok, ok := ch.contentOf(); ok {
			var lp struct {
				Content []struct {
					Token       string  `json:"token"`
					Logprob     float64 `json:"logprob"`
					Bytes       []int   `json:"bytes"`
					TopLogprobs []struct {
						Token   string  `json:"token"`
						Logprob float64 `json:"logprob"`
					} `json:"top_logprobs"`
				} `json:"content"`
			}
			if err := json.Unmarshal(ch.Choices[0].Logprobs, &lp); err != nil || len(lp.Content) != 1 {
				t.Fatalf("logprobs %s: %v", ch.Choices[0].Logprobs, err)
			}
			e := lp.Content[0]
			if e.Token != tok || e.Token != want[n] || e.Logprob >= 0 || len(e.Bytes) != len(tok) || len(e.TopLogprobs) != 2 || e.TopLogprobs[0].Token != tok || e.TopLogprobs[1].Logprob >= e.Logprob {
				t.Fatalf("logprob entry %+v for token %q", e, tok)
			}
			n++
		} else if ch.Choices[0].FinishReason == nil || string(ch.Choices[0].Logprobs) != "null" {
			t.Fatalf("metadata chunk with logprobs: %s", ev.data)
		}
	}
	if n != 3 {
		t.Fatalf("%d token chunks", n)
	}

	resp := post(t, c, url+"/v1/completions", completionBody("lp", "max_tokens", 4, "ignore_eos", true, "logprobs", 3))
	var out struct {
		Choices []struct {
			Text     string `json:"text"`
			Logprobs struct {
				TextOffset    []int                `json:"text_offset"`
				TokenLogprobs []float64            `json:"token_logprobs"`
				Tokens        []string             `json:"tokens"`
				TopLogprobs   []map[string]float64 `json:"top_logprobs"`
			} `json:"logprobs"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(readBody(t, resp), &out); err != nil {
		t.Fatal(err)
	}
	lp := out.Choices[0].Logprobs
	want, _ = Generate("lp", 0, 4, nil, true)
	if !slices.Equal(lp.Tokens, want) || len(lp.TokenLogprobs) != 4 || len(lp.TopLogprobs) != 4 || len(lp.TopLogprobs[0]) != 3 {
		t.Fatalf("completions logprobs %+v", lp)
	}
	off := 0
	for i, tok := range want {
		if lp.TextOffset[i] != off || lp.TopLogprobs[i][tok] != lp.TokenLogprobs[i] {
			t.Fatalf("token %d: offset %d (want %d), top %v", i, lp.TextOffset[i], off, lp.TopLogprobs[i])
		}
		off += len(tok)
	}
}

// TestToolCallStream: tool_choice "required" streams one tool call — a
// header delta with id, type and name and empty arguments, then argument
// pieces — and finishes with "tool_calls"; a named function works the same
// way and the non-streaming message carries the assembled call.
func TestToolCallStream(t *testing.T) {
	_, url := startEngine(t, Config{})
	c := newClient(t)
	tools := []map[string]any{
		{"type": "function", "function": map[string]any{"name": "get_weather", "parameters": map[string]any{"type": "object"}}},
		{"type": "function", "function": map[string]any{"name": "get_time"}},
	}
	for _, choice := range []any{"required", map[string]any{"type": "function", "function": map[string]any{"name": "get_time"}}} {
		evs := streamEvents(t, c, url+"/v1/chat/completions", chatBody("weather?", "stream", true, "max_tokens", 5, "ignore_eos", true, "tools", tools, "tool_choice", choice))
		wantName := "get_weather"
		if _, ok := choice.(string); !ok {
			wantName = "get_time"
		}
		toks, _ := Generate(chatPrompt(t, "weather?"), 0, 5, nil, true)
		var args strings.Builder
		var header *toolCallDelta
		finish := ""
		for _, ev := range evs[1:] {
			if ev.done() {
				continue
			}
			ch := decodeChunk(t, ev).Choices[0]
			if ch.FinishReason != nil {
				finish = *ch.FinishReason
				continue
			}
			if len(ch.Delta.ToolCalls) != 1 {
				t.Fatalf("chunk without one tool call: %s", ev.data)
			}
			tc := ch.Delta.ToolCalls[0]
			if header == nil {
				header = &tc
				if tc.ID == nil || !strings.HasPrefix(*tc.ID, "chatcmpl-tool-") || tc.Type == nil || *tc.Type != "function" || tc.Function.Name == nil || *tc.Function.Name != wantName || tc.Function.Arguments == nil || *tc.Function.Arguments != "" {
					t.Fatalf("tool call header %s", ev.data)
				}
				continue
			}
			if tc.ID != nil || tc.Function.Name != nil {
				t.Fatalf("argument delta repeats id or name: %s", ev.data)
			}
			args.WriteString(*tc.Function.Arguments)
		}
		wantArgs := `{"input":"` + strings.Join(toks, "") + `"}`
		if args.String() != wantArgs || finish != FinishToolCalls {
			t.Fatalf("arguments %q finish %q, want %q tool_calls", args.String(), finish, wantArgs)
		}
		if !json.Valid([]byte(args.String())) {
			t.Fatal("arguments are not JSON")
		}
	}

	resp := post(t, c, url+"/v1/chat/completions", chatBody("weather?", "max_tokens", 5, "ignore_eos", true, "tools", tools, "tool_choice", "required"))
	var out struct {
		Choices []struct {
			Message struct {
				Content   *string `json:"content"`
				ToolCalls []struct {
					ID       string `json:"id"`
					Type     string `json:"type"`
					Function struct {
						Name      string `json:"name"`
						Arguments string `json:"arguments"`
					} `json:"function"`
				} `json:"tool_calls"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(readBody(t, resp), &out); err != nil {
		t.Fatal(err)
	}
	toks, _ := Generate(chatPrompt(t, "weather?"), 0, 5, nil, true)
	m := out.Choices[0].Message
	if m.Content != nil || len(m.ToolCalls) != 1 || m.ToolCalls[0].Function.Name != "get_weather" || m.ToolCalls[0].Function.Arguments != `{"input":"`+strings.Join(toks, "")+`"}` || out.Choices[0].FinishReason != FinishToolCalls {
		t.Fatalf("unary tool call %+v", out.Choices[0])
	}
}

// TestRequestErrors: refused requests get vLLM's error body with the same
// status (R-API-3): 404 for another model, 400 for invalid input.
func TestRequestErrors(t *testing.T) {
	s, url := startEngine(t, Config{})
	c := newClient(t)
	cases := []struct {
		name, path string
		body       any
		status     int
		msg        string
	}{
		{"wrong model", "/v1/chat/completions", map[string]any{"model": "other", "messages": []map[string]string{{"role": "user", "content": "x"}}}, 404, "The model `other` does not exist."},
		{"invalid JSON", "/v1/chat/completions", `{"model":`, 400, "invalid JSON body"},
		{"missing messages", "/v1/chat/completions", map[string]any{"model": "m"}, 400, "messages is required"},
		{"empty messages", "/v1/chat/completions", map[string]any{"model": "m", "messages": []any{}}, 400, "messages must not be empty"},
		{"missing prompt", "/v1/completions", map[string]any{"model": "m"}, 400, "prompt is required"},
		{"token prompt", "/v1/completions", map[string]any{"model": "m", "prompt": []int{1, 2}}, 400, "prompt must be a string"},
		{"max_tokens 0", "/v1/completions", completionBody("x", "max_tokens", 0), 400, "max_tokens must be at least 1"},
		{"too long", "/v1/completions", completionBody("x", "max_tokens", DefaultMaxModelLen), 400, "maximum context length"},
		{"n 0", "/v1/completions", completionBody("x", "n", 0), 400, "n must be at least 1"},
		{"bad stop", "/v1/completions", completionBody("x", "stop", 5), 400, "stop must be"},
		{"stream options without stream", "/v1/chat/completions", chatBody("x", "stream_options", map[string]any{"include_usage": true}), 400, "Stream options"},
		{"top_logprobs without logprobs", "/v1/chat/completions", chatBody("x", "top_logprobs", 2), 400, "top_logprobs"},
		{"unknown tool", "/v1/chat/completions", chatBody("x", "tool_choice", map[string]any{"type": "function", "function": map[string]any{"name": "nope"}}), 400, "not in tools"},
		{"kv params not object", "/v1/chat/completions", chatBody("x", "kv_transfer_params", "yes"), 400, "kv_transfer_params must be an object"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp := post(t, c, url+tc.path, tc.body)
			e := errorOf(t, resp.StatusCode, readBody(t, resp), tc.status)
			if !strings.Contains(e.Message, tc.msg) {
				t.Fatalf("message %q, want it to contain %q", e.Message, tc.msg)
			}
		})
	}
	if st := s.Stats(); st.Decodes != 0 || st.Prefills != 0 || st.Completed != 0 {
		t.Fatalf("refused requests were counted as served: %+v", st)
	}
	if got := len(s.Requests()); got != len(cases) {
		t.Fatalf("%d recorded requests, want every refused one (%d)", got, len(cases))
	}
}

// TestInfoEndpoints: /health, /version, /v1/models and /metrics in vLLM's
// shapes (vLLM's "Other endpoints").
func TestInfoEndpoints(t *testing.T) {
	_, url := startEngine(t, Config{Model: "my-model", EngineVersion: "0.10.2", EngineKind: "vllm"})
	c := newClient(t)
	if st, b := get(t, c, url+"/health"); st != 200 || len(b) != 0 {
		t.Fatalf("/health %d %q", st, b)
	}
	if st, b := get(t, c, url+"/version"); st != 200 || string(b) != `{"version":"0.10.2","engine":"vllm"}` {
		t.Fatalf("/version %d %s", st, b)
	}
	st, b := get(t, c, url+"/v1/models")
	var models struct {
		Object string `json:"object"`
		Data   []struct {
			ID          string `json:"id"`
			Object      string `json:"object"`
			OwnedBy     string `json:"owned_by"`
			MaxModelLen int    `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.Unmarshal(b, &models); err != nil || st != 200 || models.Object != "list" || len(models.Data) != 1 ||
		models.Data[0].ID != "my-model" || models.Data[0].Object != "model" || models.Data[0].OwnedBy != "vllm" || models.Data[0].MaxModelLen != DefaultMaxModelLen {
		t.Fatalf("/v1/models %d %s", st, b)
	}
	resp := post(t, c, url+"/v1/completions", map[string]any{"model": "my-model", "prompt": "a b c", "max_tokens": 2, "ignore_eos": true})
	readBody(t, resp)
	st, b = get(t, c, url+"/metrics")
	for _, line := range []string{
		"# TYPE vllm:num_requests_running gauge",
		`vllm:num_requests_running{model_name="my-model"} 0`,
		`vllm:prompt_tokens_total{model_name="my-model"} 3`,
		`vllm:generation_tokens_total{model_name="my-model"} 2`,
		`vllm:request_success_total{model_name="my-model",finished_reason="length"} 1`,
		`narwhal_sim_info{engine_id="e1",role="both",connector="nixl"} 1`,
	} {
		if st != 200 || !strings.Contains(string(b), line+"\n") {
			t.Fatalf("/metrics lacks %q:\n%s", line, b)
		}
	}
}

// TestRecordedRequests: /sim/requests lists path, X-Request-Id, phase,
// the trace context headers and raw body; DELETE clears it.
func TestRecordedRequests(t *testing.T) {
	s, url := startEngine(t, Config{})
	c := newClient(t)
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	readBody(t, post(t, c, url+"/v1/completions", completionBody("rec", "max_tokens", 1), "X-Request-Id", "a1", "Traceparent", tp, "Tracestate", "vendor=x"))
	readBody(t, post(t, c, url+"/v1/chat/completions", chatBody("rec", "max_tokens", 1, "kv_transfer_params", map[string]any{"do_remote_decode": true}), "X-Request-Id", "a2"))
	st, b := get(t, c, url+"/sim/requests")
	var recs []RecordedRequest
	if err := json.Unmarshal(b, &recs); err != nil || st != 200 || len(recs) != 2 {
		t.Fatalf("/sim/requests %d %s", st, b)
	}
	if recs[0].Path != "/v1/completions" || recs[0].RequestID != "a1" || recs[0].Phase != PhaseDecode ||
		recs[1].Path != "/v1/chat/completions" || recs[1].RequestID != "a2" || recs[1].Phase != PhasePrefill {
		t.Fatalf("recorded %+v", recs)
	}
	if recs[0].Traceparent != tp || recs[0].Tracestate != "vendor=x" || recs[1].Traceparent != "" || recs[1].Tracestate != "" {
		t.Fatalf("recorded trace headers %+v", recs)
	}
	var body map[string]any
	if err := json.Unmarshal(recs[0].Body, &body); err != nil || body["prompt"] != "rec" {
		t.Fatalf("recorded body %s", recs[0].Body)
	}
	req, _ := http.NewRequest(http.MethodDelete, url+"/sim/requests", nil)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	readBody(t, resp)
	if len(s.Requests()) != 0 {
		t.Fatal("DELETE /sim/requests did not clear")
	}
	for i := range recordLimit + 5 {
		s.recorder.add(RecordedRequest{Path: fmt.Sprint(i)})
	}
	if recs := s.Requests(); len(recs) != recordLimit || recs[0].Path != "5" || recs[recordLimit-1].Path != fmt.Sprint(recordLimit+4) {
		t.Fatalf("ring keeps %d, first %q", len(recs), recs[0].Path)
	}
}

// TestClientDisconnectAborts: a client that goes away mid-stream aborts
// the request at once and is counted (R-OWN-5).
func TestClientDisconnectAborts(t *testing.T) {
	s, url := startEngine(t, Config{TTFT: time.Hour})
	c := newClient(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp, err := postCtx(ctx, c, url+"/v1/chat/completions", chatBody("bye", "stream", true))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	ev, err := newSSEReader(resp.Body).next()
	if err != nil || !strings.Contains(ev.data, `"role":"assistant"`) {
		t.Fatalf("first event %q %v", ev.data, err)
	}
	if s.Stats().ActiveStreams != 1 {
		t.Fatalf("active streams %d", s.Stats().ActiveStreams)
	}
	cancel()
	testkit.WaitFor(t, 5*time.Second, "the abort to be counted", func() bool { st := s.Stats(); return st.Aborted == 1 && st.ActiveStreams == 0 })
	if st := s.Stats(); st.Completed != 0 {
		t.Fatalf("aborted request counted as completed: %+v", st)
	}
}

// TestCloseEndsInFlightStreams: Close ends a stream that would otherwise
// wait forever and returns once its handler is gone.
func TestCloseEndsInFlightStreams(t *testing.T) {
	s, err := New(Config{EngineID: "e1", Model: "m", TTFT: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	url, err := s.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := newClient(t)
	resp := post(t, c, url+"/v1/chat/completions", chatBody("forever", "stream", true))
	defer resp.Body.Close()
	sr := newSSEReader(resp.Body)
	if _, err := sr.next(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := sr.next(); err == nil {
		t.Fatal("stream continued after Close")
	}
	if st := s.Stats(); st.ActiveStreams != 0 || st.Aborted != 0 {
		t.Fatalf("after Close: %+v (a shutdown is not a client abort)", st)
	}
	if _, err := s.Start("127.0.0.1:0"); err == nil {
		t.Fatal("Start after Close succeeded")
	}
	if err := s.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	if resp, err := c.Get(url + "/health"); err == nil {
		resp.Body.Close()
		t.Fatal("listener still open after Close")
	}
}

// TestNewValidates: bad configurations fail at New.
func TestNewValidates(t *testing.T) {
	for name, cfg := range map[string]Config{
		"no engine id":  {Model: "m"},
		"no model":      {EngineID: "e"},
		"bad role":      {EngineID: "e", Model: "m", Role: "router"},
		"connector":     {EngineID: "e", Model: "m", Connector: "lmcache"},
		"negative ttft": {EngineID: "e", Model: "m", TTFT: -1},
		"bad fault":     {EngineID: "e", Model: "m", Faults: []Fault{{Kind: "explode"}}},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("%s: New succeeded", name)
		}
	}
	s, err := New(Config{EngineID: "e", Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	c := s.Config()
	if c.Role != RoleBoth || c.KVTimeout != DefaultKVTimeout || c.EngineVersion != "0.11.0" || c.EngineKind != "vllm" || c.Connector != "nixl" || c.KVListen != "127.0.0.1:0" {
		t.Fatalf("defaults %+v", c)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}
