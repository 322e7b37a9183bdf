package schemas

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"
)

func mustParse(t *testing.T, endpoint, body string) *Request {
	t.Helper()
	r, err := ParseRequest(endpoint, []byte(body))
	if err != nil {
		t.Fatalf("parse %s: %v", body, err)
	}
	return r
}

func decodeObject(t *testing.T, b []byte) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("not a JSON object: %s: %v", b, err)
	}
	return m
}

func jsonEqual(t *testing.T, a, b json.RawMessage) bool {
	t.Helper()
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	return reflect.DeepEqual(x, y)
}

const clientChat = `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f","parameters":{}}}],
"chat_template_kwargs":{"enable_thinking":false},"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":false},
"max_tokens":64,"max_completion_tokens":64,"n":2,"temperature":0.7,"top_p":0.9,"top_k":40,"seed":7,"stop":["\n\n"],"stop_token_ids":[2],
"logprobs":true,"top_logprobs":3,"presence_penalty":0.1,"frequency_penalty":0.2,"min_tokens":4,"ignore_eos":false,
"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"evil","remote_block_ids":[1]}}`

const handoff = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

func TestPrefillBodyRLEG1(t *testing.T) {
	r := mustParse(t, EndpointChat, clientChat)
	got := decodeObject(t, r.AppendPrefillBody(nil, []byte(handoff)))
	orig := decodeObject(t, []byte(clientChat))
	// R-LEG-1: non-streaming, one token, n=1, handoff parameters.
	for k, want := range map[string]string{"stream": "false", "max_tokens": "1", "max_completion_tokens": "1", "n": "1", "ignore_eos": "true"} {
		if string(got[k]) != want {
			t.Errorf("%s = %s, want %s", k, got[k], want)
		}
	}
	if _, ok := got["stream_options"]; ok {
		t.Error("stream_options kept")
	}
	if !jsonEqual(t, got["kv_transfer_params"], json.RawMessage(handoff)) {
		t.Errorf("kv_transfer_params = %s", got["kv_transfer_params"])
	}
	// R-LEG-1a: early-stop and output-only options dropped.
	for _, k := range []string{"stop", "stop_token_ids", "logprobs", "top_logprobs", "echo", "best_of", "min_tokens"} {
		if _, ok := got[k]; ok {
			t.Errorf("%s kept in the prefill", k)
		}
	}
	// Everything that shapes the prompt is unchanged, byte for byte.
	for _, k := range []string{"model", "messages", "tools", "chat_template_kwargs", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty"} {
		if string(got[k]) != string(orig[k]) {
			t.Errorf("%s changed: %s → %s", k, orig[k], got[k])
		}
	}
}

func TestDecodeBodyRLEG3And5(t *testing.T) {
	r := mustParse(t, EndpointChat, clientChat)
	desc := `{"do_remote_prefill":true,"remote_engine_id":"p","remote_block_ids":[1,2],"opaque":"x"}`
	got := decodeObject(t, r.AppendDecodeBody(nil, []byte(desc)))
	orig := decodeObject(t, []byte(clientChat))
	// R-LEG-3: the client's originals, output limit and sampling unchanged.
	for k, v := range orig {
		switch k {
		case "stream", "stream_options", "kv_transfer_params":
			continue
		}
		if string(got[k]) != string(v) {
			t.Errorf("%s changed: %s → %s", k, v, got[k])
		}
	}
	// The descriptor byte for byte (R-DESC-5), not the client's (R-API-5).
	if string(got["kv_transfer_params"]) != desc {
		t.Errorf("kv_transfer_params = %s", got["kv_transfer_params"])
	}
	// R-LEG-5: always streamed, with usage; the client's other stream options kept.
	if string(got["stream"]) != "true" {
		t.Errorf("stream = %s", got["stream"])
	}
	if !jsonEqual(t, got["stream_options"], json.RawMessage(`{"include_usage":true,"continuous_usage_stats":false}`)) {
		t.Errorf("stream_options = %s", got["stream_options"])
	}
	// A non-streaming client's decode is still a stream.
	ns := mustParse(t, EndpointCompletions, `{"model":"m","prompt":"p","stream":false}`)
	got = decodeObject(t, ns.AppendDecodeBody(nil, nil))
	if string(got["stream"]) != "true" || !jsonEqual(t, got["stream_options"], json.RawMessage(`{"include_usage":true}`)) {
		t.Errorf("non-streaming client's decode: %v", got)
	}
}

func TestSameWorkerHasNoTransferParamsRLEG4(t *testing.T) {
	// R-LEG-4: "removed" means absent from the JSON, client-supplied ones included.
	r := mustParse(t, EndpointChat, clientChat)
	for name, b := range map[string][]byte{"prefill": r.AppendPrefillBody(nil, nil), "decode": r.AppendDecodeBody(nil, nil)} {
		if _, ok := decodeObject(t, b)["kv_transfer_params"]; ok {
			t.Errorf("%s leg carries kv_transfer_params: %s", name, b)
		}
	}
}

func TestClientTransferParamsRemovedRAPI5(t *testing.T) {
	r := mustParse(t, EndpointChat, clientChat)
	if _, ok := r.Member("kv_transfer_params"); ok {
		t.Fatal("client kv_transfer_params kept")
	}
	if m, ok := r.Member("model"); !ok || string(m) != `"m"` {
		t.Fatalf("Member(model) = %s %v", m, ok)
	}
}

func TestParsedFields(t *testing.T) {
	r := mustParse(t, EndpointChat, clientChat)
	if r.Model != "m" || !r.Stream || !r.IncludeUsage || r.N != 2 || r.MaxTokens != 64 || !r.Chat() {
		t.Fatalf("parsed %+v", r)
	}
	r = mustParse(t, EndpointCompletions, `{"model":"m","prompt":["a"],"max_tokens":5}`)
	if r.Stream || r.IncludeUsage || r.N != 1 || r.MaxTokens != 5 || r.Chat() {
		t.Fatalf("parsed %+v", r)
	}
}

func TestParseRequestRejectsRAPI4(t *testing.T) {
	cases := []struct {
		name, endpoint, body, param string
	}{
		{"invalid JSON", EndpointChat, `{"model":`, ""},
		{"not an object", EndpointChat, `[1]`, ""},
		{"empty body", EndpointChat, ``, ""},
		{"null body", EndpointChat, `null`, ""},
		{"missing model", EndpointChat, `{"messages":[{"role":"user","content":"x"}]}`, "model"},
		{"null model", EndpointChat, `{"model":null,"messages":[{"role":"user","content":"x"}]}`, "model"},
		{"empty model", EndpointChat, `{"model":"","messages":[{"role":"user","content":"x"}]}`, "model"},
		{"model not string", EndpointChat, `{"model":3,"messages":[{"role":"user","content":"x"}]}`, "model"},
		{"missing messages", EndpointChat, `{"model":"m"}`, "messages"},
		{"messages not array", EndpointChat, `{"model":"m","messages":"hi"}`, "messages"},
		{"empty messages", EndpointChat, `{"model":"m","messages":[]}`, "messages"},
		{"missing prompt", EndpointCompletions, `{"model":"m"}`, "prompt"},
		{"max_tokens 0", EndpointCompletions, `{"model":"m","prompt":"p","max_tokens":0}`, "max_tokens"},
		{"max_tokens negative", EndpointCompletions, `{"model":"m","prompt":"p","max_tokens":-3}`, "max_tokens"},
		{"max_tokens float", EndpointCompletions, `{"model":"m","prompt":"p","max_tokens":1.5}`, "max_tokens"},
		{"max_completion_tokens 0", EndpointChat, `{"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}`, "max_completion_tokens"},
		{"stream not bool", EndpointChat, `{"model":"m","messages":[{"role":"user","content":"x"}],"stream":"yes"}`, "stream"},
		{"n zero", EndpointChat, `{"model":"m","messages":[{"role":"user","content":"x"}],"n":0}`, "n"},
		{"stream_options not object", EndpointChat, `{"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":3}`, "stream_options"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := ParseRequest(c.endpoint, []byte(c.body))
			var re *RequestError
			if !errors.As(err, &re) {
				t.Fatalf("error %v", err)
			}
			if re.Status != 400 || re.Message == "" || re.Param != c.param {
				t.Fatalf("got %+v, want 400 with param %q", re, c.param)
			}
		})
	}
}

func FuzzParseRequest(f *testing.F) {
	f.Add([]byte(clientChat))
	f.Add([]byte(`{"model":"m","prompt":"x"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := ParseRequest(EndpointChat, b)
		var ref map[string]json.RawMessage
		refErr := json.Unmarshal(b, &ref)
		if err != nil {
			// The hand-written splitter agrees with encoding/json on what
			// is a JSON object.
			if re := err.(*RequestError); strings.HasPrefix(re.Message, "invalid JSON") && refErr == nil && ref != nil {
				t.Fatalf("valid object %q refused: %v", b, err)
			}
			return
		}
		if refErr != nil {
			t.Fatalf("invalid JSON %q accepted", b)
		}
		for k, v := range ref {
			if k == "kv_transfer_params" || !utf8.Valid(b) {
				continue // encoding/json rewrites invalid UTF-8 in names; the router keeps bytes as sent
			}
			if got, ok := r.Member(k); !ok || !bytes.Equal(got, bytes.TrimSpace(v)) {
				t.Fatalf("member %q: %s, want %s", k, got, v)
			}
		}
		for _, out := range [][]byte{r.AppendPrefillBody(nil, []byte(handoff)), r.AppendDecodeBody(nil, []byte(`{"a":1}`)), r.AppendDecodeBody(nil, nil)} {
			if !json.Valid(out) {
				t.Fatalf("invalid JSON from %q: %s", b, out)
			}
		}
	})
}

// BenchmarkPrefillRewrite is the per-request cost of parsing a client body
// and building both legs' bodies.
func BenchmarkPrefillRewrite(b *testing.B) {
	body := []byte(clientChat)
	dst := make([]byte, 0, 4096)
	desc := []byte(`{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"9b1e-dp0","remote_request_id":"chatcmpl-1","remote_block_ids":[17,18,19,20],"remote_host":"10.0.3.7","remote_port":5600,"tp_size":1}`)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		r, err := ParseRequest(EndpointChat, body)
		if err != nil {
			b.Fatal(err)
		}
		dst = r.AppendPrefillBody(dst[:0], []byte(handoff))
		dst = r.AppendDecodeBody(dst[:0], desc)
	}
}

// TestParseLimitedCapsRAPI8 proves R-API-8's caps: n above MaxN and
// max_tokens / max_completion_tokens above MaxTokens get 400 naming the
// field, a value of any size (2^63, a hundred digits) gets the cap's
// message and not "at least 1", and values at the caps pass; a value in
// another notation or of another type gets the message of what it is.
func TestParseLimitedCapsRAPI8(t *testing.T) {
	lim := Limits{MaxN: 16, MaxTokens: 1 << 20}
	chat := func(extra string) string {
		return `{"model":"m","messages":[{"role":"user","content":"x"}],` + extra + `}`
	}
	cases := []struct {
		name, body, param, msg string
	}{
		{"n above", chat(`"n":17`), "n", "n must be at most 16"},
		{"n huge", chat(`"n":9223372036854775808`), "n", "n must be at most 16"},
		{"max_tokens above", chat(`"max_tokens":1048577`), "max_tokens", "max_tokens must be at most 1048576"},
		{"max_tokens 2^63", chat(`"max_tokens":9223372036854775808`), "max_tokens", "max_tokens must be at most 1048576"},
		{"max_tokens 100 digits", chat(`"max_tokens":` + strings.Repeat("9", 100)), "max_tokens", "max_tokens must be at most 1048576"},
		{"max_completion_tokens 2^64", chat(`"max_completion_tokens":18446744073709551616`), "max_completion_tokens", "max_completion_tokens must be at most 1048576"},
		{"max_completion_tokens above, max_tokens fine", chat(`"max_tokens":5,"max_completion_tokens":2000000`), "max_completion_tokens", "max_completion_tokens must be at most 1048576"},
		{"negative still at least 1", chat(`"max_tokens":-9223372036854775809`), "max_tokens", "max_tokens must be at least 1"},
		// The message says what the value is, in any notation.
		{"exponent above", chat(`"max_tokens":1e30`), "max_tokens", "max_tokens must be at most 1048576"},
		{"exponent beyond float64", chat(`"max_completion_tokens":1e400`), "max_completion_tokens", "max_completion_tokens must be at most 1048576"},
		{"n fraction above", chat(`"n":16.5`), "n", "n must be at most 16"},
		{"negative exponent", chat(`"max_tokens":-1e30`), "max_tokens", "max_tokens must be at least 1"},
		{"fraction below 1", chat(`"n":0.5`), "n", "n must be at least 1"},
		{"tiny exponent", chat(`"max_tokens":1e-400`), "max_tokens", "max_tokens must be at least 1"},
		{"minus zero", chat(`"max_tokens":-0`), "max_tokens", "max_tokens must be at least 1"},
		{"fraction", chat(`"max_tokens":2.5`), "max_tokens", "max_tokens must be an integer"},
		{"decimal form of an integer", chat(`"n":2.0`), "n", "n must be an integer"},
		{"exponent form of an integer", chat(`"max_tokens":1e3`), "max_tokens", "max_tokens must be an integer"},
		{"string", chat(`"max_tokens":"5"`), "max_tokens", "max_tokens must be an integer"},
		{"boolean", chat(`"n":true`), "n", "n must be an integer"},
		{"object", chat(`"max_completion_tokens":{"v":5}`), "max_completion_tokens", "max_completion_tokens must be an integer"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := ParseLimited(EndpointChat, []byte(c.body), lim)
			var re *RequestError
			if !errors.As(err, &re) {
				t.Fatalf("error %v, want a RequestError", err)
			}
			if re.Status != 400 || re.Param != c.param || re.Message != c.msg {
				t.Fatalf("got %+v, want 400 %q naming %q", re, c.msg, c.param)
			}
		})
	}
	r, err := ParseLimited(EndpointChat, []byte(chat(`"n":16,"max_tokens":1048576`)), lim)
	if err != nil || r.N != 16 || r.MaxTokens != 1<<20 {
		t.Fatalf("values at the caps: %+v %v", r, err)
	}
	// Without caps a huge value parses (saturated), as before the caps.
	if r, err := ParseRequest(EndpointChat, []byte(chat(`"max_tokens":9223372036854775808`))); err != nil || r.MaxTokens != math.MaxInt {
		t.Fatalf("no caps: %+v %v", r, err)
	}
	// Without caps a number in another notation is no integer, however large.
	if _, err := ParseRequest(EndpointChat, []byte(chat(`"max_tokens":1e30`))); err == nil || err.(*RequestError).Message != "max_tokens must be an integer" {
		t.Fatalf("no caps, 1e30: %v", err)
	}
}
