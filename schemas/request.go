package schemas

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
)

// Endpoints Narwhal serves and forwards (behaviour.md R-API-1).
const (
	EndpointChat        = "/v1/chat/completions"
	EndpointCompletions = "/v1/completions"
)

// RequestError is a client request Narwhal refuses before touching any
// engine (behaviour.md R-API-4): Status is 400 (or 404 for an unknown model, 413
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
// the JSON body kept as raw bytes, in the client's order (a repeated key
// keeps its last value, as encoding/json does), with kv_transfer_params
// already removed (behaviour.md R-API-5). Build it with ParseRequest; it is
// immutable afterwards and safe to share between the attempts of one
// request.
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

	body    []byte // the client's body, copied once; members alias it
	members []member
	// streamOptions are the client's stream_options members other than
	// include_usage.
	streamOptions []member
}

// member is one top-level member: its name (unescaped), its name as the
// client wrote it (quoted JSON) and its raw value.
type member struct {
	key    []byte
	keyRaw []byte
	raw    []byte
}

// Size returns the length of the client's body in bytes (a capacity hint
// for the legs' bodies).
func (r *Request) Size() int { return len(r.body) }

// Chat reports whether the request is a chat completion.
func (r *Request) Chat() bool { return r.Endpoint == EndpointChat }

// Member returns the raw JSON of a top-level member and whether it is
// present.
func (r *Request) Member(key string) (json.RawMessage, bool) {
	for i := range r.members {
		if string(r.members[i].key) == key {
			return r.members[i].raw, true
		}
	}
	return nil, false
}

// splitObject returns the members of the JSON object buf in order, a
// repeated name replacing the earlier value in place (as encoding/json
// keeps the last). ok is false when buf is not exactly one valid JSON
// object.
func splitObject(buf []byte, into []member) (members []member, ok bool) {
	it := objectIter{w: chunkWalker{buf: buf}}
	members = into
	for {
		key, keyRaw, raw, more := it.next()
		if !more {
			break
		}
		m := member{key: key, keyRaw: keyRaw, raw: raw}
		replaced := false
		for i := range members {
			if bytes.Equal(members[i].key, key) {
				members[i] = m
				replaced = true
				break
			}
		}
		if !replaced {
			members = append(members, m)
		}
	}
	if !it.valid() {
		return nil, false
	}
	return members, true
}

// Limits are the caps ParseLimited applies to a client request (behaviour.md
// R-API-8). A zero field means no cap.
type Limits struct {
	// MaxN is the largest n accepted.
	MaxN int
	// MaxTokens is the largest max_tokens or max_completion_tokens
	// accepted, in tokens.
	MaxTokens int
}

// ParseRequest is ParseLimited with no caps.
func ParseRequest(endpoint string, body []byte) (*Request, error) {
	return ParseLimited(endpoint, body, Limits{})
}

// ParseLimited validates a client body for endpoint (behaviour.md R-API-4) and
// returns the parsed request with kv_transfer_params removed (R-API-5),
// and SGLang's bootstrap_host, bootstrap_port, bootstrap_room and
// bootstrap_pair_key too (R-DESC-7: the router writes its own).
// It keeps a private copy of body. It returns a *RequestError (status 400)
// for invalid JSON, a body that is not an object, a missing or non-string
// model, missing messages (chat) or prompt (completions), a non-boolean
// stream, max_tokens, max_completion_tokens or n that is not an integer
// ("<field> must be an integer") or is below 1 ("<field> must be at least
// 1"); and, for a cap of lim that is set
// (R-API-8), n above lim.MaxN ("n must be at most …") or max_tokens /
// max_completion_tokens above lim.MaxTokens ("<field> must be at most …"),
// however many digits the value has. Param names the field. Whether the
// model exists is the caller's check (404).
func ParseLimited(endpoint string, body []byte, lim Limits) (*Request, error) {
	r := &Request{Endpoint: endpoint, N: 1, body: append([]byte(nil), body...)}
	members, ok := splitObject(r.body, make([]member, 0, 16))
	if !ok {
		if t := bytes.TrimSpace(body); len(t) > 0 && t[0] == '{' {
			var v any
			err := json.Unmarshal(t, &v)
			return nil, badRequest("", "invalid JSON body: "+errText(err, "malformed object"))
		}
		return nil, badRequest("", "invalid JSON body: expected an object")
	}
	kept := members[:0]
	var model, messages, prompt []byte
	var hasMessages, hasPrompt bool
	for _, m := range members {
		switch string(m.key) {
		case "kv_transfer_params":
			continue // R-API-5
		case "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key":
			continue // SGLang's bootstrap fields are the router's to write (R-DESC-7)
		case "model":
			model = m.raw
		case "messages":
			messages, hasMessages = m.raw, true
		case "prompt":
			prompt, hasPrompt = m.raw, true
		case "stream":
			switch string(m.raw) {
			case "true":
				r.Stream = true
			case "false", "null":
			default:
				return nil, badRequest("stream", "stream must be a boolean")
			}
		case "stream_options":
			if err := r.parseStreamOptions(m.raw); err != nil {
				return nil, err
			}
		case "max_tokens", "max_completion_tokens", "n":
			if isNull(m.raw) {
				break
			}
			limit := lim.MaxTokens
			if string(m.key) == "n" {
				limit = lim.MaxN
			}
			n, msg := countValue(m.raw, limit)
			if msg != "" {
				return nil, badRequest(string(m.key), string(m.key)+msg)
			}
			switch {
			case string(m.key) == "n":
				r.N = n
			case string(m.key) == "max_completion_tokens" || r.MaxTokens == 0:
				r.MaxTokens = n
			}
		}
		kept = append(kept, m)
	}
	r.members = kept
	// max_completion_tokens wins over max_tokens whatever their order.
	if raw, ok := r.Member("max_completion_tokens"); ok && !isNull(raw) {
		r.MaxTokens, _ = positiveInt(raw)
	}

	if model == nil || isNull(model) {
		return nil, badRequest("model", "missing required field: model")
	}
	if model[0] != '"' || json.Unmarshal(model, &r.Model) != nil || r.Model == "" {
		return nil, badRequest("model", "model must be a non-empty string")
	}
	switch endpoint {
	case EndpointChat:
		if !hasMessages || isNull(messages) {
			return nil, badRequest("messages", "missing required field: messages")
		}
		if messages[0] != '[' {
			return nil, badRequest("messages", "messages must be an array")
		}
		if bytes.Equal(bytes.TrimSpace(messages[1:len(messages)-1]), nil) {
			return nil, badRequest("messages", "messages must not be empty")
		}
	case EndpointCompletions:
		if !hasPrompt || isNull(prompt) {
			return nil, badRequest("prompt", "missing required field: prompt")
		}
	}
	return r, nil
}

// parseStreamOptions reads stream_options: include_usage, and the other
// members kept for the decode leg.
func (r *Request) parseStreamOptions(raw []byte) error {
	if isNull(raw) {
		return nil
	}
	opts, ok := splitObject(raw, nil)
	if !ok {
		return badRequest("stream_options", "stream_options must be an object")
	}
	for _, m := range opts {
		if string(m.key) != "include_usage" {
			r.streamOptions = append(r.streamOptions, m)
			continue
		}
		switch string(m.raw) {
		case "true":
			r.IncludeUsage = true
		case "false", "null":
		default:
			return badRequest("stream_options", "stream_options.include_usage must be a boolean")
		}
	}
	return nil
}

func errText(err error, fallback string) string {
	if err == nil {
		return fallback
	}
	return err.Error()
}

func isNull(raw []byte) bool {
	return string(raw) == "null"
}

// countValue reads the JSON value raw of n, max_tokens or
// max_completion_tokens (R-API-4, R-API-8): a plain integer ≥ 1 and, when
// limit > 0, ≤ limit. Otherwise it returns the end of the 400's message,
// chosen by what the value is rather than by how it failed to parse: a
// number below 1 in any notation (-5, 0.5, -1e30) is " must be at least
// 1"; a number above limit in any notation or size (2^64, 1e30, 1e400)
// is " must be at most <limit>"; anything else (a fraction such as 2.5,
// a decimal or exponent form of an integer such as 2.0 or 1e3 — refused as
// the OpenAI API refuses them —, a string, a boolean, an object) is " must
// be an integer".
func countValue(raw []byte, limit int) (int, string) {
	n, err := positiveInt(raw)
	if err == nil {
		if limit > 0 && n > limit {
			return 0, " must be at most " + strconv.Itoa(limit)
		}
		return n, ""
	}
	if len(raw) > 0 && (raw[0] == '-' || raw[0] >= '0' && raw[0] <= '9') {
		// A JSON number (the object was validated): ParseFloat's range
		// error still yields ±Inf or 0 with the right sign.
		f, _ := strconv.ParseFloat(string(raw), 64)
		switch {
		case f < 1:
			return 0, " must be at least 1"
		case limit > 0 && f > float64(limit):
			return 0, " must be at most " + strconv.Itoa(limit)
		}
	}
	return 0, " must be an integer"
}

// positiveInt parses a JSON integer literal ≥ 1 without allocating. A
// literal beyond the int range saturates at math.MaxInt, so that a cap
// check sees it as too large rather than as no integer at all.
func positiveInt(raw []byte) (int, error) {
	if len(raw) == 0 {
		return 0, strconv.ErrSyntax
	}
	n := 0
	for _, c := range raw {
		if c < '0' || c > '9' {
			return 0, strconv.ErrSyntax
		}
		d := int(c - '0')
		if n > (math.MaxInt-d)/10 {
			n = math.MaxInt
			continue
		}
		n = n*10 + d
	}
	if n < 1 {
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

// AppendPrefillBody appends the prefill leg's JSON body to dst (behaviour.md
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
		if prefillDropped[string(m.key)] {
			continue
		}
		dst = appendRawMember(dst, &first, m.keyRaw, m.raw)
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

// AppendDecodeBody appends the decode leg's JSON body to dst (behaviour.md R-LEG-3,
// R-LEG-5): the client's members unchanged, except "stream":true and
// stream_options with include_usage true (the client's other
// stream_options kept), and "kv_transfer_params" set to kvParams, or
// absent when kvParams is nil (same-worker, R-LEG-4).
func (r *Request) AppendDecodeBody(dst []byte, kvParams []byte) []byte {
	dst = append(dst, '{')
	first := true
	for _, m := range r.members {
		switch string(m.key) {
		case "stream", "stream_options", "kv_transfer_params":
			continue
		}
		dst = appendRawMember(dst, &first, m.keyRaw, m.raw)
	}
	dst = appendMember(dst, &first, "stream", []byte("true"))
	dst = append(dst, `,"stream_options":{"include_usage":true`...)
	for _, m := range r.streamOptions {
		dst = append(dst, ',')
		dst = append(dst, m.keyRaw...)
		dst = append(dst, ':')
		dst = append(dst, m.raw...)
	}
	dst = append(dst, '}')
	if kvParams != nil {
		dst = appendMember(dst, &first, "kv_transfer_params", kvParams)
	}
	return append(dst, '}')
}

// appendMember appends "key":raw for a key that needs no escaping.
func appendMember(dst []byte, first *bool, key string, raw []byte) []byte {
	if !*first {
		dst = append(dst, ',')
	}
	*first = false
	dst = append(dst, '"')
	dst = append(dst, key...)
	dst = append(dst, '"', ':')
	return append(dst, raw...)
}

// appendRawMember appends keyRaw:raw, keyRaw being a quoted JSON string.
func appendRawMember(dst []byte, first *bool, keyRaw, raw []byte) []byte {
	if !*first {
		dst = append(dst, ',')
	}
	*first = false
	dst = append(dst, keyRaw...)
	dst = append(dst, ':')
	return append(dst, raw...)
}

// Prompts returns how many prompts the request carries: for completions,
// the length of a batched prompt (a JSON array of strings or of token
// arrays); 1 for everything else (a string, one token array, chat).
func (r *Request) Prompts() int {
	if r.Endpoint != EndpointCompletions {
		return 1
	}
	raw, ok := r.Member("prompt")
	if !ok {
		return 1
	}
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || raw[0] != '[' {
		return 1
	}
	n, batched := 0, false
	Elements(raw, func(e []byte) bool {
		n++
		if n == 1 {
			batched = e[0] == '"' || e[0] == '['
		}
		return batched
	})
	if !batched || n < 1 {
		return 1
	}
	return n
}

// AppendDecodeBodyWith appends the decode body of AppendDecodeBody
// without transfer parameters (the client's members, "stream":true,
// stream_options with include_usage), followed by members — raw JSON
// object members without braces that a connector writes, e.g.
// "bootstrap_host":"10.0.0.11","bootstrap_port":8998,"bootstrap_room":7
// (behaviour.md R-DESC-7) — which must not repeat a member the body has
// (the members connectors write are removed from the client's request by
// ParseLimited).
func (r *Request) AppendDecodeBodyWith(dst []byte, members []byte) []byte {
	dst = r.AppendDecodeBody(dst, nil)
	if len(members) == 0 {
		return dst
	}
	dst = append(dst[:len(dst)-1], ',')
	dst = append(dst, members...)
	return append(dst, '}')
}
