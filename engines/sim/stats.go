package sim

import (
	"encoding/json"
	"sync"
	"sync/atomic"
)

// Stats are a Server's counters since it was created, served as JSON by
// GET /sim/stats. KV counters are in handoffs (one prefill leg's blocks),
// not in blocks. Tests read them to prove that KV really moved (R-LEG-3),
// that abandoned handoffs are released (R-OWN-6) and that a client
// disconnect reaches the engine (R-OWN-5).
type Stats struct {
	// Prefills counts inference requests that were prefill legs
	// (kv_transfer_params.do_remote_decode = true).
	Prefills int64 `json:"prefills"`
	// Decodes counts every other inference request: decode legs and plain
	// requests.
	Decodes int64 `json:"decodes"`
	// KVHeld is the number of handoffs whose blocks this producer holds now.
	KVHeld int64 `json:"kv_held"`
	// KVServed counts pulls this producer answered successfully.
	KVServed int64 `json:"kv_served"`
	// KVPulled counts successful pulls this engine made as a consumer (the
	// blocks arrived and matched its prompt); with the shared-storage
	// connector, the requests that loaded at least one block from the
	// shared store.
	KVPulled int64 `json:"kv_pulled"`
	// KVPullFailures counts decode legs of this engine that failed their
	// KV transfer: pull refused, producer unreachable, invalid descriptor,
	// or blocks computed for another prompt.
	KVPullFailures int64 `json:"kv_pull_failures"`
	// KVReleased counts handoffs released early by POST /v1/kv/release.
	KVReleased int64 `json:"kv_released"`
	// KVExpired counts handoffs released because nobody pulled them within
	// Config.KVTimeout.
	KVExpired int64 `json:"kv_expired"`
	// ActiveStreams is the number of inference requests in flight,
	// streaming or not.
	ActiveStreams int64 `json:"active_streams"`
	// Aborted counts inference requests ended by a client disconnect.
	Aborted int64 `json:"aborted"`
	// Completed counts inference requests answered in full: a stream that
	// reached [DONE] or a complete non-streaming body, legal empty
	// completions included; faults and errors are not completions.
	Completed int64 `json:"completed"`
	// Unauthorized counts /v1/* requests refused with 401 for want of
	// Config.APIKey.
	Unauthorized int64 `json:"unauthorized"`
	// Running is the number of inference requests running now (holding
	// one of Config.MaxNumSeqs sequences; all of them when unbounded).
	Running int64 `json:"running"`
	// Waiting is the number of inference requests queued for a sequence
	// beyond Config.MaxNumSeqs.
	Waiting int64 `json:"waiting"`
	// PrefixCacheQueries counts prompt tokens looked up in the prefix cache
	// by prefill legs and plain requests (vllm:prefix_cache_queries_total).
	PrefixCacheQueries int64 `json:"prefix_cache_queries"`
	// PrefixCacheHits counts those of them found cached, the sum of the
	// cached_tokens those requests reported (vllm:prefix_cache_hits_total).
	PrefixCacheHits int64 `json:"prefix_cache_hits"`
	// ExternalPrefixCacheQueries and ExternalPrefixCacheHits count the prompt
	// tokens of decode legs whose KV was pulled from a producer; every
	// pulled token is a hit (vllm:external_prefix_cache_*_total). With the
	// shared-storage connector a consumer's queries are the prompt tokens
	// its own prefix cache did not hold, its hits the tokens it loaded from
	// the shared store.
	ExternalPrefixCacheQueries int64 `json:"external_prefix_cache_queries"`
	ExternalPrefixCacheHits    int64 `json:"external_prefix_cache_hits"`
	// PrefixCacheBlocks is the number of KV blocks cached now, at most
	// Config.KVCacheBlocks.
	PrefixCacheBlocks int64 `json:"prefix_cache_blocks"`
	// PrefixCacheEvicted counts blocks evicted to make room.
	PrefixCacheEvicted int64 `json:"prefix_cache_evicted"`
	// KVStoreWritten counts the KV blocks this shared-storage producer
	// wrote to the shared store (Config.KVStore), one file each; blocks it
	// found there already are not written again.
	KVStoreWritten int64 `json:"kv_store_written"`
	// KVStoreLoaded counts the KV blocks this shared-storage consumer
	// loaded from the shared store (their tokens are its external prefix
	// cache hits).
	KVStoreLoaded int64 `json:"kv_store_loaded"`
	// KVStoreEvicted counts the block files this producer removed from the
	// shared store to stay within Config.KVStoreBlocks.
	KVStoreEvicted int64 `json:"kv_store_evicted"`
	// KVStoreErrors counts block writes to the shared store that failed.
	KVStoreErrors int64 `json:"kv_store_errors"`
}

// counters are the lock-free part of Stats.
type counters struct {
	prefills, decodes          atomic.Int64
	kvPulled, kvPullFailures   atomic.Int64
	active, aborted, completed atomic.Int64
	promptTokens, genTokens    atomic.Int64
	finishedStop, finishedLen  atomic.Int64
	unauthorized               atomic.Int64
	running, waiting           atomic.Int64
	// queuedTokens is the uncached prompt tokens of the requests waiting
	// or admitted but not computing yet (estimated from the cache as it
	// stood when they arrived); the computing ones are in Server.work.
	// runningBlocks is the KV blocks of the running requests' prompts
	// (vllm:kv_cache_usage_perc).
	queuedTokens, runningBlocks atomic.Int64
}

// RecordedRequest is one inference or release request as the Server
// received it, for tests (GET /sim/requests).
type RecordedRequest struct {
	// Path is the URL path, e.g. "/v1/chat/completions".
	Path string `json:"path"`
	// RequestID is the X-Request-Id header, empty when absent.
	RequestID string `json:"request_id"`
	// Phase is "prefill" or "decode" for inference requests (see Fault),
	// empty for others.
	Phase string `json:"phase"`
	// Traceparent and Tracestate are the W3C trace context headers as
	// received (at most maxRecordedHeader bytes each), empty when absent:
	// tests see with them that a router joins each leg to its trace.
	Traceparent string `json:"traceparent,omitempty"`
	Tracestate  string `json:"tracestate,omitempty"`
	// Body is the request body as received; a body that is not valid JSON
	// is recorded as a JSON string of its bytes.
	Body json.RawMessage `json:"body"`
}

// recordLimit is how many requests the recorder keeps.
const recordLimit = 1000

// recorder is a ring of the last recordLimit requests.
type recorder struct {
	mu   sync.Mutex
	ring []RecordedRequest
	next int
}

func (r *recorder) add(rr RecordedRequest) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.ring) < recordLimit {
		r.ring = append(r.ring, rr)
		return
	}
	r.ring[r.next] = rr
	r.next = (r.next + 1) % recordLimit
}

// list returns the recorded requests, oldest first.
func (r *recorder) list() []RecordedRequest {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]RecordedRequest, 0, len(r.ring))
	out = append(out, r.ring[r.next:]...)
	return append(out, r.ring[:r.next]...)
}

func (r *recorder) reset() {
	r.mu.Lock()
	r.ring, r.next = nil, 0
	r.mu.Unlock()
}
