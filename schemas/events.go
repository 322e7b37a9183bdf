package schemas

import (
	"time"
	"unicode/utf8"
)

// MaxFieldBytes is how many bytes of a client-supplied string (a model
// name, a request id, an API key's name) an event or a log line carries;
// BoundField cuts longer ones, so that no client can put unbounded bytes
// on the bus or in the logs.
const MaxFieldBytes = 256

// TruncatedMarker ends a string that BoundField cut.
const TruncatedMarker = "…[truncated]"

// BoundField returns s when it is at most MaxFieldBytes long, else its
// first MaxFieldBytes bytes (fewer, to end on a whole UTF-8 character)
// followed by TruncatedMarker. It allocates only when it cuts.
func BoundField(s string) string {
	if len(s) <= MaxFieldBytes {
		return s
	}
	n := MaxFieldBytes
	for n > MaxFieldBytes-utf8.UTFMax && n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + TruncatedMarker
}

// Event schema names, carried in every event's "schema" field (behaviour.md R-BUS-3).
// Each has a JSON Schema file in this folder, <name>.json (see SchemaFS),
// and is the Schema of one row of EventKinds.
const (
	SchemaRequest     = "narwhal.request.v1"
	SchemaFailure     = "narwhal.failure.v1"
	SchemaQuarantine  = "narwhal.quarantine.v1"
	SchemaHandoff     = "narwhal.handoff.v1"
	SchemaProbe       = "narwhal.probe.v1"
	SchemaEligibility = "narwhal.eligibility.v1"
	SchemaChaos       = "narwhal.chaos.v1"
	// SchemaKVRecomputed names the kv_recomputed event (R-FAIL-8).
	SchemaKVRecomputed = "narwhal.kv_recomputed.v1"
)

// SchemaPlacement names the JSON Schema of a value in KV bucket
// narwhal_placement (narwhal.placement.v1.json): an Eligibility that
// carries its writer's breaker_id and lease_term (behaviour.md R-BUS-2, R-BUS-9).
// It is not an event: the values keep "schema": SchemaEligibility.
const SchemaPlacement = "narwhal.placement.v1"

// Event kinds: the <kind> part of the subject narwhal.events.<kind>.<id>
// (behaviour.md R-BUS-1), each the Name of one row of EventKinds, which
// says who publishes it and where it is kept.
const (
	KindRequest     = "request"
	KindFailure     = "failure"
	KindQuarantine  = "quarantine"
	KindHandoff     = "handoff"
	KindProbe       = "probe"
	KindEligibility = "eligibility"
	KindChaos       = "chaos"
	// KindKVRecomputed: a decode engine recomputed the prompt instead of
	// loading the handed-off KV (R-FAIL-8).
	KindKVRecomputed = "kv_recomputed"
)

// Phases of an attempt, as they appear in events and metrics.
const (
	PhasePrefill = "prefill"
	PhaseDecode  = "decode"
)

// Envelope is the part every bus event shares (behaviour.md R-BUS-3). It is
// embedded in each event type; JSON field names are given in the tags.
type Envelope struct {
	// Schema is the event's versioned schema name, e.g. "narwhal.failure.v1".
	Schema string `json:"schema"`
	// ID is unique per event and is used as the JetStream message id, so a
	// re-published event is dropped as a duplicate.
	ID string `json:"id"`
	// At is when the event happened, UTC, encoded as RFC 3339 with
	// nanoseconds.
	At time.Time `json:"at"`
	// RouterID names the publishing router; empty for breaker events.
	RouterID string `json:"router_id,omitempty"`
	// BreakerID names the publishing breaker; empty for router events.
	BreakerID string `json:"breaker_id,omitempty"`
	// EngineID is the engine the event is about, the token after the kind
	// in its subject: the engine that faulted (failure), was quarantined
	// (quarantine), holds the abandoned KV (handoff: the producer), was
	// probed (probe), changed eligibility (eligibility) or fleet state
	// (fleet), or has the chaos fault (chaos). Request events have none
	// (docs/mesh.md).
	EngineID string `json:"engine_id,omitempty"`
	// RequestID is the client-facing request id (X-Request-Id), where the
	// event belongs to a request.
	RequestID string `json:"request_id,omitempty"`
}

// Event is implemented by every bus event type. Subject returns the full
// NATS subject narwhal.events.<kind>.<engine_id|router_id>, with a fifth
// token, the router's id, for a router's events about an engine
// (EventKind.Routed, behaviour.md R-BUS-11);
// Head returns the envelope so the publisher can fill ID and At.
type Event interface {
	Subject() string
	Head() *Envelope
}

// Head returns e itself; it lets each event type satisfy Event.
func (e *Envelope) Head() *Envelope { return e }

// RequestCompleted is published once per client request when it ends,
// whatever the outcome, on narwhal.events.request.<router_id>
// (schema narwhal.request.v1, behaviour.md R-BUS-1, R-TIME-1). It has no
// engine_id: it is about a request, whose engines are ProducerID and
// ConsumerID (the schema forbids engine_id).
type RequestCompleted struct {
	Envelope
	// Endpoint is the client's path, "/v1/chat/completions" or
	// "/v1/completions".
	Endpoint string `json:"endpoint"`
	// Model is the requested model.
	Model string `json:"model"`
	// Stream is whether the client asked for a stream.
	Stream bool `json:"stream"`
	// Status is the HTTP status the client got (200 even when a committed
	// stream later ended with a terminal error event; see ErrorKind).
	Status int `json:"status"`
	// ErrorKind is the fault kind that ended the request, empty on success.
	ErrorKind string `json:"error_kind,omitempty"`
	// ProducerID and ConsumerID are the engines of the last attempt.
	ProducerID string `json:"producer_id,omitempty"`
	ConsumerID string `json:"consumer_id,omitempty"`
	// KeyName is the name of the client's API key (auth.api_keys[].name,
	// behaviour.md R-API-9), never the key; empty (absent) on a router without
	// client authentication.
	KeyName string `json:"key_name,omitempty"`
	// Attempts is the number of attempts made (0 when the request was
	// rejected before placement).
	Attempts int `json:"attempts"`
	// TTFTSeconds is seconds from arrival until the producer HTTP leg
	// completed (R-TIME-1); null when no prefill completed.
	TTFTSeconds *float64 `json:"ttft_s"`
	// FirstByteSeconds is seconds from arrival until the first generated
	// decode output was observed (R-TIME-1); null when none was.
	FirstByteSeconds *float64 `json:"first_byte_s"`
	// DurationSeconds is seconds from arrival until the request ended.
	DurationSeconds float64 `json:"duration_s"`
	// PromptTokens and CompletionTokens are the decode engine's usage
	// (R-LEG-6); nil (absent) when it reported none, e.g. on a request
	// that failed before its stream ended: an unknown count is not 0.
	PromptTokens     *int `json:"prompt_tokens,omitempty"`
	CompletionTokens *int `json:"completion_tokens,omitempty"`
	// KVRecomputed is true when the decode engine recomputed the prompt
	// instead of loading the handed-off KV (R-FAIL-8; a kv_recomputed
	// event was published): the breaker does not take the request as
	// proof that the consumer is healthy.
	KVRecomputed bool `json:"kv_recomputed,omitempty"`
}

// Subject returns narwhal.events.request.<router_id>.
func (e *RequestCompleted) Subject() string {
	return EventSubjectPrefix + KindRequest + "." + e.RouterID
}

// Failure is one engine fault seen by a router on one leg of one attempt,
// on narwhal.events.failure.<engine_id>.<router_id> (schema
// narwhal.failure.v1). The
// breaker counts it towards ejection when Counts is true (behaviour.md R-BRK-2).
type Failure struct {
	Envelope
	// Phase is "prefill" or "decode".
	Phase string `json:"phase"`
	// Kind is the fault kind, e.g. "first_token_timeout" (docs/failures.md).
	Kind string `json:"kind"`
	// Status is the HTTP status the fault maps to for the client.
	Status int `json:"status"`
	// UpstreamStatus is the engine's HTTP status, 0 when none was received.
	UpstreamStatus int `json:"upstream_status,omitempty"`
	// Message is the client-facing message.
	Message string `json:"message"`
	// Timeout is whether the fault is timeout-shaped (504).
	Timeout bool `json:"timeout"`
	// Counts is whether the fault counts towards ejection.
	Counts bool `json:"counts"`
	// ProducerID and ConsumerID are the attempt's engines; for a decode
	// fault with ProducerID != ConsumerID the decode was crossed (R-BRK-4).
	ProducerID string `json:"producer_id,omitempty"`
	ConsumerID string `json:"consumer_id,omitempty"`
	// BackendRequestID is the attempt's X-Request-Id sent to the engines.
	BackendRequestID string `json:"backend_request_id,omitempty"`
	// Attempt is the 1-based attempt number within the client request.
	Attempt int `json:"attempt"`
	// Detail is what was wrong, never shown to the client (behaviour.md
	// R-FAIL-10): for descriptor_rejected the field, the shape expected
	// and a bounded, escaped excerpt of what was found; for
	// handoff_refused the engine's status and a bounded, escaped excerpt
	// of its error. Absent for other kinds.
	Detail string `json:"detail,omitempty"`
}

// Subject returns narwhal.events.failure.<engine_id>.<router_id>
// (behaviour.md R-BUS-11).
func (e *Failure) Subject() string {
	return EventSubjectPrefix + KindFailure + "." + e.EngineID + "." + e.RouterID
}

// Quarantine says a router excluded an engine from its placement for a
// while after a failed attempt, on
// narwhal.events.quarantine.<engine_id>.<router_id> (schema
// narwhal.quarantine.v1, behaviour.md R-QUAR-1). Other routers apply it
// on arrival.
type Quarantine struct {
	Envelope
	// DurationSeconds is how long the engine stays out, in seconds.
	DurationSeconds float64 `json:"duration_s"`
	// Until is when the quarantine ends (UTC).
	Until time.Time `json:"until"`
	// Reason is the fault kind that caused it.
	Reason string `json:"reason"`
}

// Subject returns narwhal.events.quarantine.<engine_id>.<router_id>
// (behaviour.md R-BUS-11).
func (e *Quarantine) Subject() string {
	return EventSubjectPrefix + KindQuarantine + "." + e.EngineID + "." + e.RouterID
}

// Handoff outcomes.
const (
	// HandoffAbandoned: the descriptor will not be consumed (client gone,
	// decode failed before pulling, retry, expiry) (behaviour.md R-OWN-6).
	HandoffAbandoned = "abandoned"
)

// Handoff reports the fate of one KV handoff, on
// narwhal.events.handoff.<engine_id>.<router_id> where engine_id is the
// producer (schema narwhal.handoff.v1, behaviour.md R-OWN-6).
type Handoff struct {
	Envelope
	// Outcome is "abandoned".
	Outcome string `json:"outcome"`
	// Reason says why, e.g. "client_disconnected", "decode_failed",
	// "handoff_expired", "descriptor_rejected".
	Reason string `json:"reason"`
	// ConsumerID is the engine the decode was placed on, if any.
	ConsumerID string `json:"consumer_id,omitempty"`
	// BackendRequestID is the attempt's backend request id.
	BackendRequestID string `json:"backend_request_id,omitempty"`
	// Connector is the KV connector, e.g. "nixl".
	Connector string `json:"connector"`
	// AgeSeconds is the handoff's age when it was abandoned, in seconds
	// since the producer HTTP leg started (R-OWN-2).
	AgeSeconds float64 `json:"age_s"`
	// Released is whether the blocks were released at the producer.
	Released bool `json:"released"`
}

// Subject returns narwhal.events.handoff.<engine_id>.<router_id>
// (behaviour.md R-BUS-11).
func (e *Handoff) Subject() string {
	return EventSubjectPrefix + KindHandoff + "." + e.EngineID + "." + e.RouterID
}

// KVRecomputed reports a decode engine that recomputed the prompt instead
// of loading the KV blocks its producer handed off (behaviour.md R-FAIL-8): its
// usage.prompt_tokens_details.cached_tokens was below half of its
// usage.prompt_tokens. On
// narwhal.events.kv_recomputed.<engine_id>.<router_id> where
// engine_id is the decode engine (the consumer); schema
// narwhal.kv_recomputed.v1.
type KVRecomputed struct {
	Envelope
	// ProducerID is the engine that ran the prefill and handed off.
	ProducerID string `json:"producer_id"`
	// Connector is the KV connector of the handoff, e.g. "nixl", "sglang".
	Connector string `json:"connector"`
	// BackendRequestID is the attempt's backend request id.
	BackendRequestID string `json:"backend_request_id,omitempty"`
	// PromptTokens is the decode engine's usage.prompt_tokens.
	PromptTokens int `json:"prompt_tokens"`
	// CachedTokens is its usage.prompt_tokens_details.cached_tokens.
	CachedTokens int `json:"cached_tokens"`
	// Counts is whether the recompute also counts towards the pair's
	// ejection streak (handoff.on_recompute: fail_pair; a failure event
	// of kind kv_recomputed is then published too).
	Counts bool `json:"counts"`
}

// Subject returns narwhal.events.kv_recomputed.<engine_id>.<router_id>
// (behaviour.md R-BUS-11).
func (e *KVRecomputed) Subject() string {
	return EventSubjectPrefix + KindKVRecomputed + "." + e.EngineID + "." + e.RouterID
}

// Probe outcomes, the values of Probe.Outcome (behaviour.md R-BRK-3…5).
const (
	// ProbeSuccess: both legs of the probe succeeded; the engine is
	// readmitted.
	ProbeSuccess = "success"
	// ProbeFailure: the probed engine's own health check, contract check or
	// leg failed; it stays ejected and its probe backoff grows.
	ProbeFailure = "failure"
	// ProbeInconclusive: the other engine's leg failed, no partner was
	// available, the bus was down or shutdown cut the probe; nothing
	// changes (R-BRK-5).
	ProbeInconclusive = "inconclusive"
)

// Probe reports one inference probe of an ejected engine, on
// narwhal.events.probe.<engine_id> (schema narwhal.probe.v1, behaviour.md R-BRK-3…5).
type Probe struct {
	Envelope
	// Outcome is "success", "failure" or "inconclusive".
	Outcome string `json:"outcome"`
	// Phase is the role probed: "prefill" or "decode".
	Phase string `json:"phase"`
	// ProducerID is the engine that ran the probe's prefill leg; for a
	// decode probe after a crossed-decode failure it is the original
	// producer (R-BRK-4).
	ProducerID string `json:"producer_id,omitempty"`
	// ConsumerID is the engine that ran the probe's decode leg.
	ConsumerID string `json:"consumer_id,omitempty"`
	// Message explains a failure or inconclusive outcome.
	Message string `json:"message,omitempty"`
}

// Subject returns narwhal.events.probe.<engine_id>.
func (e *Probe) Subject() string { return EventSubjectPrefix + KindProbe + "." + e.EngineID }

// Placement states, the values of Eligibility.State (behaviour.md R-BRK-1,
// R-BRK-8).
const (
	// StateEligible: routers may place on the engine (Eligible is true).
	StateEligible = "eligible"
	// StateEjected: the breaker ejected the engine; routers do not place on
	// it until a probe readmits it (Eligible is false).
	StateEjected = "ejected"
)

// Eligibility is an engine's placement state as the breaker decided it. It
// is the value of the engine's key in KV bucket narwhal_placement and is
// also published on narwhal.events.eligibility.<engine_id> (schema
// narwhal.eligibility.v1, behaviour.md R-BRK-8, R-BUS-2).
type Eligibility struct {
	Envelope
	// Eligible is whether routers may place on the engine.
	Eligible bool `json:"eligible"`
	// State is "eligible" or "ejected".
	State string `json:"state"`
	// Reason says why the state changed, e.g. "ejected after 3 failures".
	Reason string `json:"reason,omitempty"`
	// Streak is the engine's current consecutive-failure count.
	Streak int `json:"streak"`
	// LeaseTerm is the term of the writing breaker's leader lease (the
	// KV revision at which it took the lease); routers apply a placement
	// value only from the current term's holder (R-BUS-9). 0 (omitted)
	// outside placement.
	LeaseTerm uint64 `json:"lease_term,omitempty"`
}

// Subject returns narwhal.events.eligibility.<engine_id>.
func (e *Eligibility) Subject() string {
	return EventSubjectPrefix + KindEligibility + "." + e.EngineID
}

// Chaos actions, the values of Chaos.Action (behaviour.md R-CHAOS-1).
const (
	// ChaosArm: a fault was armed on an engine (or re-armed, replacing the
	// fault of the same id).
	ChaosArm = "arm"
	// ChaosDisarm: an armed fault was removed before it expired or was
	// spent.
	ChaosDisarm = "disarm"
	// ChaosInject: a chaos proxy injected the fault into one request.
	ChaosInject = "inject"
)

// Chaos reports one action of the chaos tool on an engine's faults, on
// narwhal.events.chaos.<engine_id> (schema narwhal.chaos.v1, behaviour.md
// R-CHAOS-1): `narwhal chaos arm` and `disarm` publish arm and disarm
// events, a chaos proxy publishes an inject event for each fault it
// injects. RequestID is the request's X-Request-Id on inject events (absent
// when the request had none).
type Chaos struct {
	Envelope
	// Action is "arm", "disarm" or "inject".
	Action string `json:"action"`
	// Fault is the fault's name in the catalogue, e.g. "http-status"
	// (docs/chaos.md).
	Fault string `json:"fault"`
	// FaultID names the armed fault on its engine (the KV key is
	// <engine_id>.<fault_id>); it is the fault's name unless one was
	// given.
	FaultID string `json:"fault_id"`
	// Phase is the phase the fault was armed for ("prefill", "decode" or
	// "any") on arm and disarm events, and the phase of the request it
	// struck ("prefill" or "decode") on inject events.
	Phase string `json:"phase"`
	// Probability is the chance, 0…1, that the fault strikes a request it
	// applies to.
	Probability float64 `json:"probability"`
	// Count is how many injections the fault was armed for; 0 means
	// unlimited.
	Count int `json:"count"`
	// Left is, for a fault with Count > 0, how many injections remain after
	// this event; absent when 0 (spent) or when Count is 0.
	Left int `json:"left,omitempty"`
	// Expires is when the fault ends by itself (UTC).
	Expires time.Time `json:"expires"`
	// Params are the fault's parameters as armed, e.g. {"code":"503"}.
	Params map[string]string `json:"params,omitempty"`
}

// Subject returns narwhal.events.chaos.<engine_id>.
func (e *Chaos) Subject() string { return EventSubjectPrefix + KindChaos + "." + e.EngineID }
