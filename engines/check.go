package engines

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

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/schemas"
)

// maxMetaBody bounds the /health, /version and error bodies read by the
// checks, in bytes.
const maxMetaBody = 1 << 20

// FromConfig returns the Engines of a configured fleet (cfg.Fleet), in
// order: each with its base URL, role, connector and the API key Load read
// from its api_key_env (zero when it names none). The router, the breaker
// and preflight all build their configured engines with it. It returns an
// error "fleet engine <id>: <registry error>" for the first engine whose
// connector is not registered.
func FromConfig(fleet []config.EngineSpec) ([]Engine, error) {
	out := make([]Engine, 0, len(fleet))
	for _, spec := range fleet {
		e, err := NewEngine(spec.ID, spec.URL, spec.Role, spec.Connector)
		if err != nil {
			return nil, fmt.Errorf("fleet engine %s: %w", spec.ID, err)
		}
		e.Credential = NewCredential(spec.APIKey.Reveal())
		e.BootstrapPort = spec.BootstrapPort
		out = append(out, e)
	}
	return out, nil
}

// CheckHealth asks e's GET /health and returns nil for HTTP 200 (R-BRK-6:
// without an engine contract, a passing health check is the lifecycle
// check). It returns an error naming the engine and the status (with the
// start of the body) or the transport error. ctx bounds the request.
func CheckHealth(ctx context.Context, httpc *http.Client, e *Engine) error {
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

// ServedModels reads e's GET /v1/models (ListModels, with e's
// credential) and returns its entries in order. It returns an error naming
// the engine for a transport error, a non-200 status, a body that is not a
// model list, or an empty list.
func ServedModels(ctx context.Context, httpc *http.Client, e *Engine) ([]ServedModel, error) {
	models, err := ListModels(ctx, httpc, e.URL, e.Credential)
	if err != nil {
		return nil, fmt.Errorf("engine %s: /v1/models: %w", e.ID, err)
	}
	if len(models) == 0 {
		return nil, fmt.Errorf("engine %s: /v1/models lists no model", e.ID)
	}
	return models, nil
}

// CheckLifecycle runs an engine's own checks as readmission and preflight
// do (behaviour.md R-BRK-6, R-PRE-1): CheckHealth bounded by timeout, then, within
// a second window of timeout, ServedModels when contract pins no model and
// CheckContract when there is a contract. It returns the model e's
// probes use — contract.Model, else the first model e serves — and nil, or
// the first check's error (CheckHealth's, ServedModels' or
// CheckContract's). The model is "" when the health check or the model
// list failed, and still set when only the contract check failed.
func CheckLifecycle(ctx context.Context, httpc *http.Client, e *Engine, contract *config.Contract, timeout time.Duration) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	err := CheckHealth(cctx, httpc, e)
	cancel()
	if err != nil {
		return "", err
	}
	cctx, cancel = context.WithTimeout(ctx, timeout)
	defer cancel()
	var model string
	if contract != nil && contract.Model != "" {
		model = contract.Model
	} else {
		models, err := ServedModels(cctx, httpc, e)
		if err != nil {
			return "", err
		}
		model = models[0].ID
	}
	if contract != nil {
		if err := CheckContract(cctx, httpc, e, contract); err != nil {
			return model, err
		}
	}
	return model, nil
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
// (behaviour.md R-BRK-6, R-PRE-1).
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

// CheckContract validates e against contract (behaviour.md R-BRK-6, R-PRE-1): the
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
func CheckContract(ctx context.Context, httpc *http.Client, e *Engine, contract *config.Contract) error {
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
		v, err := ReadVersion(ctx, httpc, e)
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

// ReadVersion reads e's GET /version (sending e's credential), bounded by
// ctx, at most 1 MiB of it. It returns an error naming the engine for a
// transport error, a status other than 200 (with the start of the body) or
// a body that is not a version object.
func ReadVersion(ctx context.Context, httpc *http.Client, e *Engine) (EngineVersion, error) {
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
func get(ctx context.Context, httpc *http.Client, e *Engine, url string) (*http.Response, error) {
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
