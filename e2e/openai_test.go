package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/schemas"
)

// requestBound bounds one SDK call end to end.
const requestBound = 15 * time.Second

// clientKV is a forged handoff descriptor a client puts in its request. No
// engine may ever see it (R-API-5); forgedMarkers are its values, which
// must appear in no body an engine recorded.
var (
	clientKV = map[string]any{
		"do_remote_prefill": true,
		"do_remote_decode":  false,
		"remote_engine_id":  "client-forged-engine",
		"remote_block_ids":  []int{987001, 987002},
		"remote_host":       "203.0.113.77",
		"remote_port":       59999,
	}
	forgedMarkers = []string{"client-forged-engine", "987001", "203.0.113.77", "59999"}
)

// clientStopTokenIDs is sent by every request: the decode leg must get it,
// the prefill leg must not (R-LEG-1a).
var clientStopTokenIDs = []int{424242}

// nixlHandOff is the exact kv_transfer_params of every crossed prefill leg
// (R-LEG-1).
const nixlHandOff = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

// prefillDropped are the client members the prefill leg never carries
// (R-LEG-1, R-LEG-1a); the prefill sets its own stream, max_tokens,
// max_completion_tokens, n, ignore_eos and kv_transfer_params.
var prefillDropped = []string{
	"stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "stop", "stop_token_ids",
	"logprobs", "top_logprobs", "echo", "best_of", "ignore_eos", "min_tokens", "kv_transfer_params",
}

// captured is what one SDK call sent and received on the wire, recorded
// by a middleware: the request body, the response status and headers, and
// the raw response body as the SDK read it.
type captured struct {
	mu      sync.Mutex
	request []byte
	status  int
	header  http.Header
	body    bytes.Buffer
}

// option returns the middleware that fills c.
func (c *captured) option() option.RequestOption {
	return option.WithMiddleware(func(req *http.Request, next option.MiddlewareNext) (*http.Response, error) {
		if req.Body != nil {
			b, err := io.ReadAll(req.Body)
			req.Body.Close()
			if err != nil {
				return nil, err
			}
			c.mu.Lock()
			c.request = b
			c.mu.Unlock()
			req.Body = io.NopCloser(bytes.NewReader(b))
			req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
			req.ContentLength = int64(len(b))
		}
		resp, err := next(req)
		if resp != nil {
			c.mu.Lock()
			c.status, c.header = resp.StatusCode, resp.Header.Clone()
			c.mu.Unlock()
			resp.Body = teeBody{Reader: io.TeeReader(resp.Body, c), Closer: resp.Body}
		}
		return resp, err
	})
}

// Write appends response bytes as the SDK reads them.
func (c *captured) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.body.Write(p)
}

func (c *captured) raw() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return bytes.Clone(c.body.Bytes())
}

type teeBody struct {
	io.Reader
	io.Closer
}

// apiCase is one client request shape.
type apiCase struct {
	name         string
	chat         bool
	stream       bool
	includeUsage bool // stream_options.include_usage (streams only)
	sendOptions  bool // send stream_options even when includeUsage is false
	n            int  // choices asked for; 0 sends no n
	logprobs     bool
	completionMT bool   // chat: send max_completion_tokens instead of max_tokens
	clientID     string // X-Request-Id the client sends; "" sends none
}

// maxTokens is every case's output limit; the stop string of each case
// cuts its first choice after stopAfter tokens or more.
const (
	maxTokens = 12
	stopAfter = 4
)

// clientResult is what the SDK handed the client.
type clientResult struct {
	deltas  [][]string // per choice: the non-empty content/text pieces, in order (streams)
	texts   []string   // per choice: the whole content/text
	finish  []string   // per choice
	logprob []int      // per choice: logprob entries received
	usage   *openai.CompletionUsage
	model   string
}

func (r *clientResult) choice(i int) {
	for len(r.texts) <= i {
		r.deltas = append(r.deltas, nil)
		r.texts = append(r.texts, "")
		r.finish = append(r.finish, "")
		r.logprob = append(r.logprob, 0)
	}
}

// servedRequest is one request that went through the mesh, for the event
// checks.
type servedRequest struct {
	requestID          string
	endpoint           string
	stream             bool
	producer, consumer string
	promptTokens       int
	completionTokens   int
}

// TestOpenAIClientThroughMesh drives a router and four simulators, all
// separate processes, with the official OpenAI Go SDK: chat and
// completions, streaming and not, include_usage on and off, n 1 and 2,
// with a stop string that cuts the output and a forged kv_transfer_params.
// For every request it proves what the client got (R-API-1, R-LEG-5,
// R-LEG-6, R-API-6), what each leg's engine received (R-LEG-1, R-LEG-1a,
// R-LEG-3, R-API-5, R-OWN-4), that the consumer pulled the producer's KV
// blocks (R-LEG-2, R-DESC-5), and at the end that the router published
// exactly one valid request event per request (R-BUS-1, R-BUS-3,
// R-TIME-1).
func TestOpenAIClientThroughMesh(t *testing.T) {
	m := startMesh(t)
	transport := &http.Transport{}
	t.Cleanup(transport.CloseIdleConnections)
	client := openai.NewClient(
		option.WithBaseURL(m.routerURL+"/v1/"),
		option.WithAPIKey("unused"),
		option.WithMaxRetries(0),
		option.WithHTTPClient(&http.Client{Transport: transport}),
	)

	// R-API-2: the router lists the fleet's model.
	models, err := client.Models.List(testContext(t, requestBound))
	if err != nil {
		t.Fatal(err)
	}
	if len(models.Data) != 1 || models.Data[0].ID != meshModel {
		t.Fatalf("GET /v1/models listed %+v, want only %s", models.Data, meshModel)
	}

	cases := []apiCase{
		{name: "chat", chat: true, n: 2, completionMT: true, clientID: "e2e-chat-1"},
		{name: "chat-stream-usage", chat: true, stream: true, includeUsage: true, logprobs: true},
		{name: "chat-stream-usage-false", chat: true, stream: true, sendOptions: true, clientID: "e2e-chat-stream-2"},
		{name: "completions", n: 2, logprobs: true},
		{name: "completions-stream-usage", stream: true, includeUsage: true, clientID: "e2e-cmpl-stream-1"},
		{name: "completions-stream-no-options", stream: true},
	}
	var served []servedRequest
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if r, ok := runCase(t, m, &client, c, int64(10*i)); ok {
				served = append(served, r)
			}
		})
	}

	// R-API-5 over everything the engines recorded, release calls included.
	for _, s := range m.sims {
		for _, r := range s.requests(t) {
			for _, mark := range forgedMarkers {
				if bytes.Contains(r.Body, []byte(mark)) {
					t.Errorf("R-API-5: %s received the client's kv_transfer_params (%q) on %s: %s", s.id, mark, r.Path, r.Body)
				}
			}
		}
		if st := s.stats(t); st.KVPullFailures != 0 || st.KVHeld != 0 {
			t.Errorf("%s: kv_pull_failures %d, kv_held %d after every request ended; want 0 and 0", s.id, st.KVPullFailures, st.KVHeld)
		}
	}

	checkRequestEvents(t, m.allEvents(t), served, len(cases))
}

// planPrompt picks, from seed upwards, the first seed whose output for
// prompt runs the full maxTokens without an end-of-sequence token, and a
// stop string that then cuts it after at least stopAfter tokens: the word
// of the first later token that does not occur in the text before it.
func planPrompt(t *testing.T, prompt string, seed int64) (int64, string) {
	t.Helper()
	for s := seed; s < seed+200; s++ {
		toks, finish := sim.Generate(prompt, s, maxTokens, nil, false)
		if finish != sim.FinishLength || len(toks) != maxTokens {
			continue
		}
		for k := stopAfter; k < maxTokens-1; k++ {
			word := strings.TrimSpace(toks[k])
			if !strings.Contains(strings.Join(toks[:k], ""), word) {
				return s, word
			}
		}
	}
	t.Fatalf("no seed from %d runs %q for %d tokens with a usable stop word", seed, prompt, maxTokens)
	return 0, ""
}

// runCase sends one request and checks it end to end. It reports the
// request for the event checks when it got that far.
func runCase(t *testing.T, m *mesh, client *openai.Client, c apiCase, seedFrom int64) (servedRequest, bool) {
	ctx := testContext(t, requestBound)
	messages := []map[string]string{
		{"role": "system", "content": "You are a guide to the arctic sea."},
		{"role": "user", "content": "Tell me about narwhals, case " + c.name + "."},
	}
	completionPrompt := "Once upon a time, in case " + c.name + ", a narwhal"
	planned := completionPrompt
	if c.chat {
		raw, _ := json.Marshal(messages)
		var err error
		if planned, err = sim.RenderChat(raw); err != nil {
			t.Fatal(err)
		}
	}
	seed, stop := planPrompt(t, planned, seedFrom)

	before := map[string]sim.Stats{}
	for _, s := range m.sims {
		before[s.id] = s.stats(t)
	}

	var wire captured
	opts := []option.RequestOption{
		wire.option(),
		option.WithJSONSet("kv_transfer_params", clientKV),
		option.WithJSONSet("stop_token_ids", clientStopTokenIDs),
	}
	if c.clientID != "" {
		opts = append(opts, option.WithHeader("X-Request-Id", c.clientID))
	}
	var got clientResult
	var err error
	if c.chat {
		err = sendChat(ctx, client, c, messages, seed, stop, opts, &got)
	} else {
		err = sendCompletion(ctx, client, c, completionPrompt, seed, stop, opts, &got)
	}
	if err != nil {
		t.Fatalf("%s: %v\nresponse: %s", c.name, err, wire.raw())
	}
	if wire.status != http.StatusOK {
		t.Fatalf("HTTP %d: %s", wire.status, wire.raw())
	}
	if got.model != meshModel {
		t.Errorf("response model %q, want %q", got.model, meshModel)
	}

	// The prompt text as sent: the chat messages or the completions prompt
	// of the body the SDK put on the wire.
	var clientBody map[string]json.RawMessage
	if err := json.Unmarshal(wire.request, &clientBody); err != nil {
		t.Fatalf("client body: %v: %s", err, wire.request)
	}
	promptText := promptOf(t, c.chat, clientBody)
	if promptText != planned {
		t.Fatalf("the SDK sent prompt %q, planned %q", promptText, planned)
	}

	// 1. Tokens: exactly what the simulator generates for that prompt,
	// seed (seed+j for choice j), max_tokens and stop (R-LEG-3, R-LEG-5).
	n := max(c.n, 1)
	if len(got.texts) != n {
		t.Fatalf("client got %d choices, want %d", len(got.texts), n)
	}
	var wantCompletion int
	for j := range n {
		toks, finish := sim.Generate(promptText, seed+int64(j), maxTokens, []string{stop}, false)
		wantCompletion += len(toks)
		if j == 0 && (finish != sim.FinishStop || len(toks) < stopAfter || len(toks) >= maxTokens) {
			t.Fatalf("test setup: stop %q does not cut choice 0 (%d tokens, %s)", stop, len(toks), finish)
		}
		if c.stream && !slices.Equal(got.deltas[j], toks) {
			t.Errorf("choice %d: streamed tokens %q, want %q", j, got.deltas[j], toks)
		}
		if want := strings.Join(toks, ""); got.texts[j] != want {
			t.Errorf("choice %d: text %q, want %q", j, got.texts[j], want)
		}
		if got.finish[j] != finish {
			t.Errorf("choice %d: finish_reason %q, want %q", j, got.finish[j], finish)
		}
		if c.logprobs && got.logprob[j] != len(toks) {
			t.Errorf("choice %d: %d logprob entries, want one per token (%d)", j, got.logprob[j], len(toks))
		}
	}

	// 5. Usage is the decode engine's, never counting the prefill token
	// (R-LEG-6); a stream carries it only when include_usage is on
	// (R-API-1).
	wantPrompt := sim.PromptTokens(promptText)
	if c.stream {
		checkStreamUsage(t, wire.raw(), c.includeUsage, wantPrompt, wantCompletion)
	}
	if !c.stream || c.includeUsage {
		if got.usage == nil {
			t.Fatal("client got no usage")
		}
		if got.usage.PromptTokens != int64(wantPrompt) || got.usage.CompletionTokens != int64(wantCompletion) || got.usage.TotalTokens != int64(wantPrompt+wantCompletion) {
			t.Errorf("usage %d/%d/%d, want prompt %d completion %d total %d", got.usage.PromptTokens, got.usage.CompletionTokens,
				got.usage.TotalTokens, wantPrompt, wantCompletion, wantPrompt+wantCompletion)
		}
	} else if got.usage != nil {
		t.Errorf("include_usage off, yet the client got usage: prompt %d completion %d", got.usage.PromptTokens, got.usage.CompletionTokens)
	}

	// 6. X-Request-Id: the client's when it sent one (R-API-6); both legs
	// share one backend id derived from it, not equal to it (R-OWN-4).
	requestID := wire.header.Get("X-Request-Id")
	if requestID == "" || (c.clientID != "" && requestID != c.clientID) {
		t.Fatalf("X-Request-Id %q (client sent %q)", requestID, c.clientID)
	}
	var prefill, decode *sim.RecordedRequest
	var producer, consumer *simProc
	for _, s := range m.sims {
		for _, r := range s.requests(t) {
			if !strings.HasPrefix(r.RequestID, requestID) {
				continue
			}
			switch {
			case r.Phase == sim.PhasePrefill && prefill == nil:
				prefill, producer = &r, s
			case r.Phase == sim.PhaseDecode && decode == nil:
				decode, consumer = &r, s
			default:
				t.Errorf("%s received an extra %s request for %s: %s", s.id, r.Phase, requestID, r.Body)
			}
		}
	}
	if prefill == nil || decode == nil {
		t.Fatalf("request %s: prefill leg %v, decode leg %v recorded", requestID, prefill != nil, decode != nil)
	}
	if producer.role != sim.RolePrefill || consumer.role != sim.RoleDecode {
		t.Errorf("prefill ran on %s (%s), decode on %s (%s)", producer.id, producer.role, consumer.id, consumer.role)
	}
	wantPath := schemas.EndpointCompletions
	if c.chat {
		wantPath = schemas.EndpointChat
	}
	if prefill.Path != wantPath || decode.Path != wantPath {
		t.Errorf("legs on %s and %s, want both on %s (R-LEG-1, R-DESC-4)", prefill.Path, decode.Path, wantPath)
	}
	backendID := prefill.RequestID
	if backendID != decode.RequestID || backendID == requestID || !strings.HasPrefix(backendID, requestID) {
		t.Errorf("backend ids: prefill %q, decode %q; client request id %q (R-OWN-4)", prefill.RequestID, decode.RequestID, requestID)
	}

	// 2. What each leg received.
	checkPrefillBody(t, clientBody, prefill.Body)
	descriptor := checkDecodeBody(t, clientBody, decode.Body)

	// 3. The consumer pulled the producer's blocks; the descriptor names
	// the producer that served them.
	checkDescriptor(t, descriptor, producer, wantPrompt)
	for _, s := range m.sims {
		b, a := before[s.id], s.stats(t)
		want := b
		switch s {
		case producer:
			want.Prefills++
			want.KVServed++
		case consumer:
			want.Decodes++
			want.KVPulled++
		}
		if a.Prefills != want.Prefills || a.Decodes != want.Decodes || a.KVServed != want.KVServed || a.KVPulled != want.KVPulled || a.KVPullFailures != b.KVPullFailures {
			t.Errorf("%s stats %+v → %+v; want prefills %d decodes %d kv_served %d kv_pulled %d, no pull failure",
				s.id, b, a, want.Prefills, want.Decodes, want.KVServed, want.KVPulled)
		}
	}

	// 4. The client's kv_transfer_params reached neither leg (R-API-5).
	for _, leg := range [][]byte{prefill.Body, decode.Body} {
		for _, mark := range forgedMarkers {
			if bytes.Contains(leg, []byte(mark)) {
				t.Errorf("R-API-5: an engine received the client's %q: %s", mark, leg)
			}
		}
	}

	return servedRequest{
		requestID: requestID, endpoint: wantPath, stream: c.stream,
		producer: producer.id, consumer: consumer.id,
		promptTokens: wantPrompt, completionTokens: wantCompletion,
	}, !t.Failed()
}

// sendChat sends one chat completion with the SDK and fills got.
func sendChat(ctx context.Context, client *openai.Client, c apiCase, messages []map[string]string, seed int64, stop string, opts []option.RequestOption, got *clientResult) error {
	params := openai.ChatCompletionNewParams{
		Model: meshModel,
		Messages: []openai.ChatCompletionMessageParamUnion{
			openai.SystemMessage(messages[0]["content"]),
			openai.UserMessage(messages[1]["content"]),
		},
		Seed:        openai.Int(seed),
		Temperature: openai.Float(0.5),
		TopP:        openai.Float(0.9),
		Stop:        openai.ChatCompletionNewParamsStopUnion{OfStringArray: []string{stop}},
	}
	if c.completionMT {
		params.MaxCompletionTokens = openai.Int(maxTokens)
	} else {
		params.MaxTokens = openai.Int(maxTokens)
	}
	if c.n > 0 {
		params.N = openai.Int(int64(c.n))
	}
	if c.logprobs {
		params.Logprobs = openai.Bool(true)
		params.TopLogprobs = openai.Int(2)
	}
	if c.includeUsage || c.sendOptions {
		params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(c.includeUsage)}
	}
	if !c.stream {
		resp, err := client.Chat.Completions.New(ctx, params, opts...)
		if err != nil {
			return err
		}
		got.model = resp.Model
		for _, ch := range resp.Choices {
			got.choice(int(ch.Index))
			got.texts[ch.Index] = ch.Message.Content
			got.finish[ch.Index] = ch.FinishReason
			got.logprob[ch.Index] = len(ch.Logprobs.Content)
		}
		if resp.JSON.Usage.Valid() {
			got.usage = &resp.Usage
		}
		return nil
	}
	stream := client.Chat.Completions.NewStreaming(ctx, params, opts...)
	defer stream.Close()
	for stream.Next() {
		chunk := stream.Current()
		got.model = chunk.Model
		for _, ch := range chunk.Choices {
			got.choice(int(ch.Index))
			if ch.Delta.Content != "" {
				got.deltas[ch.Index] = append(got.deltas[ch.Index], ch.Delta.Content)
				got.texts[ch.Index] += ch.Delta.Content
			}
			if ch.FinishReason != "" {
				got.finish[ch.Index] = ch.FinishReason
			}
			got.logprob[ch.Index] += len(ch.Logprobs.Content)
		}
		if chunk.JSON.Usage.Valid() {
			u := chunk.Usage
			got.usage = &u
		}
	}
	return stream.Err()
}

// sendCompletion sends one completion with the SDK and fills got.
func sendCompletion(ctx context.Context, client *openai.Client, c apiCase, prompt string, seed int64, stop string, opts []option.RequestOption, got *clientResult) error {
	params := openai.CompletionNewParams{
		Model:       meshModel,
		Prompt:      openai.CompletionNewParamsPromptUnion{OfString: openai.String(prompt)},
		MaxTokens:   openai.Int(maxTokens),
		Seed:        openai.Int(seed),
		Temperature: openai.Float(0.5),
		TopP:        openai.Float(0.9),
		Stop:        openai.CompletionNewParamsStopUnion{OfStringArray: []string{stop}},
	}
	if c.n > 0 {
		params.N = openai.Int(int64(c.n))
	}
	if c.logprobs {
		params.Logprobs = openai.Int(2)
	}
	if c.includeUsage || c.sendOptions {
		params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(c.includeUsage)}
	}
	if !c.stream {
		resp, err := client.Completions.New(ctx, params, opts...)
		if err != nil {
			return err
		}
		got.model = resp.Model
		for _, ch := range resp.Choices {
			got.choice(int(ch.Index))
			got.texts[ch.Index] = ch.Text
			got.finish[ch.Index] = string(ch.FinishReason)
			got.logprob[ch.Index] = len(ch.Logprobs.TokenLogprobs)
		}
		if resp.JSON.Usage.Valid() {
			got.usage = &resp.Usage
		}
		return nil
	}
	stream := client.Completions.NewStreaming(ctx, params, opts...)
	defer stream.Close()
	for stream.Next() {
		chunk := stream.Current()
		got.model = chunk.Model
		for _, ch := range chunk.Choices {
			got.choice(int(ch.Index))
			if ch.Text != "" {
				got.deltas[ch.Index] = append(got.deltas[ch.Index], ch.Text)
				got.texts[ch.Index] += ch.Text
			}
			if ch.FinishReason != "" {
				got.finish[ch.Index] = string(ch.FinishReason)
			}
			got.logprob[ch.Index] += len(ch.Logprobs.TokenLogprobs)
		}
		if chunk.JSON.Usage.Valid() {
			u := chunk.Usage
			got.usage = &u
		}
	}
	return stream.Err()
}

// promptOf returns the prompt text of a client body: sim.RenderChat of its
// messages exactly as sent, or its completions prompt string.
func promptOf(t *testing.T, chat bool, body map[string]json.RawMessage) string {
	t.Helper()
	if chat {
		text, err := sim.RenderChat(body["messages"])
		if err != nil {
			t.Fatalf("messages %s: %v", body["messages"], err)
		}
		return text
	}
	var p string
	if err := json.Unmarshal(body["prompt"], &p); err != nil {
		t.Fatalf("prompt %s: %v", body["prompt"], err)
	}
	return p
}

// sseData returns the data payloads of an SSE body, in order.
func sseData(b []byte) []string {
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			out = append(out, p)
		}
	}
	return out
}

// checkStreamUsage checks the raw SSE body the client read: it ends with
// data: [DONE]; with include_usage exactly one usage chunk, with empty
// choices, right before [DONE], carrying the decode engine's counts;
// without it no chunk carries usage (R-API-1, R-LEG-5, R-LEG-6).
func checkStreamUsage(t *testing.T, raw []byte, includeUsage bool, prompt, completion int) {
	t.Helper()
	events := sseData(raw)
	if len(events) == 0 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("stream does not end with data: [DONE]:\n%s", raw)
	}
	var usageAt []int
	for i, e := range events[:len(events)-1] {
		if e == "[DONE]" {
			t.Fatalf("data after [DONE]:\n%s", raw)
		}
		var ch struct {
			Choices []json.RawMessage `json:"choices"`
			Usage   json.RawMessage   `json:"usage"`
			Error   json.RawMessage   `json:"error"`
		}
		if err := json.Unmarshal([]byte(e), &ch); err != nil {
			t.Fatalf("event %d is not JSON: %v: %s", i, err, e)
		}
		if ch.Error != nil {
			t.Fatalf("error event in a successful stream: %s", e)
		}
		if len(ch.Usage) == 0 || string(ch.Usage) == "null" {
			continue
		}
		usageAt = append(usageAt, i)
		var u struct {
			Prompt     int `json:"prompt_tokens"`
			Completion int `json:"completion_tokens"`
			Total      int `json:"total_tokens"`
		}
		if err := json.Unmarshal(ch.Usage, &u); err != nil || u.Prompt != prompt || u.Completion != completion || u.Total != prompt+completion {
			t.Errorf("usage chunk %s, want prompt %d completion %d (R-LEG-6)", e, prompt, completion)
		}
		if len(ch.Choices) != 0 {
			t.Errorf("usage chunk has choices: %s", e)
		}
	}
	switch {
	case includeUsage && (len(usageAt) != 1 || usageAt[0] != len(events)-2):
		t.Errorf("include_usage on: usage chunks at %v of %d events, want exactly one right before [DONE]", usageAt, len(events))
	case !includeUsage && len(usageAt) != 0:
		t.Errorf("include_usage off: %d usage chunks reached the client", len(usageAt))
	}
}

// compactJSON returns raw without insignificant whitespace.
func compactJSON(t *testing.T, raw []byte) string {
	t.Helper()
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		t.Fatalf("invalid JSON %s: %v", raw, err)
	}
	return b.String()
}

// sameJSON reports whether a and b hold the same JSON value.
func sameJSON(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	return reflect.DeepEqual(x, y)
}

func keys(m map[string]json.RawMessage) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// checkPrefillBody checks the producer's request against the client's
// (R-LEG-1, R-LEG-1a, R-API-5): a non-streaming one-token request with
// ignore_eos, the nixl hand-off parameters exactly, no stop, stop_token_ids,
// stream_options, logprobs or top_logprobs, and every other client member
// — messages or prompt, model, sampling — byte for byte.
func checkPrefillBody(t *testing.T, client map[string]json.RawMessage, raw json.RawMessage) {
	t.Helper()
	var leg map[string]json.RawMessage
	if err := json.Unmarshal(raw, &leg); err != nil {
		t.Fatalf("prefill body: %v: %s", err, raw)
	}
	want := map[string]string{
		"stream": "false", "max_tokens": "1", "max_completion_tokens": "1", "n": "1", "ignore_eos": "true",
		"kv_transfer_params": nixlHandOff,
	}
	for k, v := range client {
		if !slices.Contains(prefillDropped, k) {
			want[k] = compactJSON(t, v)
		}
	}
	for k, v := range want {
		got, ok := leg[k]
		switch {
		case !ok:
			t.Errorf("prefill leg lacks %q (want %s): %s", k, v, raw)
		case k == "kv_transfer_params":
			if !sameJSON(got, []byte(v)) {
				t.Errorf("prefill kv_transfer_params %s, want exactly %s (R-LEG-1)", got, v)
			}
		case compactJSON(t, got) != v:
			t.Errorf("prefill %q = %s, want %s", k, got, v)
		}
	}
	for _, k := range keys(leg) {
		if _, ok := want[k]; !ok {
			t.Errorf("prefill leg carries %q = %s, which it must not (R-LEG-1, R-LEG-1a)", k, leg[k])
		}
	}
}

// checkDecodeBody checks the consumer's request against the client's
// (R-LEG-3, R-LEG-5): every client member unchanged (stop, stop_token_ids,
// max_tokens, temperature, seed, logprobs, …), stream true with
// stream_options.include_usage true, and a kv_transfer_params that it
// returns for checkDescriptor.
func checkDecodeBody(t *testing.T, client map[string]json.RawMessage, raw json.RawMessage) map[string]json.RawMessage {
	t.Helper()
	var leg map[string]json.RawMessage
	if err := json.Unmarshal(raw, &leg); err != nil {
		t.Fatalf("decode body: %v: %s", err, raw)
	}
	for k, v := range client {
		switch k {
		case "stream", "stream_options", "kv_transfer_params":
			continue
		}
		if got, ok := leg[k]; !ok || compactJSON(t, got) != compactJSON(t, v) {
			t.Errorf("decode %q = %s, want the client's %s (R-LEG-3)", k, got, v)
		}
	}
	if !sameJSON(leg["stream"], []byte("true")) {
		t.Errorf("decode stream = %s, want true (R-LEG-5)", leg["stream"])
	}
	if !sameJSON(leg["stream_options"], []byte(`{"include_usage":true}`)) {
		t.Errorf("decode stream_options = %s, want {\"include_usage\":true} (R-LEG-5)", leg["stream_options"])
	}
	for _, k := range keys(leg) {
		if _, ok := client[k]; !ok && k != "stream" && k != "stream_options" && k != "kv_transfer_params" {
			t.Errorf("decode leg carries %q = %s, which the client did not send", k, leg[k])
		}
	}
	var kv map[string]json.RawMessage
	if err := json.Unmarshal(leg["kv_transfer_params"], &kv); err != nil || kv == nil {
		t.Fatalf("decode kv_transfer_params %s is not an object", leg["kv_transfer_params"])
	}
	return kv
}

// checkDescriptor checks the descriptor the consumer got: the producer's
// own, naming it and its KV side channel, with one block per
// sim.BlockSize prompt tokens (R-LEG-2, R-LEG-3, R-DESC-5).
func checkDescriptor(t *testing.T, kv map[string]json.RawMessage, producer *simProc, promptTokens int) {
	t.Helper()
	str := func(k string) string {
		var s string
		_ = json.Unmarshal(kv[k], &s)
		return s
	}
	if !sameJSON(kv["do_remote_prefill"], []byte("true")) || !sameJSON(kv["do_remote_decode"], []byte("false")) {
		t.Errorf("descriptor flags do_remote_prefill %s do_remote_decode %s", kv["do_remote_prefill"], kv["do_remote_decode"])
	}
	if got := str("remote_engine_id"); got != producer.id {
		t.Errorf("descriptor remote_engine_id %q, want the producer %q", got, producer.id)
	}
	var port int
	_ = json.Unmarshal(kv["remote_port"], &port)
	if got := hostPortString(str("remote_host"), port); got != producer.kvAddr {
		t.Errorf("descriptor remote_host:remote_port %s, want %s's side channel %s", got, producer.id, producer.kvAddr)
	}
	var blocks []int
	if err := json.Unmarshal(kv["remote_block_ids"], &blocks); err != nil || len(blocks) != (promptTokens+sim.BlockSize-1)/sim.BlockSize {
		t.Errorf("descriptor remote_block_ids %s for %d prompt tokens (%d per block)", kv["remote_block_ids"], promptTokens, sim.BlockSize)
	}
	for _, b := range blocks {
		if b < 0 {
			t.Errorf("negative block id in %s", kv["remote_block_ids"])
		}
	}
	// R-DESC-5: the fields the router does not interpret arrive unchanged.
	if str("remote_request_id") == "" || !sameJSON(kv["tp_size"], []byte("1")) {
		t.Errorf("descriptor lost opaque fields: remote_request_id %s tp_size %s", kv["remote_request_id"], kv["tp_size"])
	}
}

func hostPortString(host string, port int) string { return fmt.Sprintf("%s:%d", host, port) }

// checkRequestEvents checks every event the router published: each is
// valid against its schema (R-BUS-3); in this fault-free run each is a
// request-completed event on narwhal.events.request.e2e-router, exactly
// one per client request (R-BUS-1), with the request's outcome, engines,
// usage and both R-TIME-1 durations.
func checkRequestEvents(t *testing.T, events []bustest.Event, served []servedRequest, requests int) {
	t.Helper()
	byID := map[string][]*schemas.RequestCompleted{}
	payloads := map[*schemas.RequestCompleted][]byte{}
	var total int
	for _, ev := range events {
		if err := bus.ValidateEvent(ev.Payload); err != nil {
			t.Errorf("R-BUS-3: event on %s does not validate: %v: %s", ev.Subject, err, ev.Payload)
		}
		if ev.Subject != "narwhal.events.request."+meshRouterID {
			t.Errorf("unexpected event on %s in a fault-free run: %s", ev.Subject, ev.Payload)
			continue
		}
		var rc schemas.RequestCompleted
		if err := json.Unmarshal(ev.Payload, &rc); err != nil {
			t.Errorf("request event: %v: %s", err, ev.Payload)
			continue
		}
		total++
		byID[rc.RequestID] = append(byID[rc.RequestID], &rc)
		payloads[&rc] = ev.Payload
	}
	if total != requests {
		t.Errorf("%d request events for %d requests", total, requests)
	}
	for _, r := range served {
		evs := byID[r.requestID]
		if len(evs) != 1 {
			t.Errorf("request %s: %d request events, want exactly 1", r.requestID, len(evs))
			continue
		}
		ev := evs[0]
		if ev.RouterID != meshRouterID || ev.Status != 200 || ev.ErrorKind != "" || ev.Endpoint != r.endpoint || ev.Model != meshModel ||
			ev.Stream != r.stream || ev.Attempts != 1 || ev.ProducerID != r.producer || ev.ConsumerID != r.consumer ||
			ev.PromptTokens == nil || *ev.PromptTokens != r.promptTokens || ev.CompletionTokens == nil || *ev.CompletionTokens != r.completionTokens ||
			ev.EngineID != "" {
			t.Errorf("request %s: event %s, want status 200, attempts 1, no engine_id, %+v", r.requestID, payloads[ev], r)
		}
		if ev.TTFTSeconds == nil || ev.FirstByteSeconds == nil || *ev.TTFTSeconds <= 0 || *ev.TTFTSeconds > *ev.FirstByteSeconds || *ev.FirstByteSeconds > ev.DurationSeconds {
			t.Errorf("request %s: R-TIME-1 durations out of order (0 < ttft_s ≤ first_byte_s ≤ duration_s): %s", r.requestID, payloads[ev])
		}
	}
}
