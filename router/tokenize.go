package router

import (
	"bytes"
	"container/list"
	"context"
	"errors"
	"hash/maphash"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Outcomes of narwhal_tokenize_total.
const (
	tokenizeHit         = "hit"
	tokenizeOK          = "ok"
	tokenizeTimeout     = "timeout"
	tokenizeError       = "error"
	tokenizeGiven       = "token_ids"
	tokenizeUnsupported = "unsupported"
)

// Bounds of the tokenizations the router keeps (tokenCache): entries,
// and token ids in all (4 Mi ids are 16 MiB).
const (
	tokenCacheEntries = 4096
	tokenCacheTokens  = 1 << 22
)

// tokenizer gets a prompt's token ids for the exact index (behaviour.md
// R-PLACE-4): from the prompt itself when it is token ids, from a cache
// of the tokenizations this router made, else from one POST /tokenize to
// an engine of the model, bounded by placement.tokenize_timeout_s.
type tokenizer struct {
	httpc   *http.Client
	timeout time.Duration
	cache   tokenCache
	next    atomic.Uint64 // round robin over the engines asked
	bodies  sync.Pool     // *[]byte, /tokenize bodies

	outcomes map[string]prometheus.Counter // narwhal_tokenize_total{outcome}
	seconds  prometheus.Histogram          // narwhal_tokenize_seconds
	total    *prometheus.CounterVec
}

// newTokenizer returns the tokenizer of httpc and timeout, its metrics
// (narwhal_tokenize_total{outcome}, narwhal_tokenize_seconds, whose top
// bucket is deadline, request.timeout_s, as every histogram of seconds)
// for the caller to register.
func newTokenizer(httpc *http.Client, timeout, deadline time.Duration) *tokenizer {
	buckets := []float64{0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25}
	if top := deadline.Seconds(); top > buckets[len(buckets)-1] {
		buckets = append(buckets, top)
	}
	tk := &tokenizer{httpc: httpc, timeout: timeout, cache: newTokenCache(tokenCacheEntries, tokenCacheTokens),
		total: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_tokenize_total",
			Help: "Prompts whose token ids placement looked for, for the exact prefix index, by outcome: hit (a tokenization this router made before), ok (POST /tokenize answered), timeout (it did not within placement.tokenize_timeout_s), error (it failed), token_ids (the prompt is token ids), unsupported (a request the router cannot key exactly: cache_salt, a batch of prompts). All but hit, ok and token_ids are placed as without the exact index.",
		}, []string{"outcome"}),
		seconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "narwhal_tokenize_seconds",
			Help:    "Seconds the POST /tokenize calls of placement took (answered, timed out or failed), each bounded by placement.tokenize_timeout_s.",
			Buckets: buckets,
		}),
		outcomes: map[string]prometheus.Counter{},
	}
	for _, o := range []string{tokenizeHit, tokenizeOK, tokenizeTimeout, tokenizeError, tokenizeGiven, tokenizeUnsupported} {
		tk.outcomes[o] = tk.total.WithLabelValues(o)
	}
	tk.bodies.New = func() any { b := make([]byte, 0, 4096); return &b }
	return tk
}

// collectors returns the tokenizer's metrics.
func (tk *tokenizer) collectors() []prometheus.Collector {
	return []prometheus.Collector{tk.total, tk.seconds}
}

// tokens returns req's prompt as token ids and whether it has them:
// appended to dst[:0] when owned, else shared with the cache (the
// caller must then neither change them nor append to them). ask gives the engine of the model to call when it must
// (the n-th of those that may take the prefill). A call is bounded by
// ctx and tk.timeout: a tokenizer that hangs delays the placement by the
// timeout at most.
func (tk *tokenizer) tokens(ctx context.Context, req *schemas.Request, ask func(i uint64) *engines.Engine, dst []uint32) (toks []uint32, owned, ok bool) {
	bp := tk.bodies.Get().(*[]byte)
	body, ids, supported := appendTokenizeBody((*bp)[:0], req, dst[:0])
	defer func() {
		if cap(body) <= maxPooledPrompt {
			*bp = body[:0]
			tk.bodies.Put(bp)
		}
	}()
	switch {
	case !supported:
		tk.outcomes[tokenizeUnsupported].Inc()
		return nil, false, false
	case ids != nil:
		tk.outcomes[tokenizeGiven].Inc()
		return ids, true, true
	}
	key := maphash.Bytes(tk.cache.seed, body)
	if cached, hit := tk.cache.get(key, len(body)); hit {
		tk.outcomes[tokenizeHit].Inc()
		return cached, false, true
	}
	e := ask(tk.next.Add(1))
	if e == nil {
		return nil, false, false
	}
	cctx, cancel := context.WithTimeout(ctx, tk.timeout)
	defer cancel()
	start := time.Now()
	toks, err := engines.Tokenize(cctx, tk.httpc, e, body, dst[:0])
	tk.seconds.Observe(time.Since(start).Seconds())
	switch {
	case err == nil:
		tk.outcomes[tokenizeOK].Inc()
		tk.cache.put(key, len(body), toks)
		return toks, true, true
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(cctx.Err(), context.DeadlineExceeded):
		tk.outcomes[tokenizeTimeout].Inc()
	default:
		tk.outcomes[tokenizeError].Inc()
	}
	return nil, false, false
}

// tokenizeChatMembers are the members of a chat request vLLM's
// /tokenize takes (TokenizeChatRequest) that decide its tokens, copied
// as the client wrote them.
var tokenizeChatMembers = []string{"messages", "tools", "add_generation_prompt", "continue_final_message",
	"add_special_tokens", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "documents"}

// appendTokenizeBody appends to dst the /tokenize body of req: its model
// and, for a chat completion, the members of tokenizeChatMembers it has;
// for a completion, its prompt when it is one string (and
// add_special_tokens). A completion whose prompt is an array of token
// ids needs no call: they are appended to ids and returned (non-nil). ok
// is false for a request the exact index cannot key (behaviour.md
// R-PLACE-4): one with a cache_salt (vLLM hashes it into the first
// block's extra keys, which the router's keys do not reproduce), and a
// completion of several prompts or of any other prompt value.
func appendTokenizeBody(dst []byte, req *schemas.Request, ids []uint32) (body []byte, tokens []uint32, ok bool) {
	if raw, has := req.Member("cache_salt"); has && string(raw) != "null" {
		return dst, nil, false
	}
	model, _ := req.Member("model")
	dst = append(dst, `{"model":`...)
	dst = append(dst, model...)
	if req.Chat() {
		for _, k := range tokenizeChatMembers {
			if raw, has := req.Member(k); has {
				dst = append(dst, ',', '"')
				dst = append(dst, k...)
				dst = append(dst, '"', ':')
				dst = append(dst, raw...)
			}
		}
		return append(dst, '}'), nil, true
	}
	prompt, _ := req.Member("prompt")
	switch {
	case len(prompt) > 0 && prompt[0] == '"':
		dst = append(dst, `,"prompt":`...)
		dst = append(dst, prompt...)
		if raw, has := req.Member("add_special_tokens"); has {
			dst = append(dst, `,"add_special_tokens":`...)
			dst = append(dst, raw...)
		}
		return append(dst, '}'), nil, true
	case len(prompt) > 0 && prompt[0] == '[':
		if ids, ok := appendTokenIDs(ids, prompt); ok {
			return dst, ids, true
		}
	}
	return dst, nil, false
}

// appendTokenIDs appends the elements of raw, a JSON array, to ids when
// every one is an integer in [0, 2^32); ok is false otherwise (an array
// of strings, of arrays: a batch of prompts) or when it is empty.
func appendTokenIDs(ids []uint32, raw []byte) ([]uint32, bool) {
	inner := bytes.TrimSpace(raw[1 : len(raw)-1])
	if len(inner) == 0 {
		return ids, false
	}
	for len(inner) > 0 {
		i := bytes.IndexByte(inner, ',')
		tok := inner
		if i >= 0 {
			tok, inner = inner[:i], inner[i+1:]
		} else {
			inner = nil
		}
		n, err := strconv.ParseUint(string(bytes.TrimSpace(tok)), 10, 32)
		if err != nil {
			return ids, false
		}
		ids = append(ids, uint32(n))
	}
	return ids, true
}

// tokenCache is a bounded LRU of tokenizations, by a keyed hash of the
// /tokenize body (what decides the tokens: the model and the rendered
// request) and its length; its seed is the process's own, so a client
// cannot make two bodies share a key. Its token slices are never changed
// once stored. Safe for concurrent use.
type tokenCache struct {
	seed       maphash.Seed
	maxEntries int
	maxTokens  int
	mu         sync.Mutex
	ll         *list.List // of *tokenEntry, most recent first
	byKey      map[uint64]*list.Element
	tokens     int
}

type tokenEntry struct {
	key    uint64
	length int
	tokens []uint32
}

func newTokenCache(entries, tokens int) tokenCache {
	return tokenCache{seed: maphash.MakeSeed(), maxEntries: entries, maxTokens: tokens, ll: list.New(), byKey: map[uint64]*list.Element{}}
}

// get returns the tokens stored for key and length.
func (c *tokenCache) get(key uint64, length int) ([]uint32, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	el := c.byKey[key]
	if el == nil || el.Value.(*tokenEntry).length != length {
		return nil, false
	}
	c.ll.MoveToFront(el)
	return el.Value.(*tokenEntry).tokens, true
}

// put stores a copy of tokens for key and length, evicting the least
// recent entries beyond the bounds; a tokenization larger than a
// quarter of the token bound is not kept.
func (c *tokenCache) put(key uint64, length int, tokens []uint32) {
	if len(tokens) > c.maxTokens/4 {
		return
	}
	kept := append([]uint32(nil), tokens...)
	c.mu.Lock()
	defer c.mu.Unlock()
	if el := c.byKey[key]; el != nil {
		c.tokens -= len(el.Value.(*tokenEntry).tokens)
		c.ll.Remove(el)
	}
	c.byKey[key] = c.ll.PushFront(&tokenEntry{key: key, length: length, tokens: kept})
	c.tokens += len(kept)
	for c.ll.Len() > c.maxEntries || c.tokens > c.maxTokens {
		el := c.ll.Back()
		e := el.Value.(*tokenEntry)
		c.ll.Remove(el)
		delete(c.byKey, e.key)
		c.tokens -= len(e.tokens)
	}
}
