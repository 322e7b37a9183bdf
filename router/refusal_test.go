package router

import (
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/schemas"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// Tests of R-FAIL-10: a consumer that refuses the handoff itself is the
// pair's fault, not the client's; every other decode 4xx stays the
// client's (R-FAIL-6).

// refusalStack is faultStack (nixl) or sglangStack with the router's log
// in a buffer.
func refusalStack(t *testing.T, connectorName string, logw *syncBuffer) *stack {
	t.Helper()
	defs := []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}
	if connectorName == "sglang" {
		defs = sglangFleet(1, 1)
	}
	s := newStackLogged(t, defs, func(c *config.Config) {
		c.Engine.FirstTokenTimeoutS = 5
		c.Engine.PrefillTimeoutS = 2
	}, nil, logw)
	s.waitModels()
	return s
}

func TestDecodeRefusesHandoffRFAIL10(t *testing.T) {
	cases := []struct {
		connector, field, said string
	}{
		{"nixl", "kv_transfer_params.remote_block_ids", `"json: cannot unmarshal number into Go struct field .kv_transfer_params.remote_block_ids of type string"`},
		{"sglang", "bootstrap_room", `"1 validation error for ChatCompletionRequest\nbootstrap_room\n  Input should be a valid string [type=string_type, input_type=int]"`},
	}
	for _, c := range cases {
		for _, stream := range []bool{true, false} {
			name := c.connector + " stream"
			extra := `"stream":true,"max_tokens":4`
			if !stream {
				name, extra = c.connector+" non-stream", `"max_tokens":4`
			}
			t.Run(name, func(t *testing.T) {
				logw := &syncBuffer{}
				s := refusalStack(t, c.connector, logw)
				s.sims["d1"].Arm(sim.Fault{Kind: sim.FaultDecodeRefusesHandoff, Phase: sim.PhaseDecode, Count: 1})
				resp, body := s.post(schemas.EndpointChat, chatBody("refused handoff", extra))
				if resp.StatusCode != 502 {
					t.Fatalf("status %d, want 502 (the pair's fault, not the client's 400): %s", resp.StatusCode, body)
				}
				e := errorBody(t, 502, body)
				want := "decode engine d1 refused the handoff from prefill engine p1 (HTTP 400): its error names " + c.field
				if !strings.HasPrefix(e.Message, want) || !strings.Contains(e.Message, "prefill engine p1") {
					t.Fatalf("message %q, want it to start with %q", e.Message, want)
				}
				if strings.Contains(e.Message, "unmarshal") || strings.Contains(e.Message, "validation error") {
					t.Fatalf("the client sees the engine's message: %q", e.Message)
				}
				s.idle()
				f := s.oneFailure("d1", schemas.PhaseDecode, "handoff_refused", true)
				if f.Status != 502 || f.UpstreamStatus != 400 || f.ProducerID != "p1" || f.ConsumerID != "d1" {
					t.Fatalf("failure event %+v", f)
				}
				if wantDetail := "decode engine d1 answered HTTP 400: " + c.said; f.Detail != wantDetail {
					t.Fatalf("detail %q, want %q", f.Detail, wantDetail)
				}
				if n := testutil.ToFloat64(s.rt.metrics.faults.WithLabelValues("d1", schemas.PhaseDecode, "handoff_refused")); n != 1 {
					t.Fatalf("narwhal_engine_faults_total{d1,decode,handoff_refused} = %v, want 1", n)
				}
				log := logw.String()
				if !strings.Contains(log, "level=WARN") || !strings.Contains(log, "kind=handoff_refused") || !strings.Contains(log, "upstream_status=400") {
					t.Fatalf("no WARN line for the refusal in the log:\n%s", log)
				}
				if rs := s.events.requests(); len(rs) != 1 || rs[0].Status != 502 || rs[0].ErrorKind != "handoff_refused" {
					t.Fatalf("request events %+v", rs)
				}
				s.validEvents()
			})
		}
	}
}

// TestDecodeErrorObjectRefusesHandoffRFAIL10: SGLang answers a streamed
// request's validation error as an error object inside its 200 stream; one
// of a client-fault code naming a handoff field before the first output
// refuses the handoff too, while one naming none keeps R-FAIL-4's status.
func TestDecodeErrorObjectRefusesHandoffRFAIL10(t *testing.T) {
	for _, c := range []struct {
		name, message string
		status        int
		kind          string
	}{
		{"naming bootstrap_room", "bootstrap_room: Input should be a valid string", 502, "handoff_refused"},
		{"naming nothing of the router's", "max_tokens must be at least 1", 400, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := refusalStack(t, "sglang", &syncBuffer{})
			s.sims["d1"].Arm(sim.Fault{Kind: sim.FaultErrorObject, Phase: sim.PhaseDecode, Status: 400, Message: c.message, Count: 1})
			resp, body := s.post(schemas.EndpointChat, chatBody("error object", `"stream":true,"max_tokens":4`))
			if resp.StatusCode != c.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, c.status, body)
			}
			s.idle()
			fs := s.events.failures()
			if c.kind == "" {
				for _, f := range fs {
					if f.Counts {
						t.Fatalf("a client's error object was counted: %+v", f)
					}
				}
				return
			}
			e := errorBody(t, 502, body)
			if want := "decode engine d1 refused the handoff from prefill engine p1 (error object code 400): its error names bootstrap_room"; !strings.HasPrefix(e.Message, want) {
				t.Fatalf("message %q, want prefix %q", e.Message, want)
			}
			f := s.oneFailure("d1", schemas.PhaseDecode, c.kind, true)
			if f.Detail != `decode engine d1 answered error object code 400: "`+c.message+`"` {
				t.Fatalf("detail %q", f.Detail)
			}
		})
	}
}

// TestDecodeClientFaultsStayTheClientsRFAIL10 proves the other side of
// R-FAIL-10: a decode 4xx that does not name a handoff field the router
// wrote — vLLM's context-length error, a bad sampling parameter, a word
// that only contains a field's name, a field name the client wrote
// itself — and a producer's own 400 naming kv_transfer_params reach the
// client with the engine's status and body, and nothing is counted
// (R-FAIL-6).
func TestDecodeClientFaultsStayTheClientsRFAIL10(t *testing.T) {
	cases := []struct {
		name, connector, phase string
		status                 int
		message, extra         string
	}{
		{"context length", "nixl", sim.PhaseDecode, 400, "This model's maximum context length is 32768 tokens. However, you requested 40000 tokens (8000 in the messages, 32000 in the completion). Please reduce the length of the messages or completion.", ""},
		{"sampling parameter", "nixl", sim.PhaseDecode, 400, "temperature must be non-negative, got -1.0.", ""},
		{"unknown model", "nixl", sim.PhaseDecode, 404, "The model `m` does not exist.", ""},
		{"a longer word", "nixl", sim.PhaseDecode, 400, "my_kv_transfer_params_x is not a known option; remote_block_ids2 either", ""},
		{"the client's own word", "nixl", sim.PhaseDecode, 400, "logit_bias: remote_host is not a token id", `"logit_bias":{"remote_host":1}`},
		{"the client's prompt", "sglang", sim.PhaseDecode, 422, "bootstrap_room: the prompt is not allowed", ""},
		// vLLM answers a model validator's error (top_logprobs without
		// logprobs, which the prefill leg never carries) with the body it
		// got, the router's kv_transfer_params in it as keys.
		{"vllm echoes the decode body", "nixl", sim.PhaseDecode, 400, "1 validation error:\n  {'type': 'value_error', 'loc': ('body',), 'msg': 'Value error, when using `top_logprobs`, `logprobs` must be set to true.', " +
			"'input': {'model': 'm', 'top_logprobs': 2, 'stream': True, 'kv_transfer_params': {'do_remote_decode': False, 'do_remote_prefill': True, 'remote_engine_id': 'p1', 'remote_block_ids': [0], 'remote_host': '127.0.0.1', 'remote_port': 5555}}}", ""},
		{"the client's own word, escaped", "nixl", sim.PhaseDecode, 400, "[{'type': 'string_type', 'loc': ('body', 'user'), 'input': ['remote_host']}]", `"user":["\u0072emote_host"]`},
		{"producer's own 400", "nixl", sim.PhasePrefill, 400, sim.RefusalMessageNixl, ""},
		{"sglang producer's own 400", "sglang", sim.PhasePrefill, 400, sim.RefusalMessageSGLang, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := refusalStack(t, c.connector, &syncBuffer{})
			engine := "d1"
			if c.phase == sim.PhasePrefill {
				engine = "p1"
			}
			s.sims[engine].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: c.phase, Status: c.status, Message: c.message, Count: 1})
			content := "client fault"
			if c.name == "the client's prompt" {
				content = "what is a bootstrap_room?"
			}
			extra := `"stream":true,"max_tokens":4`
			if c.extra != "" {
				extra += "," + c.extra
			}
			resp, body := s.post(schemas.EndpointChat, chatBody(content, extra))
			if resp.StatusCode != c.status {
				t.Fatalf("status %d, want the engine's %d passed through: %s", resp.StatusCode, c.status, body)
			}
			if e := errorBody(t, c.status, body); e.Message != c.message {
				t.Fatalf("message %q, want the engine's %q", e.Message, c.message)
			}
			s.idle()
			if fs := s.events.failures(); len(fs) != 0 {
				t.Fatalf("a client fault was published as an engine failure: %+v", fs)
			}
		})
	}
}

// TestRejectedDescriptorSaysWhatWasWrongRFAIL10: a rejected descriptor's
// failure event and log carry the field, the shape expected and an
// excerpt of what was found; the client's message names the field only.
func TestRejectedDescriptorSaysWhatWasWrongRFAIL10(t *testing.T) {
	logw := &syncBuffer{}
	s := refusalStack(t, "nixl", logw)
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultGarbleBlockIDs, Count: 1})
	resp, body := s.post(schemas.EndpointChat, chatBody("garbled", `"stream":true,"max_tokens":4`))
	if resp.StatusCode != 502 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	e := errorBody(t, 502, body)
	if e.Message != "handoff descriptor rejected: malformed block ids (kv_transfer_params.remote_block_ids)" {
		t.Fatalf("client message %q", e.Message)
	}
	s.idle()
	var f *schemas.Failure
	for _, x := range s.events.failures() {
		if x.Kind == "descriptor_rejected" {
			f = x
		}
	}
	if f == nil || f.EngineID != "p1" || !f.Counts {
		t.Fatalf("failure events %+v", s.events.failures())
	}
	want := `kv_transfer_params.remote_block_ids: expected a non-empty JSON array of non-negative integers, or a non-empty array of such arrays, found an array holding a string: "[\"`
	if !strings.HasPrefix(f.Detail, want) {
		t.Fatalf("detail %q, want prefix %q", f.Detail, want)
	}
	if log := logw.String(); !strings.Contains(log, "kind=descriptor_rejected") || !strings.Contains(log, "found an array holding a string") {
		t.Fatalf("the log does not say what was wrong:\n%s", log)
	}
	s.validEvents()

	// R-DESC-0: a prefill answer whose descriptor is null says so too.
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultNoDescriptor, Count: 1})
	resp, body = s.post(schemas.EndpointChat, chatBody("no descriptor", `"stream":true,"max_tokens":4`))
	if e := errorBody(t, 502, body); resp.StatusCode != 502 || e.Message != "handoff descriptor rejected: missing descriptor (kv_transfer_params)" {
		t.Fatalf("status %d, client message %q", resp.StatusCode, e.Message)
	}
	s.idle()
	var missing *schemas.Failure
	for _, x := range s.events.failures() {
		if x.Kind == "descriptor_rejected" && x != f {
			missing = x
		}
	}
	if missing == nil || missing.Detail != `kv_transfer_params: expected the producer's descriptor, a non-empty JSON object, found null: "null"` {
		t.Fatalf("failure event of a missing descriptor %+v", missing)
	}
	if log := logw.String(); !strings.Contains(log, `detail="kv_transfer_params: expected the producer's descriptor, a non-empty JSON object, found null: \"null\""`) {
		t.Fatalf("the log does not say the descriptor was null:\n%s", log)
	}
}
