package engines

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/narwhalmesh/narwhal/schemas"
)

// maxModelsBody bounds the /v1/models body ListModels reads, in bytes.
const maxModelsBody = 1 << 20

// ServedModel is one entry of an OpenAI-compatible server's GET /v1/models.
type ServedModel struct {
	// ID is the served model name.
	ID string `json:"id"`
	// OwnedBy is what the server says owns it; vLLM reports its engine
	// kind ("vllm").
	OwnedBy string `json:"owned_by"`
}

// ErrNotModelList is wrapped by ListModels' error for a 200 answer whose
// body is not a model list.
var ErrNotModelList = errors.New("not a model list")

// StatusError is ListModels' error for an answer other than 200.
type StatusError struct {
	// Status is the HTTP status of the answer.
	Status int
	// Message is the OpenAI-shaped error's message, else the start of the
	// body (at most 512 bytes), else "".
	Message string
}

// Error returns "HTTP <status>", followed by ": <message>" when there is
// one.
func (e *StatusError) Error() string {
	s := "HTTP " + strconv.Itoa(e.Status)
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}

// ListModels reads GET <baseURL>/v1/models with httpc, sending cred, and
// returns the entries of its {"object":"list","data":[{"id","owned_by",…}]}
// that have an id, in order (possibly none). ctx bounds the request; at
// most 1 MiB of the body is read. Errors: httpc's for a transport failure
// or a body that breaks off, a *StatusError for a status other than 200,
// and one wrapping ErrNotModelList for a body that is not a model list;
// callers add which server it was.
func ListModels(ctx context.Context, httpc *http.Client, baseURL string, cred Credential) ([]ServedModel, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, baseURL+"/v1/models", nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	cred.Authorize(req.Header)
	resp, err := httpc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxModelsBody))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		se := &StatusError{Status: resp.StatusCode}
		if obj, ok := schemas.ParseError(body); ok && obj.Message != "" {
			se.Message = obj.Message
		} else {
			se.Message = strings.TrimSpace(string(body[:min(len(body), 512)]))
		}
		return nil, se
	}
	var list struct {
		Data []ServedModel `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNotModelList, err)
	}
	models := list.Data[:0]
	for _, m := range list.Data {
		if m.ID != "" {
			models = append(models, m)
		}
	}
	return models, nil
}

// ModelIDs returns the ids of models, in order.
func ModelIDs(models []ServedModel) []string {
	ids := make([]string, len(models))
	for i, m := range models {
		ids[i] = m.ID
	}
	return ids
}
