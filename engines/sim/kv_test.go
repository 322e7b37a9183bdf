package sim

import (
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// handoffRequest is nixl's "please hand off" kv_transfer_params (R-LEG-1).
func handoffRequest() map[string]any {
	return map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
}

// runPrefill runs a prefill leg shaped as R-LEG-1/R-LEG-1a describe and
// returns the top-level kv_transfer_params (nil when null).
func runPrefill(t testing.TB, c *http.Client, url, path string, body map[string]any, reqID string) map[string]any {
	t.Helper()
	b := maps.Clone(body)
	b["stream"] = false
	delete(b, "stream_options")
	b["max_tokens"] = 1
	b["max_completion_tokens"] = 1
	b["ignore_eos"] = true
	b["kv_transfer_params"] = handoffRequest()
	resp := post(t, c, url+path, b, "X-Request-Id", reqID)
	raw := readBody(t, resp)
	if resp.StatusCode != 200 {
		t.Fatalf("prefill: status %d: %s", resp.StatusCode, raw)
	}
	var out struct {
		Choices []struct {
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("prefill body %s: %v", raw, err)
	}
	if string(out.KV) == "null" {
		return nil
	}
	var d map[string]any
	if err := json.Unmarshal(out.KV, &d); err != nil {
		t.Fatalf("descriptor %s: %v", out.KV, err)
	}
	return d
}

// decodeBody is a client request turned decode leg (R-LEG-3).
func decodeBody(body map[string]any, descriptor map[string]any) map[string]any {
	b := maps.Clone(body)
	b["kv_transfer_params"] = descriptor
	return b
}

// expectKVFailure runs a streaming decode leg and checks that it fails the
// way vLLM fails a KV transfer: HTTP 200, one error frame (code 500,
// InternalServerError, "KV transfer failed: <reason>…"), then [DONE].
func expectKVFailure(t testing.TB, c *http.Client, url, path string, body map[string]any, reason string) {
	t.Helper()
	evs := streamEvents(t, c, url+path, body)
	if len(evs) != 2 || !evs[1].done() {
		t.Fatalf("want an error frame then [DONE], got %v", evs)
	}
	ch := decodeChunk(t, evs[0])
	if ch.Error == nil || ch.Error.Code != 500 || ch.Error.Type != "InternalServerError" || ch.Error.Param != nil {
		t.Fatalf("not a vLLM error frame: %s", evs[0].data)
	}
	if want := "KV transfer failed: " + reason; !strings.HasPrefix(ch.Error.Message, want) {
		t.Fatalf("message %q, want prefix %q", ch.Error.Message, want)
	}
}

// longPrompt has 40 words: "user: " + 40 words renders to 41 prompt
// tokens, 3 KV blocks.
var longPrompt = strings.TrimSpace(strings.Repeat("ice ", 40))

// TestHandoffCrossedDecode: a prefill leg on producer p1 returns the nixl
// descriptor (vLLM's "Prefill response") and holds the blocks; a
// decode leg on consumer d1 pulls them over p1's side channel and streams
// exactly Generate's tokens (R-LEG-1, R-LEG-2, R-LEG-3).
func TestHandoffCrossedDecode(t *testing.T) {
	p, pURL := startEngine(t, Config{Role: RolePrefill, EngineID: "p1"})
	d, dURL := startEngine(t, Config{Role: RoleDecode, EngineID: "d1"})
	c := newClient(t)

	client := chatBody(longPrompt, "stream", true, "stream_options", map[string]any{"include_usage": true}, "max_tokens", 8, "seed", 3)
	desc := runPrefill(t, c, pURL, "/v1/chat/completions", client, "att-1")
	host, port, _ := net.SplitHostPort(p.KVAddr())
	portN, _ := strconv.Atoi(port)
	want := map[string]any{
		"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "p1",
		"remote_request_id": "chatcmpl-att-1", "remote_block_ids": []any{1.0, 2.0, 3.0},
		"remote_host": host, "remote_port": float64(portN), "tp_size": 1.0,
	}
	if fmt.Sprint(desc) != fmt.Sprint(want) {
		t.Fatalf("descriptor\n got %v\nwant %v", desc, want)
	}
	if st := p.Stats(); st.Prefills != 1 || st.KVHeld != 1 || st.KVServed != 0 {
		t.Fatalf("producer after prefill: %+v", st)
	}

	evs := streamEvents(t, c, dURL+"/v1/chat/completions", decodeBody(client, desc), "X-Request-Id", "att-1")
	toks, finish := Generate(chatPrompt(t, longPrompt), 3, 8, nil, false)
	if got := tokensOf(t, evs, 0); !slices.Equal(got, toks) {
		t.Fatalf("decode tokens %q, want %q", got, toks)
	}
	last := decodeChunk(t, evs[len(evs)-2])
	if last.Usage == nil || last.Usage.PromptTokens != 41 || last.Usage.CompletionTokens != len(toks) {
		t.Fatalf("usage chunk %s", evs[len(evs)-2].data)
	}
	if fin := decodeChunk(t, evs[len(evs)-3]); *fin.Choices[0].FinishReason != finish {
		t.Fatalf("finish %q, want %q", *fin.Choices[0].FinishReason, finish)
	}
	if st := p.Stats(); st.KVHeld != 0 || st.KVServed != 1 {
		t.Fatalf("producer after decode: %+v", st)
	}
	if st := d.Stats(); st.Decodes != 1 || st.KVPulled != 1 || st.KVPullFailures != 0 || st.Completed != 1 {
		t.Fatalf("consumer after decode: %+v", st)
	}
	recs := d.Requests()
	if len(recs) != 1 || recs[0].Phase != PhaseDecode || recs[0].RequestID != "att-1" {
		t.Fatalf("consumer recorded %+v", recs)
	}
}

// TestHandoffSameWorkerAndCompletions: a "both" engine can be its own
// consumer, and the handoff works on /v1/completions with a
// non-streaming decode.
func TestHandoffSameWorkerAndCompletions(t *testing.T) {
	s, url := startEngine(t, Config{Role: RoleBoth, EngineID: "b1"})
	c := newClient(t)
	client := completionBody("a short prompt", "max_tokens", 5, "ignore_eos", true)
	desc := runPrefill(t, c, url, "/v1/completions", client, "")
	if desc == nil || !strings.HasPrefix(desc["remote_request_id"].(string), "cmpl-") || len(desc["remote_block_ids"].([]any)) != 1 {
		t.Fatalf("descriptor %v", desc)
	}
	resp := post(t, c, url+"/v1/completions", decodeBody(client, desc))
	var out struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(readBody(t, resp), &out); err != nil || resp.StatusCode != 200 {
		t.Fatalf("decode %d %v", resp.StatusCode, err)
	}
	toks, _ := Generate("a short prompt", 0, 5, nil, true)
	if out.Choices[0].Text != strings.Join(toks, "") || string(out.KV) != "null" {
		t.Fatalf("decode text %q kv %s", out.Choices[0].Text, out.KV)
	}
	if st := s.Stats(); st.Prefills != 1 || st.Decodes != 1 || st.KVServed != 1 || st.KVPulled != 1 || st.KVHeld != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// TestHandoffFailures: every broken handoff fails the decode with vLLM's
// mid-stream error frame, and counts as a pull failure on the consumer.
func TestHandoffFailures(t *testing.T) {
	p, pURL := startEngine(t, Config{Role: RolePrefill, EngineID: "p1"})
	d, dURL := startEngine(t, Config{Role: RoleDecode, EngineID: "d1"})
	c := newClient(t)
	client := chatBody(longPrompt, "stream", true, "max_tokens", 4)
	chat := "/v1/chat/completions"

	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadPort := closed.Addr().(*net.TCPAddr).Port
	closed.Close()

	cases := []struct {
		name   string
		edit   func(t *testing.T, desc map[string]any) (path string, body map[string]any)
		reason string
		held   int64 // handoffs still held at the producer afterwards
	}{
		{"forged request id", func(t *testing.T, desc map[string]any) (string, map[string]any) {
			desc["remote_request_id"] = "chatcmpl-forged"
			return chat, decodeBody(client, desc)
		}, "unknown request id", 1},
		{"foreign engine id", func(t *testing.T, desc map[string]any) (string, map[string]any) {
			desc["remote_engine_id"] = "p2"
			return chat, decodeBody(client, desc)
		}, "foreign engine id", 1},
		{"missing engine id", func(t *testing.T, desc map[string]any) (string, map[string]any) {
			delete(desc, "remote_engine_id")
			return chat, decodeBody(client, desc)
		}, "foreign engine id", 1},
		{"other block ids", func(t *testing.T, desc map[string]any) (string, map[string]any) {
			desc["remote_block_ids"] = []int{999}
			return chat, decodeBody(client, desc)
		}, "block ids mismatch", 1},
		{"garbled block ids", func(t *testing.T, desc map[string]any) (string, map[string]any) {
			desc["remote_block_ids"] = []string{"17", "x"}
			return chat, decodeBody(client, desc)
		}, "block ids mismatch", 1},
		{"missing block ids", func(t *testing.T, desc map[string]any) (string, map[string]any) {
			delete(desc, "remote_block_ids")
			return chat, decodeBody(client, desc)
		}, "invalid handoff descriptor: remote_block_ids", 1},
		{"missing host", func(t *testing.T, desc map[string]any) (string, map[string]any) {
			desc["remote_host"] = nil
			return chat, decodeBody(client, desc)
		}, "invalid handoff descriptor: remote_host", 1},
		{"unreachable producer", func(t *testing.T, desc map[string]any) (string, map[string]any) {
			desc["remote_port"] = deadPort
			return chat, decodeBody(client, desc)
		}, "cannot reach producer", 1},
		{"already pulled", func(t *testing.T, desc map[string]any) (string, map[string]any) {
			streamEvents(t, c, dURL+chat, decodeBody(client, desc)) // first pull succeeds
			return chat, decodeBody(client, desc)
		}, "already pulled", 0},
		{"released", func(t *testing.T, desc map[string]any) (string, map[string]any) {
			resp := post(t, c, pURL+"/v1/kv/release", map[string]any{"remote_engine_id": desc["remote_engine_id"],
				"remote_request_id": desc["remote_request_id"], "remote_block_ids": desc["remote_block_ids"]})
			if b := readBody(t, resp); resp.StatusCode != 200 || string(b) != `{"released":true}` {
				t.Fatalf("release %d %s", resp.StatusCode, b)
			}
			return chat, decodeBody(client, desc)
		}, "unknown request id", 0},
		{"wrong prompt", func(t *testing.T, desc map[string]any) (string, map[string]any) {
			return chat, decodeBody(chatBody(longPrompt+" more", "stream", true), desc)
		}, "prompt mismatch", 0},
		{"endpoint mismatch", func(t *testing.T, desc map[string]any) (string, map[string]any) {
			// Same prompt text, other endpoint: chat and completions
			// tokenise differently (R-DESC-4).
			return "/v1/completions", decodeBody(completionBody(chatPrompt(t, longPrompt), "stream", true), desc)
		}, "prompt mismatch", 0},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before, pBefore := d.Stats(), p.Stats()
			desc := runPrefill(t, c, pURL, chat, client, fmt.Sprintf("f%d", i))
			path, body := tc.edit(t, desc)
			expectKVFailure(t, c, dURL, path, body, tc.reason)
			after := d.Stats()
			if after.KVPullFailures != before.KVPullFailures+1 || after.Completed > before.Completed+1 {
				t.Fatalf("consumer stats %+v -> %+v", before, after)
			}
			if got := p.Stats().KVHeld - pBefore.KVHeld; got != tc.held {
				t.Fatalf("producer holds %d more handoffs, want %d", got, tc.held)
			}
			p.kv.mu.Lock()
			clear(p.kv.holds) // isolate the cases
			p.kv.mu.Unlock()
		})
	}
}

// TestHandoffFailureNonStreaming: a non-streaming decode whose transfer
// fails gets HTTP 500 with the error body.
func TestHandoffFailureNonStreaming(t *testing.T) {
	_, pURL := startEngine(t, Config{EngineID: "p1"})
	_, dURL := startEngine(t, Config{EngineID: "d1"})
	c := newClient(t)
	client := chatBody("hello", "max_tokens", 4)
	desc := runPrefill(t, c, pURL, "/v1/chat/completions", client, "n1")
	desc["remote_request_id"] = "chatcmpl-other"
	resp := post(t, c, dURL+"/v1/chat/completions", decodeBody(client, desc))
	e := errorOf(t, resp.StatusCode, readBody(t, resp), 500)
	if !strings.HasPrefix(e.Message, "KV transfer failed: unknown request id") {
		t.Fatalf("message %q", e.Message)
	}
}

// TestHandoffExpires: unpulled blocks are released after KVTimeout by the
// producer's timer, and a late decode fails with "expired".
func TestHandoffExpires(t *testing.T) {
	p, pURL := startEngine(t, Config{EngineID: "p1", KVTimeout: 30 * time.Millisecond})
	_, dURL := startEngine(t, Config{EngineID: "d1"})
	c := newClient(t)
	client := chatBody("hello", "stream", true)
	desc := runPrefill(t, c, pURL, "/v1/chat/completions", client, "x1")
	testkit.WaitFor(t, 5*time.Second, "the handoff to expire", func() bool { st := p.Stats(); return st.KVExpired == 1 && st.KVHeld == 0 })
	expectKVFailure(t, c, dURL, "/v1/chat/completions", decodeBody(client, desc), "expired")
	if st := p.Stats(); st.KVServed != 0 || st.KVExpired != 1 {
		t.Fatalf("producer %+v", st)
	}
}

// TestKVStoreLazyExpiryAndTombstones drives the producer's store directly
// with a fake clock: expiry is enforced at pull time even without the
// timer, and each refusal has its own status.
func TestKVStoreLazyExpiryAndTombstones(t *testing.T) {
	var k kvStore
	k.init()
	t0 := time.Unix(1000, 0)
	timeout := time.Minute
	id, blocks := k.hold("r1", "dg", 2, t0)
	if id != "r1" || !slices.Equal(blocks, []int{1, 2}) {
		t.Fatalf("hold %q %v", id, blocks)
	}
	if id2, _ := k.hold("r1", "dg", 1, t0); id2 != "r1-1" {
		t.Fatalf("duplicate id held as %q", id2)
	}
	req := func(engine, id, blocks string) *pullRequest {
		return &pullRequest{RemoteEngineID: engine, RemoteRequestID: id, RemoteBlockIDs: json.RawMessage(blocks), ConsumerEngineID: "d9"}
	}
	for _, tc := range []struct {
		req    *pullRequest
		at     time.Time
		status int
		prefix string
	}{
		{req("p2", "r1", "[1,2]"), t0, http.StatusMisdirectedRequest, pullForeign},
		{req("p1", "nope", "[1,2]"), t0, http.StatusNotFound, pullUnknown},
		{req("p1", "r1", "[1,3]"), t0, http.StatusUnprocessableEntity, pullMismatch},
		{req("p1", "r1", "[1.0,2]"), t0, http.StatusUnprocessableEntity, pullMismatch},
		{req("p1", "r1", "[1,2]"), t0.Add(time.Second), http.StatusOK, ""},
		{req("p1", "r1", "[1,2]"), t0.Add(time.Second), http.StatusConflict, pullPulled},
		{req("p1", "r1-1", "[3]"), t0.Add(timeout), http.StatusGone, pullExpired},
		{req("p1", "r1-1", "[3]"), t0.Add(timeout), http.StatusGone, pullExpired},
	} {
		h, status, msg := k.pull("p1", tc.req, tc.at, timeout)
		if status != tc.status || !strings.HasPrefix(msg, tc.prefix) || (status == 200) != (h != nil) {
			t.Fatalf("pull %+v: %d %q, want %d %q", tc.req, status, msg, tc.status, tc.prefix)
		}
	}
	if k.served != 1 || k.expired != 1 || len(k.holds) != 0 || k.heldBlock != 0 {
		t.Fatalf("store served %d expired %d holds %d blocks %d", k.served, k.expired, len(k.holds), k.heldBlock)
	}
	if !strings.Contains(fmt.Sprint(k.tombs["r1"]), "d9") {
		t.Fatalf("tombstone %+v does not name the consumer", k.tombs["r1"])
	}
	for i := range tombstoneLimit + 1 {
		k.bury(fmt.Sprint("t", i), tombstone{})
	}
	if len(k.tombs) != tombstoneLimit {
		t.Fatalf("%d tombstones kept, limit %d", len(k.tombs), tombstoneLimit)
	}
}

// TestReleaseEndpoint: POST /v1/kv/release frees held blocks early (R-OWN-6);
// unknown, foreign or mismatched handoffs get 404.
func TestReleaseEndpoint(t *testing.T) {
	p, url := startEngine(t, Config{EngineID: "p1"})
	c := newClient(t)
	desc := runPrefill(t, c, url, "/v1/chat/completions", chatBody("release me"), "rel")
	release := func(body map[string]any) (int, []byte) {
		resp := post(t, c, url+"/v1/kv/release", body)
		return resp.StatusCode, readBody(t, resp)
	}
	for _, bad := range []map[string]any{
		{"remote_engine_id": "p2", "remote_request_id": desc["remote_request_id"]},
		{"remote_engine_id": "p1", "remote_request_id": "chatcmpl-nope"},
		{"remote_engine_id": "p1", "remote_request_id": desc["remote_request_id"], "remote_block_ids": []int{77}},
	} {
		st, b := release(bad)
		errorOf(t, st, b, 404)
	}
	// The connector sends null block ids when the descriptor had none.
	st, b := release(map[string]any{"remote_engine_id": "p1", "remote_request_id": desc["remote_request_id"], "remote_block_ids": nil})
	if st != 200 || string(b) != `{"released":true}` {
		t.Fatalf("release %d %s", st, b)
	}
	if s := p.Stats(); s.KVReleased != 1 || s.KVHeld != 0 {
		t.Fatalf("stats %+v", s)
	}
	st, b = release(map[string]any{"remote_engine_id": "p1", "remote_request_id": desc["remote_request_id"]})
	errorOf(t, st, b, 404)
}

// TestPrefillWithoutLengthCapHasNoDescriptor: a prefill leg that ends by a
// stop (here a stop string on its only token) returns kv_transfer_params
// null and holds nothing — why R-LEG-1a drops stop from prefill legs.
func TestPrefillWithoutLengthCapHasNoDescriptor(t *testing.T) {
	p, url := startEngine(t, Config{EngineID: "p1"})
	c := newClient(t)
	toks, _ := Generate(chatPrompt(t, "stop early"), 0, 1, nil, true)
	b := chatBody("stop early", "max_tokens", 1, "ignore_eos", true, "stop", toks[0], "kv_transfer_params", handoffRequest())
	resp := post(t, c, url+"/v1/chat/completions", b)
	var out struct {
		Choices []struct {
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(readBody(t, resp), &out); err != nil {
		t.Fatal(err)
	}
	if out.Choices[0].FinishReason != FinishStop || string(out.KV) != "null" {
		t.Fatalf("finish %q kv %s", out.Choices[0].FinishReason, out.KV)
	}
	if st := p.Stats(); st.KVHeld != 0 || st.Prefills != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestDecodeWithoutTransferRecomputes: a decode engine serves a request
// without kv_transfer_params by recomputing (R-LEG-4); nothing is pulled.
func TestDecodeWithoutTransferRecomputes(t *testing.T) {
	d, url := startEngine(t, Config{Role: RoleDecode, EngineID: "d1"})
	c := newClient(t)
	evs := streamEvents(t, c, url+"/v1/chat/completions", chatBody("plain", "stream", true, "kv_transfer_params", map[string]any{"do_remote_prefill": false}))
	toks, _ := Generate(chatPrompt(t, "plain"), 0, DefaultMaxTokens, nil, false)
	if got := tokensOf(t, evs, 0); !slices.Equal(got, toks) {
		t.Fatalf("tokens %q, want %q", got, toks)
	}
	if st := d.Stats(); st.KVPulled != 0 || st.KVPullFailures != 0 || st.Decodes != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestLatencies: TTFT, ITL and PrefillPerToken delay the response by at
// least their configured amounts (lower bounds only).
func TestLatencies(t *testing.T) {
	_, url := startEngine(t, Config{TTFT: 40 * time.Millisecond, ITL: 15 * time.Millisecond, PrefillPerToken: 10 * time.Millisecond})
	c := newClient(t)
	start := time.Now()
	resp := post(t, c, url+"/v1/completions", completionBody("one two three", "stream", true, "max_tokens", 4, "ignore_eos", true))
	defer resp.Body.Close()
	sr := newSSEReader(resp.Body)
	if _, err := sr.next(); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el < 30*time.Millisecond+40*time.Millisecond {
		t.Fatalf("first token after %v, want at least prefill 30ms + TTFT 40ms", el)
	}
	first := time.Now()
	for range 3 {
		if _, err := sr.next(); err != nil {
			t.Fatal(err)
		}
	}
	if el := time.Since(first); el < 3*15*time.Millisecond {
		t.Fatalf("3 more tokens in %v, want at least 3 ITL", el)
	}
}
