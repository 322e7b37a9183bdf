package connector

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"

	"github.com/narwhalmesh/narwhal/schemas"
)

// Nixl is vLLM's NixlConnector (behaviour.md §2, §3; docs/connectors.md). The
// producer is asked for a handoff with
//
//	{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,
//	 "remote_block_ids":null,"remote_host":null,"remote_port":null}
//
// and answers with a descriptor such as
//
//	{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"9b1e…-dp0",
//	 "remote_request_id":"chatcmpl-…","remote_block_ids":[17,18],
//	 "remote_host":"10.0.3.7","remote_port":5600,"tp_size":1}
//
// Older engines omit remote_request_id and tp_size; every field Narwhal
// does not check is kept opaque, byte-for-byte (R-DESC-5).
type Nixl struct{}

// NixlName is the configuration name of the Nixl connector.
const NixlName = "nixl"

func init() { Register(Nixl{}) }

var nixlHandoffRequest = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// Name returns "nixl".
func (Nixl) Name() string { return NixlName }

// HandoffRequest returns the R-LEG-1 transfer parameters shown on Nixl.
func (Nixl) HandoffRequest() []byte { return nixlHandoffRequest }

// Validate applies R-DESC-0 (missing, null or empty descriptor), R-DESC-3's
// shape check (an object carrying none of nixl's fields, or
// do_remote_prefill not true), R-DESC-1 (remote_engine_id missing, null,
// empty or not a string) and R-DESC-2 (remote_block_ids not a non-empty
// array of non-negative integers, nor a non-empty array of such arrays).
// It returns a *RejectError on failure.
func (Nixl) Validate(descriptor []byte) (Handoff, error) {
	d := bytes.TrimSpace(descriptor)
	if len(d) == 0 || string(d) == "null" {
		return Handoff{}, reject(ReasonMissingDescriptor, "")
	}
	if d[0] != '{' {
		return Handoff{}, reject(ReasonConnectorMismatch, "descriptor is not a JSON object")
	}
	var (
		members                         int
		nixlShaped                      bool
		doRemotePrefill, engine, blocks []byte
		hasDoRemotePrefill, hasEngine   bool
		requestID                       []byte
	)
	// One allocation-free pass; the last occurrence of a name wins, as
	// encoding/json decodes.
	valid := schemas.Members(d, func(name, raw []byte) bool {
		members++
		switch string(name) {
		case "do_remote_prefill":
			nixlShaped, hasDoRemotePrefill, doRemotePrefill = true, true, raw
		case "remote_engine_id":
			nixlShaped, hasEngine, engine = true, true, raw
		case "remote_block_ids":
			nixlShaped, blocks = true, raw
		case "remote_request_id":
			requestID = raw
		}
		return true
	})
	switch {
	case !valid:
		return Handoff{}, reject(ReasonConnectorMismatch, "descriptor is not valid JSON")
	case members == 0:
		return Handoff{}, reject(ReasonMissingDescriptor, "empty object")
	case !nixlShaped:
		return Handoff{}, reject(ReasonConnectorMismatch, "not a nixl descriptor")
	case hasDoRemotePrefill && string(doRemotePrefill) != "true":
		return Handoff{}, reject(ReasonConnectorMismatch, "do_remote_prefill is not true")
	}
	var h Handoff
	if !hasEngine || len(engine) < 3 || engine[0] != '"' {
		return Handoff{}, reject(ReasonMissingIdentity, "")
	}
	if err := json.Unmarshal(engine, &h.EngineID); err != nil || h.EngineID == "" {
		return Handoff{}, reject(ReasonMissingIdentity, "")
	}
	n, ok := countBlockIDs(blocks)
	if !ok {
		return Handoff{}, reject(ReasonMalformedBlocks, "")
	}
	h.Blocks = n
	if len(requestID) > 0 && requestID[0] == '"' {
		_ = json.Unmarshal(requestID, &h.RequestID) // opaque when not a string
	}
	return h, nil
}

// countBlockIDs checks R-DESC-2 and returns the number of block ids: a
// non-empty array of non-negative integers, or a non-empty array of such
// arrays (KV-cache groups); nothing else.
func countBlockIDs(raw []byte) (int, bool) {
	raw = bytes.TrimSpace(raw)
	if len(raw) < 3 || raw[0] != '[' {
		return 0, false
	}
	total, elems, bad := 0, 0, false
	nested := false
	valid := schemas.Elements(raw, func(e []byte) bool {
		elems++
		if elems == 1 {
			nested = e[0] == '['
		}
		switch {
		case nested && e[0] == '[':
			inner := 0
			ok := schemas.Elements(e, func(id []byte) bool {
				inner++
				if !isBlockID(id) {
					bad = true
					return false
				}
				return true
			})
			if !ok || inner == 0 {
				bad = true
			}
			total += inner
		case !nested && isBlockID(e):
			total++
		default:
			bad = true
		}
		return !bad
	})
	if !valid || bad || elems == 0 {
		return 0, false
	}
	return total, true
}

// isBlockID reports whether raw is a JSON integer literal ≥ 0 that fits
// in an int64: digits only, no sign, fraction or exponent.
func isBlockID(raw []byte) bool {
	if len(raw) == 0 || len(raw) > 18 {
		return false
	}
	for _, c := range raw {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// Release asks the producer to free the blocks early with
// POST <producerURL>/v1/kv/release and body
// {"remote_engine_id","remote_request_id","remote_block_ids"} copied from
// the descriptor. Narwhal's simulator implements it; an engine without the
// endpoint (404, 405 or 501) is reported as released=false with no error,
// and its blocks wait for the engine's own abort timeout
// (VLLM_NIXL_ABORT_REQUEST_TIMEOUT on vLLM).
func (Nixl) Release(ctx context.Context, client *http.Client, producerURL string, descriptor []byte) (bool, error) {
	var d struct {
		EngineID  json.RawMessage `json:"remote_engine_id"`
		RequestID json.RawMessage `json:"remote_request_id"`
		BlockIDs  json.RawMessage `json:"remote_block_ids"`
	}
	if err := json.Unmarshal(descriptor, &d); err != nil {
		return false, fmt.Errorf("nixl release: %w", err)
	}
	body, err := json.Marshal(map[string]json.RawMessage{
		"remote_engine_id":  orNull(d.EngineID),
		"remote_request_id": orNull(d.RequestID),
		"remote_block_ids":  orNull(d.BlockIDs),
	})
	if err != nil {
		return false, fmt.Errorf("nixl release: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, producerURL+"/v1/kv/release", bytes.NewReader(body))
	if err != nil {
		return false, fmt.Errorf("nixl release: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return false, fmt.Errorf("nixl release: %w", err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	switch {
	case resp.StatusCode/100 == 2:
		return true, nil
	case resp.StatusCode == http.StatusNotFound, resp.StatusCode == http.StatusMethodNotAllowed, resp.StatusCode == http.StatusNotImplemented:
		return false, nil
	}
	return false, fmt.Errorf("nixl release: producer answered HTTP %d", resp.StatusCode)
}

func orNull(r json.RawMessage) json.RawMessage {
	if len(r) == 0 {
		return json.RawMessage("null")
	}
	return r
}
