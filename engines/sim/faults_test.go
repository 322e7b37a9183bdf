package sim

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// streamReq is a 6-token streaming chat request that never stops early.
func streamReq() map[string]any {
	return chatBody("fault please", "stream", true, "max_tokens", 6, "ignore_eos", true)
}

// kinds returns the kind of each event: "role", "token", "empty",
// "finish", "usage", "error", "comment" or "done".
func kinds(t testing.TB, evs []sseEvent) []string {
	t.Helper()
	var out []string
	for _, ev := range evs {
		switch {
		case ev.comment:
			out = append(out, "comment")
		case ev.done():
			out = append(out, "done")
		default:
			c := decodeChunk(t, ev)
			switch {
			case c.Error != nil:
				out = append(out, "error")
			case c.Usage != nil:
				out = append(out, "usage")
			case c.Choices[0].FinishReason != nil:
				out = append(out, "finish")
			case c.Choices[0].Delta != nil && c.Choices[0].Delta.Role != nil:
				out = append(out, "role")
			default:
				if _, ok := c.contentOf(); ok {
					out = append(out, "token")
				} else {
					out = append(out, "empty")
				}
			}
		}
	}
	return out
}

func join(k []string) string { return strings.Join(k, ",") }

// TestFaultHeaderDelay: no header before DelayMS (R-TMO-1 budget).
func TestFaultHeaderDelay(t *testing.T) {
	_, url := startEngine(t, Config{Faults: []Fault{{Kind: FaultHeaderDelay, DelayMS: 120}}})
	c := newClient(t)
	start := time.Now()
	resp := post(t, c, url+"/v1/chat/completions", streamReq())
	if el := time.Since(start); el < 120*time.Millisecond {
		t.Fatalf("headers after %v, want at least 120ms", el)
	}
	evs, err := readAllSSE(resp.Body)
	resp.Body.Close()
	if err != nil || join(kinds(t, evs)) != "role,token,token,token,token,token,token,finish,done" {
		t.Fatalf("stream after the delay: %v %v", kinds(t, evs), err)
	}
}

// TestFaultFirstTokenDelay: role chunk at once, then metadata only —
// alternating keep-alive comments and empty deltas every IntervalMS —
// until DelayMS, then the tokens (R-TMO-1: metadata is not a token).
func TestFaultFirstTokenDelay(t *testing.T) {
	_, url := startEngine(t, Config{Faults: []Fault{{Kind: FaultFirstTokenDelay, DelayMS: 100, IntervalMS: 30}}})
	c := newClient(t)
	start := time.Now()
	evs := streamEvents(t, c, url+"/v1/chat/completions", streamReq())
	if el := time.Since(start); el < 100*time.Millisecond {
		t.Fatalf("stream done after %v, want at least 100ms", el)
	}
	if got := join(kinds(t, evs)); got != "role,comment,empty,comment,token,token,token,token,token,token,finish,done" {
		t.Fatalf("events %s", got)
	}
	if evs[1].data != ": keep-alive" {
		t.Fatalf("comment %q", evs[1].data)
	}
}

// TestFaultSilence: after AfterTokens tokens only keep-alive comments
// arrive (R-TMO-2/3); a client that gives up is counted as an abort.
// With DelayMS the stream then ends without [DONE] (R-FAIL-2).
func TestFaultSilence(t *testing.T) {
	s, url := startEngine(t, Config{})
	c := newClient(t)

	s.Arm(Fault{Kind: FaultSilence, AfterTokens: 2, IntervalMS: 5, Count: 1})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp, err := postCtx(ctx, c, url+"/v1/chat/completions", streamReq())
	if err != nil {
		t.Fatal(err)
	}
	sr := newSSEReader(resp.Body)
	var got []sseEvent
	for len(got) < 6 {
		ev, err := sr.next()
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, ev)
	}
	if k := join(kinds(t, got)); k != "role,token,token,comment,comment,comment" {
		t.Fatalf("events %s", k)
	}
	cancel()
	resp.Body.Close()
	testkit.WaitFor(t, 5*time.Second, "the abort", func() bool { st := s.Stats(); return st.Aborted == 1 && st.ActiveStreams == 0 })

	s.Arm(Fault{Kind: FaultSilence, AfterTokens: 3, DelayMS: 40, Count: 1})
	start := time.Now()
	evs := streamEvents(t, c, url+"/v1/chat/completions", streamReq())
	if el := time.Since(start); el < 40*time.Millisecond {
		t.Fatalf("silence lasted %v, want at least 40ms", el)
	}
	if k := join(kinds(t, evs)); k != "role,token,token,token" {
		t.Fatalf("events %s, want the stream to end without finish or [DONE]", k)
	}
	if st := s.Stats(); st.Completed != 0 {
		t.Fatalf("a silenced stream counted as completed: %+v", st)
	}
}

// TestFaultClose: the stream ends cleanly after AfterTokens tokens,
// without [DONE] (R-FAIL-2).
func TestFaultClose(t *testing.T) {
	_, url := startEngine(t, Config{Faults: []Fault{{Kind: FaultClose, AfterTokens: 3}}})
	c := newClient(t)
	evs := streamEvents(t, c, url+"/v1/completions", completionBody("x", "stream", true, "max_tokens", 6, "ignore_eos", true))
	if k := join(kinds(t, evs)); k != "token,token,token" {
		t.Fatalf("events %s", k)
	}
	// AfterTokens beyond the stream strikes before the finish chunk.
	_, url = startEngine(t, Config{EngineID: "e2", Faults: []Fault{{Kind: FaultClose, AfterTokens: 50}}})
	evs = streamEvents(t, c, url+"/v1/chat/completions", streamReq())
	if k := join(kinds(t, evs)); k != "role,token,token,token,token,token,token" {
		t.Fatalf("events %s", k)
	}
}

// TestFaultAbort: the connection breaks after AfterTokens tokens: the
// client sees a transport error, not a clean end.
func TestFaultAbort(t *testing.T) {
	_, url := startEngine(t, Config{Faults: []Fault{{Kind: FaultAbort, AfterTokens: 1}}})
	c := newClient(t)
	resp := post(t, c, url+"/v1/chat/completions", streamReq())
	defer resp.Body.Close()
	evs, err := readAllSSE(resp.Body)
	if err == nil {
		t.Fatal("abort ended the body cleanly")
	}
	if k := join(kinds(t, evs)); k != "role,token" {
		t.Fatalf("events before the abort: %s", k)
	}

	// A non-streaming prefill leg aborted: no response at all.
	_, err = postCtx(context.Background(), c, url+"/v1/chat/completions", chatBody("x", "kv_transfer_params", handoffRequest()))
	if err == nil {
		t.Fatal("aborted prefill returned a response")
	}
}

// TestFaultDoneBeforeToken: role chunk, then [DONE] (R-FAIL-3).
func TestFaultDoneBeforeToken(t *testing.T) {
	_, url := startEngine(t, Config{Faults: []Fault{{Kind: FaultDoneBeforeToken}}})
	c := newClient(t)
	if k := join(kinds(t, streamEvents(t, c, url+"/v1/chat/completions", streamReq()))); k != "role,done" {
		t.Fatalf("events %s", k)
	}
	// It does not apply to non-streaming requests.
	resp := post(t, c, url+"/v1/chat/completions", chatBody("x"))
	if readBody(t, resp); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
}

// TestFaultImmediateStop: a legal empty completion — role, an empty chunk
// with finish_reason "stop", usage with 0 completion tokens, [DONE].
func TestFaultImmediateStop(t *testing.T) {
	_, url := startEngine(t, Config{Faults: []Fault{{Kind: FaultImmediateStop}}})
	c := newClient(t)
	b := streamReq()
	b["stream_options"] = map[string]any{"include_usage": true}
	evs := streamEvents(t, c, url+"/v1/chat/completions", b)
	if k := join(kinds(t, evs)); k != "role,finish,usage,done" {
		t.Fatalf("events %s", k)
	}
	fin := decodeChunk(t, evs[1])
	if *fin.Choices[0].FinishReason != "stop" || *fin.Choices[0].Delta.Content != "" {
		t.Fatalf("stop chunk %s", evs[1].data)
	}
	if u := decodeChunk(t, evs[2]).Usage; u.CompletionTokens != 0 {
		t.Fatalf("usage %+v", u)
	}
	evs = streamEvents(t, c, url+"/v1/completions", completionBody("x", "stream", true))
	if k := join(kinds(t, evs)); k != "empty,finish,done" {
		t.Fatalf("completions events %s", k)
	}
}

// TestFaultErrorObject: after AfterTokens tokens one error frame with the
// fault's status as code, then [DONE] (R-FAIL-4).
func TestFaultErrorObject(t *testing.T) {
	_, url := startEngine(t, Config{Faults: []Fault{{Kind: FaultErrorObject, AfterTokens: 2, Status: 503, Message: "overloaded"}}})
	c := newClient(t)
	evs := streamEvents(t, c, url+"/v1/chat/completions", streamReq())
	if k := join(kinds(t, evs)); k != "role,token,token,error,done" {
		t.Fatalf("events %s", k)
	}
	if e := decodeChunk(t, evs[3]).Error; e.Code != 503 || e.Type != "ServiceUnavailableError" || e.Message != "overloaded" {
		t.Fatalf("error frame %s", evs[3].data)
	}

	// A code that is no HTTP status is sent as is (R-FAIL-4 maps it).
	_, url = startEngine(t, Config{EngineID: "e2", Faults: []Fault{{Kind: FaultErrorObject, Status: 42, Message: "odd"}}})
	evs = streamEvents(t, c, url+"/v1/chat/completions", streamReq())
	if k := join(kinds(t, evs)); k != "role,error,done" {
		t.Fatalf("events %s", k)
	}
	if evs[1].data != `{"error":{"message":"odd","type":"InternalServerError","param":null,"code":42}}` {
		t.Fatalf("error frame %s", evs[1].data)
	}
	resp := post(t, c, url+"/v1/chat/completions", chatBody("x"))
	if b := readBody(t, resp); resp.StatusCode != 500 || string(b) != evs[1].data {
		t.Fatalf("non-streaming: %d %s", resp.StatusCode, b)
	}
}

// TestFaultStatus: HTTP Status with a vLLM error body (R-FAIL-6), counted
// per request and limited to its phase.
func TestFaultStatus(t *testing.T) {
	s, url := startEngine(t, Config{})
	c := newClient(t)
	s.Arm(Fault{Kind: FaultStatus, Phase: PhasePrefill, Count: 1, Status: 429, Message: "busy"})
	// A decode is not hit, and does not spend the count.
	resp := post(t, c, url+"/v1/chat/completions", chatBody("x"))
	if readBody(t, resp); resp.StatusCode != 200 {
		t.Fatalf("decode hit by a prefill fault: %d", resp.StatusCode)
	}
	if f := s.Faults(); len(f) != 1 || f[0].Count != 1 {
		t.Fatalf("armed %+v", f)
	}
	resp = post(t, c, url+"/v1/chat/completions", chatBody("x", "kv_transfer_params", handoffRequest()))
	if e := errorOf(t, resp.StatusCode, readBody(t, resp), 429); e.Message != "busy" {
		t.Fatalf("message %q", e.Message)
	}
	if f := s.Faults(); len(f) != 0 {
		t.Fatalf("spent fault still armed: %+v", f)
	}
	resp = post(t, c, url+"/v1/chat/completions", chatBody("x", "kv_transfer_params", handoffRequest()))
	if readBody(t, resp); resp.StatusCode != 200 {
		t.Fatalf("second prefill: %d", resp.StatusCode)
	}
}

// TestFaultTrickle: DelayMS between tokens.
func TestFaultTrickle(t *testing.T) {
	_, url := startEngine(t, Config{Faults: []Fault{{Kind: FaultTrickle, DelayMS: 25}}})
	c := newClient(t)
	start := time.Now()
	evs := streamEvents(t, c, url+"/v1/chat/completions", streamReq())
	if el := time.Since(start); el < 5*25*time.Millisecond {
		t.Fatalf("6 tokens in %v, want at least 5 gaps of 25ms", el)
	}
	if k := join(kinds(t, evs)); k != "role,token,token,token,token,token,token,finish,done" {
		t.Fatalf("events %s", k)
	}
}

// TestFaultDescriptors: descriptor corruption on prefill legs (R-DESC-0…3).
// Corrupted descriptors still hold the blocks (the engine did hand off);
// no-descriptor holds none.
func TestFaultDescriptors(t *testing.T) {
	s, url := startEngine(t, Config{EngineID: "p1"})
	c := newClient(t)
	prefill := func() json.RawMessage {
		resp := post(t, c, url+"/v1/chat/completions", chatBody("descriptor", "max_tokens", 1, "ignore_eos", true, "kv_transfer_params", handoffRequest()))
		var out struct {
			KV json.RawMessage `json:"kv_transfer_params"`
		}
		if err := json.Unmarshal(readBody(t, resp), &out); err != nil || resp.StatusCode != 200 {
			t.Fatalf("prefill %d %v", resp.StatusCode, err)
		}
		return out.KV
	}
	check := func(kind string, held int64, ok func(map[string]json.RawMessage) bool) {
		t.Helper()
		s.Arm(Fault{Kind: kind, Count: 1})
		before := s.Stats().KVHeld
		raw := prefill()
		var d map[string]json.RawMessage
		_ = json.Unmarshal(raw, &d)
		if !ok(d) {
			t.Fatalf("%s: descriptor %s", kind, raw)
		}
		if got := s.Stats().KVHeld - before; got != held {
			t.Fatalf("%s: %d handoffs held, want %d", kind, got, held)
		}
	}
	check(FaultNoDescriptor, 0, func(d map[string]json.RawMessage) bool { return d == nil })
	check(FaultDropEngineID, 1, func(d map[string]json.RawMessage) bool {
		_, has := d["remote_engine_id"]
		return !has && string(d["do_remote_prefill"]) == "true" && len(d["remote_block_ids"]) > 0
	})
	check(FaultGarbleBlockIDs, 1, func(d map[string]json.RawMessage) bool {
		var ids []string
		return json.Unmarshal(d["remote_block_ids"], &ids) == nil && len(ids) == 2 && ids[1] == "x"
	})
	check(FaultChangeConnectorShape, 1, func(d map[string]json.RawMessage) bool {
		_, has := d["lmcache_key"]
		return has && len(d) == 1
	})
	// Spent: the next prefill gets a clean descriptor.
	var d map[string]any
	if err := json.Unmarshal(prefill(), &d); err != nil || d["remote_engine_id"] != "p1" {
		t.Fatalf("clean descriptor %v", d)
	}
	// Descriptor faults do not touch decodes.
	s.Arm(Fault{Kind: FaultNoDescriptor, Count: 1})
	resp := post(t, c, url+"/v1/chat/completions", chatBody("x"))
	readBody(t, resp)
	if f := s.Faults(); len(f) != 1 {
		t.Fatalf("a decode spent a descriptor fault: %+v", f)
	}
}

// TestFaultHealthAndModels: /health answers the fault's status and
// /v1/models lists another model (R-BRK-6 lifecycle validation).
func TestFaultHealthAndModels(t *testing.T) {
	s, url := startEngine(t, Config{})
	c := newClient(t)
	s.Arm(Fault{Kind: FaultHealthStatus, Count: 1})
	if st, _ := get(t, c, url+"/health"); st != 503 {
		t.Fatalf("/health %d", st)
	}
	if st, _ := get(t, c, url+"/health"); st != 200 {
		t.Fatalf("/health after the fault %d", st)
	}
	s.Arm(Fault{Kind: FaultWrongModel, Message: "llama"})
	_, b := get(t, c, url+"/v1/models")
	if !strings.Contains(string(b), `"id":"llama"`) {
		t.Fatalf("/v1/models %s", b)
	}
	s.Disarm()
	_, b = get(t, c, url+"/v1/models")
	if !strings.Contains(string(b), `"id":"m"`) {
		t.Fatalf("/v1/models after Disarm %s", b)
	}
}

// TestFaultsNonStreaming: silence and close on a non-streaming request
// (the prefill leg): silence breaks the connection after the hold, close
// cuts the body short.
func TestFaultsNonStreaming(t *testing.T) {
	s, url := startEngine(t, Config{})
	c := newClient(t)
	s.Arm(Fault{Kind: FaultSilence, Phase: PhasePrefill, DelayMS: 30, Count: 1})
	start := time.Now()
	_, err := postCtx(context.Background(), c, url+"/v1/chat/completions", chatBody("x", "kv_transfer_params", handoffRequest()))
	if err == nil || time.Since(start) < 30*time.Millisecond {
		t.Fatalf("silent prefill: err %v after %v", err, time.Since(start))
	}
	s.Arm(Fault{Kind: FaultClose, Count: 1})
	resp := post(t, c, url+"/v1/completions", completionBody("x"))
	defer resp.Body.Close()
	if _, err := io.ReadAll(resp.Body); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("closed body read: %v", err)
	}
	s.Arm(Fault{Kind: FaultErrorObject, Count: 1, Status: 502})
	resp = post(t, c, url+"/v1/completions", completionBody("x"))
	errorOf(t, resp.StatusCode, readBody(t, resp), 502)
}

// TestFaultsOverHTTP: POST /sim/faults arms an object or an array, GET
// lists them, DELETE disarms; invalid faults are refused whole.
func TestFaultsOverHTTP(t *testing.T) {
	s, url := startEngine(t, Config{})
	c := newClient(t)
	resp := post(t, c, url+"/sim/faults", `{"kind":"status","status":503,"count":2}`)
	readBody(t, resp)
	resp = post(t, c, url+"/sim/faults", `[{"kind":"trickle","delay_ms":1,"phase":"decode"},{"kind":"health-status"}]`)
	if b := readBody(t, resp); resp.StatusCode != 200 {
		t.Fatalf("arm array %d %s", resp.StatusCode, b)
	}
	st, b := get(t, c, url+"/sim/faults")
	var armed []Fault
	if err := json.Unmarshal(b, &armed); err != nil || st != 200 || len(armed) != 3 || armed[0].Kind != FaultStatus || armed[0].Count != 2 || armed[1].Phase != PhaseDecode {
		t.Fatalf("GET /sim/faults %d %s", st, b)
	}
	for _, bad := range []string{`{"kind":"explode"}`, `{"kind":"status","phase":"later"}`, `[{"kind":"close"},{"kind":"close","count":-1}]`, `{"kind":"close","colour":"red"}`, `not json`} {
		resp := post(t, c, url+"/sim/faults", bad)
		errorOf(t, resp.StatusCode, readBody(t, resp), 400)
	}
	if got := len(s.Faults()); got != 3 {
		t.Fatalf("invalid posts changed the armed faults: %d", got)
	}
	req, _ := http.NewRequest(http.MethodDelete, url+"/sim/faults", nil)
	dr, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	readBody(t, dr)
	if dr.StatusCode != http.StatusNoContent || len(s.Faults()) != 0 {
		t.Fatalf("DELETE %d, still armed %+v", dr.StatusCode, s.Faults())
	}
	st, b = get(t, c, url+"/sim/stats")
	var stats Stats
	if err := json.Unmarshal(b, &stats); err != nil || st != 200 {
		t.Fatalf("/sim/stats %d %s", st, b)
	}
	if !strings.Contains(string(b), `"kv_pull_failures":0`) || !strings.Contains(string(b), `"active_streams":0`) {
		t.Fatalf("/sim/stats field names %s", b)
	}
}

// TestParseFaults: the --fault flag's parser.
func TestParseFaults(t *testing.T) {
	f, err := ParseFaults([]byte(` {"kind":"silence","phase":"decode","after_tokens":2,"delay_ms":5,"interval_ms":1} `))
	if err != nil || len(f) != 1 || f[0] != (Fault{Kind: FaultSilence, Phase: PhaseDecode, AfterTokens: 2, DelayMS: 5, IntervalMS: 1}) {
		t.Fatalf("%+v %v", f, err)
	}
	if _, err := ParseFaults([]byte(`{"kind":"error-object","status":42}`)); err != nil {
		t.Fatalf("error-object with a non-HTTP code: %v", err)
	}
	for _, bad := range []string{``, `{}`, `{"kind":"status","status":1000}`, `{"kind":"health-status","status":42}`, `{"kind":"close"} {"kind":"close"}`} {
		if _, err := ParseFaults([]byte(bad)); err == nil {
			t.Errorf("ParseFaults(%q) succeeded", bad)
		}
	}
}

// TestFaultDecodeRefusesHandoff: a decode leg carrying a descriptor is
// refused with 400 in vLLM's shape, naming kv_transfer_params as llm-d's
// simulator did (behaviour.md R-FAIL-10); prefill legs and decodes
// without a handoff are not hit and do not spend the count.
func TestFaultDecodeRefusesHandoff(t *testing.T) {
	s, url := startEngine(t, Config{})
	c := newClient(t)
	s.Arm(Fault{Kind: FaultDecodeRefusesHandoff, Count: 1})
	for _, body := range []map[string]any{chatBody("x"), chatBody("x", "kv_transfer_params", handoffRequest())} {
		resp := post(t, c, url+"/v1/chat/completions", body)
		if readBody(t, resp); resp.StatusCode != 200 {
			t.Fatalf("a request without a handoff to consume was hit: %d", resp.StatusCode)
		}
	}
	if f := s.Faults(); len(f) != 1 || f[0].Count != 1 {
		t.Fatalf("armed %+v", f)
	}
	descriptor := map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "p1",
		"remote_block_ids": []int{1, 2}, "remote_host": "127.0.0.1", "remote_port": 1}
	resp := post(t, c, url+"/v1/chat/completions", chatBody("x", "stream", true, "kv_transfer_params", descriptor))
	if e := errorOf(t, resp.StatusCode, readBody(t, resp), 400); e.Message != RefusalMessageNixl || e.Type != "BadRequestError" {
		t.Fatalf("refusal %+v", e)
	}
	if f := s.Faults(); len(f) != 0 {
		t.Fatalf("spent fault still armed: %+v", f)
	}
	if _, err := ParseFaults([]byte(`{"kind":"decode-refuses-handoff","phase":"decode","status":422,"message":"bootstrap_room"}`)); err != nil {
		t.Fatal(err)
	}
}
