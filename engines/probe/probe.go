// Package probe is the inference probe (behaviour.md R-BRK-3, R-BRK-4,
// R-PRE-1): one real KV transfer between a producer and a consumer, run
// through their connector exactly as a router's attempt is. The breaker
// readmits with it and preflight checks every pair with it. Before it, both
// run an engine's own checks from here: CheckLifecycle (health, models and
// the pinned engine contract, R-BRK-6) and CheckContract.
package probe

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nuid"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Prompt is the prompt of every inference probe (R-BRK-3, R-PRE-1),
// sent on /v1/completions so that it works for models without a chat
// template.
const Prompt = "narwhal probe"

// RequestIDPrefix starts the backend request id (X-Request-Id) of
// every probe attempt; the rest is a fresh NUID (R-OWN-4).
const RequestIDPrefix = "narwhal-probe-"

// NewClient returns the engine client the breaker and preflight probe
// with (R-BRK-3): each leg bounded by engine.first_token_timeout_s — the
// prefill leg as a whole, the decode leg until its first generated output —
// then engine.decode_read_timeout_s between chunks (none when 0) and
// handoff.max_age_s for the handoff. The caller should call
// CloseIdleConnections() when done with it.
func NewClient(cfg *config.Config) *engines.Client {
	return engines.NewClient(engines.Options{
		PrefillTimeout:    cfg.Engine.FirstTokenTimeout(),
		FirstTokenTimeout: cfg.Engine.FirstTokenTimeout(),
		DecodeReadTimeout: cfg.Engine.DecodeReadTimeout(), // 0: no per-chunk bound, as in the config
		HandoffMaxAge:     cfg.Handoff.MaxAge(),
		RootCAs:           cfg.Engine.RootCAs(),
	})
}

// Transfer runs one real KV transfer (R-BRK-3, R-BRK-4, R-PRE-1): a
// one-token completion of Prompt for model, from producer to consumer,
// through their connector exactly as a router's attempt runs
// (engines.Client.Transfer): for nixl a prefill with a new handoff, then
// the decode of that handoff; for sglang both legs at once with the same
// body (R-DESC-7); the decode read to its [DONE] and the prefill's answer
// waited for. When producer and consumer are the same engine the transfer
// is same-worker and carries no transfer parameters (R-LEG-4). Each leg is
// bounded by ctx and c's timeouts (see NewClient). A handoff left
// unconsumed by a failure is released at the producer where its connector
// can (R-OWN-6). When ctx carries a span, both legs carry its
// traceparent.
//
// It returns nil when the decode produced generated output and ended with
// [DONE]; otherwise the leg's *engines.Fault (its EngineID and Phase name the
// leg that failed), or a descriptive error when the probe request could not
// be built (empty model).
func Transfer(ctx context.Context, c *engines.Client, producer, consumer *engines.Engine, model string) error {
	if model == "" {
		return errors.New("probe: no model to probe with")
	}
	if producer == nil || consumer == nil {
		return errors.New("probe: producer and consumer are required")
	}
	body := make([]byte, 0, 128)
	body = append(body, `{"model":`...)
	body = strconv.AppendQuote(body, model)
	body = append(body, `,"prompt":`...)
	body = strconv.AppendQuote(body, Prompt)
	body = append(body, `,"max_tokens":1,"temperature":0}`...)
	parsed, err := schemas.ParseRequest(schemas.EndpointCompletions, body)
	if err != nil {
		return fmt.Errorf("probe: request for model %q: %w", model, err)
	}
	req := &engines.Request{
		Body:             parsed,
		BackendRequestID: RequestIDPrefix + nuid.Next(),
		Producer:         producer,
		Consumer:         consumer,
	}
	req.SetTrace(ctx)
	return c.Transfer(ctx, req, nil)
}
