// Package connector defines what a connector is: one KV transfer
// mechanism between a producer and a consumer engine, which owns how an
// attempt runs — which legs, in what order or at once, the bodies they
// are sent, what is verified, and whom each failure blames (behaviour.md
// §2, §3).
//
// Each connector is a package of its own below this one (nixl, sglang,
// sharedstorage) that implements Connector over the engine client's legs
// (Legs) and registers itself in its init function; the list of the
// connectors Narwhal ships is package engines/connector/all, one import
// line each. docs/architecture.md, "How to add a connector", is the walk
// through.
package connector

import (
	"context"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/narwhalmesh/narwhal/schemas"
)

// Connector is one KV transfer mechanism. Implementations are stateless and
// safe for concurrent use; the state of one attempt lives in its Run.
type Connector interface {
	// Name is the connector's configuration name, e.g. "nixl".
	Name() string
	// Fields lists the request body members the connector writes for a
	// handoff (nixl: kv_transfer_params; sglang: bootstrap_host,
	// bootstrap_port, bootstrap_room). A client never sends them: the
	// front end removes them from every request (behaviour.md R-API-5,
	// R-DESC-7).
	Fields() []string
	// CheckEngine judges one engine's connector settings: its role and
	// its bootstrap port (fleet entry bootstrap_port, 0 when absent). It
	// returns "" when they fit, else the fleet entry field at fault
	// ("role" or "bootstrap_port") and what is wrong.
	CheckEngine(role Role, bootstrapPort int) (field, problem string)
	// Start runs one attempt of legs' request on its producer (an engine
	// of this connector) and consumer, up to the moment the decode
	// stream is open (Legs.Decode returned nil). It refuses a consumer of
	// another connector before any leg starts.
	//
	// On success it returns the running attempt and a nil error. On
	// failure the error is the attempt's: an error a Legs method returned
	// (an engine fault), a *RejectError (a descriptor or a pairing the
	// connector refuses; blamed on the producer), or an error of
	// Legs.Failure. The Run is then non-nil whenever the attempt left
	// something to end (a handoff to abandon, a leg still running): the
	// caller calls its Abandon, then Finish.
	Start(ctx context.Context, legs Legs) (Run, error)
}

// Run is one running attempt, owned by the goroutine that started it.
type Run interface {
	// Blame returns the error that ends the attempt when its decode
	// stream failed with err before the first generated output: err
	// itself, or the failure of another leg that caused it (an SGLang
	// prefill that failed first).
	Blame(err error) error
	// Commit is called at the decode's first generated output. A non-nil
	// error means the attempt cannot be committed (the prefill had failed
	// first) and is its failure.
	Commit() error
	// Abandon ends an attempt that failed before its first output with
	// reason (an abandoned handoff's reason, e.g. "decode_failed"): its
	// legs are stopped and a handoff the producer still holds is released
	// where the connector can (behaviour.md R-OWN-6), bounded to one
	// second. It returns the handoff left unconsumed, to be reported, and
	// false when none was. Idempotent.
	Abandon(reason string) (Abandoned, bool)
	// Finish ends the attempt's legs when the request ends: a prefill leg
	// still running is waited for at most wait (0: cancelled at once),
	// then cancelled. It returns when the prefill leg completed (zero if
	// it did not), where ttft_s ends (behaviour.md R-TIME-1), and the
	// prefill's failure when it failed (nil for a leg ended by Finish or
	// by the request). Idempotent; nothing of the attempt outlives it
	// (behaviour.md R-OWN-1).
	Finish(wait time.Duration) (prefillCompleted time.Time, prefillErr error)
}

// Abandoned is a handoff an attempt left unconsumed (behaviour.md
// R-OWN-6), as its handoff event reports it.
type Abandoned struct {
	// ProducerID is the engine that holds (or held) the KV blocks.
	ProducerID string
	// Connector names the connector in the event; empty where no
	// descriptor was accepted.
	Connector string
	// Reason is why the handoff was not consumed, e.g. "decode_failed".
	Reason string
	// Age is the handoff's age when it was abandoned.
	Age time.Duration
	// Released reports whether the producer freed the blocks early.
	Released bool
	// ReleaseErr is the error of a release that was tried and failed.
	ReleaseErr error
}

// Engine is what a connector knows of one engine of an attempt.
type Engine struct {
	// ID is the engine's fleet id.
	ID string
	// URL is its base URL, e.g. "http://10.0.0.11:8000".
	URL string
	// Role is its fleet role.
	Role Role
	// Connector is its connector's name.
	Connector string
	// BootstrapPort is its bootstrap server's port (SGLang), 0 when none.
	BootstrapPort int
}

// Step is a step of an attempt that the caller observes (the router
// traces each as a span).
type Step int

// The steps of an attempt.
const (
	// StepPrefill is the prefill leg.
	StepPrefill Step = iota
	// StepHandoffCheck is the checks of a handoff before its decode leg.
	StepHandoffCheck
	// StepDecode is the decode leg. A connector begins it and never ends
	// it: it stays open until the attempt fails or the request ends, and
	// the caller ends it.
	StepDecode
	// StepLegs is both legs of an attempt whose legs run at once; like
	// StepDecode it is begun by the connector and ended by the caller.
	StepLegs
)

// StepDetail is what a step's observer may show of it.
type StepDetail struct {
	// Connector is the handoff's connector name (StepHandoffCheck).
	Connector string
	// HandoffAge is the handoff's age at the check (StepHandoffCheck).
	HandoffAge time.Duration
}

// PrefillAnswer is a prefill leg's answer.
type PrefillAnswer struct {
	// KVTransferParams is the answer's kv_transfer_params member, raw
	// JSON with its white space trimmed; nil when the answer has none
	// (or was a stream).
	KVTransferParams []byte
	// Usage is the answer's usage as the producer reported it (a JSON
	// completion's; zero for a stream).
	Usage PrefillUsage
	// Started is when the leg's HTTP request started (handoff age counts
	// from here, behaviour.md R-OWN-2).
	Started time.Time
	// Completed is when its answer was read.
	Completed time.Time
}

// PrefillUsage is the usage member of a producer's prefill answer.
type PrefillUsage struct {
	// Present reports a usage object; PromptTokens is its prompt_tokens
	// (0 when absent or not a non-negative integer).
	Present      bool
	PromptTokens int
	// Cached reports prompt_tokens_details.cached_tokens as a
	// non-negative integer (vLLM with --enable-prompt-tokens-details,
	// SGLang with --enable-cache-report); CachedTokens is its value.
	Cached       bool
	CachedTokens int
}

// Legs is the engine client's side of one attempt: the legs a connector
// may run on the attempt's producer and consumer, and the steps it tells
// the caller about. The engine client implements it for each attempt; a
// Run may call PrefillEnded and the prefill methods from a goroutine of
// its own, the others from the goroutine that called Start.
type Legs interface {
	// Request is the client's parsed request.
	Request() *schemas.Request
	// BackendRequestID is the attempt's backend request id, sent as
	// X-Request-Id on both legs (behaviour.md R-OWN-4).
	BackendRequestID() string
	// Producer and Consumer are the attempt's two engines (the same
	// engine for a same-worker attempt, behaviour.md R-LEG-4).
	Producer() Engine
	Consumer() Engine
	// Begin marks the start of step: the legs sent until its End carry
	// the step's trace context.
	Begin(step Step, detail StepDetail)
	// End marks the end of step with the error it failed with (nil when
	// it succeeded).
	End(step Step, err error)
	// Prefill sends body to the producer as a one-token, non-streaming
	// prefill leg, bounded by engine.prefill_timeout_s and ctx, and reads
	// its JSON answer (a completion with choices). Errors are engine
	// faults (connect_error, prefill_timeout, prefill_status,
	// prefill_response, client_fault, overload, request_timeout,
	// client_disconnected).
	Prefill(ctx context.Context, body []byte) (PrefillAnswer, error)
	// PrefillToEnd sends body to the producer and reads its answer to its
	// end, a JSON completion or an event stream to [DONE], bounded by
	// engine.prefill_timeout_s and ctx: a non-2xx status, an error
	// object, a stream ended early or anything that is not JSON is its
	// failure (an engine fault). The answer's content is discarded.
	// Cancellations of ctx that the request did not cause are reported
	// as such (the caller ignores them).
	PrefillToEnd(ctx context.Context, body []byte) (PrefillAnswer, error)
	// PrefillEnded reports that the prefill leg is over: the producer's
	// prefill slot is released and the leg's duration observed. late is
	// a failure of the leg that came after the attempt committed (it is
	// recorded; the client's stream goes on), else nil. Once per attempt,
	// from any goroutine.
	PrefillEnded(late error)
	// Decode opens body on the consumer as the attempt's decode stream,
	// with the first-token budget already running (behaviour.md
	// R-TMO-1), and returns once the response headers arrived with a 2xx
	// status. ctx may be cancelled by the connector (a prefill that
	// failed first); the stream is the caller's to read and close.
	// Errors are engine faults of the consumer.
	Decode(ctx context.Context, body []byte) error
	// HTTPClient is the client for calls to the producer outside its
	// legs (a release), with its credential.
	HTTPClient() *http.Client
	// HandoffMaxAge is handoff.max_age_s; zero means no limit.
	HandoffMaxAge() time.Duration
	// Expired returns the handoff_expired failure of a handoff of age
	// (behaviour.md R-OWN-2, 504 "handoff expired").
	Expired(age time.Duration) error
	// Failure returns a failure of the producer's prefill leg that the
	// connector found itself (message as the client reads it), e.g. a
	// producer without a bootstrap port: prefill_response, 502.
	Failure(message string) error
}

// Handoff is the identity a validated descriptor names.
type Handoff struct {
	// EngineID is the producer's engine identity inside the descriptor
	// (nixl: remote_engine_id).
	EngineID string
	// RequestID is the producer-side request id when the descriptor has
	// one (nixl: remote_request_id; older engines omit it).
	RequestID string
	// Blocks is the number of KV block ids the descriptor lists (summed
	// over KV-cache groups).
	Blocks int
}

// Rejection reasons, the suffixes of behaviour.md R-DESC-6's messages.
const (
	ReasonMissingDescriptor = "missing descriptor"
	ReasonMissingIdentity   = "missing engine identity"
	ReasonMalformedBlocks   = "malformed block ids"
	ReasonConnectorMismatch = "connector mismatch"
	ReasonEndpointMismatch  = "endpoint mismatch"
)

// RejectError is a rejected handoff descriptor or pairing (behaviour.md
// R-DESC-6, R-FAIL-10). Its Error text is the client-facing message
// "handoff descriptor rejected: <reason>" followed, where useful, by the
// field and a detail after " (" — never the value that was found (the
// client must not see the producer's values); Report is the operator's
// text with the expected shape, the JSON type found and a bounded,
// escaped excerpt of the value.
type RejectError struct {
	// Reason is one of the Reason* constants.
	Reason string
	// Detail says what exactly was wrong; it may be empty. It holds
	// nothing of the producer's values.
	Detail string
	// Field is the JSON path of the member at fault, e.g.
	// "kv_transfer_params.remote_block_ids"; empty when the rejection is
	// about no one member (a pairing).
	Field string
	// Expected is the shape Field should have, e.g. "a non-empty JSON
	// array of non-negative integers".
	Expected string
	// Found is what Field held: its JSON type (JSONType: "absent",
	// "string", …), or more exactly what broke the shape (e.g. "an array
	// holding a string").
	Found string
	// Excerpt is Excerpt(value, ValueExcerptBytes) of the value found;
	// empty when there was none. It appears in Report, never in Error.
	Excerpt string
}

// Error returns "handoff descriptor rejected: <reason>", with the field
// and the detail in parentheses when there are any.
func (e *RejectError) Error() string {
	s := "handoff descriptor rejected: " + e.Reason
	switch {
	case e.Field != "" && e.Detail != "":
		s += " (" + e.Field + ": " + e.Detail + ")"
	case e.Field != "":
		s += " (" + e.Field + ")"
	case e.Detail != "":
		s += " (" + e.Detail + ")"
	}
	return s
}

// Report returns what the log, the failure event and preflight show of
// the rejection (behaviour.md R-FAIL-10): "<field>: expected <shape>,
// found <type>: <excerpt>", as much of it as is known; "" when the
// rejection names no field.
func (e *RejectError) Report() string {
	if e.Field == "" {
		return ""
	}
	s := e.Field
	if e.Expected != "" {
		s += ": expected " + e.Expected
	}
	if e.Found != "" {
		s += ", found " + e.Found
	}
	if e.Excerpt != "" {
		s += ": " + e.Excerpt
	}
	return s
}

// Reject returns a *RejectError with reason and a detail formatted from
// format and args (empty format: no detail).
func Reject(reason, format string, args ...any) *RejectError {
	d := ""
	if format != "" {
		d = fmt.Sprintf(format, args...)
	}
	return &RejectError{Reason: reason, Detail: d}
}

// RejectField returns a *RejectError with reason about the member at
// path field: the shape expected, and what raw (the member's raw JSON,
// nil when absent) held — its JSON type, or found when not empty — with
// a bounded, escaped excerpt of raw (Excerpt, ValueExcerptBytes).
func RejectField(reason, field, expected, found string, raw []byte) *RejectError {
	if found == "" {
		found = JSONType(raw)
	}
	e := &RejectError{Reason: reason, Field: field, Expected: expected, Found: found}
	if raw != nil {
		e.Excerpt = Excerpt(raw, ValueExcerptBytes)
	}
	return e
}

// Mismatch is the rejection of a pairing of producer and consumer of
// different connectors (behaviour.md R-DESC-3, R-DESC-7, R-DESC-8), or
// nil when they match.
func Mismatch(producer, consumer Engine) *RejectError {
	if producer.Connector == consumer.Connector {
		return nil
	}
	return &RejectError{Reason: ReasonConnectorMismatch, Detail: "producer " + producer.Connector + ", consumer " + consumer.Connector,
		Field: "fleet[].connector", Expected: "the producer's connector " + strconv.Quote(producer.Connector),
		Found: "consumer " + consumer.ID + " of connector " + strconv.Quote(consumer.Connector)}
}

var (
	registryMu sync.RWMutex
	registry   = map[string]Connector{}
)

// Register makes c available under c.Name(). It panics if the name is
// taken, as registering twice is a programming error. Each connector's
// package calls it from its init function.
func Register(c Connector) {
	registryMu.Lock()
	defer registryMu.Unlock()
	if _, dup := registry[c.Name()]; dup {
		panic("connector: Register called twice for " + c.Name())
	}
	registry[c.Name()] = c
}

// Lookup returns the connector registered as name, or an error naming the
// known ones.
func Lookup(name string) (Connector, error) {
	registryMu.RLock()
	c, ok := registry[name]
	registryMu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("connector: unknown connector %q (known: %v)", name, Names())
	}
	return c, nil
}

// Names lists the registered connectors, sorted.
func Names() []string {
	registryMu.RLock()
	defer registryMu.RUnlock()
	out := make([]string, 0, len(registry))
	for n := range registry {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// CheckEngine judges one engine's connector settings: the connector
// registered as name, its role and its bootstrap port (fleet entry
// bootstrap_port, 0 when absent). It returns "" when they fit together,
// else the fleet entry field at fault ("connector", "role" or
// "bootstrap_port") and what is wrong. A port outside 0…65535 is wrong
// for every connector; the rest is the connector's own rule
// (Connector.CheckEngine).
func CheckEngine(name string, role Role, bootstrapPort int) (field, problem string) {
	c, err := Lookup(name)
	if err != nil {
		return "connector", err.Error()
	}
	if bootstrapPort < 0 || bootstrapPort > 65535 {
		return "bootstrap_port", "must be a port number (1 to 65535)"
	}
	return c.CheckEngine(role, bootstrapPort)
}

// NoBootstrapPort is the bootstrap-port rule of a connector without a
// bootstrap server: an engine names none. It returns CheckEngine's
// field and problem for name's engines.
func NoBootstrapPort(name string, bootstrapPort int) (field, problem string) {
	if bootstrapPort != 0 {
		return "bootstrap_port", "only engines of a connector with a bootstrap server (sglang) have one, not " + name
	}
	return "", ""
}

// Descriptors is implemented by a connector whose producer returns a
// handoff descriptor that the decode leg carries (nixl): the two halves
// of its attempt, which the engine client's public calls
// engines.Client.Prefill and engines.Client.Decode run one at a time
// (behaviour.md §12), and the early release of an unconsumed descriptor.
type Descriptors interface {
	// Prefill runs the prefill leg and binds the descriptor to it.
	Prefill(ctx context.Context, legs Legs) (*PrefillResult, error)
	// Decode checks result's handoff and opens the decode leg with it.
	Decode(ctx context.Context, legs Legs, result *PrefillResult) error
	// CheckHandoff applies the checks Decode makes before any decode HTTP
	// request, at now; nil when result's handoff may be consumed.
	CheckHandoff(legs Legs, result *PrefillResult, now time.Time) error
	// Release frees an unconsumed descriptor's KV blocks at the producer
	// (behaviour.md R-OWN-6). It returns released=false with a nil error
	// when the producer has no way to release early; an error means the
	// release was tried and failed.
	Release(ctx context.Context, client *http.Client, producerURL string, descriptor []byte) (released bool, err error)
}
