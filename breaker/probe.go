package breaker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
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

// maxMetaBody bounds the /v1/models, /version and error bodies read by the
// checks.
const maxMetaBody = 1 << 20

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
// carries no transfer parameters (R-LEG-4). Each leg is bounded by ctx and
// c's timeouts (see NewProbeClient). When the decode request fails before
// its stream opens, the handoff is released at the producer where its
// connector can (R-OWN-6).
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

// CheckHealth asks e's GET /health and returns nil for HTTP 200 (R-BRK-6:
// without an engine contract, a passing health check is the lifecycle
// check). It returns an error naming the engine and the status (with the
// start of the body) or the transport error. ctx bounds the request.
func CheckHealth(ctx context.Context, httpc *http.Client, e *engines.Engine) error {
	resp, err := get(ctx, httpc, e, e.URL+"/health")
	if err != nil {
		return fmt.Errorf("engine %s: health check: %w", e.ID, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("engine %s: health check: %s", e.ID, statusText(resp))
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxMetaBody))
	return nil
}

// ServedModel is one entry of an engine's GET /v1/models.
type ServedModel = engines.ServedModel

// ServedModels reads e's GET /v1/models (engines.ListModels, with e's
// credential) and returns its entries in order. It returns an error naming
// the engine for a transport error, a non-200 status, a body that is not a
// model list, or an empty list.
func ServedModels(ctx context.Context, httpc *http.Client, e *engines.Engine) ([]ServedModel, error) {
	models, err := engines.ListModels(ctx, httpc, e.URL, e.Credential)
	if err != nil {
		return nil, fmt.Errorf("engine %s: /v1/models: %w", e.ID, err)
	}
	if len(models) == 0 {
		return nil, fmt.Errorf("engine %s: /v1/models lists no model", e.ID)
	}
	return models, nil
}

// EngineVersion is an engine's GET /version: vLLM answers
// {"version":"0.11.0"}; engines that say what they are add "engine"
// (the simulator: "vllm").
type EngineVersion struct {
	// Version is the engine's version string, e.g. "0.11.0".
	Version string `json:"version"`
	// Engine is the engine kind, or "" when the engine does not say.
	Engine string `json:"engine"`
}

// ContractError is one way an engine breaks the pinned engine contract
// (SPEC R-BRK-6, R-PRE-1).
type ContractError struct {
	// EngineID is the engine checked.
	EngineID string
	// Field is the contract key broken: "model", "engine", "version" or
	// "connector".
	Field string
	// Want is the contract's value, Got what the engine has.
	Want, Got string
}

// Error returns "engine <id> breaks engine_contract.<field>: want <want>,
// got <got>".
func (e *ContractError) Error() string {
	return "engine " + e.EngineID + " breaks engine_contract." + e.Field + ": want " + e.Want + ", got " + e.Got
}

// CheckContract validates e against contract (SPEC R-BRK-6, R-PRE-1): the
// contract's model is listed by GET /v1/models; the engine kind (GET
// /version "engine", else the model's owned_by) equals the contract's,
// ignoring case; the version from GET /version satisfies the contract's
// constraint (config.VersionSatisfies); and the engine's connector from the
// fleet config (e.Connector) is the contract's. Empty contract fields pin
// nothing; a nil contract only requires /v1/models to list a model. ctx
// bounds the requests.
//
// It returns nil, the joined *ContractError of every mismatch, or an error
// naming the engine when an endpoint cannot be read.
func CheckContract(ctx context.Context, httpc *http.Client, e *engines.Engine, contract *config.Contract) error {
	models, err := ServedModels(ctx, httpc, e)
	if err != nil {
		return err
	}
	if contract == nil {
		return nil
	}
	var errs []error
	mismatch := func(field, want, got string) {
		errs = append(errs, &ContractError{EngineID: e.ID, Field: field, Want: want, Got: got})
	}
	served := models[0]
	if contract.Model != "" {
		i := slices.IndexFunc(models, func(m ServedModel) bool { return m.ID == contract.Model })
		if i < 0 {
			ids := make([]string, len(models))
			for j, m := range models {
				ids[j] = strconv.Quote(m.ID)
			}
			mismatch("model", strconv.Quote(contract.Model), "models "+strings.Join(ids, ", "))
		} else {
			served = models[i]
		}
	}
	if contract.Engine != "" || contract.Version != "" {
		v, err := readVersion(ctx, httpc, e)
		if err != nil {
			return err
		}
		kind := v.Engine
		if kind == "" {
			kind = served.OwnedBy
		}
		if contract.Engine != "" && !strings.EqualFold(kind, contract.Engine) {
			mismatch("engine", strconv.Quote(contract.Engine), strconv.Quote(kind))
		}
		if contract.Version != "" {
			ok, err := config.VersionSatisfies(v.Version, contract.Version)
			if err != nil {
				mismatch("version", strconv.Quote(contract.Version), strconv.Quote(v.Version)+" ("+err.Error()+")")
			} else if !ok {
				mismatch("version", strconv.Quote(contract.Version), strconv.Quote(v.Version))
			}
		}
	}
	if contract.Connector != "" {
		got := ""
		if e.Connector != nil {
			got = e.Connector.Name()
		}
		if got != contract.Connector {
			mismatch("connector", strconv.Quote(contract.Connector), strconv.Quote(got))
		}
	}
	return errors.Join(errs...)
}

// readVersion reads e's GET /version.
func readVersion(ctx context.Context, httpc *http.Client, e *engines.Engine) (EngineVersion, error) {
	var v EngineVersion
	resp, err := get(ctx, httpc, e, e.URL+"/version")
	if err != nil {
		return v, fmt.Errorf("engine %s: /version: %w", e.ID, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return v, fmt.Errorf("engine %s: /version: %s", e.ID, statusText(resp))
	}
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxMetaBody))
	if err != nil {
		return v, fmt.Errorf("engine %s: /version: %w", e.ID, err)
	}
	if err := json.Unmarshal(raw, &v); err != nil {
		return v, fmt.Errorf("engine %s: /version: not a version object: %v", e.ID, err)
	}
	return v, nil
}

// get sends one GET bounded by ctx.
// It carries the engine's credential, if any.
func get(ctx context.Context, httpc *http.Client, e *engines.Engine, url string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	e.Credential.Authorize(req.Header)
	return httpc.Do(req)
}

// statusText describes a non-200 response: "HTTP 503: <start of body>".
func statusText(resp *http.Response) string {
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	s := "HTTP " + strconv.Itoa(resp.StatusCode)
	if obj, ok := schemas.ParseError(raw); ok && obj.Message != "" {
		return s + ": " + obj.Message
	}
	if t := strings.TrimSpace(string(raw)); t != "" {
		return s + ": " + t
	}
	return s
}
