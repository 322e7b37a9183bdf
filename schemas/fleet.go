package schemas

import "time"

// Fleet states of an engine in KV bucket narwhal_fleet (behaviour.md R-FLEET-1…3),
// the values of FleetEntry.State and FleetChange.State.
const (
	// FleetJoining: in the fleet, not yet placeable; the breaker runs the
	// readmission checks (health, contract, inference probe) and makes it
	// active when they pass (R-FLEET-2).
	FleetJoining = "joining"
	// FleetActive: placeable, subject to eligibility, quarantine and slot
	// limits (R-PLACE-1).
	FleetActive = "active"
	// FleetDraining: no new placement; running legs finish (R-FLEET-3).
	FleetDraining = "draining"
	// FleetDrained: every router reported zero in-flight legs on it, or
	// membership.drain_timeout_s passed; it may be removed.
	FleetDrained = "drained"
	// FleetGone: only in FleetChange events: the key was removed.
	FleetGone = "gone"
)

// Where a fleet entry came from, the values of FleetEntry.Source.
const (
	// SourceConfig: seeded from a config file's fleet: list.
	SourceConfig = "config"
	// SourceCommand: written by `narwhal fleet add`.
	SourceCommand = "command"
	// SourceRegistration: announced by the engine itself (a
	// registration with a TTL, R-FLEET-4) and written by the breaker
	// (R-FLEET-5).
	SourceRegistration = "registration"
)

// Schema names of the fleet's bus values and events (behaviour.md R-BUS-3).
const (
	// SchemaFleetEntry names the value of an engine's key in KV bucket
	// narwhal_fleet (narwhal.engine.v1.json).
	SchemaFleetEntry = "narwhal.engine.v1"
	// SchemaFleet names the event of a fleet state change, on
	// narwhal.events.fleet.<engine_id> (narwhal.fleet.v1.json).
	SchemaFleet = "narwhal.fleet.v1"
	// SchemaRouterReport names the value of a router's key in KV bucket
	// narwhal_routers (narwhal.router.v1.json).
	SchemaRouterReport = "narwhal.router.v1"
)

// KindFleet is the event kind of FleetChange (subject
// narwhal.events.fleet.<engine_id>).
const KindFleet = "fleet"

// FleetEntry is one engine of the live fleet: the value of its key in KV
// bucket narwhal_fleet (key = EngineID), schema narwhal.engine.v1 (behaviour.md
// R-FLEET-1). Slots of 0 mean no limit (R-OWN-3). The engine's API key
// itself never goes on the bus: APIKeyEnv names the variable each process
// reads it from.
type FleetEntry struct {
	// Schema is SchemaFleetEntry.
	Schema string `json:"schema"`
	// EngineID is the engine's id, the same as the key.
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
	// BootstrapPort is the port of the engine's bootstrap server, where
	// SGLang consumers meet it for the KV (connector sglang, prefill-capable
	// engines; behaviour.md R-DESC-7); 0 (absent) otherwise.
	BootstrapPort int `json:"bootstrap_port,omitempty"`
	// APIKeyEnv names the environment variable holding the engine's API
	// key, empty when it has none.
	APIKeyEnv string `json:"api_key_env,omitempty"`
	// State is FleetJoining, FleetActive, FleetDraining or FleetDrained.
	State string `json:"state"`
	// Since is when the engine entered State (UTC); the drain timeout
	// counts from it.
	Since time.Time `json:"since"`
	// At is when the value was written (UTC).
	At time.Time `json:"at"`
	// Source is SourceConfig, SourceCommand or SourceRegistration.
	Source string `json:"source"`
	// By names the writer: a breaker id, "narwhal-fleet", a router id
	// (single node), an agent id.
	By string `json:"by"`
	// Reason says why the engine is in State, e.g. "inference probe
	// passed".
	Reason string `json:"reason,omitempty"`
	// TTLS is a registration's TTL in seconds (R-FLEET-4, R-FLEET-5):
	// every write of the key — the breaker's, which renews it on each of
	// the engine's heartbeats — carries it, so that the key lapses that
	// long after the engine's last heartbeat. 0 (absent) for entries of
	// other sources.
	TTLS float64 `json:"ttl_s,omitempty"`
}

// FleetChange is the event of an engine's fleet state change, on
// narwhal.events.fleet.<engine_id> (schema narwhal.fleet.v1, behaviour.md
// R-FLEET-2, R-FLEET-3): published by the leading breaker for the changes
// it makes (active after the readmission checks, drained) and those it
// sees (joining, draining, gone).
type FleetChange struct {
	Envelope
	// State is the new state: a FleetEntry state or FleetGone.
	State string `json:"state"`
	// Previous is the state before, empty for a new engine.
	Previous string `json:"previous,omitempty"`
	// Reason says why, e.g. "every router reports no leg in flight".
	Reason string `json:"reason,omitempty"`
}

// Subject returns narwhal.events.fleet.<engine_id>.
func (e *FleetChange) Subject() string { return EventSubjectPrefix + KindFleet + "." + e.EngineID }

// RouterReport is one router's report of its legs in flight: the value of
// its key in KV bucket narwhal_routers (key = RouterID; the bucket's TTL
// removes the key of a router that stopped), schema narwhal.router.v1
// (behaviour.md R-FLEET-3). A router writes it every second.
type RouterReport struct {
	// Schema is SchemaRouterReport.
	Schema string `json:"schema"`
	// RouterID is the router, the same as the key.
	RouterID string `json:"router_id"`
	// At is when it was written (UTC).
	At time.Time `json:"at"`
	// Draining holds, for every engine the router sees draining or
	// drained, its legs (prefill and decode) in flight there, zeros
	// included: a router that lists an engine with 0 has nothing
	// running on it.
	Draining map[string]int64 `json:"draining"`
	// InFlight holds the router's legs in flight per engine, engines
	// with none left out.
	InFlight map[string]int64 `json:"inflight"`
	// Models holds, per engine, the models its last GET /v1/models
	// listed to this router; engines not yet read are left out. Optional
	// (reports of older routers have none).
	Models map[string][]string `json:"models,omitempty"`
}
