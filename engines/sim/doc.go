// Package sim is a vLLM-compatible inference engine simulator with a real
// KV handoff between simulated producers and consumers.
//
// A Server speaks vLLM's OpenAI server dialect:
// POST /v1/chat/completions and /v1/completions (streaming or not),
// GET /v1/models, /health, /version and /metrics, with vLLM's error bodies.
// Its output is deterministic (see Generate), so a test can compute exactly
// what a decode must produce.
//
// The KV handoff follows vLLM's NixlConnector: a prefill leg
// (kv_transfer_params.do_remote_decode = true) that ends length-capped
// returns a handoff descriptor and the producer holds ceil(prompt_tokens/BlockSize)
// KV blocks for it; a decode leg (kv_transfer_params.do_remote_prefill =
// true) pulls those blocks over the producer's KV side channel (a second
// HTTP listener, POST /kv/pull) before it generates, and checks that they
// were computed for the same endpoint kind and prompt. Forged, foreign,
// garbled, already pulled, expired and released handoffs fail the decode
// the way a real engine fails it (behaviour.md §2, §3, R-OWN-6).
//
// With Config.Connector "sglang" it speaks SGLang's bootstrap protocol
// instead (bootstrap.go), and with "shared-storage" vLLM's
// SharedStorageConnector (sharedstore.go): producer and consumer share a
// KV store, a directory (Config.KVStore) where the producer writes one
// file per KV block of every prompt it computes and where the consumer
// finds them by the prompt's block hashes; no request carries anything
// for the transfer.
//
// Each Server keeps a prefix cache of KV blocks like vLLM's automatic
// prefix caching (Config.BlockSize, Config.KVCacheBlocks): prefill
// compute is spent on uncached tokens only, and shared by the prompts
// computing at once as one GPU's is, responses report
// usage.prompt_tokens_details.cached_tokens, and /metrics has vLLM's
// prefix-cache counters, its request queue (Config.MaxNumSeqs) and
// process_start_time_seconds (Server.StartTime). Its tokens are words
// with deterministic ids (tokens.go), which POST /tokenize answers in
// vLLM's shape; with Config.KVEvents the cache's stores, evictions and
// resets (POST /reset_prefix_cache) are published as vLLM's KV cache
// events over ZeroMQ, with vLLM's replay socket (kvevents.go).
//
// Faults (Fault) make the simulator misbehave on command — header and
// first-token delays, silences, closes, aborts, error objects, bad statuses,
// descriptor corruption — so the router's failure handling (behaviour.md §5, §6,
// R-CHAOS-1) can be proven against a real process. Faults are armed from
// Config, with Server.Arm, or at run time over HTTP (/sim/faults).
package sim
