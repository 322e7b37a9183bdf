package schemas

import (
	"bytes"
	"encoding/json"
	"sort"
	"strconv"
)

// Endpoints Narwhal serves and forwards (SPEC R-API-1).
const (
	EndpointChat        = "/v1/chat/completions"
	EndpointCompletions = "/v1/completions"
)

// RequestError is a client request Narwhal refuses before touching any
// engine (SPEC R-API-4): Status is 400 (or 404 for an unknown model, 413
// for a body over the limit), Message the client-facing detail, Param the
// offending field or "".
type RequestError struct {
	Status  int
	Message string
	Param   string
}

// Error returns the message.
func (e *RequestError) Error() string { return e.Message }

func badRequest(param, msg string) *RequestError {
	return &RequestError{Status: 400, Message: msg, Param: param}
}

// Request is a parsed client completion request: the top-level members of
// the JSON body kept as raw bytes, in sorted key order, with
// kv_transfer_params already removed (SPEC R-API-5). Build it with
// ParseRequest; it is immutable afterwards and safe to share between the
// attempts of one request.
type Request struct {
	// Endpoint is the client's path (EndpointChat or EndpointCompletions).
	Endpoint string
	// Model is the requested model name.
	Model string
	// Stream is the client's "stream" (false when absent).
	Stream bool
	// IncludeUsage is the client's stream_options.include_usage.
	IncludeUsage bool
	// N is the number of choices asked for (1 when absent).
	N int
	// MaxTokens is the client's max_completion_tokens, else max_tokens;
	// 0 when neither was given.
	MaxTokens int

	members []member
	// streamOptions is the client's stream_options object, or nil.
	streamOptions map[string]json.RawMessage
}

type member struct {
	key string
	raw json.RawMessage
}

// Chat reports whether the request is a chat completion.
func (r *Request) Chat() bool { return r.Endpoint == EndpointChat }

// Member returns the raw JSON of a top-level member and whether it is
// present.
func (r *Request) Member(key string) (json.RawMessage, bool) {
	i := sort.Search(len(r.members), func(i int) bool { return r.members[i].key >= key })
	if i < len(r.members) && r.members[i].key == key {
		return r.members[i].raw, true
	}
	return nil, false
}

// ParseRequest validates a client body for endpoint (SPEC R-API-4) and
// returns the parsed request with kv_transfer_params removed (R-API-5).
// It returns a *RequestError (status 400) for invalid JSON, a body that is
// not an object, a missing or non-string model, missing messages (chat)
// or prompt (completions), a non-boolean stream, max_tokens or
// max_completion_tokens that is not an integer ≥ 1, or n that is not an
// integer ≥ 1. Whether the model exists is the caller's check (404).
func ParseRequest(endpoint string, body []byte) (*Request, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(body, &top); err != nil || top == nil {
		if err == nil || bytes.HasPrefix(bytes.TrimSpace(body), []byte("{")) {
			return nil, badRequest("", "invalid JSON body: "+errText(err, "expected an object"))
		}
		return nil, badRequest("", "invalid JSON body: expected an object")
	}
	delete(top, "kv_transfer_params")
	r := &Request{Endpoint: endpoint, N: 1}

	raw, ok := top["model"]
	if !ok || isNull(raw) {
		return nil, badRequest("model", "missing required field: model")
	}
	if err := json.Unmarshal(raw, &r.Model); err != nil || r.Model == "" {
		return nil, badRequest("model", "model must be a non-empty string")
	}
	switch endpoint {
	case EndpointChat:
		raw, ok := top["messages"]
		if !ok || isNull(raw) {
			return nil, badRequest("messages", "missing required field: messages")
		}
		var msgs []json.RawMessage
		if err := json.Unmarshal(raw, &msgs); err != nil {
			return nil, badRequest("messages", "messages must be an array")
		}
		if len(msgs) == 0 {
			return nil, badRequest("messages", "messages must not be empty")
		}
	case EndpointCompletions:
		raw, ok := top["prompt"]
		if !ok || isNull(raw) {
			return nil, badRequest("prompt", "missing required field: prompt")
		}
	}
	if raw, ok := top["stream"]; ok && !isNull(raw) {
		if err := json.Unmarshal(raw, &r.Stream); err != nil {
			return nil, badRequest("stream", "stream must be a boolean")
		}
	}
	if raw, ok := top["stream_options"]; ok && !isNull(raw) {
		if err := json.Unmarshal(raw, &r.streamOptions); err != nil {
			return nil, badRequest("stream_options", "stream_options must be an object")
		}
		if iu, ok := r.streamOptions["include_usage"]; ok && !isNull(iu) {
			if err := json.Unmarshal(iu, &r.IncludeUsage); err != nil {
				return nil, badRequest("stream_options", "stream_options.include_usage must be a boolean")
			}
		}
	}
	for _, key := range []string{"max_tokens", "max_completion_tokens"} {
		raw, ok := top[key]
		if !ok || isNull(raw) {
			continue
		}
		n, err := positiveInt(raw)
		if err != nil {
			return nil, badRequest(key, key+" must be at least 1")
		}
		if key == "max_completion_tokens" || r.MaxTokens == 0 {
			r.MaxTokens = n
		}
	}
	if raw, ok := top["n"]; ok && !isNull(raw) {
		n, err := positiveInt(raw)
		if err != nil {
			return nil, badRequest("n", "n must be at least 1")
		}
		r.N = n
	}

	r.members = make([]member, 0, len(top))
	for k, v := range top {
		r.members = append(r.members, member{key: k, raw: v})
	}
	sort.Slice(r.members, func(i, j int) bool { return r.members[i].key < r.members[j].key })
	return r, nil
}

func errText(err error, fallback string) string {
	if err == nil {
		return fallback
	}
	return err.Error()
}

func isNull(raw json.RawMessage) bool {
	return bytes.Equal(bytes.TrimSpace(raw), []byte("null"))
}

func positiveInt(raw json.RawMessage) (int, error) {
	n, err := strconv.Atoi(string(bytes.TrimSpace(raw)))
	if err != nil || n < 1 {
		return 0, strconv.ErrSyntax
	}
	return n, nil
}

// prefillDropped are the members the prefill leg never carries: the
// output-only and early-stop options of R-LEG-1a, plus min_tokens, which
// would contradict max_tokens=1.
var prefillDropped = map[string]bool{
	"stream": true, "stream_options": true, "max_tokens": true, "max_completion_tokens": true,
	"n": true, "stop": true, "stop_token_ids": true, "logprobs": true, "top_logprobs": true,
	"echo": true, "best_of": true, "ignore_eos": true, "min_tokens": true, "kv_transfer_params": true,
}

// AppendPrefillBody appends the prefill leg's JSON body to dst (SPEC
// R-LEG-1, R-LEG-1a): every member that shapes the prompt unchanged;
// "stream":false, "max_tokens":1, "max_completion_tokens":1, "n":1,
// "ignore_eos":true; stream_options, stop, stop_token_ids, logprobs,
// top_logprobs, echo, best_of and min_tokens removed; and
// "kv_transfer_params" set to kvParams, or absent when kvParams is nil
// (same-worker, R-LEG-4).
func (r *Request) AppendPrefillBody(dst []byte, kvParams []byte) []byte {
	dst = append(dst, '{')
	first := true
	for _, m := range r.members {
		if prefillDropped[m.key] {
			continue
		}
		dst = appendMember(dst, &first, m.key, m.raw)
	}
	dst = appendMember(dst, &first, "stream", []byte("false"))
	dst = appendMember(dst, &first, "max_tokens", []byte("1"))
	dst = appendMember(dst, &first, "max_completion_tokens", []byte("1"))
	dst = appendMember(dst, &first, "n", []byte("1"))
	dst = appendMember(dst, &first, "ignore_eos", []byte("true"))
	if kvParams != nil {
		dst = appendMember(dst, &first, "kv_transfer_params", kvParams)
	}
	return append(dst, '}')
}

// AppendDecodeBody appends the decode leg's JSON body to dst (SPEC R-LEG-3,
// R-LEG-5): the client's members unchanged, except "stream":true and
// stream_options with include_usage true (the client's other
// stream_options kept), and "kv_transfer_params" set to kvParams, or
// absent when kvParams is nil (same-worker, R-LEG-4).
func (r *Request) AppendDecodeBody(dst []byte, kvParams []byte) []byte {
	dst = append(dst, '{')
	first := true
	for _, m := range r.members {
		switch m.key {
		case "stream", "stream_options", "kv_transfer_params":
			continue
		}
		dst = appendMember(dst, &first, m.key, m.raw)
	}
	dst = appendMember(dst, &first, "stream", []byte("true"))
	dst = append(dst, `,"stream_options":{"include_usage":true`...)
	if len(r.streamOptions) > 0 {
		keys := make([]string, 0, len(r.streamOptions))
		for k := range r.streamOptions {
			if k != "include_usage" {
				keys = append(keys, k)
			}
		}
		sort.Strings(keys)
		for _, k := range keys {
			dst = append(dst, ',')
			dst = appendJSONString(dst, k)
			dst = append(dst, ':')
			dst = append(dst, r.streamOptions[k]...)
		}
	}
	dst = append(dst, '}')
	if kvParams != nil {
		dst = appendMember(dst, &first, "kv_transfer_params", kvParams)
	}
	return append(dst, '}')
}

func appendMember(dst []byte, first *bool, key string, raw []byte) []byte {
	if !*first {
		dst = append(dst, ',')
	}
	*first = false
	dst = appendJSONString(dst, key)
	dst = append(dst, ':')
	return append(dst, raw...)
}
