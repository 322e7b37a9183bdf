package sim

import (
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
)

// TestTokenizeShape: POST /tokenize answers vLLM's {"count",
// "max_model_len", "tokens"}; a completions prompt's tokens are its words'
// ids, a chat's are its rendered messages' with a role marker (an id below
// FirstWordToken that no word has) for each role header, and its count is
// the chat's usage.prompt_tokens; a block of the chat is never a block of
// the completions prompt of the same text.
func TestTokenizeShape(t *testing.T) {
	_, url := startEngine(t, Config{MaxModelLen: 1234, BlockSize: 4})
	c := newClient(t)
	resp := post(t, c, url+"/tokenize", map[string]any{"model": "m", "prompt": "the  narwhal\tswims the"})
	body := readBody(t, resp)
	var out map[string]json.RawMessage
	if err := json.Unmarshal(body, &out); err != nil || resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("/tokenize %d %s", resp.StatusCode, body)
	}
	if len(out) != 3 || string(out["count"]) != "4" || string(out["max_model_len"]) != "1234" {
		t.Fatalf("/tokenize %s: want count 4, max_model_len 1234 and tokens", body)
	}
	words := tokenize(t, c, url, completionBody("the narwhal swims the"))
	if len(words) != 4 || words[0] != words[3] || words[0] == words[1] {
		t.Fatalf("tokens %d: the same word twice must have one id, two words two", words)
	}
	for _, id := range words {
		if id < FirstWordToken || id >= TokenVocabulary {
			t.Fatalf("word id %d outside [%d, %d)", id, FirstWordToken, TokenVocabulary)
		}
	}
	if list := tokenize(t, c, url, map[string]any{"prompt": []string{"the narwhal swims the"}}); !slices.Equal(list, words) {
		t.Fatalf("a list of one prompt (no model) tokenised as %d, want %d", list, words)
	}

	msgs := []map[string]any{{"role": "system", "content": "be brief"}, {"role": "user", "content": "the narwhal swims the"}}
	chat := tokenize(t, c, url, map[string]any{"model": "m", "messages": msgs})
	if len(chat) != 8 || chat[0] >= FirstWordToken || chat[3] >= FirstWordToken || !slices.Equal(chat[4:], words) {
		t.Fatalf("chat tokens %d: want [system: be brief user: the narwhal swims the] with markers first and fourth", chat)
	}
	resp = post(t, c, url+"/v1/chat/completions", map[string]any{"model": "m", "messages": msgs, "max_tokens": 1})
	var done struct {
		Usage usage `json:"usage"`
	}
	if err := json.Unmarshal(readBody(t, resp), &done); err != nil || done.Usage.PromptTokens != len(chat) {
		t.Fatalf("chat usage %+v, want prompt_tokens %d", done.Usage, len(chat))
	}
	text, _ := RenderChat(mustJSON(t, msgs))
	same := tokenize(t, c, url, completionBody(text))
	if len(same) != len(chat) || chainOf(same, 4)[0] == chainOf(chat, 4)[0] {
		t.Fatalf("the rendered chat as a completions prompt shares the chat's first block: %d vs %d", same, chat)
	}
}

func mustJSON(t *testing.T, v any) json.RawMessage {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestTokenizeErrors: /tokenize refuses what is not a request this
// engine serves with vLLM's error body: 400 without prompt or messages or
// with ones that do not parse, 404 for another model (vLLM's message),
// 413 for a body over the bound of the other endpoints.
func TestTokenizeErrors(t *testing.T) {
	_, url := startEngine(t, Config{})
	c := newClient(t)
	for _, tc := range []struct {
		body   any
		status int
		msg    string
	}{
		{`{"model":"m"}`, 400, "messages or prompt is required"},
		{`{"model":"m","prompt":null}`, 400, "messages or prompt is required"},
		{`{"model":"m","prompt":7}`, 400, "prompt must be a string"},
		{`{"model":"m","messages":[]}`, 400, "messages must not be empty"},
		{`{"model":"m","messages":[{"content":"x"}]}`, 400, "role is required"},
		{`not json`, 400, "invalid JSON"},
		{`{"model":"other","prompt":"x"}`, 404, "The model `other` does not exist."},
		{strings.Repeat(" ", DefaultMaxBodyBytes+1), 413, "request body exceeds"},
	} {
		resp := post(t, c, url+"/tokenize", tc.body)
		b := readBody(t, resp)
		var e struct {
			Error struct {
				Message string `json:"message"`
				Type    string `json:"type"`
				Code    int    `json:"code"`
			} `json:"error"`
		}
		if err := json.Unmarshal(b, &e); err != nil || resp.StatusCode != tc.status || e.Error.Code != tc.status || !strings.Contains(e.Error.Message, tc.msg) {
			body, _ := tc.body.(string)
			t.Errorf("/tokenize %.40q: %d %s, want %d with %q", body, resp.StatusCode, b, tc.status, tc.msg)
		}
	}
	if resp := post(t, c, url+"/tokenize", ""); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("an empty body: %d", resp.StatusCode)
	} else {
		readBody(t, resp)
	}
}

// BenchmarkTokenize2000 is the cost of tokenising a 2,000-token
// completions prompt, as POST /tokenize and every prefill do.
func BenchmarkTokenize2000(b *testing.B) {
	s, err := New(Config{EngineID: "e", Model: "m"})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	body, _ := json.Marshal(map[string]any{"model": "m", "prompt": words("token", 2000)})
	b.ReportAllocs()
	for b.Loop() {
		t, err := s.Tokenize(body)
		if err != nil || t.Count != 2000 {
			b.Fatal(err, t.Count)
		}
	}
}

// BenchmarkTokenIDs2000 is the tokeniser alone on 2,000 words (the
// prefill's own cost, with reused buffers): ids and block hashes.
func BenchmarkTokenIDs2000(b *testing.B) {
	prompt := words("token", 2000)
	ids, hashes := make([]uint32, 0, 2048), make([]uint64, 0, 128)
	b.ReportAllocs()
	for b.Loop() {
		ids = appendTokenIDs(ids[:0], prompt, nil)
		hashes = appendBlockHashes(hashes[:0], ids, BlockSize)
	}
}
