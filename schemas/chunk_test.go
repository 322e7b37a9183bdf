package schemas

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// Real vLLM stream chunks (vLLM's "Streaming response" shape).
const (
	vllmRoleChunk    = `{"id":"chatcmpl-7f3a","object":"chat.completion.chunk","created":1764460000,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`
	vllmContentChunk = `{"id":"chatcmpl-7f3a","object":"chat.completion.chunk","created":1764460000,"model":"m","choices":[{"index":0,"delta":{"content":" narwhal"},"logprobs":null,"finish_reason":null}]}`
	vllmFinishChunk  = `{"id":"chatcmpl-7f3a","object":"chat.completion.chunk","created":1764460000,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length","stop_reason":null}]}`
	vllmUsageChunk   = `{"id":"chatcmpl-7f3a","object":"chat.completion.chunk","created":1764460000,"model":"m","choices":[],"usage":{"prompt_tokens":812,"completion_tokens":64,"total_tokens":876}}`
	vllmErrorFrame   = `{"error": {"message": "engine core died", "type": "InternalServerError", "param": null, "code": 500}}`
	vllmFlatError    = `{"object":"error","message":"engine core died","type":"InternalServerError","param":null,"code":500}`
	vllmTextChunk    = `{"id":"cmpl-9c1d","object":"text_completion","created":1764460000,"model":"m","choices":[{"index":0,"text":" narwhal","logprobs":null,"finish_reason":null,"stop_reason":null}]}`
	vllmToolChunk    = `{"id":"chatcmpl-7f3a","object":"chat.completion.chunk","created":1764460000,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"chatcmpl-tool-1","type":"function","function":{"name":"get_weather","arguments":""}}]},"logprobs":null,"finish_reason":null}]}`
)

type chunkCase struct {
	name    string
	payload string
	want    ChunkKind
}

// chunkCases covers behaviour.md §0 (generated output vs metadata), R-FAIL-2/3
// ([DONE]), R-FAIL-4 (error frames) and malformed payloads.
var chunkCases = []chunkCase{
	// Real vLLM chunks.
	{"vllm role chunk is metadata", vllmRoleChunk, ChunkMetadata},
	{"vllm content chunk is output", vllmContentChunk, ChunkOutput},
	{"vllm finish_reason length with empty delta is output", vllmFinishChunk, ChunkOutput},
	{"vllm usage-only chunk is metadata", vllmUsageChunk, ChunkMetadata},
	{"vllm error frame", vllmErrorFrame, ChunkError},
	{"vllm flat error", vllmFlatError, ChunkError},
	{"vllm text completion chunk", vllmTextChunk, ChunkOutput},
	{"vllm tool call delta", vllmToolChunk, ChunkOutput},
	{"done", `[DONE]`, ChunkDone},
	{"done with spaces", "  [DONE] \r\n", ChunkDone},

	// Output signals.
	{"immediate stop is output", `{"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}`, ChunkOutput},
	{"finish_reason empty string is non-null", `{"choices":[{"delta":{},"finish_reason":""}]}`, ChunkOutput},
	{"text empty", `{"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":null}]}`, ChunkMetadata},
	{"text null", `{"choices":[{"index":0,"text":null}]}`, ChunkMetadata},
	{"content null", `{"choices":[{"delta":{"content":null}}]}`, ChunkMetadata},
	{"reasoning_content", `{"choices":[{"delta":{"reasoning_content":"think"}}]}`, ChunkOutput},
	{"reasoning", `{"choices":[{"delta":{"reasoning":"think","content":null}}]}`, ChunkOutput},
	{"reasoning empty", `{"choices":[{"delta":{"reasoning":"","reasoning_content":""}}]}`, ChunkMetadata},
	{"tool_calls empty array", `{"choices":[{"delta":{"tool_calls":[]}}]}`, ChunkMetadata},
	{"tool_calls empty array with spaces", `{"choices":[{"delta":{"tool_calls":[ ]}}]}`, ChunkMetadata},
	{"tool_calls null", `{"choices":[{"delta":{"tool_calls":null}}]}`, ChunkMetadata},
	{"tool_calls arguments only", `{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}}]}`, ChunkOutput},
	{"chat logprobs", `{"choices":[{"index":0,"delta":{"content":""},"logprobs":{"content":[{"token":"a","logprob":-0.1,"bytes":[97],"top_logprobs":[]}]},"finish_reason":null}]}`, ChunkOutput},
	{"logprobs empty object is non-null", `{"choices":[{"delta":{},"logprobs":{}}]}`, ChunkOutput},
	{"completion logprobs", `{"choices":[{"text":"","logprobs":{"tokens":["a"],"token_logprobs":[-0.1],"top_logprobs":[null],"text_offset":[0]}}]}`, ChunkOutput},
	{"second choice has output (n=2)", `{"choices":[{"index":0,"delta":{"role":"assistant"}},{"index":1,"delta":{"content":"x"}}]}`, ChunkOutput},
	{"no choices member", `{"id":"x","object":"chat.completion.chunk"}`, ChunkMetadata},
	{"choices not an array", `{"choices":{"delta":{"content":"x"}}}`, ChunkMetadata},
	{"choice not an object", `{"choices":["content",1,null,[{"delta":{"content":"x"}}]]}`, ChunkMetadata},
	{"delta not an object", `{"choices":[{"delta":"content"}]}`, ChunkMetadata},
	{"content not a string", `{"choices":[{"delta":{"content":1}}]}`, ChunkMetadata},
	{"empty object", `{}`, ChunkMetadata},
	{"empty choice and delta", `{"choices":[{}, {"delta":{}}]}`, ChunkMetadata},

	// Structure, not text, decides.
	{"content key inside a string value", `{"choices":[{"index":0,"delta":{"role":"assistant","note":"\"content\":\"hi\""}}]}`, ChunkMetadata},
	{"content in an unrelated nested object", `{"extra":{"choices":[{"delta":{"content":"x"}}]},"choices":[{"delta":{}}]}`, ChunkMetadata},
	{"content nested below delta", `{"choices":[{"delta":{"extra":{"content":"x"}}}]}`, ChunkMetadata},
	{"finish_reason at top level", `{"finish_reason":"stop","choices":[]}`, ChunkMetadata},
	{"keys in any order", `{"usage":null,"choices":[{"finish_reason":null,"logprobs":null,"delta":{"content":"x","role":"assistant"},"index":0}],"id":"x"}`, ChunkOutput},
	{"whitespace everywhere", "\n\t{ \"choices\" :\r\n[ { \"delta\" : { \"content\" : \"x\" } } ] }\n", ChunkOutput},
	{"escaped character counts as non-empty", `{"choices":[{"delta":{"content":"\u0041"}}]}`, ChunkOutput},
	{"escaped NUL counts as non-empty", `{"choices":[{"delta":{"content":"\u0000"}}]}`, ChunkOutput},
	{"escaped quote content", `{"choices":[{"delta":{"content":"\""}}]}`, ChunkOutput},
	{"escaped key", `{"ch\u006fices":[{"d\u0065lta":{"\u0063ontent":"x"}}]}`, ChunkOutput},
	{"escaped slash in key does not match", `{"choices":[{"delta":{"con\/tent":"x"}}]}`, ChunkMetadata},
	{"keys are case-sensitive", `{"Choices":[{"Delta":{"Content":"x"}}]}`, ChunkMetadata},
	{"non-ASCII key", `{"choices":[{"delta":{"cöntent":"x","\u00e9":"y","\ud83d\ude00":"z"}}]}`, ChunkMetadata},
	{"long escaped key", `{"choices":[{"delta":{"\u0063ontent_content_content_content":"x"}}]}`, ChunkMetadata},
	{"duplicate content last empty", `{"choices":[{"delta":{"content":"x","content":""}}]}`, ChunkMetadata},
	{"duplicate content last non-empty", `{"choices":[{"delta":{"content":"","content":"x"}}]}`, ChunkOutput},
	{"duplicate delta last empty", `{"choices":[{"delta":{"content":"x"},"delta":{}}]}`, ChunkMetadata},
	{"duplicate choices last empty", `{"choices":[{"delta":{"content":"x"}}],"choices":[]}`, ChunkMetadata},
	{"duplicate choices last not array", `{"choices":[{"delta":{"content":"x"}}],"choices":null}`, ChunkMetadata},
	{"duplicate finish_reason last null", `{"choices":[{"finish_reason":"stop","finish_reason":null}]}`, ChunkMetadata},
	{"huge numbers", `{"created":1e999999,"choices":[{"index":123456789012345678901234567890,"x":-0.0000000000000000000000001E-400,"finish_reason":"stop"}]}`, ChunkOutput},
	{"unicode and raw UTF-8 text", `{"choices":[{"delta":{"content":"ñ 🐋 \ud83d\udc33"}}]}`, ChunkOutput},

	// Errors.
	{"error object beats output", `{"choices":[{"delta":{"content":"x"}}],"error":{"message":"m"}}`, ChunkError},
	{"error empty object", `{"error":{}}`, ChunkError},
	{"error null", `{"error":null,"choices":[{"delta":{"content":"x"}}]}`, ChunkOutput},
	{"error string", `{"error":"boom"}`, ChunkMetadata},
	{"error nested is not top-level", `{"choices":[{"error":{"message":"m"}}]}`, ChunkMetadata},
	{"escaped flat error", `{"object":"\u0065rror","message":"m"}`, ChunkError},
	{"object is chunk", `{"object":"chat.completion.chunk","choices":[]}`, ChunkMetadata},
	{"duplicate object last chunk", `{"object":"error","object":"chat.completion.chunk"}`, ChunkMetadata},
	{"duplicate error last null", `{"error":{"message":"m"},"error":null}`, ChunkMetadata},
	{"object errors is not error", `{"object":"errors"}`, ChunkMetadata},

	// Valid JSON that is not an object.
	{"array", `[]`, ChunkMetadata},
	{"array of chunk", `[{"choices":[{"delta":{"content":"x"}}]}]`, ChunkMetadata},
	{"string", `"[DONE]"`, ChunkMetadata},
	{"number", `42`, ChunkMetadata},
	{"null", `null`, ChunkMetadata},

	// Invalid.
	{"empty", ``, ChunkInvalid},
	{"spaces only", "  \t", ChunkInvalid},
	{"done prefix", `[DONE`, ChunkInvalid},
	{"done trailing garbage", `[DONE]x`, ChunkInvalid},
	{"done lower case", `[done]`, ChunkInvalid},
	{"trailing garbage", `{"choices":[]} x`, ChunkInvalid},
	{"trailing brace", `{"choices":[]}}`, ChunkInvalid},
	{"two objects", `{}{}`, ChunkInvalid},
	{"truncated", `{"choices":[{"delta":{"content":"hi`, ChunkInvalid},
	{"truncated after key", `{"choices"`, ChunkInvalid},
	{"single quotes", `{'choices':[]}`, ChunkInvalid},
	{"bad escape", `{"choices":[{"delta":{"content":"\x"}}]}`, ChunkInvalid},
	{"short unicode escape", `{"a":"\u00G1"}`, ChunkInvalid},
	{"raw control byte", "{\"a\":\"x\ny\"}", ChunkInvalid},
	{"leading zero", `{"a":01}`, ChunkInvalid},
	{"lone minus", `{"a":-}`, ChunkInvalid},
	{"dot without digits", `{"a":1.}`, ChunkInvalid},
	{"exponent without digits", `{"a":1e+}`, ChunkInvalid},
	{"plus sign", `{"a":+1}`, ChunkInvalid},
	{"bad literal", `{"a":tru}`, ChunkInvalid},
	{"literal with suffix", `{"a":truex}`, ChunkInvalid},
	{"trailing comma in object", `{"a":1,}`, ChunkInvalid},
	{"trailing comma in array", `{"choices":[{"delta":{}},]}`, ChunkInvalid},
	{"trailing comma in nested array", `{"a":[1,]}`, ChunkInvalid},
	{"missing value", `{"a":}`, ChunkInvalid},
	{"missing colon", `{"a" 1}`, ChunkInvalid},
	{"missing comma", `{"a":1 "b":2}`, ChunkInvalid},
	{"non-string key", `{1:2}`, ChunkInvalid},
	{"mismatched brackets", `{"a":[}`, ChunkInvalid},
	{"mismatched brackets deep", `{"a":[{"b":[1}]}`, ChunkInvalid},
	{"NaN", `{"a":NaN}`, ChunkInvalid},
	{"comment", `{"a":1 /* c */}`, ChunkInvalid},
	{"byte order mark", "\ufeff{}", ChunkInvalid},
	{"SSE line not stripped", `data: {"choices":[]}`, ChunkInvalid},
}

// TestClassifyChunk checks every case against its expected kind (behaviour.md §0,
// R-FAIL-2/3/4, R-TMO-1/2) and against the encoding/json reference, so the
// reference itself is pinned by the table.
func TestClassifyChunk(t *testing.T) {
	for _, tc := range chunkCases {
		t.Run(tc.name, func(t *testing.T) {
			if got := ClassifyChunk([]byte(tc.payload)); got != tc.want {
				t.Errorf("ClassifyChunk(%q) = %v, want %v", tc.payload, got, tc.want)
			}
			if ref := referenceClassify([]byte(tc.payload)); ref != tc.want {
				t.Errorf("reference(%q) = %v, want %v", tc.payload, ref, tc.want)
			}
		})
	}
}

// TestClassifyChunkNesting checks the nesting limit shared with
// encoding/json (10000 levels) and deep values around the fields read.
func TestClassifyChunkNesting(t *testing.T) {
	const content = `"choices":[{"delta":{"content":"x"}}]}`
	// arrays returns {"x":[[…]],"choices":…} with n nested arrays below
	// the top object, so the deepest level is n+1.
	arrays := func(n int) []byte {
		return []byte(`{"x":` + strings.Repeat("[", n) + strings.Repeat("]", n) + "," + content)
	}
	// objects does the same with n nested {"a":…} objects.
	objects := func(n int) []byte {
		return []byte(`{"x":` + strings.Repeat(`{"a":`, n) + "1" + strings.Repeat("}", n) + "," + content)
	}
	cases := []struct {
		name    string
		payload []byte
		want    ChunkKind
	}{
		{"arrays at the limit", arrays(9999), ChunkOutput},
		{"arrays past the limit", arrays(10000), ChunkInvalid},
		{"objects at the limit", objects(9999), ChunkOutput},
		{"objects past the limit", objects(10000), ChunkInvalid},
		{"deep value inside delta", []byte(`{"choices":[{"delta":{"content":"x","deep":` +
			strings.Repeat(`[{"k":`, 3000) + "null" + strings.Repeat("}]", 3000) + "}}]}"), ChunkOutput},
		{"top-level array at the limit", []byte(strings.Repeat("[", 10000) + strings.Repeat("]", 10000)), ChunkMetadata},
		{"top-level array past the limit", []byte(strings.Repeat("[", 10001) + strings.Repeat("]", 10001)), ChunkInvalid},
		{"unbalanced deep", []byte(`{"x":` + strings.Repeat("[", 200) + strings.Repeat("]", 201) + "}"), ChunkInvalid},
		{"mismatched at level 130", []byte(`{"x":` + strings.Repeat("[", 130) + "}" + strings.Repeat("]", 129) + "}"), ChunkInvalid},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := ClassifyChunk(tc.payload); got != tc.want {
				t.Errorf("ClassifyChunk = %v, want %v", got, tc.want)
			}
			if ref := referenceClassify(tc.payload); ref != tc.want {
				t.Errorf("reference = %v, want %v", ref, tc.want)
			}
		})
	}
}

// chunkGen builds random chunk-like JSON documents: mostly the chunk
// structure (top object, choices, choice, delta) with the member names the
// classifier reads, sometimes escaped, repeated or misplaced, values of
// every JSON type, and whitespace between tokens.
type chunkGen struct {
	r *rand.Rand
	b strings.Builder
}

// chunkGenLevels lists the member names of each level of a chunk: the top
// object, a choice, a delta.
var chunkGenLevels = [][]string{
	{"choices", "error", "object", "usage", "id"},
	{"delta", "text", "logprobs", "finish_reason", "index"},
	{"content", "reasoning", "reasoning_content", "tool_calls", "role"},
}

var chunkGenNames = []string{
	"choices", "delta", "content", "text", "logprobs", "finish_reason", "reasoning",
	"reasoning_content", "tool_calls", "error", "object", "usage", "index", "role", "id", "Content",
}

func (g *chunkGen) space() {
	if g.r.IntN(4) == 0 {
		g.b.WriteString([]string{" ", "\n", "\t", "\r\n ", "  "}[g.r.IntN(5)])
	}
}

// str writes s as a JSON string, escaping some characters as \uXXXX.
func (g *chunkGen) str(s string) {
	g.b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case g.r.IntN(8) == 0:
			fmt.Fprintf(&g.b, `\u%04x`, c)
		case c == '"' || c == '\\':
			g.b.WriteByte('\\')
			g.b.WriteByte(c)
		default:
			g.b.WriteByte(c)
		}
	}
	g.b.WriteByte('"')
}

// value writes a value for member name at nesting depth.
func (g *chunkGen) value(depth int, name string) {
	g.space()
	switch {
	case depth < 6 && name == "choices" && g.r.IntN(4) != 0:
		g.array(depth, 1)
	case depth < 6 && name == "delta" && g.r.IntN(4) != 0:
		g.object(depth+1, 2)
	case depth < 6 && (name == "error" || name == "usage") && g.r.IntN(2) == 0:
		g.object(depth+1, -1)
	default:
		n := 9
		if depth >= 6 {
			n = 5 // scalars only
		}
		switch g.r.IntN(n) {
		case 0, 1:
			g.b.WriteString("null")
		case 2, 3:
			g.str([]string{"", "", "x", "error", `"`, "chat.completion.chunk"}[g.r.IntN(6)])
		case 4:
			g.b.WriteString([]string{"true", "false", "0", "-1.5e3", "123456789012345678901234567890"}[g.r.IntN(5)])
		case 5, 6:
			g.array(depth, -1)
		default:
			g.object(depth+1, -1)
		}
	}
	g.space()
}

// array writes an array whose object elements are of level (-1: any).
func (g *chunkGen) array(depth, level int) {
	g.b.WriteByte('[')
	for i := range g.r.IntN(3) {
		if i > 0 {
			g.b.WriteByte(',')
		}
		if level >= 0 && g.r.IntN(4) != 0 {
			g.space()
			g.object(depth+2, level)
			g.space()
		} else {
			g.value(depth+1, "")
		}
	}
	g.space()
	g.b.WriteByte(']')
}

// object writes an object of level (0 top, 1 choice, 2 delta, -1 any).
func (g *chunkGen) object(depth, level int) {
	g.b.WriteByte('{')
	for i := range g.r.IntN(5) {
		if i > 0 {
			g.b.WriteByte(',')
		}
		g.space()
		name := chunkGenNames[g.r.IntN(len(chunkGenNames))]
		if level >= 0 && g.r.IntN(4) != 0 {
			name = chunkGenLevels[level][g.r.IntN(len(chunkGenLevels[level]))]
		}
		g.str(name)
		g.space()
		g.b.WriteByte(':')
		g.value(depth, name)
	}
	g.space()
	g.b.WriteByte('}')
}

// TestClassifyChunkGenerated cross-checks ClassifyChunk, ChunkHasUsage and
// IsUsageOnly against the encoding/json reference on generated documents
// (behaviour.md §0, R-FAIL-4), and checks that every truncation of a document is
// classified like the reference too.
func TestClassifyChunkGenerated(t *testing.T) {
	g := &chunkGen{r: rand.New(rand.NewPCG(1, 2))}
	kinds := map[ChunkKind]int{}
	for range 20000 {
		g.b.Reset()
		g.object(1, 0)
		doc := []byte(g.b.String())
		got, want := ClassifyChunk(doc), referenceClassify(doc)
		if got != want {
			t.Fatalf("ClassifyChunk(%s) = %v, reference %v", doc, got, want)
		}
		kinds[got]++
		h, u := referenceUsage(doc)
		if ChunkHasUsage(doc) != h || IsUsageOnly(doc) != u {
			t.Fatalf("usage(%s) = %v, %v, reference %v, %v", doc, ChunkHasUsage(doc), IsUsageOnly(doc), h, u)
		}
		cut := doc[:g.r.IntN(len(doc))]
		if got, want := ClassifyChunk(cut), referenceClassify(cut); got != want {
			t.Fatalf("ClassifyChunk(%s) = %v, reference %v", cut, got, want)
		}
	}
	t.Logf("kinds: %v", kinds)
	// The generator must reach every kind a JSON object can have.
	for _, k := range []ChunkKind{ChunkMetadata, ChunkOutput, ChunkError} {
		if kinds[k] < 100 {
			t.Errorf("generated only %d %v documents: %v", kinds[k], k, kinds)
		}
	}
}

// TestChunkUsage checks ChunkHasUsage and IsUsageOnly (R-LEG-5, R-LEG-6).
func TestChunkUsage(t *testing.T) {
	cases := []struct {
		payload   string
		hasUsage  bool
		usageOnly bool
	}{
		{vllmUsageChunk, true, true},
		{vllmContentChunk, false, false},
		{vllmRoleChunk, false, false},
		{`{"choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`, true, false},
		{`{"choices":[],"usage":null}`, false, false},
		{`{"choices":[ ],"usage":{}}`, true, true},
		{`{"usage":{"prompt_tokens":1}}`, true, false},
		{`{"choices":null,"usage":{"prompt_tokens":1}}`, true, false},
		{`{"choices":[],"usage":{"a":1},"usage":null}`, false, false},
		{`{"choices":[],"usage":7}`, false, false},
		{`{"choices":[],"x":{"usage":{}}}`, false, false},
		{`{"choices":[],"usage":{}`, false, false},
		{`[DONE]`, false, false},
		{`[{"choices":[],"usage":{}}]`, false, false},
	}
	for _, tc := range cases {
		if got := ChunkHasUsage([]byte(tc.payload)); got != tc.hasUsage {
			t.Errorf("ChunkHasUsage(%s) = %v, want %v", tc.payload, got, tc.hasUsage)
		}
		if got := IsUsageOnly([]byte(tc.payload)); got != tc.usageOnly {
			t.Errorf("IsUsageOnly(%s) = %v, want %v", tc.payload, got, tc.usageOnly)
		}
		h, u := referenceUsage([]byte(tc.payload))
		if h != tc.hasUsage || u != tc.usageOnly {
			t.Errorf("reference(%s) = %v, %v, want %v, %v", tc.payload, h, u, tc.hasUsage, tc.usageOnly)
		}
	}
}

// TestSSEData checks the per-line SSE reader the decode leg uses
// (R-FAIL-2, R-TMO-2: comments and keep-alives are not data).
func TestSSEData(t *testing.T) {
	cases := []struct {
		line    string
		payload string
		ok      bool
	}{
		{"data: {\"a\":1}\n", `{"a":1}`, true},
		{"data: {\"a\":1}\r\n", `{"a":1}`, true},
		{"data: {\"a\":1}\r", `{"a":1}`, true},
		{"data: {\"a\":1}", `{"a":1}`, true},
		{"data:{\"a\":1}\n", `{"a":1}`, true},
		{"data:  two spaces\n", " two spaces", true},
		{"data: [DONE]\n", "[DONE]", true},
		{"data:\n", "", true},
		{"data: \n", "", true},
		{"data:", "", true},
		{"data", "", false},
		{"data\n", "", false},
		{"Data: x\n", "", false},
		{" data: x\n", "", false},
		{": keep-alive\n", "", false},
		{":\n", "", false},
		{"event: error\n", "", false},
		{"id: 7\n", "", false},
		{"retry: 1000\n", "", false},
		{"\n", "", false},
		{"\r\n", "", false},
		{"", "", false},
		{"dat", "", false},
	}
	for _, tc := range cases {
		p, ok := SSEData([]byte(tc.line))
		if ok != tc.ok || string(p) != tc.payload {
			t.Errorf("SSEData(%q) = %q, %v; want %q, %v", tc.line, p, ok, tc.payload, tc.ok)
		}
	}
}

// TestClassifyChunkStream reads a whole vLLM SSE transcript line by line as
// the decode leg does: metadata before the first output (R-TMO-1), output,
// the usage chunk, then [DONE] (R-FAIL-2).
func TestClassifyChunkStream(t *testing.T) {
	transcript := "data: " + vllmRoleChunk + "\n\n" +
		": keep-alive\n\n" +
		"data: " + vllmContentChunk + "\r\n\r\n" +
		"data: " + vllmFinishChunk + "\n\n" +
		"data: " + vllmUsageChunk + "\n\n" +
		"data: [DONE]\n\n"
	var got []ChunkKind
	for line := range bytes.Lines([]byte(transcript)) {
		if p, ok := SSEData(line); ok {
			got = append(got, ClassifyChunk(p))
		}
	}
	want := []ChunkKind{ChunkMetadata, ChunkOutput, ChunkOutput, ChunkMetadata, ChunkDone}
	if len(got) != len(want) {
		t.Fatalf("kinds = %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("kinds = %v, want %v", got, want)
		}
	}
}

// TestChunkZeroAllocs asserts that the per-token path does not allocate,
// for every kind and for the slow paths (escaped keys, deep nesting).
func TestChunkZeroAllocs(t *testing.T) {
	deep := []byte(`{"x":` + strings.Repeat("[", 500) + strings.Repeat("]", 500) + `,"choices":[{"delta":{"\u0063ontent":"x"}}]}`)
	payloads := map[string][]byte{
		"metadata":     []byte(vllmRoleChunk),
		"output":       []byte(vllmContentChunk),
		"finish":       []byte(vllmFinishChunk),
		"usage":        []byte(vllmUsageChunk),
		"error":        []byte(vllmErrorFrame),
		"flat error":   []byte(`{"object":"\u0065rror"}`),
		"done":         []byte(" [DONE] "),
		"invalid":      []byte(`{"choices":[{"delta":{"content":"x"}}],}`),
		"deep escaped": deep,
	}
	for name, p := range payloads {
		if n := testkit.LeastAllocs(100, func() { ClassifyChunk(p) }); n != 0 {
			t.Errorf("ClassifyChunk(%s): %v allocs/op, want 0", name, n)
		}
		if n := testkit.LeastAllocs(100, func() { ChunkHasUsage(p) }); n != 0 {
			t.Errorf("ChunkHasUsage(%s): %v allocs/op, want 0", name, n)
		}
		if n := testkit.LeastAllocs(100, func() { IsUsageOnly(p) }); n != 0 {
			t.Errorf("IsUsageOnly(%s): %v allocs/op, want 0", name, n)
		}
	}
	line := []byte("data: " + vllmContentChunk + "\r\n")
	if n := testkit.LeastAllocs(100, func() { SSEData(line) }); n != 0 {
		t.Errorf("SSEData: %v allocs/op, want 0", n)
	}
}

func TestChunkKindString(t *testing.T) {
	want := map[ChunkKind]string{
		ChunkMetadata: "metadata", ChunkOutput: "output", ChunkDone: "done",
		ChunkError: "error", ChunkInvalid: "invalid", ChunkInvalid + 1: "unknown",
	}
	for k, s := range want {
		if k.String() != s {
			t.Errorf("ChunkKind(%d).String() = %q, want %q", k, k.String(), s)
		}
	}
}

// referenceClassify is ClassifyChunk written on encoding/json, for the
// table and the fuzz cross-check.
func referenceClassify(payload []byte) ChunkKind {
	if string(bytes.Trim(payload, " \t\r\n")) == "[DONE]" {
		return ChunkDone
	}
	v, ok := referenceDecode(payload)
	if !ok {
		return ChunkInvalid
	}
	top, ok := v.(map[string]any)
	if !ok {
		return ChunkMetadata
	}
	if _, ok := top["error"].(map[string]any); ok {
		return ChunkError
	}
	if s, ok := top["object"].(string); ok && s == "error" {
		return ChunkError
	}
	choices, _ := top["choices"].([]any)
	for _, c := range choices {
		choice, ok := c.(map[string]any)
		if !ok {
			continue
		}
		if s, ok := choice["text"].(string); ok && s != "" {
			return ChunkOutput
		}
		if v, ok := choice["logprobs"]; ok && v != nil {
			return ChunkOutput
		}
		if v, ok := choice["finish_reason"]; ok && v != nil {
			return ChunkOutput
		}
		delta, _ := choice["delta"].(map[string]any)
		for _, k := range []string{"content", "reasoning_content", "reasoning"} {
			if s, ok := delta[k].(string); ok && s != "" {
				return ChunkOutput
			}
		}
		if a, ok := delta["tool_calls"].([]any); ok && len(a) > 0 {
			return ChunkOutput
		}
	}
	return ChunkMetadata
}

// referenceUsage is ChunkHasUsage and IsUsageOnly written on encoding/json.
func referenceUsage(payload []byte) (hasUsage, usageOnly bool) {
	v, ok := referenceDecode(payload)
	if !ok {
		return false, false
	}
	top, ok := v.(map[string]any)
	if !ok {
		return false, false
	}
	_, hasUsage = top["usage"].(map[string]any)
	choices, isArray := top["choices"].([]any)
	return hasUsage, hasUsage && isArray && len(choices) == 0
}

func referenceDecode(payload []byte) (any, bool) {
	if !json.Valid(payload) {
		return nil, false
	}
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, false
	}
	return v, true
}

// FuzzClassifyChunk checks that ClassifyChunk never panics, agrees with
// json.Valid on validity, and agrees with the encoding/json reference on
// every valid payload; likewise ChunkHasUsage and IsUsageOnly.
func FuzzClassifyChunk(f *testing.F) {
	for _, tc := range chunkCases {
		f.Add([]byte(tc.payload))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		got := ClassifyChunk(payload)
		want := referenceClassify(payload)
		if got != want {
			t.Fatalf("ClassifyChunk(%q) = %v, reference %v", payload, got, want)
		}
		if got != ChunkDone && (got == ChunkInvalid) == json.Valid(payload) {
			t.Fatalf("ClassifyChunk(%q) = %v, json.Valid = %v", payload, got, json.Valid(payload))
		}
		h, u := referenceUsage(payload)
		if ChunkHasUsage(payload) != h || IsUsageOnly(payload) != u {
			t.Fatalf("usage(%q) = %v, %v, reference %v, %v", payload,
				ChunkHasUsage(payload), IsUsageOnly(payload), h, u)
		}
	})
}

// FuzzSSEData checks SSEData against a direct reading of the SSE field
// rules and that it never panics.
func FuzzSSEData(f *testing.F) {
	for _, s := range []string{"data: x\n", "data:x\r\n", "data:", ": c\n", "event: e\n", "", "\r", "data: \r\n"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, line []byte) {
		orig := bytes.Clone(line)
		p, ok := SSEData(line)
		if !bytes.Equal(line, orig) {
			t.Fatalf("SSEData modified its input")
		}
		body := bytes.TrimSuffix(line, []byte("\n"))
		body = bytes.TrimSuffix(body, []byte("\r"))
		rest, isData := bytes.CutPrefix(body, []byte("data:"))
		if ok != isData {
			t.Fatalf("SSEData(%q) ok = %v, want %v", line, ok, isData)
		}
		if !ok {
			if p != nil {
				t.Fatalf("SSEData(%q) payload %q with ok=false", line, p)
			}
			return
		}
		rest = bytes.TrimPrefix(rest, []byte(" "))
		if !bytes.Equal(p, rest) {
			t.Fatalf("SSEData(%q) = %q, want %q", line, p, rest)
		}
	})
}

// BenchmarkClassifyChunk measures a typical ~200-byte vLLM content chunk.
func BenchmarkClassifyChunk(b *testing.B) {
	for _, bc := range []struct {
		name    string
		payload []byte
	}{
		{"content", []byte(vllmContentChunk)},
		{"role", []byte(vllmRoleChunk)},
		{"usage", []byte(vllmUsageChunk)},
		{"done", []byte("[DONE]")},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(bc.payload)))
			b.ReportAllocs()
			for b.Loop() {
				ClassifyChunk(bc.payload)
			}
		})
	}
}

// BenchmarkSSEData measures the per-line SSE reader.
func BenchmarkSSEData(b *testing.B) {
	line := []byte("data: " + vllmContentChunk + "\n")
	b.ReportAllocs()
	for b.Loop() {
		SSEData(line)
	}
}

// TestScanChunkCachedTokensRFAIL8 proves the one scan of a usage chunk
// reads usage.prompt_tokens_details.cached_tokens (the last occurrence,
// only when it is a non-negative integer in an object), reports its
// absence, and allocates nothing (R-FAIL-8).
func TestScanChunkCachedTokensRFAIL8(t *testing.T) {
	cases := []struct {
		payload string
		known   bool
		cached  int
	}{
		{`{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":39}}}`, true, 39},
		{`{"choices":[],"usage":{"prompt_tokens_details":{"audio_tokens":1,"cached_tokens":0},"prompt_tokens":40}}`, true, 0},
		{`{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":4}}`, false, 0},
		{`{"choices":[],"usage":{"prompt_tokens":40,"prompt_tokens_details":null}}`, false, 0},
		{`{"choices":[],"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":"39"}}}`, false, 0},
		{`{"choices":[],"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":-1}}}`, false, 0},
		{`{"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":5,"cached_tokens":7}}}`, true, 7},
		{`{"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":5}},"usage":{"prompt_tokens":2}}`, false, 0},
		{`{"choices":[],"prompt_tokens_details":{"cached_tokens":5},"usage":{"prompt_tokens":2}}`, false, 0},
		{`{"choices":[],"usage":{"prompt_tokens_details":{"c\u0061ched_tokens":12}}}`, true, 12},
	}
	for _, c := range cases {
		ch := ScanChunk([]byte(c.payload))
		if !ch.Usage || ch.Cached != c.known || ch.CachedTokens != c.cached {
			t.Errorf("%s: usage %v cached %v %d, want %v %d", c.payload, ch.Usage, ch.Cached, ch.CachedTokens, c.known, c.cached)
		}
	}
	if ch := ScanChunk([]byte(`{"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":5}`)); ch.Kind != ChunkInvalid || ch.Cached {
		t.Errorf("truncated chunk: %+v", ch)
	}
	p := []byte(cases[0].payload)
	if n := testkit.LeastAllocs(100, func() { ScanChunk(p) }); n != 0 {
		t.Errorf("ScanChunk of a usage chunk with details: %v allocs", n)
	}
}
