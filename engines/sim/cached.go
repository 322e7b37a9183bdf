package sim

import (
	"net/http"
)

// Cached is what an engine holds for one request, as POST /sim/cached
// answers it: the request's prompt as its prefill would see it, and the
// engine's queue. Tokens are the simulator's (PromptTokens).
type Cached struct {
	// PromptTokens is the request's prompt length, its usage.prompt_tokens.
	PromptTokens int `json:"prompt_tokens"`
	// CachedTokens is what a prefill of the request would report in
	// usage.prompt_tokens_details.cached_tokens if it started now: the
	// leading full blocks the prefix cache holds, never the prompt's last
	// token (for a shared-storage consumer, followed by those its store
	// holds).
	CachedTokens int `json:"cached_tokens"`
	// Waiting and Running are the requests waiting for a sequence and
	// running now (vllm:num_requests_waiting and
	// vllm:num_requests_running).
	Waiting int64 `json:"waiting"`
	// Running: see Waiting.
	Running int64 `json:"running"`
	// QueuedPromptTokens is the prompt tokens the waiting and running
	// requests still have to compute: a waiting request's uncached
	// tokens, estimated from the cache as it stood when it arrived; for a
	// computing one, the tokens of the compute time still ahead of it
	// (Config.PrefillPerToken each); 0 for one whose prefill is done.
	QueuedPromptTokens int64 `json:"queued_prompt_tokens"`
}

// CachedFor answers what the engine holds for body, a chat completion
// (it has "messages") or completions ("prompt") request body, computed
// exactly as its prefill's lookup would, without touching the cache's
// recency, contents or counters and without queueing anything. It fails
// when body is not such a request, or names another model.
func (s *Server) CachedFor(body []byte) (Cached, error) {
	prompt, headers, err := s.requestPrompt(body, nil)
	if err != nil {
		return Cached{}, err
	}
	c := Cached{PromptTokens: PromptTokens(prompt)}
	hashes := appendBlockHashes(nil, appendTokenIDs(nil, prompt, headers), s.cfg.BlockSize)
	c.CachedTokens = s.cache.peek(hashes, c.PromptTokens, s.cfg.BlockSize)
	if s.store != nil && s.cfg.Role != RolePrefill {
		limit := min(len(hashes), max(c.PromptTokens-1, 0)/s.cfg.BlockSize)
		for k := c.CachedTokens / s.cfg.BlockSize; k < limit && s.store.has(hashes[k]); k++ {
			c.CachedTokens += s.cfg.BlockSize
		}
	}
	c.Waiting, c.Running = s.count.waiting.Load(), s.count.running.Load()
	c.QueuedPromptTokens = s.count.queuedTokens.Load()
	if per := s.cfg.PrefillPerToken; per > 0 {
		left := s.work.left()
		c.QueuedPromptTokens += int64((left + per - 1) / per)
	}
	return c, nil
}

// serveCached is POST /sim/cached: the body of a completion request in,
// Cached out as JSON (400 with a vLLM error body when the body is not a
// request this engine serves).
func (s *Server) serveCached(w http.ResponseWriter, r *http.Request) {
	body, status, msg := s.readBody(nil, w, r)
	if status != 0 {
		writeError(w, status, msg)
		return
	}
	c, err := s.CachedFor(body)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	writeJSON(w, c)
}
