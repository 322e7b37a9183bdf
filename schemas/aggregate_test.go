package schemas

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// sdkChatCompletion mirrors the OpenAI SDK's ChatCompletion shape (the
// fields a client reads from a non-streaming response).
type sdkChatCompletion struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index   int `json:"index"`
		Message struct {
			Role             string  `json:"role"`
			Content          *string `json:"content"`
			ReasoningContent *string `json:"reasoning_content"`
			Reasoning        *string `json:"reasoning"`
			ToolCalls        []struct {
				ID       string `json:"id"`
				Type     string `json:"type"`
				Function struct {
					Name      string `json:"name"`
					Arguments string `json:"arguments"`
				} `json:"function"`
			} `json:"tool_calls"`
		} `json:"message"`
		Logprobs *struct {
			Content []struct {
				Token       string  `json:"token"`
				Logprob     float64 `json:"logprob"`
				Bytes       []int   `json:"bytes"`
				TopLogprobs []struct {
					Token   string  `json:"token"`
					Logprob float64 `json:"logprob"`
				} `json:"top_logprobs"`
			} `json:"content"`
		} `json:"logprobs"`
		FinishReason *string         `json:"finish_reason"`
		StopReason   json.RawMessage `json:"stop_reason"`
	} `json:"choices"`
	Usage *sdkUsage `json:"usage"`
}

// sdkCompletion mirrors the OpenAI SDK's Completion shape.
type sdkCompletion struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index    int    `json:"index"`
		Text     string `json:"text"`
		Logprobs *struct {
			Tokens        []string             `json:"tokens"`
			TokenLogprobs []float64            `json:"token_logprobs"`
			TopLogprobs   []map[string]float64 `json:"top_logprobs"`
			TextOffset    []int                `json:"text_offset"`
		} `json:"logprobs"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *sdkUsage `json:"usage"`
}

type sdkUsage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// aggregate feeds payloads to a new Aggregator and returns its output.
func aggregate(t *testing.T, chat bool, payloads ...string) (*Aggregator, []byte) {
	t.Helper()
	a := NewAggregator(chat)
	for _, p := range payloads {
		if err := a.Add([]byte(p)); err != nil {
			t.Fatalf("Add(%s): %v", p, err)
		}
	}
	out := a.AppendJSON(nil)
	if !json.Valid(out) {
		t.Fatalf("AppendJSON produced invalid JSON: %s", out)
	}
	return a, out
}

// decodeStrict unmarshals out into v, failing on trailing data.
func decodeStrict(t *testing.T, out []byte, v any) {
	t.Helper()
	if err := json.Unmarshal(out, v); err != nil {
		t.Fatalf("unmarshal %s: %v", out, err)
	}
}

// chatChunk builds a vLLM chat chunk for choice index with the given delta
// and trailing choice members.
func chatChunk(index int, delta, rest string) string {
	return fmt.Sprintf(`{"id":"chatcmpl-7f3a","object":"chat.completion.chunk","created":1764460000,"model":"m","choices":[{"index":%d,"delta":%s,"logprobs":null,"finish_reason":null%s}]}`, index, delta, rest)
}

// TestAggregatorChatContent proves R-LEG-5 (content, finish_reason) and
// R-LEG-6 (the decode engine's usage verbatim; id, created and model kept).
func TestAggregatorChatContent(t *testing.T) {
	usage := `{"prompt_tokens":812,"completion_tokens":3,"total_tokens":815,"prompt_tokens_details":{"cached_tokens":512}}`
	a, out := aggregate(t, true,
		vllmRoleChunk,
		chatChunk(0, `{"content":"Hello"}`, ""),
		chatChunk(0, `{"content":" <narwhal>"}`, ""),
		chatChunk(0, `{"content":" & \"friends\""}`, ""),
		chatChunk(0, `{}`, `,"finish_reason":"stop","stop_reason":null`),
		`{"id":"chatcmpl-7f3a","object":"chat.completion.chunk","created":1764460000,"model":"m","choices":[],"usage":`+usage+`}`,
	)
	var got sdkChatCompletion
	decodeStrict(t, out, &got)
	if got.ID != "chatcmpl-7f3a" || got.Object != "chat.completion" || got.Created != 1764460000 || got.Model != "m" {
		t.Errorf("header = %q %q %d %q", got.ID, got.Object, got.Created, got.Model)
	}
	if len(got.Choices) != 1 {
		t.Fatalf("choices = %d, want 1: %s", len(got.Choices), out)
	}
	c := got.Choices[0]
	if c.Message.Role != "assistant" || c.Message.Content == nil || *c.Message.Content != `Hello <narwhal> & "friends"` {
		t.Errorf("message = %+v", c.Message)
	}
	if c.Message.ToolCalls != nil || c.Message.ReasoningContent != nil || c.Logprobs != nil {
		t.Errorf("unexpected members in %s", out)
	}
	if c.FinishReason == nil || *c.FinishReason != "stop" {
		t.Errorf("finish_reason = %v", c.FinishReason)
	}
	if c.StopReason != nil {
		t.Errorf("stop_reason = %s, want omitted when the stream gave only null", c.StopReason)
	}
	if !bytes.Contains(out, []byte(`<narwhal> &`)) {
		t.Errorf("HTML characters were escaped: %s", out)
	}
	if !bytes.Contains(out, []byte(`"usage":`+usage)) {
		t.Errorf("usage not copied verbatim: %s", out)
	}
	if p, c, ok := a.Usage(); !ok || p != 812 || c != 3 {
		t.Errorf("Usage() = %d, %d, %v; want 812, 3, true", p, c, ok)
	}
	if !bytes.Contains(out, []byte(`"logprobs":null`)) {
		t.Errorf("logprobs not null: %s", out)
	}
}

// TestAggregatorChoicesInterleaved proves R-LEG-5 for n=2: every choice,
// ordered by index, content not mixed between choices.
func TestAggregatorChoicesInterleaved(t *testing.T) {
	_, out := aggregate(t, true,
		chatChunk(1, `{"role":"assistant","content":""}`, ""),
		chatChunk(0, `{"role":"assistant","content":""}`, ""),
		chatChunk(1, `{"content":"B1"}`, ""),
		chatChunk(0, `{"content":"A1"}`, ""),
		chatChunk(0, `{"content":" A2"}`, ""),
		chatChunk(1, `{"content":" B2"}`, ""),
		chatChunk(1, `{}`, `,"finish_reason":"length"`),
		chatChunk(0, `{"content":" A3"}`, `,"finish_reason":"stop","stop_reason":"</s>"`),
	)
	var got sdkChatCompletion
	decodeStrict(t, out, &got)
	if len(got.Choices) != 2 {
		t.Fatalf("choices = %d, want 2: %s", len(got.Choices), out)
	}
	want := []struct {
		content, finish string
	}{{"A1 A2 A3", "stop"}, {"B1 B2", "length"}}
	for i, w := range want {
		c := got.Choices[i]
		if c.Index != i || c.Message.Content == nil || *c.Message.Content != w.content || c.FinishReason == nil || *c.FinishReason != w.finish {
			t.Errorf("choice %d = index %d content %v finish %v; want %q %q", i, c.Index, c.Message.Content, c.FinishReason, w.content, w.finish)
		}
	}
	if string(got.Choices[0].StopReason) != `"</s>"` {
		t.Errorf("stop_reason = %s, want \"</s>\"", got.Choices[0].StopReason)
	}
	if got.Usage != nil {
		t.Errorf("usage = %+v, want null without a usage chunk", got.Usage)
	}
	if !bytes.Contains(out, []byte(`"usage":null`)) {
		t.Errorf("usage not null: %s", out)
	}
}

// TestAggregatorToolCalls proves R-LEG-5 tool-call assembly: two calls
// split over many deltas, interleaved, id/type/name from the first delta
// that has them, arguments concatenated, content null.
func TestAggregatorToolCalls(t *testing.T) {
	tool := func(index int, fields string) string {
		return chatChunk(0, `{"tool_calls":[{"index":`+fmt.Sprint(index)+fields+`}]}`, "")
	}
	_, out := aggregate(t, true,
		vllmRoleChunk,
		tool(0, `,"id":"chatcmpl-tool-a","type":"function","function":{"name":"get_weather","arguments":""}`),
		tool(0, `,"function":{"arguments":"{\"city\": "}`),
		tool(1, `,"id":"chatcmpl-tool-b","type":"function","function":{"name":"get_time"}`),
		tool(0, `,"function":{"arguments":"\"Oslo\"}"}`),
		tool(1, `,"function":{"arguments":"{\"tz\":"}`),
		tool(1, `,"id":"ignored","function":{"name":"ignored","arguments":"\"CET\"}"}`),
		chatChunk(0, `{}`, `,"finish_reason":"tool_calls"`),
	)
	var got sdkChatCompletion
	decodeStrict(t, out, &got)
	m := got.Choices[0].Message
	if m.Content != nil {
		t.Errorf("content = %q, want null with only tool calls", *m.Content)
	}
	if len(m.ToolCalls) != 2 {
		t.Fatalf("tool_calls = %d, want 2: %s", len(m.ToolCalls), out)
	}
	want := []struct{ id, name, args string }{
		{"chatcmpl-tool-a", "get_weather", `{"city": "Oslo"}`},
		{"chatcmpl-tool-b", "get_time", `{"tz":"CET"}`},
	}
	for i, w := range want {
		tc := m.ToolCalls[i]
		if tc.ID != w.id || tc.Type != "function" || tc.Function.Name != w.name || tc.Function.Arguments != w.args {
			t.Errorf("tool call %d = %+v, want %+v", i, tc, w)
		}
		if !json.Valid([]byte(tc.Function.Arguments)) {
			t.Errorf("tool call %d arguments are not JSON: %q", i, tc.Function.Arguments)
		}
	}
	if *got.Choices[0].FinishReason != "tool_calls" {
		t.Errorf("finish_reason = %q", *got.Choices[0].FinishReason)
	}
}

// TestAggregatorToolCallsWithContent: content stays a string beside tool
// calls, and a missing type defaults to "function".
func TestAggregatorToolCallsWithContent(t *testing.T) {
	_, out := aggregate(t, true,
		chatChunk(0, `{"content":"Let me check."}`, ""),
		chatChunk(0, `{"tool_calls":[{"index":0,"id":"call_1","function":{"name":"f","arguments":"{}"}}]}`, ""),
	)
	var got sdkChatCompletion
	decodeStrict(t, out, &got)
	m := got.Choices[0].Message
	if m.Content == nil || *m.Content != "Let me check." || len(m.ToolCalls) != 1 || m.ToolCalls[0].Type != "function" {
		t.Errorf("message = %s", out)
	}
	if got.Choices[0].FinishReason != nil {
		t.Errorf("finish_reason = %q, want null when no chunk gave one", *got.Choices[0].FinishReason)
	}
}

// TestAggregatorToolCallsOrder: tool calls are ordered by their index, not
// by arrival.
func TestAggregatorToolCallsOrder(t *testing.T) {
	_, out := aggregate(t, true,
		chatChunk(0, `{"tool_calls":[{"index":1,"id":"call_b","type":"function","function":{"name":"b","arguments":"{}"}}]}`, ""),
		chatChunk(0, `{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"a","arguments":"{}"}}]}`, ""),
	)
	var got sdkChatCompletion
	decodeStrict(t, out, &got)
	tcs := got.Choices[0].Message.ToolCalls
	if len(tcs) != 2 || tcs[0].ID != "call_a" || tcs[1].ID != "call_b" {
		t.Errorf("tool_calls = %s", out)
	}
}

// TestAggregatorEmptyCompletion: an immediate stop gives content "" (not
// null) and the finish_reason (behaviour.md §0: an immediate stop is output).
func TestAggregatorEmptyCompletion(t *testing.T) {
	_, out := aggregate(t, true, vllmRoleChunk, chatChunk(0, `{}`, `,"finish_reason":"stop"`))
	var got sdkChatCompletion
	decodeStrict(t, out, &got)
	if c := got.Choices[0].Message.Content; c == nil || *c != "" {
		t.Errorf("content = %v, want empty string: %s", c, out)
	}
}

// TestAggregatorReasoning: reasoning deltas under either vLLM name are
// collected once into reasoning_content (and reasoning when the stream used
// that name).
func TestAggregatorReasoning(t *testing.T) {
	_, out := aggregate(t, true,
		chatChunk(0, `{"role":"assistant","content":""}`, ""),
		chatChunk(0, `{"reasoning_content":"Think"}`, ""),
		chatChunk(0, `{"reasoning_content":"ing."}`, ""),
		chatChunk(0, `{"content":"Answer","reasoning":""}`, `,"finish_reason":"stop"`),
	)
	var got sdkChatCompletion
	decodeStrict(t, out, &got)
	m := got.Choices[0].Message
	if m.ReasoningContent == nil || *m.ReasoningContent != "Thinking." || m.Reasoning != nil || *m.Content != "Answer" {
		t.Errorf("message = %s", out)
	}

	_, out = aggregate(t, true,
		chatChunk(0, `{"reasoning":"Hm","reasoning_content":"Hm"}`, ""),
		chatChunk(0, `{"reasoning":"m."}`, ""),
		chatChunk(0, `{"content":"Yes"}`, ""),
	)
	got = sdkChatCompletion{}
	decodeStrict(t, out, &got)
	m = got.Choices[0].Message
	if m.ReasoningContent == nil || *m.ReasoningContent != "Hmm." || m.Reasoning == nil || *m.Reasoning != "Hmm." {
		t.Errorf("message = %s", out)
	}
}

// TestAggregatorChatLogprobs proves R-LEG-5 logprobs for chat: content
// arrays concatenated in order.
func TestAggregatorChatLogprobs(t *testing.T) {
	lp := func(tok string, p float64) string {
		return fmt.Sprintf(`,"logprobs":{"content":[{"token":%q,"logprob":%v,"bytes":[%d],"top_logprobs":[{"token":%q,"logprob":%v,"bytes":[%d]}]}]}`,
			tok, p, tok[0], tok, p, tok[0])
	}
	chunk := func(content, logprobs, finish string) string {
		return `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"` + content + `"}` + logprobs + `,"finish_reason":` + finish + `}]}`
	}
	_, out := aggregate(t, true,
		`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
		chunk("a", lp("a", -0.5), "null"),
		chunk("b", lp("b", -1.25), "null"),
		chunk("c", lp("c", -2), `"length"`),
	)
	var got sdkChatCompletion
	decodeStrict(t, out, &got)
	l := got.Choices[0].Logprobs
	if l == nil || len(l.Content) != 3 {
		t.Fatalf("logprobs = %s", out)
	}
	for i, w := range []struct {
		tok string
		p   float64
	}{{"a", -0.5}, {"b", -1.25}, {"c", -2}} {
		c := l.Content[i]
		if c.Token != w.tok || c.Logprob != w.p || len(c.Bytes) != 1 || c.Bytes[0] != int(w.tok[0]) || len(c.TopLogprobs) != 1 {
			t.Errorf("logprobs[%d] = %+v, want %s %v", i, c, w.tok, w.p)
		}
	}
}

// TestAggregatorCompletions proves R-LEG-5 for /v1/completions: text
// concatenated, the four logprobs lists merged, usage verbatim (R-LEG-6).
func TestAggregatorCompletions(t *testing.T) {
	chunk := func(text string, offset int, finish string) string {
		return fmt.Sprintf(`{"id":"cmpl-9c1d","object":"text_completion","created":1764460000,"model":"m","choices":[{"index":0,"text":%q,"logprobs":{"tokens":[%q],"token_logprobs":[-0.25],"top_logprobs":[{%q:-0.25}],"text_offset":[%d]},"finish_reason":%s,"stop_reason":null}]}`,
			text, text, text, offset, finish)
	}
	a, out := aggregate(t, false,
		chunk(" narwhal", 10, "null"),
		chunk("s", 18, "null"),
		chunk(" swim", 19, `"length"`),
		`{"id":"cmpl-9c1d","object":"text_completion","created":1764460000,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}`,
	)
	var got sdkCompletion
	decodeStrict(t, out, &got)
	if got.ID != "cmpl-9c1d" || got.Object != "text_completion" || got.Created != 1764460000 || got.Model != "m" {
		t.Errorf("header = %s", out)
	}
	c := got.Choices[0]
	if c.Text != " narwhals swim" || c.FinishReason == nil || *c.FinishReason != "length" {
		t.Errorf("choice = %s", out)
	}
	l := c.Logprobs
	if l == nil || strings.Join(l.Tokens, "|") != " narwhal|s| swim" || len(l.TokenLogprobs) != 3 ||
		len(l.TopLogprobs) != 3 || l.TopLogprobs[2][" swim"] != -0.25 || fmt.Sprint(l.TextOffset) != "[10 18 19]" {
		t.Errorf("logprobs = %s", out)
	}
	if got.Usage == nil || *got.Usage != (sdkUsage{5, 3, 8}) {
		t.Errorf("usage = %+v", got.Usage)
	}
	if p, c, ok := a.Usage(); !ok || p != 5 || c != 3 {
		t.Errorf("Usage() = %d, %d, %v", p, c, ok)
	}
}

// TestAggregatorCompletionsNoLogprobs: null logprobs give "logprobs":null;
// n=2 choices ordered by index.
func TestAggregatorCompletionsNoLogprobs(t *testing.T) {
	chunk := func(index int, text string) string {
		return fmt.Sprintf(`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":%d,"text":%q,"logprobs":null,"finish_reason":null}]}`, index, text)
	}
	_, out := aggregate(t, false, chunk(1, "b"), chunk(0, "a"), chunk(1, "B"), chunk(0, "A"))
	var got sdkCompletion
	decodeStrict(t, out, &got)
	if len(got.Choices) != 2 || got.Choices[0].Text != "aA" || got.Choices[1].Text != "bB" || got.Choices[0].Index != 0 {
		t.Errorf("choices = %s", out)
	}
	if got.Choices[0].Logprobs != nil || !bytes.Contains(out, []byte(`"logprobs":null`)) {
		t.Errorf("logprobs not null: %s", out)
	}
}

// TestAggregatorUsageLastWins (R-LEG-6): with continuous usage stats every
// chunk carries usage; the last one is the total.
func TestAggregatorUsageLastWins(t *testing.T) {
	a, out := aggregate(t, true,
		`{"id":"chatcmpl-1","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"a"}}],"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8}}`,
		`{"id":"chatcmpl-1","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"b"}}],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}`,
		`{"id":"chatcmpl-1","created":1,"model":"m","choices":[],"usage":null}`,
	)
	if p, c, ok := a.Usage(); !ok || p != 7 || c != 2 {
		t.Errorf("Usage() = %d, %d, %v; want 7, 2, true", p, c, ok)
	}
	if !bytes.Contains(out, []byte(`"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}`)) {
		t.Errorf("usage = %s", out)
	}
	// A usage object without integer counts is copied but not reported.
	b, _ := aggregate(t, true, `{"choices":[],"usage":{"prompt_tokens":"seven"}}`)
	if _, _, ok := b.Usage(); ok {
		t.Errorf("Usage() ok for a usage object without integer counts")
	}
	if _, _, ok := NewAggregator(true).Usage(); ok {
		t.Errorf("Usage() ok with no chunks")
	}
}

// TestAggregatorAddErrors: invalid JSON or wrong member types return an
// error and leave the Aggregator unchanged.
func TestAggregatorAddErrors(t *testing.T) {
	a := NewAggregator(true)
	if err := a.Add([]byte(chatChunk(0, `{"role":"assistant","content":"ok"}`, ""))); err != nil {
		t.Fatal(err)
	}
	before := string(a.AppendJSON(nil))
	for _, bad := range []string{
		``,
		`{"choices":[{"delta":{"content":"x"}}`,
		`not json`,
		`{"choices":[{"index":"0","delta":{"content":"x"}}]}`,
		`{"choices":[{"index":0,"delta":{"content":"x"},"logprobs":{"content":7}}]}`,
		`{"choices":[{"index":0,"delta":{"content":"x"},"logprobs":"bad"}]}`,
	} {
		if err := a.Add([]byte(bad)); err == nil {
			t.Errorf("Add(%q) = nil, want an error", bad)
		}
	}
	if after := string(a.AppendJSON(nil)); after != before {
		t.Errorf("failed Add changed the completion:\n%s\n%s", before, after)
	}
}

// TestAggregatorCopiesPayload: the caller may reuse its buffer after Add.
func TestAggregatorCopiesPayload(t *testing.T) {
	a := NewAggregator(true)
	buf := []byte(chatChunk(0, `{"role":"assistant","content":"first"}`, `,"finish_reason":"stop"`))
	if err := a.Add(buf); err != nil {
		t.Fatal(err)
	}
	usage := []byte(`{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	if err := a.Add(usage); err != nil {
		t.Fatal(err)
	}
	want := string(a.AppendJSON(nil))
	for i := range buf {
		buf[i] = ' '
	}
	for i := range usage {
		usage[i] = ' '
	}
	if got := string(a.AppendJSON(nil)); got != want {
		t.Errorf("completion changed after the payload buffers were reused:\n%s\n%s", want, got)
	}
}

// TestAggregatorAppendJSON: AppendJSON appends to dst and can be called
// more than once.
func TestAggregatorAppendJSON(t *testing.T) {
	a := NewAggregator(false)
	if err := a.Add([]byte(vllmTextChunk)); err != nil {
		t.Fatal(err)
	}
	one := a.AppendJSON(nil)
	out := a.AppendJSON([]byte("prefix:"))
	if string(out) != "prefix:"+string(one) {
		t.Errorf("AppendJSON(prefix) = %s, want prefix:%s", out, one)
	}
	if bytes.HasSuffix(one, []byte("\n")) {
		t.Errorf("output ends with a newline")
	}
	want := `{"id":"cmpl-9c1d","object":"text_completion","created":1764460000,"model":"m","choices":[{"index":0,"text":" narwhal","logprobs":null,"finish_reason":null}],"usage":null}`
	if string(one) != want {
		t.Errorf("AppendJSON = %s\nwant          %s", one, want)
	}
}

// TestAggregatorFromStream folds a whole vLLM SSE transcript the way the
// router does for a non-streaming client (R-LEG-5): SSEData per line,
// ClassifyChunk, Add for output and metadata, stop at [DONE].
func TestAggregatorFromStream(t *testing.T) {
	transcript := "data: " + vllmRoleChunk + "\n\n" +
		": keep-alive\n\n" +
		"data: " + vllmContentChunk + "\n\n" +
		"data: " + chatChunk(0, `{"content":"s"}`, "") + "\n\n" +
		"data: " + vllmFinishChunk + "\n\n" +
		"data: " + vllmUsageChunk + "\n\n" +
		"data: [DONE]\n\n"
	a := NewAggregator(true)
	done := false
	for line := range bytes.Lines([]byte(transcript)) {
		p, ok := SSEData(line)
		if !ok {
			continue
		}
		switch k := ClassifyChunk(p); k {
		case ChunkOutput, ChunkMetadata:
			if err := a.Add(p); err != nil {
				t.Fatal(err)
			}
		case ChunkDone:
			done = true
		default:
			t.Fatalf("unexpected %v chunk %s", k, p)
		}
	}
	if !done {
		t.Fatal("no [DONE]")
	}
	var got sdkChatCompletion
	decodeStrict(t, a.AppendJSON(nil), &got)
	c := got.Choices[0]
	if *c.Message.Content != " narwhals" || *c.FinishReason != "length" || got.Usage == nil || got.Usage.CompletionTokens != 64 || got.Usage.PromptTokens != 812 {
		t.Errorf("completion = %s", a.AppendJSON(nil))
	}
}

// BenchmarkAggregatorAdd measures folding one content chunk.
func BenchmarkAggregatorAdd(b *testing.B) {
	p := []byte(vllmContentChunk)
	a := NewAggregator(true)
	b.ReportAllocs()
	for b.Loop() {
		if err := a.Add(p); err != nil {
			b.Fatal(err)
		}
	}
}

// TestAggregatorBytes proves that Bytes counts the output an Aggregator
// keeps — texts, reasoning, tool-call arguments and logprobs entries —
// and not the chunks' envelopes, which it does not keep (R-LEG-5: the
// router bounds it with request.max_response_bytes).
func TestAggregatorBytes(t *testing.T) {
	entry := `{"token":"ab","logprob":-0.5,"bytes":[97,98],"top_logprobs":[]}`
	chat := NewAggregator(true)
	for _, c := range []string{
		`{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
		`{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"ab"},"logprobs":{"content":[` + entry + `]},"finish_reason":null},{"index":1,"delta":{"reasoning_content":"think"},"logprobs":null,"finish_reason":null}]}`,
		`{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},"logprobs":null,"finish_reason":"tool_calls"}]}`,
	} {
		if err := chat.Add([]byte(c)); err != nil {
			t.Fatal(err)
		}
	}
	if want := len("ab") + len(entry) + len("think") + len(`{"a":1}`); chat.Bytes() != want {
		t.Errorf("chat Bytes() = %d, want %d", chat.Bytes(), want)
	}
	text := NewAggregator(false)
	if err := text.Add([]byte(`{"id":"x","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"hello","logprobs":{"tokens":["hello"],"token_logprobs":[-1.5],"top_logprobs":[{"hello":-1.5}],"text_offset":[0]},"finish_reason":null}]}`)); err != nil {
		t.Fatal(err)
	}
	if want := len("hello") + len(`"hello"`) + len(`-1.5`) + len(`{"hello":-1.5}`) + len(`0`); text.Bytes() != want {
		t.Errorf("completions Bytes() = %d, want %d", text.Bytes(), want)
	}
}
