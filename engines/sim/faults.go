package sim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
)

// Fault kinds (Fault.Kind). Each imitates an engine failure the router
// must handle (behaviour.md §5, §6, R-DESC-0…3, R-CHAOS-1).
const (
	// FaultHeaderDelay sleeps DelayMS before any response header is
	// written (and before a decode leg pulls its KV blocks).
	FaultHeaderDelay = "header-delay"
	// FaultFirstTokenDelay sends headers and the role chunk promptly, then
	// waits DelayMS before the first token. With IntervalMS > 0 it sends a
	// metadata chunk every IntervalMS meanwhile, alternating an SSE comment
	// ": keep-alive" and an empty-content delta. Non-streaming: DelayMS
	// is added before the response.
	FaultFirstTokenDelay = "first-token-delay"
	// FaultSilence stops writing after AfterTokens tokens, holds the
	// connection for DelayMS (0 = until the client goes away) and then
	// ends the stream without [DONE]; with IntervalMS > 0 it sends SSE
	// keep-alive comments every IntervalMS meanwhile. Non-streaming: no
	// response is written and the connection is broken after the hold.
	FaultSilence = "silence"
	// FaultClose ends the response cleanly after AfterTokens tokens,
	// without [DONE]. Non-streaming: the body is cut in half under a
	// Content-Length announcing all of it.
	FaultClose = "close"
	// FaultAbort breaks the connection abruptly after AfterTokens tokens
	// (panic(http.ErrAbortHandler)).
	FaultAbort = "abort"
	// FaultDoneBeforeToken sends the role chunk, then data: [DONE].
	// Streaming requests only.
	FaultDoneBeforeToken = "done-before-token"
	// FaultImmediateStop sends the role chunk, a chunk with empty content
	// and finish_reason "stop", the usage chunk when asked, then [DONE]: a
	// legal empty completion. Non-streaming: an empty completion.
	FaultImmediateStop = "immediate-stop"
	// FaultErrorObject sends, after AfterTokens tokens, one frame
	// data: {"error":{…,"code":Status}} (Status defaults to 500 and may be
	// a code that is no HTTP status) and then data: [DONE], as vLLM does.
	// Non-streaming: an HTTP Status error (500 when Status is no HTTP
	// status).
	FaultErrorObject = "error-object"
	// FaultStatus answers HTTP Status (default 500) with a vLLM error body
	// carrying Message, and a Retry-After header of RetryAfterS seconds
	// when RetryAfterS > 0 (backpressure, e.g. status 503).
	FaultStatus = "status"
	// FaultTrickle adds DelayMS between tokens.
	FaultTrickle = "trickle"
	// FaultNoDescriptor makes a prefill leg return "kv_transfer_params":
	// null and hold no blocks (R-DESC-0).
	FaultNoDescriptor = "no-descriptor"
	// FaultDropEngineID removes remote_engine_id from the descriptor
	// (R-DESC-1). The blocks are still held.
	FaultDropEngineID = "drop-engine-id"
	// FaultGarbleBlockIDs replaces remote_block_ids with strings, e.g.
	// ["17","x"] (R-DESC-2). The blocks are still held.
	FaultGarbleBlockIDs = "garble-block-ids"
	// FaultChangeConnectorShape replaces the descriptor with an
	// LMCache-like {"lmcache_key":"…"} (R-DESC-3). The blocks are still
	// held.
	FaultChangeConnectorShape = "change-connector-shape"
	// FaultHealthStatus makes GET /health answer Status (default 503).
	FaultHealthStatus = "health-status"
	// FaultWrongModel makes GET /v1/models list Message as the model, or
	// "<model>-other" when Message is empty (R-BRK-6).
	FaultWrongModel = "wrong-model"
	// FaultRoomUnserved makes an sglang prefill answer as if it succeeded
	// but never serve its rooms' KV on the bootstrap server: the decode
	// waits for it until its own KV timeout (R-DESC-7).
	FaultRoomUnserved = "room-unserved"
	// FaultKVRecompute makes a decode leg ignore its handoff (descriptor
	// or bootstrap room): it pulls no KV, computes the whole prompt itself
	// (PrefillPerToken per prompt token) and reports
	// usage.prompt_tokens_details.cached_tokens 0 — the silent recompute
	// the router detects (R-FAIL-8). A shared-storage consumer ignores the
	// shared store instead (a forced store miss): only its own prefix
	// cache counts, and it computes the rest.
	FaultKVRecompute = "kv-recompute"
	// FaultKVPullError makes a decode leg's KV pull fail: the decode
	// answers an error, as vLLM's kv_load_failure_policy=fail does (HTTP
	// Status, default 500, when not streaming; a 200 stream with one error
	// frame of code Status and [DONE] when streaming). On a shared-storage
	// consumer it is its load from the shared store that fails.
	FaultKVPullError = "kv-pull-error"
	// FaultDecodeRefusesHandoff makes a decode leg that carries a handoff
	// (a nixl descriptor in kv_transfer_params, or sglang bootstrap
	// fields) refuse it before any work: HTTP Status (default 400) in
	// vLLM's error shape, with Message or, by default, a message naming
	// the handoff field as llm-d's vLLM simulator's does — nixl:
	// "json: cannot unmarshal number into Go struct field
	// .kv_transfer_params.remote_block_ids of type string"; sglang: a
	// validation error of bootstrap_room (behaviour.md R-FAIL-10). A
	// request without a handoff (same-worker, shared-storage) is not hit.
	FaultDecodeRefusesHandoff = "decode-refuses-handoff"
)

// Default messages of FaultDecodeRefusesHandoff.
const (
	// RefusalMessageNixl is what llm-d's vLLM simulator answered a
	// router's descriptor with (block ids decoded as strings).
	RefusalMessageNixl = "json: cannot unmarshal number into Go struct field .kv_transfer_params.remote_block_ids of type string"
	// RefusalMessageSGLang is a pydantic validation error of the
	// bootstrap room, as a decode server that wants another type of it
	// would answer.
	RefusalMessageSGLang = "1 validation error for ChatCompletionRequest\nbootstrap_room\n  Input should be a valid string [type=string_type, input_type=int]"
)

// Fault phases (Fault.Phase). A request is a prefill leg when its
// kv_transfer_params.do_remote_decode is true, else it is a decode. With
// the sglang connector both engines of a pair receive the same body, so
// the phase is the engine's role. With the shared-storage connector no
// request says what it is either: every request of a prefill engine is a
// prefill, every request of a decode or both engine a decode.
//
// On an sglang prefill, a silence, close, abort or error-object fault with
// after_tokens 0 strikes during the prefill's forward pass, before its
// rooms are served (the decode never gets the KV: a prefill that fails
// after accepting the request, or hangs); with after_tokens ≥ 1 it strikes
// after the rooms were served (the KV arrived; only the prefill's answer
// fails).
const (
	PhaseAny     = "any"
	PhasePrefill = "prefill"
	PhaseDecode  = "decode"
)

// Fault is one armed misbehaviour. JSON: {"kind","phase","count",
// "after_tokens","delay_ms","interval_ms","status","message",
// "retry_after_s"}; see the
// Fault* kind constants for what each field means to each kind.
type Fault struct {
	// Kind is one of the Fault* constants.
	Kind string `json:"kind"`
	// Phase limits the fault to "prefill" legs, "decode" requests, or
	// "any" (the default, also for an empty Phase). GET /health and
	// GET /v1/models have no phase: their faults match any Phase.
	Phase string `json:"phase"`
	// Count is how many requests the fault hits before it disarms itself;
	// 0 hits until Disarm. A request counts only when the fault applies to
	// it (e.g. a descriptor fault counts only non-streaming prefill legs).
	// Server.Faults reports the remaining count.
	Count int `json:"count"`
	// AfterTokens is the number of tokens sent before a silence, close,
	// abort or error-object strikes. A stream with fewer tokens is struck
	// after its last token, before its finish chunk.
	AfterTokens int `json:"after_tokens"`
	// DelayMS is the delay or hold, in milliseconds.
	DelayMS int `json:"delay_ms"`
	// IntervalMS is the period of keep-alive metadata, in milliseconds.
	IntervalMS int `json:"interval_ms"`
	// Status is the HTTP status to answer (status, health-status), or the
	// code of the error frame (error-object: any positive integer; a
	// non-streaming request then gets HTTP 500 when it is not an HTTP
	// status).
	Status int `json:"status"`
	// Message is the error message (status, error-object) or the model
	// name (wrong-model).
	Message string `json:"message"`
	// RetryAfterS is, for status, the Retry-After header in seconds sent
	// with the answer; 0 sends none.
	RetryAfterS int `json:"retry_after_s"`
}

// faultKind indexes the per-request set of active faults.
type faultKind uint8

const (
	fkHeaderDelay faultKind = iota
	fkFirstTokenDelay
	fkSilence
	fkClose
	fkAbort
	fkDoneBeforeToken
	fkImmediateStop
	fkErrorObject
	fkStatus
	fkTrickle
	fkNoDescriptor
	fkDropEngineID
	fkGarbleBlockIDs
	fkChangeConnectorShape
	fkHealthStatus
	fkWrongModel
	fkRoomUnserved
	fkKVRecompute
	fkKVPullError
	fkDecodeRefusesHandoff
	numFaultKinds
)

func faultKindOf(kind string) (faultKind, bool) {
	switch kind {
	case FaultHeaderDelay:
		return fkHeaderDelay, true
	case FaultFirstTokenDelay:
		return fkFirstTokenDelay, true
	case FaultSilence:
		return fkSilence, true
	case FaultClose:
		return fkClose, true
	case FaultAbort:
		return fkAbort, true
	case FaultDoneBeforeToken:
		return fkDoneBeforeToken, true
	case FaultImmediateStop:
		return fkImmediateStop, true
	case FaultErrorObject:
		return fkErrorObject, true
	case FaultStatus:
		return fkStatus, true
	case FaultTrickle:
		return fkTrickle, true
	case FaultNoDescriptor:
		return fkNoDescriptor, true
	case FaultDropEngineID:
		return fkDropEngineID, true
	case FaultGarbleBlockIDs:
		return fkGarbleBlockIDs, true
	case FaultChangeConnectorShape:
		return fkChangeConnectorShape, true
	case FaultHealthStatus:
		return fkHealthStatus, true
	case FaultWrongModel:
		return fkWrongModel, true
	case FaultRoomUnserved:
		return fkRoomUnserved, true
	case FaultKVRecompute:
		return fkKVRecompute, true
	case FaultKVPullError:
		return fkKVPullError, true
	case FaultDecodeRefusesHandoff:
		return fkDecodeRefusesHandoff, true
	}
	return 0, false
}

// Validate reports whether f can be armed: a known kind, a known phase,
// no negative numbers, and a Status (when set) between 100 and 599 —
// except for error-object, whose Status is the frame's code and may be any
// positive integer.
func (f Fault) Validate() error {
	if _, ok := faultKindOf(f.Kind); !ok {
		return fmt.Errorf("unknown fault kind %q", f.Kind)
	}
	switch f.Phase {
	case "", PhaseAny, PhasePrefill, PhaseDecode:
	default:
		return fmt.Errorf("fault %s: unknown phase %q (want prefill, decode or any)", f.Kind, f.Phase)
	}
	if f.Count < 0 || f.AfterTokens < 0 || f.DelayMS < 0 || f.IntervalMS < 0 || f.RetryAfterS < 0 {
		return fmt.Errorf("fault %s: count, after_tokens, delay_ms, interval_ms and retry_after_s must not be negative", f.Kind)
	}
	if f.Status < 0 {
		return fmt.Errorf("fault %s: status must not be negative", f.Kind)
	}
	// An error object's code may be any integer (R-FAIL-4 maps a code that
	// is not an HTTP status to 502); the other kinds answer HTTP Status.
	if f.Kind != FaultErrorObject && f.Status != 0 && (f.Status < 100 || f.Status > 599) {
		return fmt.Errorf("fault %s: status %d is not an HTTP status", f.Kind, f.Status)
	}
	return nil
}

// ParseFaults reads one Fault JSON object or a JSON array of them (the
// body of POST /sim/faults and the value of `narwhal sim --fault`, the
// engine-side faults of R-CHAOS-1).
// Unknown fields are rejected, and every fault must pass Validate.
func ParseFaults(data []byte) ([]Fault, error) {
	data = bytes.TrimSpace(data)
	if len(data) == 0 {
		return nil, errors.New("empty fault: want a JSON object or array")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var faults []Fault
	if data[0] == '[' {
		if err := dec.Decode(&faults); err != nil {
			return nil, fmt.Errorf("invalid faults: %v", err)
		}
	} else {
		var f Fault
		if err := dec.Decode(&f); err != nil {
			return nil, fmt.Errorf("invalid fault: %v", err)
		}
		faults = append(faults, f)
	}
	if dec.More() {
		return nil, errors.New("invalid fault: trailing data after the JSON value")
	}
	for _, f := range faults {
		if err := f.Validate(); err != nil {
			return nil, err
		}
	}
	return faults, nil
}

// faultTarget is what a request is, for deciding which faults apply.
type faultTarget uint8

const (
	targetInference faultTarget = iota
	targetHealth
	targetModels
)

// appliesTo reports whether a fault of kind k can act on a request;
// handoff is whether it is a decode leg that carries a handoff.
func (k faultKind) appliesTo(t faultTarget, prefillLeg, stream, handoff bool) bool {
	switch k {
	case fkHealthStatus:
		return t == targetHealth
	case fkWrongModel:
		return t == targetModels
	}
	if t != targetInference {
		return false
	}
	switch k {
	case fkNoDescriptor, fkDropEngineID, fkGarbleBlockIDs, fkChangeConnectorShape:
		return prefillLeg && !stream
	case fkDoneBeforeToken:
		return stream
	case fkRoomUnserved:
		return prefillLeg
	case fkKVRecompute, fkKVPullError:
		return !prefillLeg
	case fkDecodeRefusesHandoff:
		return handoff
	}
	return true
}

// armedFault is a Fault with its remaining hit count (0 = unlimited).
type armedFault struct {
	fault     Fault
	kind      faultKind
	remaining int
}

// faultSet holds the armed faults of one Server.
type faultSet struct {
	armed atomic.Int32 // len(list), read without the lock on the hot path
	mu    sync.Mutex
	list  []armedFault
}

// statusOr returns the fault's Status, or def when it is unset (0).
func (f *Fault) statusOr(def int) int {
	if f.Status == 0 {
		return def
	}
	return f.Status
}

// messageOr returns the fault's Message, or def when it is unset.
func (f *Fault) messageOr(def string) string {
	if f.Message == "" {
		return def
	}
	return f.Message
}

// activeFaults is the set of faults striking one request: at most one per
// kind, the earliest armed.
type activeFaults struct {
	has    uint32
	faults [numFaultKinds]Fault
}

func (a *activeFaults) get(k faultKind) (*Fault, bool) {
	if a.has&(1<<k) == 0 {
		return nil, false
	}
	return &a.faults[k], true
}

func (fs *faultSet) arm(f Fault) {
	k, ok := faultKindOf(f.Kind)
	if !ok {
		return
	}
	fs.mu.Lock()
	fs.list = append(fs.list, armedFault{fault: f, kind: k, remaining: f.Count})
	fs.armed.Store(int32(len(fs.list)))
	fs.mu.Unlock()
}

func (fs *faultSet) disarm() {
	fs.mu.Lock()
	fs.list = nil
	fs.armed.Store(0)
	fs.mu.Unlock()
}

func (fs *faultSet) snapshot() []Fault {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	out := make([]Fault, 0, len(fs.list))
	for _, a := range fs.list {
		f := a.fault
		f.Count = a.remaining
		out = append(out, f)
	}
	return out
}

// take selects the faults that strike a request into dst (reset first),
// spending one hit of each counted fault it selects; handoff is whether
// the request is a decode leg carrying a handoff.
func (fs *faultSet) take(dst *activeFaults, t faultTarget, phase string, prefillLeg, stream, handoff bool) {
	dst.has = 0
	if fs.armed.Load() == 0 {
		return
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	kept := fs.list[:0]
	for _, a := range fs.list {
		hit := dst.has&(1<<a.kind) == 0 &&
			a.kind.appliesTo(t, prefillLeg, stream, handoff) &&
			(t != targetInference || a.fault.Phase == "" || a.fault.Phase == PhaseAny || a.fault.Phase == phase)
		if hit {
			dst.has |= 1 << a.kind
			dst.faults[a.kind] = a.fault
			if a.remaining > 0 {
				a.remaining--
				if a.remaining == 0 {
					continue // spent: disarmed
				}
			}
		}
		kept = append(kept, a)
	}
	clear(fs.list[len(kept):])
	fs.list = kept
	fs.armed.Store(int32(len(kept)))
}
