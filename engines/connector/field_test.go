package connector

import (
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

// TestExcerptHostileValuesRFAIL10: whatever a producer puts in a
// descriptor, its excerpt is bounded, one line, valid UTF-8, and quoted
// so that it cannot end the log field or the event string it is put in.
func TestExcerptHostileValuesRFAIL10(t *testing.T) {
	huge := []byte(`"` + strings.Repeat("x", 1<<20) + `"`)
	cases := map[string][]byte{
		"huge":         huge,
		"binary":       {0, 1, 2, 0xff, 0xfe, '\a', '\b', 0x7f, 0x1b, '[', '3', '1', 'm'},
		"quotes":       []byte(`"a\"b" "c" \" '`),
		"newlines":     []byte("line1\nlevel=ERROR msg=forged\r\nline3"),
		"invalid utf8": {'"', 0xc3, 0x28, 0xa0, 0xa1, 0xe2, 0x28, 0xa1, 0xf0, 0x28, 0x8c, 0xbc, '"'},
		"cut rune":     []byte(strings.Repeat("a", ValueExcerptBytes-1) + "€€€"),
		"bidi":         []byte("abc\u202edcba"),
	}
	for name, raw := range cases {
		t.Run(name, func(t *testing.T) {
			e := Excerpt(raw, ValueExcerptBytes)
			if !utf8.ValidString(e) || strings.ContainsAny(e, "\n\r\x00\x1b\u202e") {
				t.Fatalf("excerpt %q is not one safe line", e)
			}
			body, rest, _ := strings.Cut(e, "…(+")
			s, err := strconv.Unquote(body)
			if err != nil {
				t.Fatalf("excerpt %q does not start with a quoted string: %v", e, err)
			}
			if len(s) > ValueExcerptBytes || !strings.HasPrefix(string(raw), s) {
				t.Fatalf("excerpt %q is not a prefix of at most %d bytes", e, ValueExcerptBytes)
			}
			if len(raw) > ValueExcerptBytes {
				if want := strconv.Itoa(len(raw)-len(s)) + " bytes)"; rest != want {
					t.Fatalf("excerpt %q of a cut value does not say how much was cut (%q)", e, want)
				}
			} else if rest != "" || s != string(raw) {
				t.Fatalf("excerpt %q of a short value is not the value", e)
			}
			if len(e) > 4*ValueExcerptBytes+32 {
				t.Fatalf("excerpt of %d bytes", len(e))
			}
		})
	}
	if e := Excerpt([]byte(strings.Repeat("a", ValueExcerptBytes-1)+"€"), ValueExcerptBytes); strings.Contains(e, `\x`) {
		t.Fatalf("a rune cut in half: %q", e)
	}
}

// vllmEchoedBody is what vLLM answers (400) a chat request with
// top_logprobs but no logprobs: str(exc) and str(exc.errors()) of
// pydantic, whose input is the decode body, handoff fields and all.
const vllmEchoedBody = "1 validation error:\n  {'type': 'value_error', 'loc': ('body',), 'msg': 'Value error, when using `top_logprobs`, `logprobs` must be set to true.', " +
	"'input': {'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}], 'top_logprobs': 2, 'stream': True, 'stream_options': {'include_usage': True}, " +
	"'kv_transfer_params': {'do_remote_decode': False, 'do_remote_prefill': True, 'remote_engine_id': 'p1', 'remote_block_ids': [0, 1], 'remote_host': '10.0.0.1', 'remote_port': 5555}}, " +
	"'ctx': {'error': ValueError('when using `top_logprobs`, `logprobs` must be set to true.')}}"

func TestNamedFieldWholeWordsRFAIL10(t *testing.T) {
	paths := []string{"kv_transfer_params", "kv_transfer_params.remote_block_ids", "kv_transfer_params.remote_host", "bootstrap_room"}
	cases := []struct{ message, request, want string }{
		{"json: cannot unmarshal number into Go struct field .kv_transfer_params.remote_block_ids of type string", `{}`, "kv_transfer_params.remote_block_ids"},
		{"invalid kv_transfer_params", `{}`, "kv_transfer_params"},
		{"remote_block_ids must be a list", `{}`, "kv_transfer_params.remote_block_ids"},
		{`{"detail":[{"loc":["body","bootstrap_room"],"msg":"bad"}]}`, `{}`, "bootstrap_room"},
		{"1 validation error\nbootstrap_room\n  Input should be", `{}`, "bootstrap_room"},
		{"my_kv_transfer_params is unknown", `{}`, ""},
		{"kv_transfer_params2 is unknown", `{}`, ""},
		{"This model's maximum context length is 32768 tokens", `{}`, ""},
		{"logit_bias.remote_host: not a token", `{"logit_bias":{"remote_host":1}}`, ""},
		{"bad bootstrap_room", `{"messages":[{"content":"what is a bootstrap_room_x"}]}`, ""},
		{"", `{}`, ""},
		// The client's strings as the engine read them: a JSON escape
		// does not hide a name the client wrote.
		{"[{'type': 'int_parsing', 'loc': ('body', 'top_logprobs'), 'input': 'remote_host'}]", `{"top_logprobs":"\u0072emote_host"}`, ""},
		{"logit_bias: remote_host is not a token", `{"logit_bias":{"\u0072emote_\u0048ost":1,"remote\u005fhost":2}}`, ""},
		{"bad remote_host", `{"stop":["a\\u0072emote_host"]}`, "kv_transfer_params.remote_host"},
		{"bad remote_host", `{"stop":["\u0041"]}`, "kv_transfer_params.remote_host"},
		// vLLM's and SGLang's validation handler answers a model
		// validator's error (the client's top_logprobs without logprobs)
		// with pydantic's errors, whose input is the whole body the engine
		// got — the router's kv_transfer_params included, as keys.
		{vllmEchoedBody, `{"model":"m","top_logprobs":2}`, ""},
		{`{"detail":[{"type":"value_error","loc":["body"],"msg":"bad","input":{"model":"m","kv_transfer_params":{"remote_block_ids":[1],"remote_host":"10.0.0.1"},"bootstrap_room":7}}]}`, `{}`, ""},
		{`{"detail":"{\"kv_transfer_params\": {\"remote_host\" : 1}}"}`, `{}`, ""},
		// A name in the message or the location still counts beside an
		// echoed body.
		{"Value error, kv_transfer_params needs remote_host, 'input': {'kv_transfer_params': {'remote_host': None}}", `{}`, "kv_transfer_params.remote_host"},
		{`{"detail":[{"loc":["body","bootstrap_room"],"input":{"bootstrap_room":"x"}}]}`, `{}`, "bootstrap_room"},
		{"missing 'remote_host': required by the nixl handshake", `{}`, "kv_transfer_params.remote_host"},
		{`bad "bootstrap_room": must be set`, `{}`, "bootstrap_room"},
	}
	for _, c := range cases {
		if got := NamedField(paths, []byte(c.message), []byte(c.request)); got != c.want {
			t.Errorf("NamedField(%q, %s) = %q, want %q", c.message, c.request, got, c.want)
		}
	}
}

func TestRejectFieldReportRFAIL10(t *testing.T) {
	e := RejectField(ReasonMalformedBlocks, "kv_transfer_params.remote_block_ids", "an array", "", []byte(`"17\n"`))
	if got, want := e.Error(), "handoff descriptor rejected: malformed block ids (kv_transfer_params.remote_block_ids)"; got != want {
		t.Fatalf("client text %q, want %q", got, want)
	}
	if got, want := e.Report(), `kv_transfer_params.remote_block_ids: expected an array, found string: "\"17\\n\""`; got != want {
		t.Fatalf("report %q, want %q", got, want)
	}
	if JSONType(nil) != "absent" || JSONType([]byte(" -1")) != "number" || JSONType([]byte("tru")) != "boolean" || JSONType([]byte("x")) != "not JSON" {
		t.Fatal("JSONType")
	}
}
