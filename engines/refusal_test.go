package engines

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/connector/nixl"
	"github.com/narwhalmesh/narwhal/engines/connector/sglang"
	"github.com/narwhalmesh/narwhal/engines/connector/sharedstorage"
	"github.com/narwhalmesh/narwhal/schemas"
)

func refusalRequest(t *testing.T, c connector.Connector, client string) *Request {
	t.Helper()
	body, err := schemas.ParseRequest(schemas.EndpointChat, []byte(client))
	if err != nil {
		t.Fatal(err)
	}
	return &Request{Body: body, Producer: &Engine{ID: "p1", Connector: c}, Consumer: &Engine{ID: "d1", Connector: c}}
}

func decodeClientFault(status int, body string) *Fault {
	f := NewFault(KindClientFault, schemas.PhaseDecode, "d1", status, "engine message")
	f.Body = []byte(body)
	return f
}

// vllmTopLogprobs is vLLM's 400 message for a chat request with
// top_logprobs but no logprobs (a model validator of its request; the
// prefill leg never carries either): pydantic's errors, whose input is
// the whole decode body — the router's kv_transfer_params too.
const vllmTopLogprobs = "1 validation error:\n  {'type': 'value_error', 'loc': ('body',), 'msg': 'Value error, when using `top_logprobs`, `logprobs` must be set to true.', " +
	"'input': {'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}], 'top_logprobs': 2, 'stream': True, 'stream_options': {'include_usage': True}, " +
	"'kv_transfer_params': {'do_remote_decode': False, 'do_remote_prefill': True, 'remote_engine_id': 'p1', 'remote_block_ids': [0, 1], 'remote_host': '10.0.0.1', 'remote_port': 5555}}, " +
	"'ctx': {'error': ValueError('when using `top_logprobs`, `logprobs` must be set to true.')}}"

// sglangEchoedBody is SGLang's 400 for a client's mistake a model
// validator finds: the body echoed, the router's bootstrap fields too.
const sglangEchoedBody = "1 validation error for ChatCompletionRequest\n  Value error, bad tool_choice [type=value_error, input_value={'model': 'm', 'messages': [...], " +
	"'bootstrap_host': '10.0.0.1', 'bootstrap_port': 8998, 'bootstrap_room': 7}, input_type=dict] [{'type': 'value_error', 'loc': ('body',), 'msg': 'Value error, bad tool_choice', " +
	"'input': {'model': 'm', 'bootstrap_host': '10.0.0.1', 'bootstrap_port': 8998, 'bootstrap_room': 7}}]"

// vllmError is vLLM's error body with message.
func vllmError(t *testing.T, message string) string {
	t.Helper()
	b, err := json.Marshal(map[string]any{"error": map[string]any{"message": message, "type": "Bad Request", "param": nil, "code": 400}})
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestHandoffRefusalRFAIL10 classifies decode 4xx answers: naming a
// handoff field of the attempt's connector is handoff_refused (502,
// counted, transient, the consumer's), and its Detail is a bounded,
// escaped excerpt of the engine's message, however hostile.
func TestHandoffRefusalRFAIL10(t *testing.T) {
	const client = `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	huge := strings.Repeat("kv_transfer_params ", 1<<16)
	hostile := "kv_transfer_params: \"\n\x00\x1b[31m level=ERROR msg=forged \xff\xfe"
	cases := []struct {
		name      string
		conn      connector.Connector
		status    int
		body      string
		refused   bool
		field     string
		excerptOf string
	}{
		{"llm-d", nixl.Nixl{}, 400, `{"error":{"message":"json: cannot unmarshal number into Go struct field .kv_transfer_params.remote_block_ids of type string","type":"BadRequestError","param":null,"code":400}}`, true, "kv_transfer_params.remote_block_ids", "json: cannot unmarshal number into Go struct field .kv_transfer_params.remote_block_ids of type string"},
		{"vllm flat shape, param", nixl.Nixl{}, 422, `{"object":"error","message":"value is not valid","type":"BadRequestError","param":"remote_port","code":422}`, true, "kv_transfer_params.remote_port", "value is not valid"},
		{"fastapi detail", sglang.SGLang{}, 422, `{"detail":[{"loc":["body","bootstrap_room"],"msg":"Input should be a valid integer"}]}`, true, "bootstrap_room", `{"detail":[{"loc":["body","bootstrap_room"],"msg":"Input should be a valid integer"}]}`},
		{"404 naming an engine id", nixl.Nixl{}, 404, `{"error":{"message":"remote_engine_id abc not registered","type":"NotFoundError","code":404}}`, true, "kv_transfer_params.remote_engine_id", "remote_engine_id abc not registered"},
		{"huge", nixl.Nixl{}, 400, `{"error":{"message":"` + huge + `","type":"BadRequestError","code":400}}`, true, "kv_transfer_params", huge},
		{"hostile", nixl.Nixl{}, 400, "plain text " + hostile, true, "kv_transfer_params", "plain text " + hostile},
		{"vllm echoes the body it got", nixl.Nixl{}, 400, vllmError(t, vllmTopLogprobs), false, "", ""},
		{"sglang echoes the body it got", sglang.SGLang{}, 400, vllmError(t, sglangEchoedBody), false, "", ""},
		{"context length", nixl.Nixl{}, 400, `{"error":{"message":"This model's maximum context length is 32768 tokens. However, you requested 40000 tokens.","type":"BadRequestError","code":400}}`, false, "", ""},
		{"sglang field on nixl", nixl.Nixl{}, 400, `{"error":{"message":"bootstrap_room is required","code":400}}`, false, "", ""},
		{"shared-storage writes nothing", sharedstorage.SharedStorage{}, 400, `{"error":{"message":"invalid kv_transfer_params","code":400}}`, false, "", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req := refusalRequest(t, c.conn, client)
			in := decodeClientFault(c.status, c.body)
			f := HandoffRefusal(req, in)
			if !c.refused {
				if f != in {
					t.Fatalf("%+v classified as %s, want the client's fault unchanged", in, f.Kind)
				}
				return
			}
			if f.Kind != KindHandoffRefused || f.Status != 502 || f.EngineID != "d1" || f.Phase != schemas.PhaseDecode ||
				f.UpstreamStatus != c.status || !f.EngineFault() || !f.CountsTowardEjection() || !f.Transient() {
				t.Fatalf("fault %+v", f)
			}
			want := "decode engine d1 refused the handoff from prefill engine p1 (HTTP " + strconv.Itoa(c.status) + "): its error names " + c.field + ","
			if !strings.HasPrefix(f.Message, want) {
				t.Fatalf("message %q, want prefix %q", f.Message, want)
			}
			if strings.Contains(f.Message, "level=ERROR") || strings.Contains(f.Message, "not registered") || strings.Contains(f.Message, "valid") {
				t.Fatalf("the client's message carries the engine's: %q", f.Message)
			}
			prefix := "decode engine d1 answered HTTP " + strconv.Itoa(c.status) + ": "
			if !strings.HasPrefix(f.Detail, prefix) {
				t.Fatalf("detail %q", f.Detail)
			}
			ex := strings.TrimPrefix(f.Detail, prefix)
			if !utf8.ValidString(ex) || strings.ContainsAny(ex, "\n\r\x00\x1b") || len(ex) > 4*RefusalExcerptBytes+32 {
				t.Fatalf("excerpt is not one bounded, safe line: %q", ex)
			}
			quoted, _, _ := strings.Cut(ex, "…(+")
			s, err := strconv.Unquote(quoted)
			if err != nil || len(s) > RefusalExcerptBytes || !strings.HasPrefix(c.excerptOf, s) || (len(c.excerptOf) <= RefusalExcerptBytes && s != c.excerptOf) {
				t.Fatalf("excerpt %q of %q (%v)", ex, c.excerptOf, err)
			}
		})
	}
	// A client that sent the handoff fields itself had them removed
	// (R-API-5): the consumer still refused the router's.
	stripped := refusalRequest(t, nixl.Nixl{}, `{"model":"m","messages":[{"role":"user","content":"hi"}],"kv_transfer_params":{"remote_block_ids":[1]},"bootstrap_room":1}`)
	if f := HandoffRefusal(stripped, decodeClientFault(400, `{"error":{"message":"bad kv_transfer_params.remote_block_ids","code":400}}`)); f.Kind != KindHandoffRefused {
		t.Fatalf("a refusal of the router's fields was the client's because the client had sent its own: %+v", f)
	}
	// Not a refusal: a producer's 4xx, a same-worker decode (no handoff
	// field was written), a decode 5xx.
	req := refusalRequest(t, nixl.Nixl{}, client)
	named := `{"error":{"message":"invalid kv_transfer_params","code":400}}`
	pf := decodeClientFault(400, named)
	pf.Phase, pf.EngineID = schemas.PhasePrefill, "p1"
	if HandoffRefusal(req, pf) != pf {
		t.Fatal("a producer's own 400 was taken for a refusal")
	}
	same := refusalRequest(t, nixl.Nixl{}, client)
	same.Consumer = same.Producer
	if f := decodeClientFault(400, named); HandoffRefusal(same, f) != f {
		t.Fatal("a same-worker decode's 400 was taken for a refusal")
	}
	up := NewFault(KindUpstreamStatus, schemas.PhaseDecode, "d1", 500, "invalid kv_transfer_params")
	if HandoffRefusal(req, up) != up {
		t.Fatal("a 5xx was reclassified")
	}
}
