// Package nixl is vLLM's NixlConnector (behaviour.md §2, §3;
// docs/connectors.md): the producer is asked for a handoff in its prefill
// leg's kv_transfer_params, answers with a handoff descriptor, and the
// consumer is sent the client's request with that descriptor byte for
// byte; it pulls the KV blocks from the producer itself. The package
// registers the connector as "nixl".
//
// The producer is asked for a handoff with
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
package nixl

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Nixl is vLLM's NixlConnector. It implements connector.Connector and
// connector.Descriptors.
type Nixl struct{}

// Name is the configuration name of the Nixl connector.
const Name = "nixl"

func init() { connector.Register(Nixl{}) }

// fieldDescriptor is the JSON path of the descriptor in a body.
const fieldDescriptor = "kv_transfer_params"

// descriptorShape is what R-DESC-0 expects of the prefill's answer.
const descriptorShape = "the producer's descriptor, a non-empty JSON object"

// missingDescriptor is the R-DESC-0 rejection of raw, the descriptor the
// prefill answered (nil: none), found being what it was when not its JSON
// type.
func missingDescriptor(found string, raw []byte) *connector.RejectError {
	return connector.RejectField(connector.ReasonMissingDescriptor, fieldDescriptor, descriptorShape, found, raw)
}

var handoffRequest = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// Name returns "nixl".
func (Nixl) Name() string { return Name }

// Fields returns kv_transfer_params, the one member nixl writes.
func (Nixl) Fields() []string { return []string{fieldDescriptor} }

// HandoffMembers returns the paths of the members of kv_transfer_params
// the router writes on the prefill leg (R-LEG-1) and forwards from the
// descriptor on the decode leg (R-LEG-3): a decode engine's 4xx naming
// one of them refuses the handoff (behaviour.md R-FAIL-10).
func (Nixl) HandoffMembers() []string {
	return []string{
		fieldDescriptor + ".do_remote_decode",
		fieldDescriptor + ".do_remote_prefill",
		fieldDescriptor + ".remote_engine_id",
		fieldDescriptor + ".remote_request_id",
		fieldDescriptor + ".remote_block_ids",
		fieldDescriptor + ".remote_host",
		fieldDescriptor + ".remote_port",
		fieldDescriptor + ".tp_size",
	}
}

// CheckEngine accepts every role; a nixl engine has no bootstrap port.
func (Nixl) CheckEngine(_ connector.Role, bootstrapPort int) (field, problem string) {
	return connector.NoBootstrapPort(Name, bootstrapPort)
}

// HandoffRequest returns the R-LEG-1 transfer parameters shown in the
// package doc. The returned slice is shared: callers must not modify it.
func (Nixl) HandoffRequest() []byte { return handoffRequest }

// Start runs a nixl attempt (behaviour.md §0, §2, §3): Prefill (the
// handoff asked for and its descriptor validated), then Decode (the
// handoff checked, the decode stream opened with the descriptor). A
// same-worker attempt (one engine of role both for both legs) sends no
// transfer parameters on either leg (R-LEG-4).
func (n Nixl) Start(ctx context.Context, legs connector.Legs) (connector.Run, error) {
	res, err := n.Prefill(ctx, legs)
	r := &run{legs: legs}
	if err != nil {
		var rej *connector.RejectError
		if errors.As(err, &rej) && rej.Reason != connector.ReasonMissingDescriptor {
			// The producer may hold blocks for a descriptor nobody can
			// use: make the stranded KV visible (R-OWN-6). Without a
			// descriptor there is no handoff to abandon.
			r.rejected = true
			return r, err
		}
		return nil, err
	}
	r.result = res
	if err := n.Decode(ctx, legs, res); err != nil {
		return r, err
	}
	return r, nil
}

// Prefill runs the prefill leg of legs' attempt (R-LEG-1, R-LEG-1a,
// R-LEG-4) and binds the descriptor the producer returned to it
// (R-LEG-2): for a crossed attempt it asks for a handoff and validates
// the descriptor (R-DESC-0…2, Validate). The errors are the leg's engine
// faults or a *connector.RejectError.
func (n Nixl) Prefill(ctx context.Context, legs connector.Legs) (*connector.PrefillResult, error) {
	p, d := legs.Producer(), legs.Consumer()
	req := legs.Request()
	same := p.ID == d.ID
	var kv []byte
	if !same {
		kv = handoffRequest
	}
	body := req.AppendPrefillBody(make([]byte, 0, req.Size()+len(kv)+96), kv)
	legs.Begin(connector.StepPrefill, connector.StepDetail{})
	ans, err := legs.Prefill(ctx, body)
	legs.PrefillEnded(nil)
	if err != nil {
		legs.End(connector.StepPrefill, err)
		return nil, err
	}
	meta := connector.PrefillResult{
		ProducerID:  p.ID,
		ProducerURL: p.URL,
		Endpoint:    req.Endpoint,
		RequestID:   legs.BackendRequestID(),
		Connector:   Name,
		Started:     ans.Started,
		Completed:   ans.Completed,
	}
	if same {
		legs.End(connector.StepPrefill, nil)
		return connector.NewPrefillResult(meta, nil), nil
	}
	h, err := n.Validate(ans.KVTransferParams)
	if err != nil {
		legs.End(connector.StepPrefill, err)
		return nil, err
	}
	meta.Handoff = h
	legs.End(connector.StepPrefill, nil)
	return connector.NewPrefillResult(meta, ans.KVTransferParams), nil
}

// Decode checks result's handoff (CheckHandoff) and opens the decode leg
// of legs' attempt with its descriptor byte for byte (R-LEG-3, R-DESC-5,
// R-LEG-5). The errors are the handoff check's or the leg's.
func (n Nixl) Decode(ctx context.Context, legs connector.Legs, result *connector.PrefillResult) error {
	detail := connector.StepDetail{}
	if result != nil {
		detail = connector.StepDetail{Connector: result.Connector, HandoffAge: result.Age(time.Now())}
	}
	legs.Begin(connector.StepHandoffCheck, detail)
	if err := n.CheckHandoff(legs, result, time.Now()); err != nil {
		legs.End(connector.StepHandoffCheck, err)
		return err
	}
	legs.End(connector.StepHandoffCheck, nil)
	req := legs.Request()
	var kv []byte
	if legs.Producer().ID != legs.Consumer().ID {
		kv = result.AppendDescriptor(nil)
	}
	body := req.AppendDecodeBody(make([]byte, 0, req.Size()+len(kv)+96), kv)
	legs.Begin(connector.StepDecode, connector.StepDetail{})
	return legs.Decode(ctx, body)
}

// CheckHandoff applies the checks made before any decode HTTP request
// (R-DESC-0, R-DESC-3, R-DESC-4, R-OWN-2): a descriptor present for a
// crossed attempt, the consumer of the same connector, the same endpoint,
// and an age within handoff.max_age_s. It returns a
// *connector.RejectError, the Legs.Expired failure, or nil when the
// handoff may be consumed.
func (Nixl) CheckHandoff(legs connector.Legs, result *connector.PrefillResult, now time.Time) error {
	if result == nil {
		return missingDescriptor("", nil)
	}
	p, d := legs.Producer(), legs.Consumer()
	if p.ID != d.ID {
		if !result.HasDescriptor() {
			return missingDescriptor("", nil)
		}
		if result.Connector != d.Connector {
			return &connector.RejectError{Reason: connector.ReasonConnectorMismatch,
				Detail: "producer " + result.Connector + ", consumer " + d.Connector, Field: "fleet[].connector",
				Expected: "the producer's connector " + result.Connector, Found: "consumer " + d.ID + " of connector " + d.Connector}
		}
	}
	if ep := legs.Request().Endpoint; result.Endpoint != ep {
		return &connector.RejectError{Reason: connector.ReasonEndpointMismatch,
			Detail: "prefill " + result.Endpoint + ", decode " + ep}
	}
	if max := legs.HandoffMaxAge(); max > 0 {
		if age := result.Age(now); age > max {
			return legs.Expired(age)
		}
	}
	return nil
}

// run is one nixl attempt after its prefill leg.
type run struct {
	legs     connector.Legs
	result   *connector.PrefillResult // nil once consumed (committed) or abandoned
	rejected bool                     // a descriptor came back and was rejected
	ttft     time.Time
}

// Blame returns err: a nixl decode fails on its own.
func (r *run) Blame(err error) error { return err }

// Commit consumes the handoff: the decode produced output.
func (r *run) Commit() error {
	r.take()
	return nil
}

func (r *run) take() {
	if r.result != nil {
		r.ttft = r.result.Completed
		r.result = nil
	}
}

// Abandon releases the descriptor's blocks at the producer (Release,
// bounded to one second) and reports the handoff; a rejected descriptor
// is reported without a release (nobody can use it).
func (r *run) Abandon(reason string) (connector.Abandoned, bool) {
	if r.rejected {
		r.rejected = false
		return connector.Abandoned{ProducerID: r.legs.Producer().ID, Reason: reason}, true
	}
	res := r.result
	r.take()
	if res == nil || !res.HasDescriptor() {
		return connector.Abandoned{}, false
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	released, err := Nixl{}.Release(ctx, r.legs.HTTPClient(), r.legs.Producer().URL, res.AppendDescriptor(nil))
	cancel()
	return connector.Abandoned{ProducerID: res.ProducerID, Connector: res.Connector, Reason: reason,
		Age: res.Age(time.Now()), Released: released, ReleaseErr: err}, true
}

// Finish returns when the prefill leg completed: a nixl prefill is over
// before the decode starts.
func (r *run) Finish(time.Duration) (time.Time, error) {
	r.take()
	return r.ttft, nil
}

// Validate applies R-DESC-0 (missing, null or empty descriptor), R-DESC-3's
// shape check (an object carrying none of nixl's fields, or
// do_remote_prefill not true), R-DESC-1 (remote_engine_id missing, null,
// empty or not a string) and R-DESC-2 (remote_block_ids not a non-empty
// array of non-negative integers, nor a non-empty array of such arrays).
// It returns a *RejectError on failure.
func (Nixl) Validate(descriptor []byte) (connector.Handoff, error) {
	d := bytes.TrimSpace(descriptor)
	if len(d) == 0 || string(d) == "null" {
		return connector.Handoff{}, missingDescriptor("", d)
	}
	if d[0] != '{' {
		return connector.Handoff{}, connector.RejectField(connector.ReasonConnectorMismatch, fieldDescriptor, "a JSON object", "", d)
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
		return connector.Handoff{}, connector.RejectField(connector.ReasonConnectorMismatch, fieldDescriptor,
			"a JSON object", "invalid JSON", d)
	case members == 0:
		return connector.Handoff{}, missingDescriptor("an empty object", d)
	case !nixlShaped:
		return connector.Handoff{}, connector.RejectField(connector.ReasonConnectorMismatch, fieldDescriptor,
			"a nixl descriptor (do_remote_prefill, remote_engine_id, remote_block_ids)", "an object with none of them", d)
	case hasDoRemotePrefill && string(doRemotePrefill) != "true":
		return connector.Handoff{}, connector.RejectField(connector.ReasonConnectorMismatch, fieldDescriptor+".do_remote_prefill",
			"true", "", doRemotePrefill)
	}
	var h connector.Handoff
	const engineShape = "a non-empty JSON string"
	switch {
	case !hasEngine:
		return connector.Handoff{}, connector.RejectField(connector.ReasonMissingIdentity, fieldDescriptor+".remote_engine_id", engineShape, "", nil)
	case len(engine) < 3 || engine[0] != '"':
		return connector.Handoff{}, connector.RejectField(connector.ReasonMissingIdentity, fieldDescriptor+".remote_engine_id", engineShape, "", engine)
	}
	if err := json.Unmarshal(engine, &h.EngineID); err != nil || h.EngineID == "" {
		return connector.Handoff{}, connector.RejectField(connector.ReasonMissingIdentity, fieldDescriptor+".remote_engine_id", engineShape, "an invalid or empty string", engine)
	}
	n, found := countBlockIDs(blocks)
	if found != "" {
		return connector.Handoff{}, connector.RejectField(connector.ReasonMalformedBlocks, fieldDescriptor+".remote_block_ids",
			"a non-empty JSON array of non-negative integers, or a non-empty array of such arrays", found, blocks)
	}
	h.Blocks = n
	if len(requestID) > 0 && requestID[0] == '"' {
		_ = json.Unmarshal(requestID, &h.RequestID) // opaque when not a string
	}
	return h, nil
}

// countBlockIDs checks R-DESC-2 and returns the number of block ids: a
// non-empty array of non-negative integers, or a non-empty array of such
// arrays (KV-cache groups); nothing else. found is "" when raw fits, else
// what broke the shape (e.g. "an array holding a string").
func countBlockIDs(raw []byte) (n int, found string) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || raw[0] != '[' {
		return 0, connector.JSONType(raw)
	}
	total, elems := 0, 0
	nested := false
	found = ""
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
					found = "an array of arrays holding " + blockIDType(id)
					return false
				}
				return true
			})
			switch {
			case found != "":
			case !ok:
				found = "an array holding invalid JSON"
			case inner == 0:
				found = "an array holding an empty array"
			}
			total += inner
		case !nested && isBlockID(e):
			total++
		case nested:
			found = "an array mixing arrays and " + blockIDType(e)
		case e[0] == '[':
			found = "an array mixing block ids and arrays"
		default:
			found = "an array holding " + blockIDType(e)
		}
		return found == ""
	})
	switch {
	case found != "":
		return 0, found
	case !valid:
		return 0, "invalid JSON"
	case elems == 0:
		return 0, "an empty array"
	}
	return total, ""
}

// blockIDType says what a block id that is not one is: "a string", "a
// negative number", "a fraction", "an out-of-range number", "null", ….
func blockIDType(raw []byte) string {
	switch t := connector.JSONType(raw); t {
	case "number":
		switch {
		case isBlockID(raw):
			return "a number"
		case raw[0] == '-':
			return "a negative number"
		case bytes.ContainsAny(raw, ".eE"):
			return "a fraction or exponent"
		}
		return "an out-of-range number"
	case "null":
		return "null"
	case "array", "object":
		return "an " + t
	default:
		return "a " + t
	}
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
