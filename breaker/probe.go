package breaker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/nats-io/nuid"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// ProbePrompt is the prompt of every inference probe (R-BRK-3, R-PRE-1),
// sent on /v1/completions so that it works for models without a chat
// template.
const ProbePrompt = "narwhal probe"

// ProbeRequestIDPrefix starts the backend request id (X-Request-Id) of
// every probe attempt; the rest is a fresh NUID (R-OWN-4).
const ProbeRequestIDPrefix = "narwhal-probe-"

// releaseTimeout bounds the early release of a probe's unconsumed handoff.
const releaseTimeout = 2 * time.Second

// NewProbeClient returns the engine client the breaker and preflight probe
// with (R-BRK-3): each leg bounded by engine.first_token_timeout_s — the
// prefill leg as a whole, the decode leg until its first generated output —
// then engine.decode_read_timeout_s between chunks (none when 0) and
// handoff.max_age_s for the handoff. The caller should call
// CloseIdleConnections() when done with it.
func NewProbeClient(cfg *config.Config) *engines.Client {
	return engines.NewClient(engines.Options{
		PrefillTimeout:    cfg.Engine.FirstTokenTimeout(),
		FirstTokenTimeout: cfg.Engine.FirstTokenTimeout(),
		DecodeReadTimeout: cfg.Engine.DecodeReadTimeout(), // 0: no per-chunk bound, as in the config
		HandoffMaxAge:     cfg.Handoff.MaxAge(),
		RootCAs:           cfg.Engine.RootCAs(),
	})
}

// ProbeTransfer runs one real KV transfer (R-BRK-3, R-BRK-4, R-PRE-1): a
// one-token prefill of ProbePrompt for model on producer with a new
// handoff, then a decode of that handoff on consumer, read to its [DONE]. When
// producer and consumer are the same engine the transfer is same-worker and
// carries no transfer parameters (R-LEG-4). With a connector whose legs
// run at once (sglang) both legs start together with the same body, as a
// router's attempt does (R-DESC-7). Each leg is bounded by ctx and
// c's timeouts (see NewProbeClient). When the decode request fails before
// its stream opens, the handoff is released at the producer where its
// connector can (R-OWN-6). When ctx carries a span, both legs carry its
// traceparent.
//
// It returns nil when the decode produced generated output and ended with
// [DONE]; otherwise the leg's *engines.Fault (its EngineID and Phase name the
// leg that failed), or a descriptive error when the probe request could not
// be built (empty model).
func ProbeTransfer(ctx context.Context, c *engines.Client, producer, consumer *engines.Engine, model string) error {
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
	body = strconv.AppendQuote(body, ProbePrompt)
	body = append(body, `,"max_tokens":1,"temperature":0}`...)
	parsed, err := schemas.ParseRequest(schemas.EndpointCompletions, body)
	if err != nil {
		return fmt.Errorf("probe: request for model %q: %w", model, err)
	}
	req := &engines.Request{
		Body:             parsed,
		BackendRequestID: ProbeRequestIDPrefix + nuid.Next(),
		Producer:         producer,
		Consumer:         consumer,
	}
	req.SetTrace(ctx)
	if connector.Concurrent(producer.Connector) || connector.Concurrent(consumer.Connector) {
		return probeConcurrent(ctx, c, req)
	}
	result, err := c.Prefill(ctx, req)
	if err != nil {
		return err
	}
	stream, err := c.Decode(ctx, req, result)
	if err != nil {
		releaseHandoff(ctx, c, producer, result)
		return err
	}
	defer stream.Close()
	for {
		_, _, err := stream.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// probeConcurrent is ProbeTransfer for a connector whose legs run at once
// (SGLang, R-DESC-7): the router's own path — fresh bootstrap fields, one
// body to both engines, the prefill watched — with the decode read to its
// [DONE] and the prefill's answer waited for: the probe passes only when
// both legs succeeded.
func probeConcurrent(ctx context.Context, c *engines.Client, req *engines.Request) error {
	b, err := engines.NewBootstrap(req)
	if err != nil {
		return engines.NewFault(engines.KindPrefillResponse, schemas.PhasePrefill, req.Producer.ID, 0, err.Error())
	}
	legs, stream, err := c.StartSGLang(ctx, req, b, nil)
	if legs == nil {
		return err
	}
	defer legs.Close()
	if err != nil {
		return err
	}
	defer stream.Close()
	for {
		_, kind, err := stream.Next()
		if err == io.EOF {
			if f := legs.Wait(); f != nil {
				return f
			}
			return nil
		}
		if err != nil {
			return legs.Blame(err, req.Consumer.ID)
		}
		if kind == schemas.ChunkOutput && !legs.Commit() {
			return legs.Failed()
		}
	}
}

// releaseHandoff frees an unconsumed probe handoff at the producer, best
// effort, with its own short deadline.
func releaseHandoff(ctx context.Context, c *engines.Client, producer *engines.Engine, result *connector.PrefillResult) {
	if !result.HasDescriptor() {
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	_, _ = c.Release(rctx, producer, result)
}
