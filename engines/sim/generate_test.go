package sim

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
)

func TestGenerateIsDeterministic(t *testing.T) {
	a, fa := Generate("user: hello\n", 7, 40, nil, true)
	b, fb := Generate("user: hello\n", 7, 40, nil, true)
	if !slices.Equal(a, b) || fa != fb {
		t.Fatalf("same inputs, different outputs: %q/%s vs %q/%s", a, fa, b, fb)
	}
	if len(a) != 40 || fa != FinishLength {
		t.Fatalf("ignore_eos with 40 tokens: got %d tokens, finish %q", len(a), fa)
	}
	for _, tok := range a {
		if !strings.HasPrefix(tok, " ") || !slices.Contains(vocabulary[:], tok) {
			t.Fatalf("token %q is not a vocabulary word with a leading space", tok)
		}
	}
	c, _ := Generate("user: hello\n", 8, 40, nil, true)
	d, _ := Generate("user: hello!\n", 7, 40, nil, true)
	if slices.Equal(a, c) || slices.Equal(a, d) {
		t.Fatal("seed and prompt must change the output")
	}
}

func TestGenerateEndOfSequence(t *testing.T) {
	// Find a prompt whose EOS falls inside 64 tokens; its output without
	// ignore_eos is exactly the prefix before that token.
	for p := 0; p < 200; p++ {
		prompt := "prompt " + strings.Repeat("x", p)
		full, _ := Generate(prompt, 0, 64, nil, true)
		toks, finish := Generate(prompt, 0, 64, nil, false)
		if finish != FinishStop {
			continue
		}
		base := streamBase(prompt, 0)
		if !isEOS(tokenHash(base, len(toks))) {
			t.Fatalf("stopped at %d but that token is not EOS", len(toks))
		}
		if !slices.Equal(toks, full[:len(toks)]) {
			t.Fatalf("EOS output %q is not a prefix of %q", toks, full)
		}
		return
	}
	t.Fatal("no prompt hit EOS within 64 tokens in 200 tries: EOS rate is wrong")
}

func TestGenerateStopStrings(t *testing.T) {
	full, _ := Generate("stop test", 1, 12, nil, true)
	text := strings.Join(full, "")
	// A stop string spanning the end of token 3 and the start of token 4.
	cut := len(full[0]) + len(full[1]) + len(full[2]) + len(full[3]) - 2
	stop := text[cut : cut+4]
	toks, finish := Generate("stop test", 1, 12, []string{"never-there", stop}, true)
	if finish != FinishStop {
		t.Fatalf("finish %q, want stop", finish)
	}
	got := strings.Join(toks, "")
	first := strings.Index(text, stop)
	if got != text[:first] {
		t.Fatalf("output %q, want the text before the first %q: %q", got, stop, text[:first])
	}
	if strings.Contains(got, stop) {
		t.Fatal("output contains the stop string")
	}
	// A stop string that never occurs changes nothing.
	toks, finish = Generate("stop test", 1, 12, []string{"zzz"}, true)
	if !slices.Equal(toks, full) || finish != FinishLength {
		t.Fatalf("absent stop string changed output: %q %s", toks, finish)
	}
	// A stop string at the very start empties the output.
	toks, finish = Generate("stop test", 1, 12, []string{full[0]}, true)
	if len(toks) != 0 || finish != FinishStop {
		t.Fatalf("stop on first token: %q %s", toks, finish)
	}
}

func TestPromptTokens(t *testing.T) {
	for in, want := range map[string]int{"": 1, "   ": 1, "one": 1, "user: hello there\n": 3, "a\tb\nc  d": 4} {
		if got := PromptTokens(in); got != want {
			t.Errorf("PromptTokens(%q) = %d, want %d", in, got, want)
		}
	}
}

func TestRenderChat(t *testing.T) {
	got, err := RenderChat(json.RawMessage(`[
		{"role":"system","content":"be brief"},
		{"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]},
		{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},
		{"role":"tool","tool_call_id":"c1","content":"42"}]`))
	if err != nil {
		t.Fatal(err)
	}
	want := "system: be brief\nuser: hi there\nassistant:  tool_calls=[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]\ntool[c1]: 42\n"
	if got != want {
		t.Fatalf("RenderChat = %q, want %q", got, want)
	}
	for _, bad := range []string{`{}`, `[]`, `[{"content":"x"}]`, `[{"role":"user","content":[{"type":"image_url"}]}]`, `[{"role":"user","content":3}]`} {
		if _, err := RenderChat(json.RawMessage(bad)); err == nil {
			t.Errorf("RenderChat(%s) succeeded", bad)
		}
	}
}

func TestAppendJSONStringMatchesEncodingJSON(t *testing.T) {
	for _, s := range []string{"", " narwhal", `quote " and \ slash`, "ctl \x01\n\r\t", "ünïcødé ☃", "bad \xff utf8", "sep \u2028 \u2029"} {
		want, _ := json.Marshal(s)
		got := appendJSONString(nil, s)
		var back string
		if err := json.Unmarshal(got, &back); err != nil {
			t.Fatalf("%q encodes to invalid JSON %s", s, got)
		}
		var wantBack string
		_ = json.Unmarshal(want, &wantBack)
		if back != wantBack {
			t.Errorf("%q round-trips to %q, encoding/json gives %q", s, back, wantBack)
		}
	}
}
