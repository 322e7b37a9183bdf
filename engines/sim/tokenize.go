package sim

import (
	"encoding/json"
	"errors"
	"fmt"

	"net/http"
	"strconv"
)

// Tokenized is POST /tokenize's answer, in vLLM's shape.
type Tokenized struct {
	// Count is len(Tokens).
	Count int `json:"count"`
	// MaxModelLen is the engine's context length (Config.MaxModelLen).
	MaxModelLen int `json:"max_model_len"`
	// Tokens are the prompt's token ids (tokens.go): for a chat request,
	// those of the rendered messages with their role markers. Their full
	// blocks of Config.BlockSize are exactly the token_ids of the
	// BlockStored events a prefill of the same request publishes.
	Tokens []uint32 `json:"tokens"`
}

// unknownModelError is a request for a model the engine does not serve
// (404 in vLLM), with vLLM's message.
type unknownModelError struct{ model string }

func (e unknownModelError) Error() string {
	return fmt.Sprintf("The model `%s` does not exist.", e.model)
}

// requestPrompt reads the prompt of body, a chat ("messages") or
// completions ("prompt") request, as the engine's prefill sees it: the
// prompt text and the byte spans of its role headers (chat only,
// appended to headers). A model other than the engine's
// fails with an unknownModelError; no messages or prompt, or ones that do
// not parse, fail too.
func (s *Server) requestPrompt(body []byte, headers []int) (prompt string, spans []int, err error) {
	// The prompt is decoded once, as a value, not kept raw and decoded
	// again: a long prompt's cost is its JSON decoding.
	var req struct {
		Model    string          `json:"model"`
		Messages json.RawMessage `json:"messages"`
		Prompt   any             `json:"prompt"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		return "", headers, fmt.Errorf("invalid JSON body: %w", err)
	}
	if req.Model != "" && req.Model != s.cfg.Model {
		return "", headers, unknownModelError{req.Model}
	}
	switch p := req.Prompt; {
	case !isNull(req.Messages):
		prompt, headers, err = renderChat(req.Messages, headers)
		return prompt, headers, err
	case p == nil:
		return "", headers, errors.New("messages or prompt is required")
	default:
		if list, ok := p.([]any); ok && len(list) == 1 {
			p = list[0]
		}
		if text, ok := p.(string); ok {
			return text, headers, nil
		}
		return "", headers, errors.New("prompt must be a string or a list of one string")
	}
}

// Tokenize answers POST /tokenize for body, a request in vLLM's shape
// ({"model", "prompt"} or {"model", "messages"}), with the tokens the
// engine's prefix cache stores for the same completions or chat request.
// It fails as requestPrompt does.
func (s *Server) Tokenize(body []byte) (Tokenized, error) {
	prompt, headers, err := s.requestPrompt(body, nil)
	if err != nil {
		return Tokenized{}, err
	}
	tokens := appendTokenIDs(make([]uint32, 0, 64), prompt, headers)
	return Tokenized{Count: len(tokens), MaxModelLen: s.cfg.MaxModelLen, Tokens: tokens}, nil
}

// serveTokenize is POST /tokenize: Tokenized as JSON; a vLLM error body
// with 404 for another model, 413 for a body over Config.MaxBodyBytes, 400 for
// anything else that is not a request.
func (s *Server) serveTokenize(w http.ResponseWriter, r *http.Request) {
	body, status, msg := s.readBody(nil, w, r)
	if status != 0 {
		writeError(w, status, msg)
		return
	}
	t, err := s.Tokenize(body)
	if _, ok := errors.AsType[unknownModelError](err); ok {
		writeError(w, http.StatusNotFound, err.Error())
		return
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	out := make([]byte, 0, 48+len(t.Tokens)*11)
	out = append(out, `{"count":`...)
	out = strconv.AppendInt(out, int64(t.Count), 10)
	out = append(out, `,"max_model_len":`...)
	out = strconv.AppendInt(out, int64(t.MaxModelLen), 10)
	out = append(out, `,"tokens":[`...)
	for i, id := range t.Tokens {
		if i > 0 {
			out = append(out, ',')
		}
		out = strconv.AppendUint(out, uint64(id), 10)
	}
	out = append(out, "]}"...)
	w.Header()["Content-Type"] = jsonContentType
	_, _ = w.Write(out)
}

// serveResetPrefixCache is vLLM's POST /reset_prefix_cache: the prefix
// cache is emptied (its counters kept) and, with KV events, an
// AllBlocksCleared is published. 200 with an empty body.
func (s *Server) serveResetPrefixCache(w http.ResponseWriter, r *http.Request) {
	s.cache.reset()
	w.WriteHeader(http.StatusOK)
}
