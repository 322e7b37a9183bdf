package bench

import (
	"container/list"
	"encoding/json"
	"errors"
	"fmt"
	"hash/maphash"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Shapes of a prefix workload (PrefixWorkload.Shape).
const (
	// ShapeSharedPrefix: every request of a tenant has the tenant's shared
	// context as its system prompt, then the user's own query.
	ShapeSharedPrefix = "shared-prefix"
	// ShapeNoSharedPrefix: the same lengths and arrivals, but every
	// request's system prompt is its own, so no two prompts share a block.
	ShapeNoSharedPrefix = "no-shared-prefix"
	// ShapeHotTenant: shared-prefix with one tenant (Tenants must be 1):
	// one application with one long system prompt and many users, the
	// most common deployment there is.
	ShapeHotTenant = "hot-tenant"
	// ShapeCachePressure: shared-prefix whose tenants' contexts together
	// hold at least CachePressureFactor × FleetKVTokens tokens, so no
	// placement can keep every context cached.
	ShapeCachePressure = "cache-pressure"
	// ShapeMixed: the tenants' shared-prefix requests and as many short
	// chats (a user message of QueryTokens words, no system prompt, each
	// its own), arriving in bursts: Poisson arrivals during BurstOn, none
	// during the BurstOff after it, at a rate that keeps Rate on average.
	ShapeMixed = "mixed"
)

// Shapes lists every workload shape, in the order the command line names
// them.
var Shapes = []string{ShapeSharedPrefix, ShapeNoSharedPrefix, ShapeHotTenant, ShapeCachePressure, ShapeMixed}

// CachePressureFactor is how many times the fleet's KV capacity the
// contexts of a ShapeCachePressure workload hold together, at least.
const CachePressureFactor = 3

// DefaultBurst is the length of a ShapeMixed workload's on and off
// phases when BurstOn or BurstOff is zero.
const DefaultBurst = time.Second

// CachePressureTenants is the fewest tenants whose contexts of
// contextTokens tokens hold CachePressureFactor × fleetKVTokens tokens
// together (fleetKVTokens: prefill engines × KV cache blocks × block
// size). Both must be ≥ 1.
func CachePressureTenants(fleetKVTokens, contextTokens int) int {
	return (CachePressureFactor*fleetKVTokens + contextTokens - 1) / contextTokens
}

// PrefixWorkload is a multi-tenant chat workload in the shape of llm-d's
// shared-prefix benchmark, scaled down: Tenants tenants each own a shared
// context of ContextTokens tokens (the system prompt); each of their
// UsersPerTenant users sends QueriesPerUser queries of QueryTokens tokens
// (the user message); requests arrive as a Poisson process of Rate per
// second, in an order drawn from Seed. Tokens are the simulator's
// (whitespace-separated words of the rendered chat, sim.PromptTokens).
// Shape says how contexts are shared and requests arrive (Shapes).
type PrefixWorkload struct {
	// Shape is one of Shapes.
	Shape string
	// Model is the model name sent. Required.
	Model string
	// Tenants is the number of tenants, ≥ 1 (exactly 1 for
	// ShapeHotTenant).
	Tenants int
	// ContextTokens is the length of a system prompt in words, ≥ 1.
	ContextTokens int
	// UsersPerTenant is the number of users of each tenant, ≥ 1.
	UsersPerTenant int
	// QueriesPerUser is the number of queries each user sends, ≥ 1.
	QueriesPerUser int
	// QueryTokens is the length of a user message in words, ≥ 2.
	QueryTokens int
	// MaxTokens is each request's max_tokens, ≥ 1 (sent with
	// "ignore_eos": true, so every request generates exactly that many).
	MaxTokens int
	// Rate is the Poisson arrival rate, requests per second, > 0 (for
	// ShapeMixed the mean over on and off phases).
	Rate float64
	// Seed seeds the contexts, the queries, their order and the arrivals.
	Seed uint64
	// FleetKVTokens is, for ShapeCachePressure, the prefill fleet's KV
	// capacity in tokens (engines × --kv-cache-blocks × --block-size);
	// Tenants × ContextTokens must be at least CachePressureFactor times
	// it (CachePressureTenants).
	FleetKVTokens int `json:",omitempty"`
	// BurstOn and BurstOff are, for ShapeMixed, the lengths of the phases
	// with and without arrivals (0: DefaultBurst each).
	BurstOn  time.Duration `json:",omitempty"`
	BurstOff time.Duration `json:",omitempty"`
}

// Validate reports the first problem with w, naming the field.
func (w *PrefixWorkload) Validate() error {
	switch {
	case !slices.Contains(Shapes, w.Shape):
		return fmt.Errorf("workload %q: want one of %s", w.Shape, strings.Join(Shapes, ", "))
	case w.Model == "":
		return errors.New("model: required")
	case w.Tenants < 1 || w.UsersPerTenant < 1 || w.QueriesPerUser < 1:
		return errors.New("tenants, users per tenant and queries per user must be at least 1")
	case w.ContextTokens < 1 || w.QueryTokens < 2:
		return errors.New("context tokens must be at least 1 and query tokens at least 2")
	case w.MaxTokens < 1:
		return errors.New("max tokens must be at least 1")
	case !(w.Rate > 0):
		return errors.New("rate must be positive")
	case w.Requests() > 1_000_000:
		return errors.New("the workload must not exceed 1,000,000 requests")
	case w.Shape == ShapeHotTenant && w.Tenants != 1:
		return fmt.Errorf("%s has one tenant, not %d", ShapeHotTenant, w.Tenants)
	case w.Shape == ShapeCachePressure && w.FleetKVTokens < 1:
		return fmt.Errorf("%s needs the fleet's KV capacity in tokens", ShapeCachePressure)
	case w.Shape == ShapeCachePressure && int64(w.Tenants)*int64(w.ContextTokens) < CachePressureFactor*int64(w.FleetKVTokens):
		return fmt.Errorf("%s: %d tenants × %d tokens is less than %d× the fleet's %d tokens of KV (want at least %d tenants)",
			ShapeCachePressure, w.Tenants, w.ContextTokens, CachePressureFactor, w.FleetKVTokens, CachePressureTenants(w.FleetKVTokens, w.ContextTokens))
	case w.BurstOn < 0 || w.BurstOff < 0:
		return errors.New("burst phases must not be negative")
	}
	return nil
}

// sharedRequests is the number of the tenants' requests: Tenants ×
// UsersPerTenant × QueriesPerUser.
func (w *PrefixWorkload) sharedRequests() int { return w.Tenants * w.UsersPerTenant * w.QueriesPerUser }

// Requests is the number of requests of the workload: Tenants ×
// UsersPerTenant × QueriesPerUser, twice that for ShapeMixed (its short
// chats).
func (w *PrefixWorkload) Requests() int {
	if w.Shape == ShapeMixed {
		return 2 * w.sharedRequests()
	}
	return w.sharedRequests()
}

// bursts returns the on and off phases of a ShapeMixed workload (zero
// for the others).
func (w *PrefixWorkload) bursts() (on, off time.Duration) {
	if w.Shape != ShapeMixed {
		return 0, 0
	}
	on, off = w.BurstOn, w.BurstOff
	if on <= 0 {
		on = DefaultBurst
	}
	if off <= 0 {
		off = DefaultBurst
	}
	return on, off
}

// TraceRequest is one request of a Trace.
type TraceRequest struct {
	// At is the request's arrival, from the trace's start.
	At time.Duration
	// Tenant, User and Query identify the request (0-based; User within
	// its tenant, Query within its user). A short chat of ShapeMixed has
	// Tenant −1 and User its own number.
	Tenant, User, Query int
	// Body is the chat completion request body (streamed, with usage).
	Body []byte
	// Tokens is the prompt as the simulator tokenizes it: the words of the
	// rendered messages (sim.RenderChat).
	Tokens []string
}

// Trace is a PrefixWorkload drawn out: every request, in arrival order.
type Trace struct {
	// Workload is what the trace was drawn from.
	Workload PrefixWorkload
	// Requests are in arrival order (At ascending).
	Requests []TraceRequest
}

// NewTrace draws the requests of w: the same w (Seed included) always
// gives the same trace, byte for byte. The order is a uniform shuffle of
// every (tenant, user, query) — and of ShapeMixed's short chats — with
// each user's queries kept in order; the gaps between arrivals are
// exponential with mean 1/Rate (for ShapeMixed, exponential at Rate ×
// (on + off) / on within the on phases, which the off phases interrupt).
func NewTrace(w PrefixWorkload) (*Trace, error) {
	if err := w.Validate(); err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(w.Seed, 0x5eed_0f_7e4a47))
	contexts := make([]string, w.Tenants)
	if w.Shape != ShapeNoSharedPrefix {
		for t := range contexts {
			contexts[t] = words(rng, "tenant-"+strconv.Itoa(t), w.ContextTokens)
		}
	}
	users := w.Tenants * w.UsersPerTenant
	shared, n := w.sharedRequests(), w.Requests()
	order := make([]int, n) // the user (tenant×users + user) of each slot; users+k is chat k
	for i := range order {
		if i < shared {
			order[i] = i / w.QueriesPerUser
		} else {
			order[i] = users + i - shared
		}
	}
	rng.Shuffle(n, func(i, j int) { order[i], order[j] = order[j], order[i] })
	next := make([]int, users) // each user's next query
	on, off := w.bursts()
	rate := w.Rate
	if on > 0 {
		rate = w.Rate * float64(on+off) / float64(on)
	}
	model, _ := json.Marshal(w.Model)
	tr := &Trace{Workload: w, Requests: make([]TraceRequest, n)}
	var active time.Duration // time spent in on phases (all of it without bursts)
	for i, u := range order {
		body := append([]byte(`{"model":`), model...)
		var req TraceRequest
		if u >= users {
			k := u - users
			req = TraceRequest{Tenant: -1, User: k}
			body = append(body, `,"messages":[{"role":"user","content":"`...)
			body = append(body, words(rng, "chat-"+strconv.Itoa(k), w.QueryTokens)...)
		} else {
			t, user := u/w.UsersPerTenant, u%w.UsersPerTenant
			q := next[u]
			next[u]++
			req = TraceRequest{Tenant: t, User: user, Query: q}
			ctx := contexts[t]
			if w.Shape == ShapeNoSharedPrefix {
				ctx = words(rng, "request-"+strconv.Itoa(i), w.ContextTokens)
			}
			query := words(rng, fmt.Sprintf("user-%d-%d-query-%d", t, user, q), w.QueryTokens)
			body = append(body, `,"messages":[{"role":"system","content":"`...)
			body = append(body, ctx...)
			body = append(body, `"},{"role":"user","content":"`...)
			body = append(body, query...)
		}
		// The gap is drawn after the words, as traces of the first two
		// shapes always were: their seeds still give the same bytes.
		active += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		at := active
		if on > 0 {
			at = active/on*(on+off) + active%on
		}
		body = append(body, `"}],"max_tokens":`...)
		body = strconv.AppendInt(body, int64(w.MaxTokens), 10)
		body = append(body, `,"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true}`...)
		tokens, err := chatTokens(body)
		if err != nil {
			return nil, err
		}
		req.At, req.Body, req.Tokens = at, body, tokens
		tr.Requests[i] = req
	}
	return tr, nil
}

// words returns first followed by n−1 words of promptWords drawn from
// rng, space-separated: n words in all, plain ASCII (no JSON escaping).
func words(rng *rand.Rand, first string, n int) string {
	var b strings.Builder
	b.WriteString(first)
	for i := 1; i < n; i++ {
		b.WriteByte(' ')
		b.WriteString(promptWords[rng.IntN(len(promptWords))])
	}
	return b.String()
}

// chatTokens returns the prompt of a chat body as the simulator sees it:
// the words of sim.RenderChat of its messages.
func chatTokens(body []byte) ([]string, error) {
	var req struct {
		Messages json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		return nil, err
	}
	prompt, err := sim.RenderChat(req.Messages)
	if err != nil {
		return nil, err
	}
	return strings.Fields(prompt), nil
}

// Endpoint is the path every trace request is sent to.
func (tr *Trace) Endpoint() string { return schemas.EndpointChat }

// PromptTokens is the sum of the requests' prompt lengths, in tokens.
func (tr *Trace) PromptTokens() int64 {
	var n int64
	for i := range tr.Requests {
		n += int64(len(tr.Requests[i].Tokens))
	}
	return n
}

// Oracle is the ideal prefix-cache hit rate of a trace: what a fleet
// would get if every request went to an engine already holding its
// longest cached prefix, with the fleet's caches pooled into one LRU of
// Engines × CacheBlocks blocks. A prompt is cut into blocks of BlockSize
// tokens, each identified by the hash of its tokens chained to the
// previous block's (as vLLM's prefix cache); only full blocks are cached;
// a request's hit is its leading run of cached blocks, and never its
// whole prompt (the last token is always computed, as vLLM does: at most
// ⌊(n−1)/BlockSize⌋ blocks hit for an n-token prompt). After the lookup
// every full block of the prompt is inserted or refreshed, the last block
// first, so that a prompt's head is its most recently used block and its
// tail is evicted first (as the simulator and vLLM free them).
//
// The pooled LRU is a definition, not a proof of optimality: one LRU of
// the whole fleet's blocks is what an engine-aware oracle can at best
// keep with LRU eviction, but split caches can occasionally do better
// than one pooled LRU, so a measured hit rate may exceed it slightly.
type Oracle struct {
	// BlockSize is the tokens per KV block (the sims' --block-size), ≥ 1.
	BlockSize int
	// Engines is the number of prefill engines, ≥ 1.
	Engines int
	// CacheBlocks is each engine's cache capacity in blocks (the sims'
	// --kv-cache-blocks), ≥ 1.
	CacheBlocks int
}

// OracleResult is the Oracle's accounting of one trace, in tokens (as
// vLLM's vllm:prefix_cache_queries and vllm:prefix_cache_hits).
type OracleResult struct {
	// QueryTokens is the sum of the prompts' lengths.
	QueryTokens int64 `json:"query_tokens"`
	// HitTokens is the sum of the tokens served from the pooled cache.
	HitTokens int64 `json:"hit_tokens"`
	// HitRate is HitTokens / QueryTokens (0 for an empty trace).
	HitRate float64 `json:"hit_rate"`
}

// Run computes the oracle's hit rate over the requests of tr, in order.
func (o Oracle) Run(tr *Trace) (OracleResult, error) {
	if o.BlockSize < 1 || o.Engines < 1 || o.CacheBlocks < 1 {
		return OracleResult{}, errors.New("oracle: block size, engines and cache blocks must be at least 1")
	}
	capacity := o.Engines * o.CacheBlocks
	lru := list.New() // of uint64 block hashes, most recent at the back
	where := map[uint64]*list.Element{}
	seed := maphash.MakeSeed()
	var res OracleResult
	var hashes []uint64
	for i := range tr.Requests {
		toks := tr.Requests[i].Tokens
		res.QueryTokens += int64(len(toks))
		hashes = blockHashes(hashes[:0], seed, toks, o.BlockSize)
		hitBlocks := 0
		limit := 0
		if len(toks) > 0 {
			limit = (len(toks) - 1) / o.BlockSize
		}
		for _, h := range hashes[:min(limit, len(hashes))] {
			if _, ok := where[h]; !ok {
				break
			}
			hitBlocks++
		}
		res.HitTokens += int64(hitBlocks * o.BlockSize)
		for k := len(hashes) - 1; k >= 0; k-- {
			h := hashes[k]
			if e, ok := where[h]; ok {
				lru.MoveToBack(e)
				continue
			}
			where[h] = lru.PushBack(h)
			if lru.Len() > capacity {
				old := lru.Front()
				delete(where, old.Value.(uint64))
				lru.Remove(old)
			}
		}
	}
	if res.QueryTokens > 0 {
		res.HitRate = float64(res.HitTokens) / float64(res.QueryTokens)
	}
	return res, nil
}

// blockHashes appends to dst the chained hashes of the full blocks of
// toks: block k's hash covers block k−1's hash and block k's tokens.
func blockHashes(dst []uint64, seed maphash.Seed, toks []string, blockSize int) []uint64 {
	var prev uint64
	var h maphash.Hash
	h.SetSeed(seed)
	for k := 0; (k+1)*blockSize <= len(toks); k++ {
		h.Reset()
		var b [8]byte
		for i := range b {
			b[i] = byte(prev >> (8 * i))
		}
		h.Write(b[:])
		for _, t := range toks[k*blockSize : (k+1)*blockSize] {
			h.WriteString(t)
			h.WriteByte(0)
		}
		prev = h.Sum64()
		dst = append(dst, prev)
	}
	return dst
}
