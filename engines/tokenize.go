package engines

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// MaxTokenizeBytes bounds the answer of an engine's POST /tokenize that
// Tokenize reads (4 MiB: some 500,000 token ids); a longer one is an
// error.
const MaxTokenizeBytes = 4 << 20

// ErrTokenize is wrapped by every error of Tokenize the engine's answer
// caused (a status other than 200, a body too long or not the shape).
var ErrTokenize = errors.New("engines: /tokenize")

// tokenizeAnswer is vLLM's answer to POST /tokenize: {"count",
// "max_model_len", "tokens": [ids…]}.
type tokenizeAnswer struct {
	Count  *int     `json:"count"`
	Tokens []uint32 `json:"tokens"`
}

// Tokenize asks engine e (with its credential) for the token ids of a
// prompt (behaviour.md R-PLACE-4): it POSTs body — vLLM's shape,
// {"model", "prompt"} or {"model", "messages", …} — to e's /tokenize and
// returns the answer's "tokens" appended to dst. ctx bounds the whole
// call (connect, headers, body). It fails when the engine cannot be
// reached, answers other than 200, answers more than MaxTokenizeBytes,
// or with a body that is not {"tokens": [non-negative 32-bit ids], …}
// whose "count", when present, is the ids' number (errors of the answer
// wrap ErrTokenize).
func Tokenize(ctx context.Context, httpc *http.Client, e *Engine, body []byte, dst []uint32) ([]uint32, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(e.URL, "/")+"/tokenize", bytes.NewReader(body))
	if err != nil {
		return dst, err
	}
	req.Header.Set("Content-Type", "application/json")
	e.Credential.Authorize(req.Header)
	resp, err := httpc.Do(req)
	if err != nil {
		return dst, fmt.Errorf("engine %s: /tokenize: %w", e.ID, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
		return dst, fmt.Errorf("%w: engine %s: %s", ErrTokenize, e.ID, statusText(resp))
	}
	raw, err := io.ReadAll(io.LimitReader(resp.Body, MaxTokenizeBytes+1))
	if err != nil {
		return dst, fmt.Errorf("engine %s: /tokenize: %w", e.ID, err)
	}
	if len(raw) > MaxTokenizeBytes {
		return dst, fmt.Errorf("%w: engine %s: answer longer than %d bytes", ErrTokenize, e.ID, MaxTokenizeBytes)
	}
	var a tokenizeAnswer
	if err := json.Unmarshal(raw, &a); err != nil {
		return dst, fmt.Errorf("%w: engine %s: %v", ErrTokenize, e.ID, err)
	}
	if a.Tokens == nil {
		return dst, fmt.Errorf("%w: engine %s: no \"tokens\"", ErrTokenize, e.ID)
	}
	if a.Count != nil && *a.Count != len(a.Tokens) {
		return dst, fmt.Errorf("%w: engine %s: count %d for %d tokens", ErrTokenize, e.ID, *a.Count, len(a.Tokens))
	}
	return append(dst, a.Tokens...), nil
}
