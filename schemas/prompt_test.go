package schemas

import (
	"bytes"
	"math"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

func renderPrompt(t *testing.T, endpoint, body string) []byte {
	t.Helper()
	r, err := ParseRequest(endpoint, []byte(body))
	if err != nil {
		t.Fatalf("parse %s: %v", body, err)
	}
	return r.AppendPrompt(nil)
}

// firstDiff returns the first byte offset where a and b differ.
func firstDiff(a, b []byte) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// TestAppendPromptChatRPLACE2 proves that the rendered chat prompt (what
// R-PLACE-2 hashes) holds every message — the system prompt, each later
// turn, their names and tool calls — and the tools, in an order where a
// change to the 3rd message changes nothing before it, and a change to a
// tool changes everything after the model.
func TestAppendPromptChatRPLACE2(t *testing.T) {
	const sys = `{"role":"system","content":"You are a helpful narwhal."}`
	const tools = `"tools":[{"type":"function","function":{"name":"dive","parameters":{"type":"object"}}}]`
	body := func(third, tl string) string {
		return `{"model":"m",` + tl + `,"messages":[` + sys + `,{"role":"user","content":"first question"},` +
			`{"role":"assistant","content":"` + third + `","tool_calls":[{"id":"c1","type":"function","function":{"name":"dive","arguments":"{}"}}]},` +
			`{"role":"tool","tool_call_id":"c1","content":"deep"},{"role":"user","name":"ana","content":[{"type":"text","text":"last"},{"type":"image_url","image_url":{"url":"x"}}]}]}`
	}
	a := renderPrompt(t, EndpointChat, body("answer one", tools))
	for _, want := range []string{"You are a helpful narwhal.", "system", "first question", "answer one", `"arguments":"{}"`, "c1", "deep", "ana", "last", `"image_url"`, `"name":"dive"`} {
		if !bytes.Contains(a, []byte(want)) {
			t.Errorf("rendered prompt lacks %q:\n%q", want, a)
		}
	}
	if !bytes.HasPrefix(a, []byte("m")) {
		t.Errorf("rendered prompt does not start with the model: %q", a)
	}
	if bytes.Index(a, []byte("dive")) > bytes.Index(a, []byte("helpful")) {
		t.Errorf("tools are not rendered before the messages: %q", a)
	}
	b := renderPrompt(t, EndpointChat, body("answer two", tools))
	at := bytes.Index(a, []byte("answer one"))
	if d := firstDiff(a, b); d != at+len("answer ") {
		t.Errorf("changing the 3rd message changed the rendering at %d, want %d (where it differs)", d, at+len("answer "))
	}
	c := renderPrompt(t, EndpointChat, body("answer one", strings.Replace(tools, "dive", "swim", 1)))
	if d := firstDiff(a, c); d >= bytes.Index(a, []byte("helpful")) {
		t.Errorf("changing a tool changed the rendering only at %d, after the system prompt", d)
	}
}

// TestAppendPromptCanonicalRPLACE2: spacing, member order and string
// escapes do not change the rendering (equal prompts, equal hashes), and
// different roles or contents do.
func TestAppendPromptCanonicalRPLACE2(t *testing.T) {
	a := renderPrompt(t, EndpointChat, `{"model":"m","messages":[{"role":"user","content":"héllo \"you\"\n"}],"stream":true}`)
	b := renderPrompt(t, EndpointChat, "{ \"messages\" : [ { \"content\" : \"h\\u00e9llo \\\"you\\\"\\n\" ,\n \"role\":\"user\" } ] , \"model\":\"m\"}")
	if !bytes.Equal(a, b) {
		t.Fatalf("equal prompts render differently:\n%q\n%q", a, b)
	}
	if !bytes.Contains(a, []byte("héllo \"you\"\n")) {
		t.Fatalf("content not unescaped: %q", a)
	}
	c := renderPrompt(t, EndpointChat, `{"model":"m","messages":[{"role":"system","content":"héllo \"you\"\n"}]}`)
	if bytes.Equal(a, c) {
		t.Fatal("a different role renders the same")
	}
	d := renderPrompt(t, EndpointChat, `{"model":"other","messages":[{"role":"user","content":"héllo \"you\"\n"}]}`)
	if bytes.Equal(a, d) {
		t.Fatal("a different model renders the same")
	}
	// Surrogate pairs, a lone surrogate.
	e := renderPrompt(t, EndpointChat, `{"model":"m","messages":[{"role":"user","content":"\ud83d\udc0b \ud83d x"}]}`)
	if !bytes.Contains(e, []byte("🐋 \uFFFD x")) {
		t.Fatalf("surrogates: %q", e)
	}
}

// TestAppendPromptCompletionsRPLACE2: a completion's prompt, string or
// array, is rendered; nothing else of the body is.
func TestAppendPromptCompletionsRPLACE2(t *testing.T) {
	a := renderPrompt(t, EndpointCompletions, `{"model":"m","prompt":"once upon a time","max_tokens":5}`)
	if want := "m\x1eonce upon a time\x1e"; string(a) != want {
		t.Fatalf("rendered %q, want %q", a, want)
	}
	b := renderPrompt(t, EndpointCompletions, `{"model":"m","prompt":["a", "b"]}`)
	if want := "m\x1ea\x1fb\x1f\x1e"; string(b) != want {
		t.Fatalf("rendered %q, want %q", b, want)
	}
	c := renderPrompt(t, EndpointCompletions, `{"model":"m","prompt":[1, 2, 3]}`)
	if want := "m\x1e1\x1f2\x1f3\x1f\x1e"; string(c) != want {
		t.Fatalf("rendered %q, want %q", c, want)
	}
}

// TestAppendPromptAllocs: rendering into a buffer with room allocates
// nothing (it runs on every placement).
func TestAppendPromptAllocs(t *testing.T) {
	r, err := ParseRequest(EndpointChat, []byte(`{"model":"m","tools":[{"type":"function"}],"messages":[{"role":"system","content":"s \u00e9"},{"role":"user","content":[{"type":"text","text":"t"}],"x":1}]}`))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 0, 4096)
	if n := testkit.LeastAllocs(100, func() { buf = r.AppendPrompt(buf[:0]) }); n != 0 {
		t.Fatalf("%v allocs per render, want 0", n)
	}
}

// BenchmarkAppendPrompt2000Tokens renders a chat request of about 2,000
// tokens (a system prompt, 6 turns, 8,000 bytes of text).
func BenchmarkAppendPrompt2000Tokens(b *testing.B) {
	r, err := ParseRequest(EndpointChat, chatBody2000())
	if err != nil {
		b.Fatal(err)
	}
	buf := make([]byte, 0, 16384)
	b.ReportAllocs()
	for b.Loop() {
		buf = r.AppendPrompt(buf[:0])
	}
}

func chatBody2000() []byte {
	var sb strings.Builder
	sb.WriteString(`{"model":"m","messages":[{"role":"system","content":"`)
	sb.WriteString(strings.Repeat("You are a narwhal. ", 200))
	sb.WriteString(`"}`)
	for i := range 6 {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		sb.WriteString(`,{"role":"` + role + `","content":"` + strings.Repeat("narwhals use their tusks to sense the water around them and the ice above.\\n ", 10) + `"}`)
	}
	sb.WriteString(`]}`)
	return []byte(sb.String())
}

// TestAppendPromptPrefixRPLACE2: AppendPromptPrefix(n) is exactly the
// first n bytes of AppendPrompt's rendering, whatever n cuts (an escape,
// a compacted value, a member name, a separator), and a huge prompt is
// rendered no further than n: into a buffer of n + 16 bytes it
// allocates nothing.
func TestAppendPromptPrefixRPLACE2(t *testing.T) {
	bodies := []struct {
		ep   string
		body string
	}{
		{EndpointChat, `{"model":"m","tools":[{"type":"function", "function":{"name":"dive"}}],"messages":[{"role":"system","content":"a\nb \u00e9\ud83d\udc0b \"q\" c"},{"role":"user","name":"ana","content":[{"type":"text","text":"x\ty"},{"type":"image_url", "image_url":{"url":"u"}}],"extra": [1, 2]},{"role":"assistant","content":null,"tool_calls":[{"id":"c1"}]}]}`},
		{EndpointCompletions, `{"model":"m","prompt":["one \n", 2, "three"]}`},
	}
	for _, b := range bodies {
		r, err := ParseRequest(b.ep, []byte(b.body))
		if err != nil {
			t.Fatal(err)
		}
		full := r.AppendPrompt(nil)
		for n := 0; n <= len(full)+3; n++ {
			got := r.AppendPromptPrefix([]byte("pre"), n)
			want := append([]byte("pre"), full[:min(n, len(full))]...)
			if !bytes.Equal(got, want) {
				t.Fatalf("n=%d:\n got %q\nwant %q", n, got, want)
			}
		}
	}
	big := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("abc \\n ", 1<<20) + `"}]}`
	r, err := ParseRequest(EndpointChat, []byte(big))
	if err != nil {
		t.Fatal(err)
	}
	const n = 256 << 10
	backing := make([]byte, 0, n+16) // the rendering may run a few bytes past n before the cut
	var buf []byte
	if a := testkit.LeastAllocs(5, func() { buf = r.AppendPromptPrefix(backing[:0], n) }); a != 0 || len(buf) != n {
		t.Fatalf("%v allocations, %d bytes rendered of a %d-byte prompt; want 0 and %d", a, len(buf), len(big), n)
	}
}

// FuzzAppendMessageEnds checks the shortcut of the chat rendering: each
// message is read once, and its end is where reading its members ended.
// For any request ParseRequest accepts, every message must end where
// valueEnd says it does and render the same bytes as the message cut out
// on its own, so the shortcut changes no hash (R-PLACE-2).
func FuzzAppendMessageEnds(f *testing.F) {
	for _, seed := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","messages":[ {} , {"role":"system","content":"a\"}b\\"} ,"text",7,null,[1,{"x":"}"}]]}`,
		`{"model":"m","messages":[{"content":[{"type":"text","text":"x\n"},{"type":"image_url","image_url":{"url":"u"}}],"role":"user","extra":{"k":[1,2]}} ]}`,
		`{"model":"m","messages":[{"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c","content":"ok"}]}`,
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, body string) {
		r, err := ParseRequest(EndpointChat, []byte(body))
		if err != nil {
			return
		}
		raw, ok := r.Member("messages")
		if !ok {
			return
		}
		for it := (elements{buf: raw}); it.nextStart(); {
			start := it.start
			got, end := appendMessageAt(nil, raw, start, math.MaxInt)
			if want := valueEnd(raw, start); end != want {
				t.Fatalf("message at %d of %s ends at %d, want %d", start, raw, end, want)
			}
			alone, aloneEnd := appendMessageAt(nil, raw[start:end], 0, math.MaxInt)
			if !bytes.Equal(got, alone) || aloneEnd != end-start {
				t.Fatalf("message %s renders %q in place, %q alone", raw[start:end], got, alone)
			}
			it.setEnd(end)
		}
	})
}
