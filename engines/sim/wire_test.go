package sim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/narwhalmesh/narwhal/schemas"
)

// TestMain fails the package if any test leaves a goroutine behind, but
// two that are not ours: zmq4 v0.17.0 starts a writer goroutine per PUB
// socket that its Close never stops (parked on a condition variable,
// holding nothing but the socket's empty queue; gone from zmq4's main
// branch, not yet in a release), and net/http lingers half a second on
// a connection whose request body was refused unread (a 413) before it
// closes it. Every goroutine of ours, and every other one of zmq4's, must
// end.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
		goleak.IgnoreAnyFunction("net/http.(*conn).closeWriteAndWait"))
}

// startEngine starts a Server on loopback ports; it is closed when the
// test ends. Model defaults to "m", EngineID to "e1".
func startEngine(t testing.TB, cfg Config) (*Server, string) {
	t.Helper()
	if cfg.Model == "" {
		cfg.Model = "m"
	}
	if cfg.EngineID == "" {
		cfg.EngineID = "e1"
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	url, err := s.Start("127.0.0.1:0")
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return s, url
}

// newClient returns an HTTP client whose idle connections are closed when
// the test ends (before the engines it talks to are closed).
func newClient(t testing.TB) *http.Client {
	tr := &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 16}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

// post sends body (a string, []byte or any JSON-encodable value) and
// returns the response. Header pairs follow as "Name", "value".
func post(t testing.TB, c *http.Client, url string, body any, header ...string) *http.Response {
	t.Helper()
	resp, err := postCtx(context.Background(), c, url, body, header...)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return resp
}

func postCtx(ctx context.Context, c *http.Client, url string, body any, header ...string) (*http.Response, error) {
	var raw []byte
	switch b := body.(type) {
	case string:
		raw = []byte(b)
	case []byte:
		raw = b
	default:
		var err error
		if raw, err = json.Marshal(b); err != nil {
			return nil, err
		}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(raw))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	return c.Do(req)
}

func get(t testing.TB, c *http.Client, url string) (int, []byte) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: reading body: %v", url, err)
	}
	return resp.StatusCode, b
}

func readBody(t testing.TB, resp *http.Response) []byte {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading body: %v", err)
	}
	return b
}

// sseEvent is one SSE event: a comment line or a data payload.
type sseEvent struct {
	comment bool
	data    string
}

func (e sseEvent) done() bool { return !e.comment && e.data == "[DONE]" }

// sseReader reads SSE events one by one.
type sseReader struct{ r *bufio.Reader }

func newSSEReader(r io.Reader) *sseReader { return &sseReader{r: bufio.NewReader(r)} }

// next returns the next event, io.EOF at a clean end of the body, or the
// transport error.
func (s *sseReader) next() (sseEvent, error) {
	for {
		line, err := s.r.ReadString('\n')
		if err != nil {
			if err == io.EOF && line == "" {
				return sseEvent{}, io.EOF
			}
			if err == io.EOF {
				return sseEvent{}, io.ErrUnexpectedEOF
			}
			return sseEvent{}, err
		}
		line = strings.TrimRight(line, "\r\n")
		switch {
		case line == "":
			continue
		case strings.HasPrefix(line, ":"):
			return sseEvent{comment: true, data: line}, nil
		case strings.HasPrefix(line, "data: "):
			return sseEvent{data: strings.TrimPrefix(line, "data: ")}, nil
		default:
			return sseEvent{}, errors.New("unexpected SSE line: " + line)
		}
	}
}

// readAllSSE reads every event until the body ends; err is nil at a clean
// end of the body.
func readAllSSE(r io.Reader) ([]sseEvent, error) {
	sr := newSSEReader(r)
	var out []sseEvent
	for {
		ev, err := sr.next()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, ev)
	}
}

// streamEvents posts a streaming request, checks 200 and the SSE content
// type, and reads every event; the body must end cleanly.
func streamEvents(t testing.TB, c *http.Client, url string, body any, header ...string) []sseEvent {
	t.Helper()
	resp := post(t, c, url, body, header...)
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream; charset=utf-8" {
		t.Fatalf("content-type %q", ct)
	}
	evs, err := readAllSSE(resp.Body)
	if err != nil {
		t.Fatalf("reading stream: %v", err)
	}
	return evs
}

// toolCallDelta is one entry of delta.tool_calls.
type toolCallDelta struct {
	Index    int     `json:"index"`
	ID       *string `json:"id"`
	Type     *string `json:"type"`
	Function struct {
		Name      *string `json:"name"`
		Arguments *string `json:"arguments"`
	} `json:"function"`
}

// chunk decodes a chat or completions stream chunk.
type chunk struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index int `json:"index"`
		Delta *struct {
			Role      *string         `json:"role"`
			Content   *string         `json:"content"`
			ToolCalls []toolCallDelta `json:"tool_calls"`
		} `json:"delta"`
		Text         *string         `json:"text"`
		Logprobs     json.RawMessage `json:"logprobs"`
		FinishReason *string         `json:"finish_reason"`
	} `json:"choices"`
	Usage *usage               `json:"usage"`
	Error *schemas.ErrorObject `json:"error"`
}

type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
	Details          *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func decodeChunk(t testing.TB, ev sseEvent) chunk {
	t.Helper()
	if ev.comment {
		t.Fatalf("expected a data event, got comment %q", ev.data)
	}
	var c chunk
	if err := json.Unmarshal([]byte(ev.data), &c); err != nil {
		t.Fatalf("chunk %q: %v", ev.data, err)
	}
	return c
}

// contentOf returns the generated text a chunk carries for choice 0: chat
// delta content or completions text ("" for none).
func (c chunk) contentOf() (string, bool) {
	if len(c.Choices) == 0 {
		return "", false
	}
	ch := c.Choices[0]
	if ch.Text != nil {
		return *ch.Text, *ch.Text != ""
	}
	if ch.Delta != nil && ch.Delta.Content != nil {
		return *ch.Delta.Content, *ch.Delta.Content != ""
	}
	return "", false
}

// tokensOf collects the non-empty content/text of every chunk of choice j.
func tokensOf(t testing.TB, evs []sseEvent, j int) []string {
	t.Helper()
	var toks []string
	for _, ev := range evs {
		if ev.comment || ev.done() {
			continue
		}
		c := decodeChunk(t, ev)
		for _, ch := range c.Choices {
			if ch.Index != j {
				continue
			}
			switch {
			case ch.Text != nil && *ch.Text != "":
				toks = append(toks, *ch.Text)
			case ch.Delta != nil && ch.Delta.Content != nil && *ch.Delta.Content != "":
				toks = append(toks, *ch.Delta.Content)
			}
		}
	}
	return toks
}

func chatBody(content string, fields ...any) map[string]any {
	b := map[string]any{
		"model":    "m",
		"messages": []map[string]any{{"role": "user", "content": content}},
	}
	for i := 0; i+1 < len(fields); i += 2 {
		b[fields[i].(string)] = fields[i+1]
	}
	return b
}

func completionBody(prompt string, fields ...any) map[string]any {
	b := map[string]any{"model": "m", "prompt": prompt}
	for i := 0; i+1 < len(fields); i += 2 {
		b[fields[i].(string)] = fields[i+1]
	}
	return b
}

// chatPrompt is RenderChat of one user message.
func chatPrompt(t testing.TB, content string) string {
	t.Helper()
	msgs, _ := json.Marshal([]map[string]any{{"role": "user", "content": content}})
	p, err := RenderChat(msgs)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// errorOf decodes a vLLM error body and checks its shape: status, type and
// a null param.
func errorOf(t testing.TB, status int, body []byte, wantStatus int) schemas.ErrorObject {
	t.Helper()
	if status != wantStatus {
		t.Fatalf("status %d, want %d: %s", status, wantStatus, body)
	}
	var wire struct {
		Error *struct {
			Message string          `json:"message"`
			Type    string          `json:"type"`
			Param   json.RawMessage `json:"param"`
			Code    int             `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal(body, &wire); err != nil || wire.Error == nil {
		t.Fatalf("not a vLLM error body: %s", body)
	}
	e := wire.Error
	if e.Code != wantStatus || e.Type != schemas.ErrorType(wantStatus) || string(e.Param) != "null" {
		t.Fatalf("error body %s: want code %d type %s param null", body, wantStatus, schemas.ErrorType(wantStatus))
	}
	return schemas.ErrorObject{Message: e.Message, Type: e.Type, Code: e.Code}
}
