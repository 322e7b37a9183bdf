package router

import (
	"strconv"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Silent recompute (R-FAIL-8, docs/connectors.md#recompute-detection): a
// decode engine that did not load the KV blocks its producer handed off
// still answers — it computes the whole prompt again, slowly and at the
// producer's expense. Its usage tells: prompt_tokens_details.cached_tokens
// counts the prompt tokens it did not compute, and after a handoff that is
// (nearly) the whole prompt.

// minJudgedPrompt is the shortest prompt, in the decode engine's
// usage.prompt_tokens, whose handoff is judged: an engine recomputes at
// least the last prompt token itself, which on a tiny prompt is a large
// share of it.
const minJudgedPrompt = 4

// recomputedKV reports whether a decode engine that reported prompt
// prompt tokens, cached of them cached, recomputed the prompt instead of
// loading the handed-off KV: fewer than half of them cached (R-FAIL-8).
func recomputedKV(prompt, cached int) bool {
	return prompt >= minJudgedPrompt && cached*2 < prompt
}

// checkRecompute judges the finished request's handoff by the decode
// engine's usage (R-FAIL-8), once, from finish: a recompute is counted
// per pair and published as a kv_recomputed event; with
// handoff.on_recompute fail_pair also as a counted failure of the decode
// engine, with its producer (the pair's streak, R-BRK-2, R-BRK-4). An
// engine that reports usage without the details is said once in the log.
// A request without a handoff (one engine for both phases) or without
// usage is not judged.
func (c *call) checkRecompute() {
	if !c.usage || c.producer == nil || c.consumer == nil || c.producer == c.consumer || c.producer.ID == c.consumer.ID {
		return
	}
	rt := c.rt
	if !c.cachedKnown {
		if c.consumer.MarkNoCacheDetails() {
			rt.log.Warn("decode engine reports no usage.prompt_tokens_details.cached_tokens: whether it loaded the handed-off KV or recomputed the prompt cannot be verified on it (vLLM: --enable-prompt-tokens-details; SGLang: --enable-cache-report)",
				"engine_id", c.consumer.ID)
		}
		return
	}
	if !recomputedKV(c.promptTokens, c.cachedTokens) {
		return
	}
	failPair := rt.cfg.Handoff.OnRecompute == config.OnRecomputeFailPair
	rt.metrics.recomputed(rt.inFleet, c.producer.ID, c.consumer.ID)
	conn := c.producer.Connector.Name()
	rt.log.Warn("decode engine recomputed the prompt instead of loading the handed-off KV",
		"request_id", c.id, "engine_id", c.consumer.ID, "producer_id", c.producer.ID, "connector", conn,
		"prompt_tokens", c.promptTokens, "cached_tokens", c.cachedTokens, "counts", failPair)
	rt.publish(&schemas.KVRecomputed{
		Envelope:         schemas.Envelope{Schema: schemas.SchemaKVRecomputed, RouterID: rt.id, EngineID: c.consumer.ID, RequestID: c.id},
		ProducerID:       c.producer.ID,
		Connector:        conn,
		BackendRequestID: c.backendID,
		PromptTokens:     c.promptTokens,
		CachedTokens:     c.cachedTokens,
		Counts:           failPair,
	})
	c.recomputed = true
	if !failPair {
		return
	}
	const kind = "kv_recomputed"
	rt.metrics.fault(rt.inFleet, c.consumer.ID, schemas.PhaseDecode, kind)
	status := c.status
	if status < 100 || status > 599 {
		status = 200
	}
	rt.publish(&schemas.Failure{
		Envelope:       schemas.Envelope{Schema: schemas.SchemaFailure, RouterID: rt.id, EngineID: c.consumer.ID, RequestID: c.id},
		Phase:          schemas.PhaseDecode,
		Kind:           kind,
		Status:         status,
		UpstreamStatus: 200,
		Message: "decode engine " + c.consumer.ID + " reported " + strconv.Itoa(c.cachedTokens) + " of " + strconv.Itoa(c.promptTokens) +
			" prompt tokens cached: it recomputed the prompt instead of loading the KV of " + c.producer.ID,
		Counts:           true,
		BackendRequestID: c.backendID,
		Attempt:          c.attempts,
		ProducerID:       c.producer.ID,
		ConsumerID:       c.consumer.ID,
	})
}
