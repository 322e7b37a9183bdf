package schemas

import "time"

// SchemaRegistration names an engine's registration, the payload of
// stream NARWHAL_REGISTRATIONS on narwhal.registrations.<engine_id>
// (narwhal.registration.v1.json; behaviour.md R-FLEET-4, R-FLEET-5).
const SchemaRegistration = "narwhal.registration.v1"

// The states an engine may ask for in its registration, the values of
// Registration.State (behaviour.md R-FLEET-5): only the breaker makes an
// engine active, so an engine never asks for it.
const (
	// AskJoining: the engine is up and asks to be placed on once the
	// breaker's checks pass (R-FLEET-2); every heartbeat asks it again.
	AskJoining = FleetJoining
	// AskDraining: the engine is stopping and asks for no new placement
	// (R-FLEET-3).
	AskDraining = FleetDraining
	// AskLeaving: the engine is gone; the breaker deletes its key.
	AskLeaving = "leaving"
)

// Registration is an engine's announcement of itself (behaviour.md
// R-FLEET-4, R-FLEET-5): published by the engine (package membership,
// `narwhal agent`, `narwhal sim --register`) with its own credential on
// narwhal.registrations.<engine_id>, at once and every TTLS/3 (a
// heartbeat), schema narwhal.registration.v1. Its spec fields are those
// of a FleetEntry; the leading breaker alone turns it into the engine's
// entry of narwhal_fleet.
type Registration struct {
	// Schema is SchemaRegistration.
	Schema string `json:"schema"`
	// EngineID is the engine's id, the last token of the subject.
	EngineID string `json:"engine_id"`
	// URL is the engine's absolute http(s) base URL.
	URL string `json:"url"`
	// Role is "prefill", "decode" or "both".
	Role string `json:"role"`
	// Connector is the KV connector's name, e.g. "nixl".
	Connector string `json:"connector"`
	// PrefillSlots and DecodeSlots limit the phases running at once on
	// the engine; 0 = no limit.
	PrefillSlots int `json:"prefill_slots,omitempty"`
	DecodeSlots  int `json:"decode_slots,omitempty"`
	// BootstrapPort is a prefill-capable SGLang engine's bootstrap port;
	// 0 (absent) otherwise.
	BootstrapPort int `json:"bootstrap_port,omitempty"`
	// APIKeyEnv names the environment variable holding the engine's API
	// key, empty when it has none; the key itself never goes on the bus.
	// It is EngineKeyEnv(EngineID) or empty: the breaker refuses any
	// other name (R-FLEET-5).
	APIKeyEnv string `json:"api_key_env,omitempty"`
	// State is what the engine asks for: AskJoining, AskDraining or
	// AskLeaving.
	State string `json:"state"`
	// TTLS is the registration's TTL in seconds: the engine's fleet key
	// lapses that long after the breaker's last renewal of it. The schema
	// allows (0, 86400]; the breaker writes the key with at most its
	// membership.max_registration_ttl_s (R-FLEET-5).
	TTLS float64 `json:"ttl_s"`
	// At is when the registration was published (UTC).
	At time.Time `json:"at"`
	// By names the publisher, e.g. "agent-d3".
	By string `json:"by"`
}

// Spec returns the fleet entry r describes, in state joining from
// source registration, written by by at now (UTC): what the breaker
// writes for a new engine (R-FLEET-5).
func (r Registration) Spec(by, reason string, now time.Time) FleetEntry {
	now = now.UTC()
	return FleetEntry{
		Schema: SchemaFleetEntry, EngineID: r.EngineID, URL: r.URL, Role: r.Role, Connector: r.Connector,
		PrefillSlots: r.PrefillSlots, DecodeSlots: r.DecodeSlots, BootstrapPort: r.BootstrapPort, APIKeyEnv: r.APIKeyEnv,
		State: FleetJoining, Since: now, At: now, Source: SourceRegistration, By: by, Reason: reason, TTLS: r.TTLS,
	}
}

// KindAdmission is the event kind of Admission (subject
// narwhal.events.admission.<engine_id>).
const KindAdmission = "admission"

// SchemaAdmission names the event of an engine that has not been active
// yet (narwhal.admission.v1.json).
const SchemaAdmission = "narwhal.admission.v1"

// Admission states that are no fleet state, the values of
// Admission.State besides FleetJoining and FleetGone.
const (
	// AdmissionRefused: the breaker did not write the registration (the
	// fleet is full, the id belongs to an operator's entry).
	AdmissionRefused = "refused"
)

// Admission is the event of an engine that never was active (behaviour.md
// R-FLEET-5): a registration written as joining, refused, drained or gone
// before the breaker's checks made it active, on
// narwhal.events.admission.<engine_id> (schema narwhal.admission.v1),
// published by the leading breaker. Its kind stays in NARWHAL_EVENTS
// only, not in the 30-day NARWHAL_HISTORY, so that registrations of ids
// that never served do not crowd it; once an engine has been active its
// changes are FleetChange events.
type Admission struct {
	Envelope
	// State is FleetJoining, FleetDraining, FleetDrained, AdmissionRefused
	// or FleetGone.
	State string `json:"state"`
	// Previous is the fleet state before, empty for a new engine.
	Previous string `json:"previous,omitempty"`
	// Reason says why, e.g. "the fleet holds membership.max_engines engines".
	Reason string `json:"reason,omitempty"`
}

// Subject returns narwhal.events.admission.<engine_id>.
func (e *Admission) Subject() string { return EventSubjectPrefix + KindAdmission + "." + e.EngineID }

// EngineKeyEnvPrefix starts the name of the environment variable that
// holds an engine's API key when the engine registers itself (behaviour.md
// R-FLEET-5): see EngineKeyEnv.
const EngineKeyEnvPrefix = "NARWHAL_ENGINE_KEY_"

// EngineKeyEnv returns the only api_key_env a registration of engine id
// may name, and the only variable a router or the breaker reads for a
// fleet entry of source registration (behaviour.md R-FLEET-5):
// EngineKeyEnvPrefix + id upper-cased with each '-' as '_', e.g.
// NARWHAL_ENGINE_KEY_D_1 for id "d-1". So an engine's credential makes
// routers send only the key the operator put aside for that id, never
// another variable of theirs (NARWHAL_NATS_CREDS, another engine's key).
// Ids that differ only in case or in '-' against '_' ("d-1", "D_1") share
// a name, and so a key.
func EngineKeyEnv(id string) string {
	b := make([]byte, 0, len(EngineKeyEnvPrefix)+len(id))
	b = append(b, EngineKeyEnvPrefix...)
	for i := 0; i < len(id); i++ {
		c := id[i]
		switch {
		case c >= 'a' && c <= 'z':
			c -= 'a' - 'A'
		case c == '-':
			c = '_'
		}
		b = append(b, c)
	}
	return string(b)
}
