package engines

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/narwhalmesh/narwhal/schemas"
)

// maxMetaBody bounds the /health, /version and error bodies read by the
// checks, in bytes.
const maxMetaBody = 1 << 20

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

// EngineVersion is an engine's GET /version: vLLM answers
// {"version":"0.11.0"}; engines that say what they are add "engine"
// (the simulator: "vllm").
type EngineVersion struct {
	// Version is the engine's version string, e.g. "0.11.0".
	Version string `json:"version"`
	// Engine is the engine kind, or "" when the engine does not say.
	Engine string `json:"engine"`
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
