package sim

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/narwhalmesh/narwhal/schemas"
)

// endpointKind is the OpenAI endpoint a request came in on. Chat and
// completions tokenise differently, so it is part of the handoff digest
// (R-DESC-4).
type endpointKind uint8

const (
	kindChat endpointKind = iota
	kindCompletions
)

// String returns "chat" or "completions".
func (k endpointKind) String() string {
	if k == kindChat {
		return "chat"
	}
	return "completions"
}

// completionRequest is the part of an OpenAI chat or completions request
// the simulator honours.
type completionRequest struct {
	Model         string          `json:"model"`
	Messages      json.RawMessage `json:"messages"`
	Prompt        json.RawMessage `json:"prompt"`
	Stream        bool            `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	N                   *int            `json:"n"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Seed                *int64          `json:"seed"`
	Stop                json.RawMessage `json:"stop"`
	IgnoreEOS           bool            `json:"ignore_eos"`
	Logprobs            json.RawMessage `json:"logprobs"`
	TopLogprobs         *int            `json:"top_logprobs"`
	Tools               []toolSpec      `json:"tools"`
	ToolChoice          json.RawMessage `json:"tool_choice"`
	KVTransferParams    json.RawMessage `json:"kv_transfer_params"`
	BootstrapHost       json.RawMessage `json:"bootstrap_host"`
	BootstrapPort       json.RawMessage `json:"bootstrap_port"`
	BootstrapRoom       json.RawMessage `json:"bootstrap_room"`
}

type toolSpec struct {
	Type     string `json:"type"`
	Function struct {
		Name string `json:"name"`
	} `json:"function"`
}

// maxLogprobs is vLLM's default max_logprobs.
const maxLogprobs = 20

// Tool-call arguments are {"input":"<generated text>"}: the opening goes
// before the first token, the closing after the last.
const (
	argsOpen  = `{"input":"`
	argsClose = `"}`
)

// choice is the generated output of one choice of a request.
type choice struct {
	tokens []string
	text   []byte // stop-string scratch
	finish string
	base   uint64 // token hash base: streamBase(prompt, seed+j)
	offset int    // text offset of the next streamed token
}

// exchange is one inference request in flight. Exchanges are pooled so
// their buffers are reused: a stream encodes every chunk into buf with
// append-based encoding, and allocates nothing per token.
type exchange struct {
	s       *Server
	ctx     context.Context
	w       http.ResponseWriter
	flusher interface{ FlushError() error }
	kind    endpointKind
	req     completionRequest
	kvp     kvParams
	faults  activeFaults

	rooms    []uint64 // sglang: the request's bootstrap rooms, one per choice
	bootAddr string   // sglang decode: the prefill's bootstrap server

	body    []byte
	buf     []byte
	head    []byte // chunk prefix: {"id":…,"object":…,"created":…,"model":…,"choices":[
	timer   *time.Timer
	job     computeJob // this request's share of the engine's prefill compute
	choices []choice
	stop    []string
	hashes  []uint64 // the prompt's block hashes
	tokens  []uint32 // the prompt's token ids (tokens.go)
	headers []int    // chat: the role headers' byte spans in prompt

	requestID    string
	id           string
	prompt       string
	toolName     string
	created      int64
	promptTokens int
	cachedTokens int // usage.prompt_tokens_details.cached_tokens
	queued       int // this request's share of counters.queuedTokens
	maxTokens    int
	n            int
	topLogprobs  int
	emitted      int
	seed         int64
	ignoreEOS    bool
	stream       bool
	includeUsage bool
	logprobs     bool
	prefillLeg   bool
	decodeLeg    bool
	sglang       bool // a request paired by an sglang router (bootstrap.go)
	aborted      bool
}

func (x *exchange) reset(s *Server, w http.ResponseWriter, kind endpointKind) {
	*x = exchange{
		body:    x.body[:0],
		buf:     x.buf[:0],
		head:    x.head[:0],
		timer:   x.timer,
		job:     computeJob{kick: x.job.kick, timer: x.job.timer},
		choices: x.choices[:0],
		stop:    x.stop[:0],
		hashes:  x.hashes[:0],
		tokens:  x.tokens[:0],
		headers: x.headers[:0],
		rooms:   x.rooms[:0],
	}
	x.s, x.w, x.kind = s, w, kind
	x.flusher, _ = w.(interface{ FlushError() error })
}

// serveInference is POST /v1/chat/completions and POST /v1/completions.
func (s *Server) serveInference(w http.ResponseWriter, r *http.Request, kind endpointKind) {
	x := s.exchanges.Get().(*exchange)
	defer s.exchanges.Put(x)
	x.reset(s, w, kind)
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stop := context.AfterFunc(s.baseCtx, cancel)
	defer stop()
	x.ctx = ctx

	status, msg := x.parse(r)
	phase := PhaseDecode
	if x.prefillLeg || (s.cfg.Connector == ConnectorSGLang && s.cfg.Role == RolePrefill) {
		phase = PhasePrefill // sglang: both engines get the same body; the phase is the role
	}
	s.record(r, phase, x.body, status == 0)
	if status != 0 {
		writeError(w, status, msg)
		return
	}
	if x.prefillLeg {
		s.count.prefills.Add(1)
	} else {
		s.count.decodes.Add(1)
	}
	s.count.promptTokens.Add(int64(x.promptTokens))
	s.faults.take(&x.faults, targetInference, phase, x.prefillLeg, x.stream, x.decodeLeg)
	s.count.active.Add(1)
	defer s.count.active.Add(-1)
	x.tokens = appendTokenIDs(x.tokens[:0], x.prompt, x.headers)
	x.hashes = appendBlockHashes(x.hashes[:0], x.tokens, s.cfg.BlockSize)
	defer x.setQueued(0)
	x.setQueued(x.expectedWork())
	if !s.admit(ctx) {
		x.abort()
		return
	}
	defer s.leave()
	blocks := int64((x.promptTokens + s.cfg.BlockSize - 1) / s.cfg.BlockSize)
	s.count.runningBlocks.Add(blocks)
	defer s.count.runningBlocks.Add(-blocks)
	x.run()
}

// expectedWork is the prompt tokens this request will compute as the
// cache stands now: none for a decode leg that receives its KV from a
// producer, else the tokens a lookup would not find (the cache's own
// blocks only; a shared-storage consumer may load more from the store).
func (x *exchange) expectedWork() int {
	if x.decodeLeg && x.s.store == nil {
		return 0
	}
	return x.promptTokens - x.s.cache.peek(x.hashes, x.promptTokens, x.s.cfg.BlockSize)
}

// setQueued makes n this request's uncached prompt tokens in the engine's
// queue (counters.queuedTokens).
func (x *exchange) setQueued(n int) {
	if d := n - x.queued; d != 0 {
		x.s.count.queuedTokens.Add(int64(d))
		x.queued = n
	}
}

// compute spends PrefillPerToken on each of n prompt tokens of the
// engine's prefill compute, shared with the prompts computing meanwhile
// (Server.work: N at once take N times as long each). It returns false
// when the request's context ended first.
func (x *exchange) compute(n int) bool {
	s := x.s
	x.setQueued(0)
	d := s.cfg.PrefillPerToken * time.Duration(n)
	if d <= 0 {
		return true
	}
	return s.work.run(x.ctx, &x.job, d)
}

// admit takes one of Config.MaxNumSeqs sequences, waiting in arrival
// order (counted in vllm:num_requests_waiting) while all are taken. It
// returns false when ctx ended first. Every true is paired with leave.
func (s *Server) admit(ctx context.Context) bool {
	if s.seqs != nil {
		select {
		case s.seqs <- struct{}{}:
		default:
			s.count.waiting.Add(1)
			select {
			case s.seqs <- struct{}{}:
				s.count.waiting.Add(-1)
			case <-ctx.Done():
				s.count.waiting.Add(-1)
				return false
			}
		}
	}
	s.count.running.Add(1)
	return true
}

// leave gives back the sequence admit took.
func (s *Server) leave() {
	s.count.running.Add(-1)
	if s.seqs != nil {
		<-s.seqs
	}
}

// readAll reads r to EOF into dst and returns it.
func readAll(dst []byte, r io.Reader) ([]byte, error) {
	for {
		if len(dst) == cap(dst) {
			dst = append(dst, 0)[:len(dst)]
		}
		n, err := r.Read(dst[len(dst):cap(dst)])
		dst = dst[:len(dst)+n]
		if err == io.EOF {
			return dst, nil
		}
		if err != nil {
			return dst, err
		}
	}
}

// readBody reads r's body into dst, at most Config.MaxBodyBytes: a body
// whose Content-Length is larger is refused with 413 before any of it is
// read, one that grows past the bound while read too (and net/http closes
// the connection after the answer). Other read errors are 400. A zero
// status means the body was read.
func (s *Server) readBody(dst []byte, w http.ResponseWriter, r *http.Request) ([]byte, int, string) {
	limit := s.cfg.MaxBodyBytes
	if r.ContentLength > int64(limit) {
		w.Header().Set("Connection", "close")
		return dst, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds %d bytes (Content-Length %d)", limit, r.ContentLength)
	}
	dst, err := readAll(dst, http.MaxBytesReader(w, r.Body, int64(limit)))
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return dst, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds %d bytes", limit)
		}
		return dst, http.StatusBadRequest, "cannot read request body: " + err.Error()
	}
	return dst, 0, ""
}

// parse reads and validates the request. It returns a non-zero HTTP
// status and a message when the request is refused (vLLM's checks: 400
// for invalid input, 404 for an unknown model, 413 for an oversized body).
func (x *exchange) parse(r *http.Request) (int, string) {
	var err error
	var status int
	var msg string
	if x.body, status, msg = x.s.readBody(x.body[:0], x.w, r); status != 0 {
		return status, msg
	}
	req := &x.req
	if err := json.Unmarshal(x.body, req); err != nil {
		return http.StatusBadRequest, "invalid JSON body: " + err.Error()
	}
	if !isNull(req.KVTransferParams) {
		kv := bytes.TrimSpace(req.KVTransferParams)
		if kv[0] != '{' {
			return http.StatusBadRequest, "kv_transfer_params must be an object"
		}
		if err := json.Unmarshal(kv, &x.kvp); err != nil {
			return http.StatusBadRequest, "invalid kv_transfer_params: " + err.Error()
		}
		x.prefillLeg = x.kvp.DoRemoteDecode
		x.decodeLeg = x.kvp.DoRemotePrefill
	}
	s := x.s
	if s.cfg.Connector == ConnectorSharedStorage {
		// vLLM's SharedStorageConnector reads no transfer parameters (a
		// valid kv_transfer_params object is accepted and ignored): the
		// leg is the engine's role, as for sglang.
		x.prefillLeg, x.decodeLeg = s.cfg.Role == RolePrefill, false
	}
	if req.Model != "" && req.Model != s.cfg.Model {
		return http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", req.Model)
	}
	where := "messages"
	switch x.kind {
	case kindChat:
		if isNull(req.Messages) {
			return http.StatusBadRequest, "messages is required"
		}
		if x.prompt, x.headers, err = renderChat(req.Messages, x.headers[:0]); err != nil {
			return http.StatusBadRequest, err.Error()
		}
	default:
		where = "prompt"
		if isNull(req.Prompt) {
			return http.StatusBadRequest, "prompt is required"
		}
		if x.prompt, err = parsePrompt(req.Prompt); err != nil {
			return http.StatusBadRequest, err.Error()
		}
	}
	x.promptTokens = PromptTokens(x.prompt)

	x.n = 1
	if req.N != nil {
		x.n = *req.N
	}
	if x.n < 1 {
		return http.StatusBadRequest, fmt.Sprintf("n must be at least 1, got %d.", x.n)
	}
	if x.n > maxChoices {
		return http.StatusBadRequest, fmt.Sprintf("n must be at most %d, got %d.", maxChoices, x.n)
	}
	limit := req.MaxTokens
	if (x.kind == kindChat && req.MaxCompletionTokens != nil) || limit == nil {
		limit = req.MaxCompletionTokens
	}
	x.maxTokens = DefaultMaxTokens
	if limit != nil {
		x.maxTokens = *limit
	}
	if x.maxTokens < 1 {
		return http.StatusBadRequest, fmt.Sprintf("max_tokens must be at least 1, got %d.", x.maxTokens)
	}
	if x.promptTokens+x.maxTokens > s.cfg.MaxModelLen {
		return http.StatusBadRequest, fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the %s, %d in the completion). Please reduce the length of the %s or completion.",
			s.cfg.MaxModelLen, x.promptTokens+x.maxTokens, x.promptTokens, where, x.maxTokens, where)
	}
	if req.Seed != nil {
		x.seed = *req.Seed
	}
	if x.stop, err = parseStop(x.stop[:0], req.Stop); err != nil {
		return http.StatusBadRequest, err.Error()
	}
	x.ignoreEOS = req.IgnoreEOS
	x.stream = req.Stream
	if req.StreamOptions != nil {
		if !x.stream {
			return http.StatusBadRequest, "Stream options can only be defined when `stream=True`."
		}
		x.includeUsage = req.StreamOptions.IncludeUsage
	}
	if status, msg := x.parseLogprobs(); status != 0 {
		return status, msg
	}
	if x.kind == kindChat {
		if status, msg := x.parseToolChoice(); status != 0 {
			return status, msg
		}
	}
	if s.cfg.Connector == ConnectorSGLang {
		if status, msg := x.parseBootstrap(); status != 0 {
			return status, msg
		}
	}
	x.requestID = r.Header.Get("X-Request-Id")
	suffix := x.requestID
	if suffix == "" {
		var b [16]byte
		_, _ = rand.Read(b[:])
		suffix = hex.EncodeToString(b[:])
	}
	if x.kind == kindChat {
		x.id = "chatcmpl-" + suffix
	} else {
		x.id = "cmpl-" + suffix
	}
	x.created = time.Now().Unix()
	return 0, ""
}

// parsePrompt reads a completions prompt: a string or a list of one string.
func parsePrompt(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	var p string
	if raw[0] == '"' {
		if err := json.Unmarshal(raw, &p); err != nil {
			return "", fmt.Errorf("prompt: %v", err)
		}
		return p, nil
	}
	var list []string
	if err := json.Unmarshal(raw, &list); err != nil || len(list) != 1 {
		return "", errors.New("prompt must be a string or a list of one string")
	}
	return list[0], nil
}

// parseStop reads stop: null, a string, or a list of strings.
func parseStop(dst []string, raw json.RawMessage) ([]string, error) {
	if isNull(raw) {
		return dst, nil
	}
	raw = bytes.TrimSpace(raw)
	if raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return dst, fmt.Errorf("stop: %v", err)
		}
		return append(dst, s), nil
	}
	var list []string
	if err := json.Unmarshal(raw, &list); err != nil {
		return dst, errors.New("stop must be a string or a list of strings")
	}
	return append(dst, list...), nil
}

// parseLogprobs reads chat's logprobs (bool) and top_logprobs, or
// completions' logprobs (int).
func (x *exchange) parseLogprobs() (int, string) {
	req := &x.req
	if x.kind == kindChat {
		if !isNull(req.Logprobs) {
			if err := json.Unmarshal(req.Logprobs, &x.logprobs); err != nil {
				return http.StatusBadRequest, "logprobs must be a boolean"
			}
		}
		if req.TopLogprobs != nil {
			x.topLogprobs = *req.TopLogprobs
			if x.topLogprobs < 0 || x.topLogprobs > maxLogprobs {
				return http.StatusBadRequest, fmt.Sprintf("top_logprobs must be between 0 and %d, got %d.", maxLogprobs, x.topLogprobs)
			}
			if x.topLogprobs > 0 && !x.logprobs {
				return http.StatusBadRequest, "when using `top_logprobs`, `logprobs` must be set to true."
			}
		}
		return 0, ""
	}
	if isNull(req.Logprobs) {
		return 0, ""
	}
	if err := json.Unmarshal(req.Logprobs, &x.topLogprobs); err != nil || x.topLogprobs < 0 || x.topLogprobs > maxLogprobs {
		return http.StatusBadRequest, fmt.Sprintf("logprobs must be an integer between 0 and %d.", maxLogprobs)
	}
	x.logprobs = true
	return 0, ""
}

// parseToolChoice decides whether the request forces a tool call:
// tool_choice "required" (the first tool) or a named function.
func (x *exchange) parseToolChoice() (int, string) {
	req := &x.req
	if isNull(req.ToolChoice) {
		return 0, ""
	}
	tc := bytes.TrimSpace(req.ToolChoice)
	if tc[0] == '"' {
		var mode string
		_ = json.Unmarshal(tc, &mode)
		switch mode {
		case "auto", "none":
			return 0, ""
		case "required":
			if len(req.Tools) == 0 || req.Tools[0].Function.Name == "" {
				return http.StatusBadRequest, `tool_choice "required" needs at least one named tool in tools.`
			}
			x.toolName = req.Tools[0].Function.Name
			return 0, ""
		}
		return http.StatusBadRequest, fmt.Sprintf("invalid tool_choice %s.", tc)
	}
	var named struct {
		Type     string `json:"type"`
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	if err := json.Unmarshal(tc, &named); err != nil || named.Function.Name == "" {
		return http.StatusBadRequest, "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\":\"function\",\"function\":{\"name\":…}}."
	}
	for _, t := range req.Tools {
		if t.Function.Name == named.Function.Name {
			x.toolName = named.Function.Name
			return 0, ""
		}
	}
	return http.StatusBadRequest, fmt.Sprintf("tool_choice names function %q, which is not in tools.", named.Function.Name)
}

func ms(n int) time.Duration { return time.Duration(n) * time.Millisecond }

// sleep waits d, reusing the exchange's timer. It returns false when the
// request's context ended first.
func (x *exchange) sleep(d time.Duration) bool {
	if d <= 0 {
		return true
	}
	if x.timer == nil {
		x.timer = time.NewTimer(d)
	} else {
		x.timer.Reset(d)
	}
	select {
	case <-x.timer.C:
		return true
	case <-x.ctx.Done():
		x.timer.Stop()
		return false
	}
}

// abort counts a client disconnect once (not when the Server is closing).
func (x *exchange) abort() {
	if x.aborted {
		return
	}
	x.aborted = true
	if x.s.baseCtx.Err() == nil {
		x.s.count.aborted.Add(1)
	}
}

// flush pushes written bytes to the client; false when the client is gone.
func (x *exchange) flush() bool {
	if x.flusher != nil {
		return x.flusher.FlushError() == nil
	}
	if f, ok := x.w.(http.Flusher); ok {
		f.Flush()
	}
	return x.ctx.Err() == nil
}

// send writes and flushes buf, then empties it; false when the client is
// gone.
func (x *exchange) send() bool {
	_, err := x.w.Write(x.buf)
	x.buf = x.buf[:0]
	return err == nil && x.flush()
}

// run serves a parsed request.
func (x *exchange) run() {
	if f, ok := x.faults.get(fkHeaderDelay); ok && !x.sleep(ms(f.DelayMS)) {
		x.abort()
		return
	}
	if f, ok := x.faults.get(fkDecodeRefusesHandoff); ok {
		msg := RefusalMessageNixl
		if x.sglang {
			msg = RefusalMessageSGLang
		}
		writeError(x.w, f.statusOr(http.StatusBadRequest), f.messageOr(msg))
		return
	}
	if f, ok := x.faults.get(fkStatus); ok {
		status := f.statusOr(http.StatusInternalServerError)
		msg := f.messageOr(fmt.Sprintf("simulated engine fault: HTTP %d", status))
		if f.RetryAfterS > 0 {
			x.w.Header().Set("Retry-After", strconv.Itoa(f.RetryAfterS))
		}
		writeError(x.w, status, msg)
		return
	}
	x.generate()
	if x.stream {
		x.runStream()
	} else {
		x.runUnary()
	}
}

// generate computes every choice's tokens up front (choice j uses seed+j).
func (x *exchange) generate() {
	x.choices = slices.Grow(x.choices[:0], x.n)[:x.n]
	_, immediate := x.faults.get(fkImmediateStop)
	for j := range x.choices {
		c := &x.choices[j]
		c.base = streamBase(x.prompt, x.seed+int64(j))
		c.offset = 0
		if immediate {
			c.tokens, c.finish = c.tokens[:0], FinishStop
			continue
		}
		c.tokens, c.text, c.finish = generateInto(c.tokens, c.text, c.base, x.maxTokens, x.stop, x.ignoreEOS)
		// A length-capped prefill leg keeps "length" so that it hands off
		// (vLLM returns a descriptor only then, R-LEG-1a).
		if x.toolName != "" && !(x.prefillLeg && c.finish == FinishLength) {
			c.finish = FinishToolCalls
		}
	}
}

// prepare gets the prompt's KV cache: a decode leg pulls it from the
// producer (every prompt token then counts as cached), a shared-storage
// engine uses its prefix cache and the shared store (prepareShared),
// anything else looks it up in the prefix cache and computes the rest
// (PrefillPerToken per uncached prompt token). It returns false when the
// request ended (error already answered, or the client went away).
func (x *exchange) prepare() bool {
	s := x.s
	if x.sglang {
		return x.prepareSGLang()
	}
	if s.store != nil {
		return x.prepareShared()
	}
	if x.decodeLeg {
		if done, ok := x.pullFault(); done {
			return ok
		}
		reason, err := x.s.pullKV(x.ctx, &x.kvp, x.id, handoffDigest(x.kind, x.prompt))
		if err != nil {
			x.abort()
			return false
		}
		if reason != "" {
			x.s.count.kvPullFailures.Add(1)
			x.fail(http.StatusInternalServerError, "KV transfer failed: "+reason)
			return false
		}
		x.s.count.kvPulled.Add(1)
		x.cachedTokens = s.cache.lookup(x.hashes, x.tokens, x.promptTokens, s.cfg.BlockSize, false)
		return true
	}
	x.cachedTokens = s.cache.lookup(x.hashes, x.tokens, x.promptTokens, s.cfg.BlockSize, true)
	if !x.compute(x.promptTokens - x.cachedTokens) {
		x.abort()
		return false
	}
	return true
}

// pullFault applies a kv-recompute or kv-pull-error fault to a decode
// leg in place of its KV pull. done reports that one applied; ok is then
// prepare's result.
func (x *exchange) pullFault() (done, ok bool) {
	s := x.s
	if f, hit := x.faults.get(fkKVPullError); hit {
		s.count.kvPullFailures.Add(1)
		x.fail(f.statusOr(http.StatusInternalServerError), f.messageOr("KV transfer failed: simulated pull error"))
		return true, false
	}
	if _, hit := x.faults.get(fkKVRecompute); hit {
		x.cachedTokens = 0
		if !x.compute(x.promptTokens) {
			x.abort()
			return true, false
		}
		return true, true
	}
	return false, false
}

// fail ends the request with a vLLM error: an HTTP error response, or for
// a stream (already 200) one error frame followed by [DONE], as vLLM does.
func (x *exchange) fail(status int, msg string) {
	if !x.stream {
		writeError(x.w, status, msg)
		return
	}
	x.buf = append(x.buf[:0], "data: "...)
	x.buf = appendEngineError(x.buf, status, msg)
	x.buf = append(x.buf, "\n\ndata: [DONE]\n\n"...)
	if !x.send() {
		x.abort()
	}
}

// appendEngineError appends a vLLM error object
// {"error":{"message","type","param":null,"code"}}. For an HTTP status it
// is schemas.AppendErrorJSON; any other code (an engine may send one, see
// R-FAIL-4) gets type "InternalServerError".
func appendEngineError(dst []byte, code int, msg string) []byte {
	if code >= 100 && code <= 599 {
		return schemas.AppendErrorJSON(dst, code, msg)
	}
	dst = append(dst, `{"error":{"message":`...)
	dst = appendJSONString(dst, msg)
	dst = append(dst, `,"type":"InternalServerError","param":null,"code":`...)
	dst = strconv.AppendInt(dst, int64(code), 10)
	return append(dst, "}}"...)
}

// succeed counts a request answered in full.
func (x *exchange) succeed() {
	s := x.s
	s.count.completed.Add(1)
	total := 0
	for j := range x.choices {
		total += len(x.choices[j].tokens)
		if x.choices[j].finish == FinishLength {
			s.count.finishedLen.Add(1)
		} else {
			s.count.finishedStop.Add(1)
		}
	}
	s.count.genTokens.Add(int64(total))
}

// buildHead encodes the chunk prefix shared by every chunk of the stream.
func (x *exchange) buildHead() {
	object := "text_completion"
	if x.kind == kindChat {
		object = "chat.completion.chunk"
	}
	x.head = x.appendPrefix(x.head[:0], object)
}

// appendPrefix appends {"id":…,"object":object,"created":…,"model":…,"choices":[
// — the start of every response and chunk — to dst.
func (x *exchange) appendPrefix(dst []byte, object string) []byte {
	dst = append(dst, `{"id":`...)
	dst = appendJSONString(dst, x.id)
	dst = append(dst, `,"object":"`...)
	dst = append(dst, object...)
	dst = append(dst, `","created":`...)
	dst = strconv.AppendInt(dst, x.created, 10)
	dst = append(dst, `,"model":`...)
	dst = appendJSONString(dst, x.s.cfg.Model)
	return append(dst, `,"choices":[`...)
}

// beginChoice appends "data: <head>{"index":j".
func (x *exchange) beginChoice(j int) {
	x.buf = append(x.buf, "data: "...)
	x.buf = append(x.buf, x.head...)
	x.buf = append(x.buf, `{"index":`...)
	x.buf = strconv.AppendInt(x.buf, int64(j), 10)
}

const endChoice = "}]}\n\n"

// appendOpener appends choice j's metadata opener: the role chunk for
// chat, an empty-text chunk for completions.
func (x *exchange) appendOpener(j int) {
	x.beginChoice(j)
	if x.kind == kindChat {
		x.buf = append(x.buf, `,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null`+endChoice...)
	} else {
		x.buf = append(x.buf, `,"text":"","logprobs":null,"finish_reason":null`+endChoice...)
	}
}

// appendEmpty appends an empty-content chunk of choice j with the given
// finish_reason JSON ("null" or a quoted reason).
func (x *exchange) appendEmpty(j int, finish string) {
	x.beginChoice(j)
	if x.kind == kindChat {
		x.buf = append(x.buf, `,"delta":{"content":""},"logprobs":null,"finish_reason":`...)
	} else {
		x.buf = append(x.buf, `,"text":"","logprobs":null,"finish_reason":`...)
	}
	x.buf = append(x.buf, finish...)
	x.buf = append(x.buf, endChoice...)
}

// appendToolHeader appends the first tool-call delta of choice j: id,
// type and function name with empty arguments.
func (x *exchange) appendToolHeader(j int) {
	x.beginChoice(j)
	x.buf = append(x.buf, `,"delta":{"tool_calls":[{"index":0,"id":`...)
	x.buf = appendToolID(x.buf, &x.choices[j])
	x.buf = append(x.buf, `,"type":"function","function":{"name":`...)
	x.buf = appendJSONString(x.buf, x.toolName)
	x.buf = append(x.buf, `,"arguments":""}}]},"logprobs":null,"finish_reason":null`+endChoice...)
}

// appendToolID appends the deterministic tool call id of a choice, quoted.
func appendToolID(b []byte, c *choice) []byte {
	b = append(b, `"chatcmpl-tool-`...)
	b = appendHex64(b, finalize(c.base^0x746f6f6c))
	return append(b, '"')
}

func appendHex64(b []byte, v uint64) []byte {
	for shift := 60; shift >= 0; shift -= 4 {
		b = append(b, hexDigits[(v>>uint(shift))&0xf])
	}
	return b
}

// appendTokenChunk appends the chunk carrying token i of choice j.
func (x *exchange) appendTokenChunk(j, i int) {
	c := &x.choices[j]
	tok := c.tokens[i]
	x.beginChoice(j)
	if x.kind == kindChat {
		if x.toolName != "" {
			x.buf = append(x.buf, `,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"`...)
			if i == 0 {
				x.buf = appendJSONStringContent(x.buf, argsOpen)
			}
			x.buf = appendJSONStringContent(x.buf, tok)
			if i == len(c.tokens)-1 {
				x.buf = appendJSONStringContent(x.buf, argsClose)
			}
			x.buf = append(x.buf, `"}}]}`...)
		} else {
			x.buf = append(x.buf, `,"delta":{"content":`...)
			x.buf = appendJSONString(x.buf, tok)
			x.buf = append(x.buf, '}')
		}
		x.buf = append(x.buf, `,"logprobs":`...)
		if x.logprobs {
			x.buf = append(x.buf, `{"content":[`...)
			x.buf = appendChatLogprob(x.buf, tok, tokenHash(c.base, i), x.topLogprobs)
			x.buf = append(x.buf, "]}"...)
		} else {
			x.buf = append(x.buf, "null"...)
		}
	} else {
		x.buf = append(x.buf, `,"text":`...)
		x.buf = appendJSONString(x.buf, tok)
		x.buf = append(x.buf, `,"logprobs":`...)
		if x.logprobs {
			h := tokenHash(c.base, i)
			x.buf = append(x.buf, `{"text_offset":[`...)
			x.buf = strconv.AppendInt(x.buf, int64(c.offset), 10)
			x.buf = append(x.buf, `],"token_logprobs":[`...)
			x.buf = strconv.AppendFloat(x.buf, tokenLogprob(h), 'f', 4, 64)
			x.buf = append(x.buf, `],"tokens":[`...)
			x.buf = appendJSONString(x.buf, tok)
			x.buf = append(x.buf, `],"top_logprobs":[`...)
			x.buf = appendCompletionTop(x.buf, tok, h, x.topLogprobs)
			x.buf = append(x.buf, "]}"...)
		} else {
			x.buf = append(x.buf, "null"...)
		}
	}
	c.offset += len(tok)
	x.buf = append(x.buf, `,"finish_reason":null`+endChoice...)
}

// appendUsage appends {"prompt_tokens","completion_tokens","total_tokens",
// "prompt_tokens_details":{"cached_tokens"}} (vLLM's usage with
// --enable-prompt-tokens-details); a negative cached leaves
// prompt_tokens_details out (vLLM without it).
func appendUsage(b []byte, prompt, completion, cached int) []byte {
	b = append(b, `{"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(prompt), 10)
	b = append(b, `,"completion_tokens":`...)
	b = strconv.AppendInt(b, int64(completion), 10)
	b = append(b, `,"total_tokens":`...)
	b = strconv.AppendInt(b, int64(prompt+completion), 10)
	if cached < 0 {
		return append(b, '}')
	}
	b = append(b, `,"prompt_tokens_details":{"cached_tokens":`...)
	b = strconv.AppendInt(b, int64(cached), 10)
	return append(b, "}}"...)
}

func (x *exchange) completionTokens() int {
	total := 0
	for j := range x.choices {
		total += len(x.choices[j].tokens)
	}
	return total
}

// reportedCached is the cached_tokens the usage reports, -1 (no
// prompt_tokens_details) when Config.NoPromptTokensDetails.
func (x *exchange) reportedCached() int {
	if x.s.cfg.NoPromptTokensDetails {
		return -1
	}
	return x.cachedTokens
}

// appendTail appends the usage-only chunk (when asked) and [DONE].
func (x *exchange) appendTail() {
	if x.includeUsage {
		x.buf = append(x.buf, "data: "...)
		x.buf = append(x.buf, x.head...)
		x.buf = append(x.buf, `],"usage":`...)
		x.buf = appendUsage(x.buf, x.promptTokens, x.completionTokens(), x.reportedCached())
		x.buf = append(x.buf, "}\n\n"...)
	}
	x.buf = append(x.buf, "data: [DONE]\n\n"...)
}

// runStream serves a streaming request: headers at once, then the KV pull
// or prefill, the role chunks, the tokens, the finish chunks, the usage
// chunk and [DONE] (vLLM's "Streaming response").
func (x *exchange) runStream() {
	h := x.w.Header()
	h["Content-Type"] = sseContentType
	if x.requestID != "" {
		h["X-Request-Id"] = []string{x.requestID}
	}
	x.w.WriteHeader(http.StatusOK)
	if !x.flush() {
		x.abort()
		return
	}
	if !x.prepare() {
		return
	}
	x.buildHead()
	if _, ok := x.faults.get(fkDoneBeforeToken); ok {
		for j := range x.n {
			x.appendOpener(j)
		}
		x.buf = append(x.buf, "data: [DONE]\n\n"...)
		if !x.send() {
			x.abort()
		}
		return
	}
	_, immediate := x.faults.get(fkImmediateStop)
	if x.kind == kindChat || immediate {
		for j := range x.n {
			x.appendOpener(j)
		}
		if !x.send() {
			x.abort()
			return
		}
	}
	if f, ok := x.faults.get(fkFirstTokenDelay); ok && !x.firstTokenDelay(f) {
		x.abort()
		return
	}
	if immediate {
		for j := range x.n {
			x.appendEmpty(j, `"stop"`)
		}
		x.appendTail()
		if !x.send() {
			x.abort()
			return
		}
		x.succeed()
		return
	}
	if !x.streamTokens() {
		return
	}
	for j := range x.n {
		c := &x.choices[j]
		if x.toolName != "" && len(c.tokens) == 0 {
			// No token: the call still has its header and whole arguments.
			x.appendToolHeader(j)
			x.beginChoice(j)
			x.buf = append(x.buf, `,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"`...)
			x.buf = appendJSONStringContent(x.buf, argsOpen+argsClose)
			x.buf = append(x.buf, `"}}]},"logprobs":null,"finish_reason":null`+endChoice...)
		}
		x.beginChoice(j)
		if x.kind == kindChat {
			x.buf = append(x.buf, `,"delta":{},"logprobs":null,"finish_reason":"`...)
		} else {
			x.buf = append(x.buf, `,"text":"","logprobs":null,"finish_reason":"`...)
		}
		x.buf = append(x.buf, c.finish...)
		x.buf = append(x.buf, '"')
		x.buf = append(x.buf, endChoice...)
	}
	x.appendTail()
	if !x.send() {
		x.abort()
		return
	}
	x.succeed()
}

// firstTokenDelay is the first-token-delay fault on a stream: wait
// DelayMS, sending alternately ": keep-alive" and an empty delta every
// IntervalMS meanwhile. False when the client went away.
func (x *exchange) firstTokenDelay(f *Fault) bool {
	start := time.Now()
	delay, interval := ms(f.DelayMS), ms(f.IntervalMS)
	if interval > 0 {
		comment := true
		for next := interval; next < delay; next += interval {
			if !x.sleep(time.Until(start.Add(next))) {
				return false
			}
			if comment {
				x.buf = append(x.buf, ": keep-alive\n\n"...)
			} else {
				x.appendEmpty(0, "null")
			}
			comment = !comment
			if !x.send() {
				return false
			}
		}
	}
	return x.sleep(time.Until(start.Add(delay)))
}

// streamTokens sends every token chunk, choices interleaved step by step,
// with TTFT before the first and ITL (plus a trickle fault's delay)
// between the others, striking mid-stream faults where armed. False when
// the request ended early.
func (x *exchange) streamTokens() bool {
	longest := 0
	for j := range x.choices {
		longest = max(longest, len(x.choices[j].tokens))
	}
	var trickle time.Duration
	if f, ok := x.faults.get(fkTrickle); ok {
		trickle = ms(f.DelayMS)
	}
	ttft := x.s.cfg.TTFT
	if x.prefillLeg {
		ttft = 0
	}
	for step := 0; step < longest; step++ {
		for j := range x.choices {
			if step >= len(x.choices[j].tokens) {
				continue
			}
			if x.midStreamFault(false) {
				return false
			}
			d := ttft
			if x.emitted > 0 {
				d = x.s.cfg.ITL + trickle
			}
			if !x.sleep(d) {
				x.abort()
				return false
			}
			if step == 0 && x.toolName != "" {
				x.appendToolHeader(j)
			}
			x.appendTokenChunk(j, step)
			if !x.send() {
				x.abort()
				return false
			}
			x.emitted++
		}
	}
	return !x.midStreamFault(true)
}

var midStreamKinds = [...]faultKind{fkSilence, fkClose, fkAbort, fkErrorObject}

// midStreamFault strikes a silence, close, abort or error-object fault
// whose AfterTokens is the number of tokens sent (or, at the end of the
// tokens, any larger number). True when one struck and the stream is over.
func (x *exchange) midStreamFault(atEnd bool) bool {
	if x.faults.has == 0 {
		return false
	}
	for _, k := range midStreamKinds {
		f, ok := x.faults.get(k)
		if !ok || !(f.AfterTokens == x.emitted || (atEnd && f.AfterTokens > x.emitted)) {
			continue
		}
		switch k {
		case fkSilence:
			if !x.hold(f, true) {
				x.abort()
			}
		case fkClose:
		case fkAbort:
			panic(http.ErrAbortHandler)
		case fkErrorObject:
			status := f.statusOr(http.StatusInternalServerError)
			msg := f.messageOr("simulated engine error")
			x.fail(status, msg)
		}
		return true
	}
	return false
}

// hold keeps the request open for f.DelayMS (0 = until the client goes
// away or the Server closes), sending ": keep-alive" every f.IntervalMS
// when keepAlive. False when the client went away.
func (x *exchange) hold(f *Fault, keepAlive bool) bool {
	delay, interval := ms(f.DelayMS), ms(f.IntervalMS)
	if !keepAlive {
		interval = 0
	}
	start := time.Now()
	for {
		wait := interval
		if wait == 0 {
			wait = delay
		}
		if wait == 0 {
			<-x.ctx.Done()
			return false
		}
		if delay > 0 {
			left := delay - time.Since(start)
			if left <= 0 {
				return true
			}
			wait = min(wait, left)
		}
		if !x.sleep(wait) {
			return false
		}
		if interval > 0 && (delay == 0 || time.Since(start) < delay) {
			x.buf = append(x.buf[:0], ": keep-alive\n\n"...)
			if !x.send() {
				return false
			}
		}
	}
}

// runUnary serves a non-streaming request: one JSON completion with
// usage and, at the top level, kv_transfer_params (the handoff descriptor
// of a length-capped prefill leg, else null).
func (x *exchange) runUnary() {
	if !x.prepare() {
		return
	}
	if f, ok := x.faults.get(fkSilence); ok {
		if !x.hold(f, false) {
			x.abort()
			return
		}
		panic(http.ErrAbortHandler)
	}
	var d time.Duration
	if f, ok := x.faults.get(fkFirstTokenDelay); ok {
		d += ms(f.DelayMS)
	}
	longest := 0
	for j := range x.choices {
		longest = max(longest, len(x.choices[j].tokens))
	}
	if !x.prefillLeg && longest > 0 {
		d += x.s.cfg.TTFT + x.s.cfg.ITL*time.Duration(longest-1)
	}
	if f, ok := x.faults.get(fkTrickle); ok && longest > 1 {
		d += ms(f.DelayMS) * time.Duration(longest-1)
	}
	if !x.sleep(d) {
		x.abort()
		return
	}
	if _, ok := x.faults.get(fkAbort); ok {
		panic(http.ErrAbortHandler)
	}
	if f, ok := x.faults.get(fkErrorObject); ok {
		status := f.statusOr(http.StatusInternalServerError)
		msg := f.messageOr("simulated engine error")
		if status < 100 || status > 599 {
			// A code that is no HTTP status travels with HTTP 500.
			x.buf = appendEngineError(x.buf[:0], status, msg)
			x.w.Header()["Content-Type"] = jsonContentType
			x.w.WriteHeader(http.StatusInternalServerError)
			_, _ = x.w.Write(x.buf)
			return
		}
		writeError(x.w, status, msg)
		return
	}
	x.buildUnary()
	h := x.w.Header()
	h["Content-Type"] = jsonContentType
	if x.requestID != "" {
		h["X-Request-Id"] = []string{x.requestID}
	}
	if _, ok := x.faults.get(fkClose); ok {
		h["Content-Length"] = []string{strconv.Itoa(len(x.buf))}
		x.w.WriteHeader(http.StatusOK)
		_, _ = x.w.Write(x.buf[:len(x.buf)/2])
		return
	}
	x.w.WriteHeader(http.StatusOK)
	if _, err := x.w.Write(x.buf); err != nil {
		x.abort()
		return
	}
	x.succeed()
}

// buildUnary encodes the non-streaming response into buf.
func (x *exchange) buildUnary() {
	object := "text_completion"
	if x.kind == kindChat {
		object = "chat.completion"
	}
	b := x.appendPrefix(x.buf[:0], object)
	for j := range x.choices {
		c := &x.choices[j]
		if j > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"index":`...)
		b = strconv.AppendInt(b, int64(j), 10)
		if x.kind == kindChat {
			b = append(b, `,"message":{"role":"assistant","content":`...)
			if x.toolName != "" {
				b = append(b, `null,"tool_calls":[{"id":`...)
				b = appendToolID(b, c)
				b = append(b, `,"type":"function","function":{"name":`...)
				b = appendJSONString(b, x.toolName)
				b = append(b, `,"arguments":"`...)
				b = appendJSONStringContent(b, argsOpen)
				for _, t := range c.tokens {
					b = appendJSONStringContent(b, t)
				}
				b = appendJSONStringContent(b, argsClose)
				b = append(b, `"}}]}`...)
			} else {
				b = append(b, '"')
				for _, t := range c.tokens {
					b = appendJSONStringContent(b, t)
				}
				b = append(b, `"}`...)
			}
			b = append(b, `,"logprobs":`...)
			if x.logprobs {
				b = append(b, `{"content":[`...)
				for i, t := range c.tokens {
					if i > 0 {
						b = append(b, ',')
					}
					b = appendChatLogprob(b, t, tokenHash(c.base, i), x.topLogprobs)
				}
				b = append(b, "]}"...)
			} else {
				b = append(b, "null"...)
			}
		} else {
			b = append(b, `,"text":"`...)
			for _, t := range c.tokens {
				b = appendJSONStringContent(b, t)
			}
			b = append(b, `","logprobs":`...)
			if x.logprobs {
				b = appendCompletionLogprobs(b, c, x.topLogprobs)
			} else {
				b = append(b, "null"...)
			}
		}
		b = append(b, `,"finish_reason":"`...)
		b = append(b, c.finish...)
		b = append(b, `"}`...)
	}
	b = append(b, `],"usage":`...)
	b = appendUsage(b, x.promptTokens, x.completionTokens(), x.reportedCached())
	b = append(b, `,"kv_transfer_params":`...)
	b = x.appendDescriptor(b)
	x.buf = append(b, '}')
}

// appendDescriptor appends the handoff descriptor of a length-capped,
// non-streaming prefill leg — and holds its KV blocks — or null
// (vLLM's "Prefill response"; always null for sglang and shared-storage,
// whose KV does not travel by descriptor). Descriptor faults alter it
// here.
func (x *exchange) appendDescriptor(b []byte) []byte {
	if !x.prefillLeg || x.sglang || x.s.store != nil || x.choices[0].finish != FinishLength {
		return append(b, "null"...)
	}
	if _, ok := x.faults.get(fkNoDescriptor); ok {
		return append(b, "null"...)
	}
	s := x.s
	host, port := s.kvEndpoint()
	nBlocks := (x.promptTokens + s.cfg.BlockSize - 1) / s.cfg.BlockSize
	rid, blocks := s.kv.hold(x.id, handoffDigest(x.kind, x.prompt), nBlocks, time.Now())
	if _, ok := x.faults.get(fkChangeConnectorShape); ok {
		b = append(b, `{"lmcache_key":`...)
		b = appendJSONString(b, s.cfg.EngineID+"/"+rid)
		return append(b, '}')
	}
	b = append(b, `{"do_remote_prefill":true,"do_remote_decode":false`...)
	if _, ok := x.faults.get(fkDropEngineID); !ok {
		b = append(b, `,"remote_engine_id":`...)
		b = appendJSONString(b, s.cfg.EngineID)
	}
	b = append(b, `,"remote_request_id":`...)
	b = appendJSONString(b, rid)
	b = append(b, `,"remote_block_ids":[`...)
	if _, ok := x.faults.get(fkGarbleBlockIDs); ok {
		b = append(b, '"')
		b = strconv.AppendInt(b, int64(blocks[0]), 10)
		b = append(b, `","x"`...)
	} else {
		for i, id := range blocks {
			if i > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendInt(b, int64(id), 10)
		}
	}
	b = append(b, `],"remote_host":`...)
	b = appendJSONString(b, host)
	b = append(b, `,"remote_port":`...)
	b = strconv.AppendInt(b, int64(port), 10)
	return append(b, `,"tp_size":1}`...)
}

// appendBytes appends the UTF-8 bytes of s as a JSON array of integers.
func appendBytes(b []byte, s string) []byte {
	b = append(b, '[')
	for i := 0; i < len(s); i++ {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(s[i]), 10)
	}
	return append(b, ']')
}

// alternative returns the next vocabulary word after position prev
// (relative to idx) that differs from tok, and its position.
func alternative(tok string, idx, prev int) (string, int) {
	for k := prev + 1; ; k++ {
		if w := vocabulary[(idx+k)%len(vocabulary)]; w != tok {
			return w, k
		}
	}
}

// appendChatLogprob appends one chat logprobs content entry:
// {"token","logprob","bytes","top_logprobs":[top entries, the sampled
// token first]}. Logprobs are deterministic (tokenLogprob).
func appendChatLogprob(b []byte, tok string, h uint64, top int) []byte {
	lp := tokenLogprob(h)
	b = append(b, `{"token":`...)
	b = appendJSONString(b, tok)
	b = append(b, `,"logprob":`...)
	b = strconv.AppendFloat(b, lp, 'f', 4, 64)
	b = append(b, `,"bytes":`...)
	b = appendBytes(b, tok)
	b = append(b, `,"top_logprobs":[`...)
	idx, pos := wordIndex(h), 0
	for m := 0; m < top; m++ {
		t, l := tok, lp
		if m > 0 {
			t, pos = alternative(tok, idx, pos)
			l = lp - 0.5*float64(m)
			b = append(b, ',')
		}
		b = append(b, `{"token":`...)
		b = appendJSONString(b, t)
		b = append(b, `,"logprob":`...)
		b = strconv.AppendFloat(b, l, 'f', 4, 64)
		b = append(b, `,"bytes":`...)
		b = appendBytes(b, t)
		b = append(b, '}')
	}
	return append(b, "]}"...)
}

// appendCompletionTop appends a completions top_logprobs object
// {token: logprob, …}: the sampled token and top-1 alternatives (at least
// the sampled token).
func appendCompletionTop(b []byte, tok string, h uint64, top int) []byte {
	lp := tokenLogprob(h)
	idx, pos := wordIndex(h), 0
	b = append(b, '{')
	for m := 0; m < max(top, 1); m++ {
		t, l := tok, lp
		if m > 0 {
			t, pos = alternative(tok, idx, pos)
			l = lp - 0.5*float64(m)
			b = append(b, ',')
		}
		b = appendJSONString(b, t)
		b = append(b, ':')
		b = strconv.AppendFloat(b, l, 'f', 4, 64)
	}
	return append(b, '}')
}

// appendCompletionLogprobs appends a non-streaming completions logprobs
// object {"text_offset","token_logprobs","tokens","top_logprobs"}.
func appendCompletionLogprobs(b []byte, c *choice, top int) []byte {
	b = append(b, `{"text_offset":[`...)
	off := 0
	for i, t := range c.tokens {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(off), 10)
		off += len(t)
	}
	b = append(b, `],"token_logprobs":[`...)
	for i := range c.tokens {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendFloat(b, tokenLogprob(tokenHash(c.base, i)), 'f', 4, 64)
	}
	b = append(b, `],"tokens":[`...)
	for i, t := range c.tokens {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, t)
	}
	b = append(b, `],"top_logprobs":[`...)
	for i, t := range c.tokens {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendCompletionTop(b, t, tokenHash(c.base, i), top)
	}
	return append(b, "]}"...)
}
