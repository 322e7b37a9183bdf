package engines

import (
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// FaultKind names one class of engine fault. The kinds and what each means
// for the client, the bus and the breaker are the table in
// docs/failures.md.
type FaultKind string

// The fault kinds (behaviour.md §5, §6, R-FAIL-6, R-DESC-6, R-OWN-2).
const (
	// KindConnectError: the engine could not be reached, or the connection
	// failed before any response header arrived. 502, transient, counts.
	KindConnectError FaultKind = "connect_error"
	// KindPrefillTimeout: the prefill leg outlived engine.prefill_timeout_s.
	// 504, transient, counts.
	KindPrefillTimeout FaultKind = "prefill_timeout"
	// KindPrefillStatus: the producer answered a non-2xx status that is an
	// engine fault. 502 (504 for an upstream 504/408), transient, counts.
	KindPrefillStatus FaultKind = "prefill_status"
	// KindPrefillResponse: the producer's 2xx body was not a completion.
	// 502, transient, counts.
	KindPrefillResponse FaultKind = "prefill_response"
	// KindDescriptorRejected: R-DESC-0…4 refused the handoff descriptor.
	// 502, transient, counts against the producer.
	KindDescriptorRejected FaultKind = "descriptor_rejected"
	// KindHandoffExpired: the descriptor outlived handoff.max_age_s before
	// the decode request (R-OWN-2). 504 "handoff expired", transient.
	KindHandoffExpired FaultKind = "handoff_expired"
	// KindFirstTokenTimeout: no generated output within
	// engine.first_token_timeout_s of opening the decode (R-TMO-1). 504
	// "engine first token timeout", transient, counts.
	KindFirstTokenTimeout FaultKind = "first_token_timeout"
	// KindMidStreamSilence: no bytes for engine.decode_read_timeout_s after
	// the first output (R-TMO-2/3). 504 "engine went silent between
	// tokens", counts.
	KindMidStreamSilence FaultKind = "mid_stream_silence"
	// KindClosedBeforeDone: the decode stream ended or broke before
	// [DONE] (R-FAIL-2). 502, transient before output, counts.
	KindClosedBeforeDone FaultKind = "closed_before_done"
	// KindDoneBeforeToken: [DONE] before any generated output (R-FAIL-3).
	// 502 "stream ended with [DONE] before any token arrived", transient,
	// counts.
	KindDoneBeforeToken FaultKind = "done_before_token"
	// KindErrorObject: an error object inside a 200 stream (R-FAIL-4), with
	// the object's own status (502 when its code is no HTTP status).
	KindErrorObject FaultKind = "error_object"
	// KindInvalidStream: a data line that is not JSON. 502, counts.
	KindInvalidStream FaultKind = "invalid_stream"
	// KindUpstreamStatus: the consumer answered a non-2xx status that is an
	// engine fault (R-FAIL-6). 502 (504 for 504/408), transient, counts.
	KindUpstreamStatus FaultKind = "upstream_status"
	// KindClientFault: the engine refused the request as the client's fault
	// (400, 404, 413, 422): passed through, not counted (R-FAIL-6).
	KindClientFault FaultKind = "client_fault"
	// KindEngineUnauthorized: the engine refused the router's credentials
	// with 401 or 403 (a missing or wrong fleet[].api_key_env). A
	// configuration fault, not a stream failure: 502 to the client (the
	// engine's body is not passed through), transient (a retry may take
	// another engine), published with counts false, never towards
	// ejection; the router places nothing on the engine while its
	// credentials are refused (docs/failures.md).
	KindEngineUnauthorized FaultKind = "engine_unauthorized"
	// KindOverload: the engine answered 429, or 503 with a valid
	// Retry-After header: passed through with that status (and the
	// Retry-After, Fault.RetryAfter), counted as overload, not failure
	// (R-FAIL-6, R-FAIL-7).
	KindOverload FaultKind = "overload"
	// KindRequestTimeout: the request's own deadline (request.timeout_s or
	// the client's) ran out (R-TMO-5). 504, not transient, not counted:
	// the deadline is the client's budget, not an engine verdict.
	KindRequestTimeout FaultKind = "request_timeout"
	// KindClientGone: the client disconnected (R-OWN-5). Not an engine
	// fault: nothing is counted and nothing is sent.
	KindClientGone FaultKind = "client_disconnected"
	// KindNoEngine: no eligible engine for a phase. 503 with Retry-After.
	KindNoEngine FaultKind = "no_eligible_engine"
	// KindShutdown: the router is shutting down and its grace period ran
	// out. 503, not counted.
	KindShutdown FaultKind = "router_shutdown"
	// KindRouterResources: the leg could not start because the router
	// itself ran out of something — file descriptors (EMFILE, ENFILE),
	// buffers or memory (ENOBUFS, ENOMEM), local ports (EADDRNOTAVAIL),
	// or room in its own connection pool (Fault.Resource names which).
	// The router's fault, nobody else's (behaviour.md R-FAIL-9): 503 with
	// Retry-After, not transient, not published, never towards ejection,
	// no engine blamed.
	KindRouterResources FaultKind = "router_resources"
	// KindHandoffRefused: the consumer answered a 4xx whose error names a
	// field the router wrote for the handoff (behaviour.md R-FAIL-10,
	// HandoffRefusal): the pair's fault, not the client's. 502 naming the
	// consumer, transient (a retry may take another consumer), counts
	// towards the consumer's ejection.
	KindHandoffRefused FaultKind = "handoff_refused"
)

// Exact client messages from docs/behaviour.md.
const (
	MsgFirstTokenTimeout = "engine first token timeout"
	MsgSilence           = "engine went silent between tokens"
	MsgDoneBeforeToken   = "stream ended with [DONE] before any token arrived"
	MsgHandoffExpired    = "handoff expired"
	MsgPrefillTimeout    = "engine prefill timeout"
	MsgClosedBeforeDone  = "engine stream closed before [DONE]"
	MsgRequestTimeout    = "request deadline exceeded"
)

// Fault is one engine leg's failure, classified in one place: Kind decides
// the HTTP status, whether the fault is timeout-shaped, transient
// (retryable before visible output, R-RETRY-2) and whether it counts
// towards ejection (R-BRK-2). Build faults with NewFault.
type Fault struct {
	// Kind is the fault class.
	Kind FaultKind
	// Phase is schemas.PhasePrefill or schemas.PhaseDecode.
	Phase string
	// EngineID is the engine at fault: the producer for prefill faults and
	// rejected descriptors, the consumer for decode faults.
	EngineID string
	// Status is the HTTP status the client gets (R-FAIL-1, R-FAIL-4,
	// R-FAIL-6).
	Status int
	// UpstreamStatus is the engine's HTTP status, or the code of an error
	// object; 0 when there was none.
	UpstreamStatus int
	// Timeout is whether the fault is timeout-shaped (504).
	Timeout bool
	// Message is the client-facing message; it starts with docs/behaviour.md's exact
	// detail string where docs/behaviour.md gives one.
	Message string
	// Type is the error type shown to the client (the engine's own for
	// error objects and passed-through errors).
	Type string
	// Rejection is, for KindDescriptorRejected, why the descriptor was
	// refused: one of the connector.Reason* constants (R-DESC-6); empty
	// for every other kind. Callers decide on it, never on Message.
	Rejection string
	// Body is the engine's error body for passed-through client faults
	// and overloads; nil otherwise.
	Body []byte
	// RetryAfter is, for KindOverload, how long the engine asked not to
	// be sent requests (its Retry-After header, seconds or HTTP-date,
	// rounded up to whole seconds, at least 1 s); 0 when it sent none
	// (R-FAIL-7). The router caps it.
	RetryAfter time.Duration
	// Cause is the underlying error, if any (for logs).
	Cause error
	// Resource is, for KindRouterResources, what the router ran out of:
	// one of the Resource* constants (resources.go); empty for every
	// other kind.
	Resource string
	// Detail is what was wrong, for the log, the failure event and
	// preflight, never for the client (behaviour.md R-FAIL-10): for
	// descriptor_rejected the field, the shape expected and a bounded,
	// escaped excerpt of what was found (connector.RejectError.Report);
	// for handoff_refused the engine's status and a bounded, escaped
	// excerpt of its error. Empty for other faults. It is one line.
	Detail string
}

// NewFault returns the classified fault of kind on phase of engineID.
// upstream is the engine's HTTP status or error-object code (0 if none);
// message is the client-facing message.
func NewFault(kind FaultKind, phase, engineID string, upstream int, message string) *Fault {
	f := &Fault{Kind: kind, Phase: phase, EngineID: engineID, UpstreamStatus: upstream, Message: message}
	switch kind {
	case KindPrefillTimeout, KindHandoffExpired, KindFirstTokenTimeout, KindMidStreamSilence, KindRequestTimeout:
		f.Status, f.Timeout = 504, true
	case KindPrefillStatus, KindUpstreamStatus:
		if upstream == 504 || upstream == 408 {
			f.Status, f.Timeout = 504, true
		} else {
			f.Status = 502
		}
	case KindErrorObject:
		f.Status = 502
		if upstream >= 400 && upstream <= 599 {
			f.Status = upstream
		}
		f.Timeout = f.Status == 504 || f.Status == 408
	case KindClientFault:
		f.Status = upstream
	case KindOverload:
		f.Status = 429
		if upstream == 503 {
			f.Status = 503
		}
	case KindNoEngine, KindShutdown:
		f.Status = 503
	case KindClientGone:
		f.Status = 499
	case KindRouterResources:
		f.Status = 503
	default:
		f.Status = 502
	}
	f.Type = schemas.ErrorType(f.Status)
	return f
}

// AsFault returns the *Fault that err is or wraps (errors.As). The
// client's legs return no other error, but a caller must not rely on an
// unchecked type assertion: any other non-nil error comes back as a
// protocol fault of phase on engineID — KindPrefillResponse for the
// prefill phase, KindInvalidStream for the decode phase — with err as its
// Cause. AsFault(nil, …) is nil.
func AsFault(err error, phase, engineID string) *Fault {
	if err == nil {
		return nil
	}
	var f *Fault
	if errors.As(err, &f) {
		return f
	}
	kind := KindInvalidStream
	if phase == schemas.PhasePrefill {
		kind = KindPrefillResponse
	}
	f = NewFault(kind, phase, engineID, 0, phase+" engine "+engineID+" failed: "+err.Error())
	f.Cause = err
	return f
}

// MissingDescriptor reports whether f is a descriptor rejected because the
// producer returned none — the field missing, null or an empty object
// (R-DESC-0): no KV blocks were handed off, so there is no handoff to
// abandon (R-OWN-6).
func (f *Fault) MissingDescriptor() bool {
	return f.Kind == KindDescriptorRejected && f.Rejection == connector.ReasonMissingDescriptor
}

// Error returns "<phase> <kind> on <engine>: <message>", followed by
// " [<detail>]" when the fault has a Detail.
func (f *Fault) Error() string {
	s := f.Phase + " " + string(f.Kind)
	if f.EngineID != "" {
		s += " on " + f.EngineID
	}
	if f.UpstreamStatus != 0 {
		s += " (upstream " + strconv.Itoa(f.UpstreamStatus) + ")"
	}
	s += ": " + f.Message
	if f.Detail != "" {
		s += " [" + f.Detail + "]"
	}
	return s
}

// Unwrap returns the underlying cause.
func (f *Fault) Unwrap() error { return f.Cause }

// EngineFault reports whether the fault is the engine's (as opposed to the
// client's, the deadline's, or placement's). Only engine faults are
// published as failure events.
func (f *Fault) EngineFault() bool {
	switch f.Kind {
	case KindClientFault, KindClientGone, KindRequestTimeout, KindNoEngine, KindShutdown:
		return false
	case KindRouterResources:
		return false
	}
	return true
}

// Transient reports whether a fresh attempt may help (behaviour.md R-RETRY-2):
// connect errors, timeouts, 5xx, closed streams, [DONE] before a token,
// rejected descriptors and expired handoffs.
func (f *Fault) Transient() bool {
	switch f.Kind {
	case KindConnectError, KindPrefillTimeout, KindPrefillResponse, KindDescriptorRejected, KindHandoffExpired,
		KindFirstTokenTimeout, KindMidStreamSilence, KindClosedBeforeDone, KindDoneBeforeToken, KindInvalidStream,
		KindEngineUnauthorized:
		return true
	case KindHandoffRefused:
		return true
	case KindPrefillStatus, KindUpstreamStatus, KindErrorObject:
		return f.Status >= 500
	}
	return false
}

// CountsTowardEjection reports whether the breaker counts the fault in the
// engine's failure streak (behaviour.md R-BRK-2): every engine fault except
// client faults, overload, client disconnects, the request's own deadline,
// an expired handoff (which measures the router's wait, not the engine)
// and refused credentials (a configuration fault). An error object counts
// unless its code is a client-fault or overload status.
func (f *Fault) CountsTowardEjection() bool {
	switch f.Kind {
	case KindClientFault, KindOverload, KindClientGone, KindRequestTimeout, KindNoEngine, KindShutdown, KindHandoffExpired,
		KindEngineUnauthorized:
		return false
	case KindRouterResources:
		return false
	case KindErrorObject:
		switch f.Status {
		case 400, 404, 413, 422, 429:
			return false
		}
	}
	return true
}

// AppendJSON appends the client error body for f: the engine's own body for
// passed-through client faults and 429s when it is valid JSON, otherwise
// {"error":{"message","type","param":null,"code"}} (behaviour.md R-API-3).
func (f *Fault) AppendJSON(dst []byte) []byte {
	if (f.Kind == KindClientFault || f.Kind == KindOverload) && len(f.Body) > 0 {
		if _, ok := schemas.ParseError(f.Body); ok {
			return append(dst, f.Body...)
		}
	}
	return appendErrorObject(dst, f.Status, f.Type, f.Message)
}

func appendErrorObject(dst []byte, status int, typ, message string) []byte {
	e := schemas.NewError(status, message)
	if typ != "" {
		e.Error.Type = typ
	}
	b, err := jsonMarshal(e)
	if err != nil {
		return schemas.AppendErrorJSON(dst, status, message)
	}
	return append(dst, b...)
}

// ParseRetryAfter reads a Retry-After header value (RFC 9110 §10.2.3):
// delay-seconds (a non-negative integer) or an HTTP-date, relative to now.
// The delay is rounded up to whole seconds and is at least one second; ok
// is false for an empty or malformed value (R-FAIL-7). Values beyond a day
// are cut to a day (callers cap further).
func ParseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	const most = 24 * time.Hour
	var d time.Duration
	if v[0] >= '0' && v[0] <= '9' {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			if !allDigits(v) {
				return 0, false
			}
			n = uint64(most / time.Second) // overflow: a very long delay
		}
		if n > uint64(most/time.Second) {
			n = uint64(most / time.Second)
		}
		d = time.Duration(n) * time.Second
	} else {
		t, err := http.ParseTime(v)
		if err != nil {
			return 0, false
		}
		d = t.Sub(now)
		if d > most {
			d = most
		}
		if d%time.Second != 0 {
			d = d.Truncate(time.Second) + time.Second
		}
	}
	if d < time.Second {
		d = time.Second
	}
	return d, true
}

func allDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}
