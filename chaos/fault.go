package chaos

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/schemas"
)

// Fault names, the catalogue of behaviour.md R-CHAOS-1. docs/chaos.md says what a
// client behind a router sees for each.
const (
	// FaultConnectRefused closes the client connection without a response
	// (a TCP reset), as a refused or reset engine connection looks to the
	// router. The engine never sees the request.
	FaultConnectRefused = "connect-refused"
	// FaultConnectDelay waits delay_ms before forwarding the request.
	FaultConnectDelay = "connect-delay"
	// FaultHeaderDelay forwards the request, then holds the engine's
	// response headers for delay_ms.
	FaultHeaderDelay = "header-delay"
	// FaultFirstTokenDelay passes the headers and any metadata chunks at
	// once and holds the first generated-output chunk for delay_ms (a
	// non-streaming body, which is all output, is held whole).
	FaultFirstTokenDelay = "first-token-delay"
	// FaultMidStreamSilence forwards after_tokens output chunks (default
	// 1, at least 1: a silence before the first token is
	// FaultFirstTokenDelay), then stops forwarding and holds the
	// connection open for delay_ms (0: until the client leaves), then ends
	// the response without [DONE]. Streamed requests only.
	FaultMidStreamSilence = "mid-stream-silence"
	// FaultCloseBeforeDone forwards after_tokens output chunks (default 0:
	// the stream ends at its first output chunk, before the router
	// commits), then ends the response without [DONE]. Streamed requests
	// only.
	FaultCloseBeforeDone = "close-before-done"
	// FaultDoneBeforeToken replaces the stream from its first output chunk
	// on with data: [DONE]: the client gets the engine's metadata chunks
	// and [DONE], no token. Streamed requests only.
	FaultDoneBeforeToken = "done-before-token"
	// FaultErrorObject forwards after_tokens output chunks (default 0:
	// before the router commits), then writes
	// data: {"error":{"message","type","param":null,"code"}} and
	// data: [DONE] inside the HTTP 200 stream, as vLLM does. Streamed
	// requests only.
	FaultErrorObject = "error-object"
	// FaultHTTPStatus answers HTTP code (5xx, 429, …) with a vLLM error
	// body instead of forwarding the request.
	FaultHTTPStatus = "http-status"
	// FaultTrickle waits delay_ms before forwarding each chunk (each SSE
	// event; a non-streaming body once).
	FaultTrickle = "trickle"
	// FaultDropEngineID removes remote_engine_id from the handoff
	// descriptor of a prefill response (R-DESC-1).
	FaultDropEngineID = "drop-engine-id"
	// FaultGarbleBlockIDs turns remote_block_ids of a prefill response's
	// descriptor into strings, e.g. [17,18] into ["17","18"] (R-DESC-2).
	FaultGarbleBlockIDs = "garble-block-ids"
	// FaultChangeConnectorShape replaces a prefill response's descriptor
	// with an LMCache-shaped {"lmcache_key":"chaos"} (R-DESC-3).
	FaultChangeConnectorShape = "change-connector-shape"
)

// Phases a fault is armed for (Fault.Phase). A request is a prefill leg
// when its JSON body's kv_transfer_params.do_remote_decode is true, else a
// POST to /v1/chat/completions or /v1/completions is a decode; every other
// request has no phase and is never faulted.
const (
	PhasePrefill = schemas.PhasePrefill
	PhaseDecode  = schemas.PhaseDecode
	PhaseAny     = "any"
)

// Parameter names (Fault.Params keys). Values are decimal integers except
// message and type.
const (
	// ParamDelayMS is a delay or hold in milliseconds.
	ParamDelayMS = "delay_ms"
	// ParamAfterTokens is the number of output chunks forwarded before a
	// stream fault strikes: default 0 (before the first) for
	// close-before-done and error-object, 1 for mid-stream-silence, whose
	// minimum it is too.
	ParamAfterTokens = "after_tokens"
	// ParamCode is the HTTP status (http-status, 400…599, default 500) or
	// the error object's code (error-object, any integer, default 500).
	ParamCode = "code"
	// ParamMessage is the error message (http-status, error-object).
	ParamMessage = "message"
	// ParamType is the error object's type (error-object; default the
	// OpenAI type of code, see schemas.ErrorType).
	ParamType = "type"
)

// Bounds of Fault values.
const (
	// DefaultFor is how long a fault armed without an expiry lasts.
	DefaultFor = 10 * time.Minute
	// MaxFor is the longest a fault may be armed for; it is also the
	// bucket's MaxAge, so that no fault outlives it.
	MaxFor = 24 * time.Hour
	// defaultCode is the status of http-status and the code of
	// error-object when no code is given.
	defaultCode = 500
)

// faultKind is a fault name as a small integer, in catalogue order (which is
// also the order of precedence when two faults of one group strike the same
// request).
type faultKind uint8

const (
	kindConnectRefused faultKind = iota
	kindConnectDelay
	kindHeaderDelay
	kindFirstTokenDelay
	kindMidStreamSilence
	kindCloseBeforeDone
	kindDoneBeforeToken
	kindErrorObject
	kindHTTPStatus
	kindTrickle
	kindDropEngineID
	kindGarbleBlockIDs
	kindChangeConnectorShape
	numKinds
)

// catalogue describes each fault kind: its name, the parameters it takes
// and the parameters it requires.
var catalogue = [numKinds]struct {
	name     string
	params   []string
	required []string
}{
	kindConnectRefused:       {FaultConnectRefused, nil, nil},
	kindConnectDelay:         {FaultConnectDelay, []string{ParamDelayMS}, []string{ParamDelayMS}},
	kindHeaderDelay:          {FaultHeaderDelay, []string{ParamDelayMS}, []string{ParamDelayMS}},
	kindFirstTokenDelay:      {FaultFirstTokenDelay, []string{ParamDelayMS}, []string{ParamDelayMS}},
	kindMidStreamSilence:     {FaultMidStreamSilence, []string{ParamAfterTokens, ParamDelayMS}, nil},
	kindCloseBeforeDone:      {FaultCloseBeforeDone, []string{ParamAfterTokens}, nil},
	kindDoneBeforeToken:      {FaultDoneBeforeToken, nil, nil},
	kindErrorObject:          {FaultErrorObject, []string{ParamAfterTokens, ParamCode, ParamMessage, ParamType}, nil},
	kindHTTPStatus:           {FaultHTTPStatus, []string{ParamCode, ParamMessage}, nil},
	kindTrickle:              {FaultTrickle, []string{ParamDelayMS}, []string{ParamDelayMS}},
	kindDropEngineID:         {FaultDropEngineID, nil, nil},
	kindGarbleBlockIDs:       {FaultGarbleBlockIDs, nil, nil},
	kindChangeConnectorShape: {FaultChangeConnectorShape, nil, nil},
}

// Names returns the fault names of the catalogue, in catalogue order.
func Names() []string {
	out := make([]string, numKinds)
	for k := range numKinds {
		out[k] = catalogue[k].name
	}
	return out
}

func kindOf(name string) (faultKind, bool) {
	for k := range numKinds {
		if catalogue[k].name == name {
			return k, true
		}
	}
	return 0, false
}

// streamOnly reports whether the kind acts on a streamed response only.
func (k faultKind) streamOnly() bool {
	return k == kindMidStreamSilence || k == kindCloseBeforeDone || k == kindDoneBeforeToken || k == kindErrorObject
}

// descriptorFault reports whether the kind corrupts a prefill response's
// handoff descriptor.
func (k faultKind) descriptorFault() bool {
	return k == kindDropEngineID || k == kindGarbleBlockIDs || k == kindChangeConnectorShape
}

// Fault is one armed fault: the value of key <engine_id>.<fault_id> in KV
// bucket narwhal_chaos, as JSON:
//
//	{"engine_id":"decode-1","id":"http-status","fault":"http-status",
//	 "phase":"decode","probability":1,"count":3,"left":2,
//	 "params":{"code":"503"},"armed_at":"…Z","expires":"…Z"}
type Fault struct {
	// EngineID is the engine whose chaos proxy injects the fault: letters,
	// digits, '-' and '_'.
	EngineID string `json:"engine_id"`
	// ID names the fault on its engine (letters, digits, '-' and '_');
	// Store.Arm sets it to Name when empty. Arming a fault with the ID of
	// an armed one replaces it.
	ID string `json:"id"`
	// Name is the fault's name in the catalogue, one of the Fault*
	// constants.
	Name string `json:"fault"`
	// Phase is "prefill", "decode" or "any" (Store.Arm sets "any" when
	// empty).
	Phase string `json:"phase"`
	// Probability is the chance, 0…1, that the fault strikes a request it
	// applies to. 0 never strikes: callers set it (the CLI's default is 1).
	Probability float64 `json:"probability"`
	// Count is how many requests the fault strikes before it is spent; 0
	// is unlimited.
	Count int `json:"count"`
	// Left is how many strikes remain of Count; a proxy decrements it with
	// a revision-checked update and deletes the key at 0. Store.Arm sets it
	// to Count.
	Left int `json:"left"`
	// Params are the fault's parameters (the Param* names).
	Params map[string]string `json:"params,omitempty"`
	// ArmedAt is when the fault was armed (UTC).
	ArmedAt time.Time `json:"armed_at"`
	// Expires is when the fault ends by itself (UTC). Proxies ignore a
	// fault past its expiry even before the bucket drops its key.
	Expires time.Time `json:"expires"`
}

// Key returns the fault's key in bucket narwhal_chaos:
// "<engine_id>.<fault_id>".
func (f *Fault) Key() string { return f.EngineID + "." + f.ID }

// Expired reports whether the fault has expired at now.
func (f *Fault) Expired(now time.Time) bool { return !now.Before(f.Expires) }

// Validate reports whether f can be armed: valid engine and fault ids, a
// known name and phase, probability within 0…1, count ≥ 0 and left within
// 0…count, an expiry, and parameters the fault takes with values it
// accepts (integers ≥ 0; delays > 0 where required; http-status code
// 400…599). It returns an error naming what is wrong.
func (f *Fault) Validate() error {
	if !validID(f.EngineID) {
		return fmt.Errorf("engine id %q: want letters, digits, '-' or '_'", f.EngineID)
	}
	if !validID(f.ID) {
		return fmt.Errorf("fault id %q: want letters, digits, '-' or '_'", f.ID)
	}
	if _, ok := kindOf(f.Name); !ok {
		return fmt.Errorf("unknown fault %q (want one of %s)", f.Name, strings.Join(Names(), ", "))
	}
	switch f.Phase {
	case PhasePrefill, PhaseDecode, PhaseAny:
	default:
		return fmt.Errorf("fault %s: unknown phase %q (want prefill, decode or any)", f.Name, f.Phase)
	}
	if math.IsNaN(f.Probability) || f.Probability < 0 || f.Probability > 1 {
		return fmt.Errorf("fault %s: probability %v is not within 0…1", f.Name, f.Probability)
	}
	if f.Count < 0 {
		return fmt.Errorf("fault %s: count %d is negative", f.Name, f.Count)
	}
	if f.Left < 0 || f.Left > f.Count {
		return fmt.Errorf("fault %s: left %d is not within 0…count (%d)", f.Name, f.Left, f.Count)
	}
	if f.Expires.IsZero() {
		return fmt.Errorf("fault %s: no expiry", f.Name)
	}
	_, err := f.compile()
	return err
}

// setting is a validated, parsed fault, as the proxy applies it.
type setting struct {
	kind    faultKind
	delay   time.Duration // delay_ms
	after   int           // after_tokens
	code    int           // code
	message string        // message
	errType string        // type
	frame   []byte        // error-object: the SSE error frame and [DONE]
}

// compile checks f's parameters and parses them into a setting, with the
// defaults filled in.
func (f *Fault) compile() (setting, error) {
	k, ok := kindOf(f.Name)
	if !ok {
		return setting{}, fmt.Errorf("unknown fault %q", f.Name)
	}
	s := setting{kind: k, code: defaultCode}
	if k == kindMidStreamSilence {
		s.after = 1 // mid-stream: after the first token
	}
	c := catalogue[k]
	for _, name := range slices.Sorted(maps.Keys(f.Params)) {
		if !slices.Contains(c.params, name) {
			if len(c.params) == 0 {
				return setting{}, fmt.Errorf("fault %s takes no parameters (got %s)", f.Name, name)
			}
			return setting{}, fmt.Errorf("fault %s: unknown parameter %q (want %s)", f.Name, name, strings.Join(c.params, ", "))
		}
		v := f.Params[name]
		switch name {
		case ParamMessage:
			s.message = v
			continue
		case ParamType:
			s.errType = v
			continue
		}
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil {
			return setting{}, fmt.Errorf("fault %s: %s=%q is not an integer", f.Name, name, v)
		}
		switch name {
		case ParamDelayMS:
			if n < 0 || n > int(MaxFor/time.Millisecond) {
				return setting{}, fmt.Errorf("fault %s: %s=%d is not within 0…%d", f.Name, name, n, MaxFor/time.Millisecond)
			}
			s.delay = time.Duration(n) * time.Millisecond
		case ParamAfterTokens:
			if n < 0 {
				return setting{}, fmt.Errorf("fault %s: %s=%d is negative", f.Name, name, n)
			}
			s.after = n
		case ParamCode:
			s.code = n
		}
	}
	for _, name := range c.required {
		if _, ok := f.Params[name]; !ok {
			return setting{}, fmt.Errorf("fault %s: parameter %s is required", f.Name, name)
		}
	}
	if slices.Contains(c.required, ParamDelayMS) && s.delay <= 0 {
		return setting{}, fmt.Errorf("fault %s: %s must be > 0", f.Name, ParamDelayMS)
	}
	switch k {
	case kindMidStreamSilence:
		if s.after < 1 {
			return setting{}, fmt.Errorf("fault %s: %s must be at least 1 (a silence before the first token is %s)", f.Name, ParamAfterTokens, FaultFirstTokenDelay)
		}
	case kindHTTPStatus:
		if s.code < 400 || s.code > 599 {
			return setting{}, fmt.Errorf("fault %s: code %d is not an HTTP error status (400…599)", f.Name, s.code)
		}
		if s.message == "" {
			s.message = "chaos: injected HTTP " + strconv.Itoa(s.code)
		}
	case kindErrorObject:
		if s.message == "" {
			s.message = "chaos: injected error object"
		}
		if s.errType == "" {
			s.errType = "InternalServerError"
			if s.code >= 400 && s.code <= 599 {
				s.errType = schemas.ErrorType(s.code)
			}
		}
		msg, _ := json.Marshal(s.message) // strings always marshal
		typ, _ := json.Marshal(s.errType)
		s.frame = fmt.Appendf(nil, "data: {\"error\":{\"message\":%s,\"type\":%s,\"param\":null,\"code\":%d}}\n\ndata: [DONE]\n\n", msg, typ, s.code)
	}
	return s, nil
}

// event returns the schemas.Chaos event of action on f.
func (f *Fault) event(action string) *schemas.Chaos {
	ev := &schemas.Chaos{
		Envelope:    schemas.Envelope{Schema: schemas.SchemaChaos, EngineID: f.EngineID},
		Action:      action,
		Fault:       f.Name,
		FaultID:     f.ID,
		Phase:       f.Phase,
		Probability: f.Probability,
		Count:       f.Count,
		Expires:     f.Expires.UTC(),
	}
	if f.Count > 0 {
		ev.Left = f.Left
	}
	if len(f.Params) > 0 {
		ev.Params = maps.Clone(f.Params)
	}
	return ev
}

// String describes f on one line, e.g. "decode-1/http-status phase=decode
// prob=1 count=3 left=2 code=503 expires=2026-03-01T12:40:00Z".
func (f *Fault) String() string {
	var b strings.Builder
	b.WriteString(f.EngineID)
	b.WriteByte('/')
	b.WriteString(f.Name)
	if f.ID != f.Name {
		b.WriteString(" (id " + f.ID + ")")
	}
	b.WriteString(" phase=" + f.Phase)
	b.WriteString(" prob=" + strconv.FormatFloat(f.Probability, 'g', -1, 64))
	if f.Count == 0 {
		b.WriteString(" count=unlimited")
	} else {
		fmt.Fprintf(&b, " count=%d left=%d", f.Count, f.Left)
	}
	if p := ParamString(f.Params); p != "" {
		b.WriteString(" " + p)
	}
	b.WriteString(" expires=" + f.Expires.UTC().Format(time.RFC3339))
	return b.String()
}

// ParamString returns params as "k=v" pairs sorted by key and separated by
// spaces, e.g. "after_tokens=2 code=503"; "" when there are none.
func ParamString(params map[string]string) string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(params)) {
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(k + "=" + params[k])
	}
	return b.String()
}

// ParseParam splits one --param argument "k=v" into its key and value. It
// returns an error when there is no '=' or the key is empty.
func ParseParam(kv string) (key, value string, err error) {
	key, value, ok := strings.Cut(kv, "=")
	key = strings.TrimSpace(key)
	if !ok || key == "" {
		return "", "", errors.New("parameter " + strconv.Quote(kv) + ": want KEY=VALUE")
	}
	return key, value, nil
}

// validID reports whether s is a non-empty run of ASCII letters, digits,
// '-' and '_': one NATS subject token and one KV key part.
func validID(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}
