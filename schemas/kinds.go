package schemas

import (
	"slices"
	"strings"
)

// EventSubjectPrefix starts every event subject,
// narwhal.events.<kind>.<engine_id|router_id>, followed by
// .<router_id> for a router's events about an engine (behaviour.md
// R-BUS-1, R-BUS-11).
const EventSubjectPrefix = "narwhal.events."

// The roles of behaviour.md R-BUS-8 that publish events, as EventKind
// rows name them. Package bus gives its credentials the same
// names (bus.RoleRouter is RoleRouter, and so on).
const (
	// RoleRouter is the routers' credential.
	RoleRouter = "router"
	// RoleBreaker is the breaker's credential.
	RoleBreaker = "breaker"
	// RoleChaos is the chaos tool's credential (`narwhal chaos`, the chaos
	// proxies).
	RoleChaos = "chaos"
)

// What the fourth token of an event's subject is (the one after the
// kind): the values of EventKind.ID, each the JSON name of the envelope
// field that holds it.
const (
	// IDEngine: the engine the event is about (Envelope.EngineID).
	IDEngine = "engine_id"
	// IDRouter: the router that published the event (Envelope.RouterID).
	IDRouter = "router_id"
)

// EventKind is one row of the table of bus event kinds (EventKinds): all
// that the bus, `narwhal events` and the dashboard know about a kind
// besides its payload's fields (behaviour.md R-BUS-1, R-BUS-3, R-BUS-8).
type EventKind struct {
	// Name is the kind, the <kind> token of the subject
	// narwhal.events.<kind>.<id>, e.g. "failure": one NATS subject token
	// (no dots, wildcards or spaces).
	Name string
	// ID says what the subject's token after the kind is: IDEngine or
	// IDRouter. A kind the routers publish about an engine (Routed) has
	// the router's id as a fifth token.
	ID string
	// Schema is the events' "schema" field, e.g. "narwhal.failure.v1";
	// SchemaFS holds its JSON Schema as "<Schema>.json".
	Schema string
	// Publishers are the roles whose credential may publish the kind (on
	// narwhal.events.<kind>.>, R-BUS-8); the admin may publish anything.
	Publishers []string
	// History is whether stream NARWHAL_HISTORY keeps the kind (30 days,
	// apart from the high-volume kinds); NARWHAL_EVENTS keeps every kind
	// for a day. The dashboard replays the last hour of a kind it shows
	// only when History is set; it counts the others from its start.
	History bool
	// New returns a new, zero payload of the kind (a pointer to its Go
	// type), for decoding an event of the kind.
	New func() Event
}

// Routed reports whether the kind's subjects carry the publishing
// router's id as a fifth token, narwhal.events.<kind>.<engine_id>.<router_id>:
// the kinds the routers publish about an engine (behaviour.md R-BUS-11),
// so that a router's credential may publish them under its own id only.
func (k EventKind) Routed() bool {
	return k.ID == IDEngine && slices.Contains(k.Publishers, RoleRouter)
}

// Subject returns the subject of an event of the kind about id (an engine
// id or a router id, as ID says): narwhal.events.<kind>.<id>, or, for a
// Routed kind, narwhal.events.<kind>.<id>.<routerID> (routerID is the
// publishing router's id; other kinds ignore it).
func (k EventKind) Subject(id, routerID string) string {
	if k.Routed() {
		return EventSubjectPrefix + k.Name + "." + id + "." + routerID
	}
	return EventSubjectPrefix + k.Name + "." + id
}

// Filter returns the subject filter of every event of the kind,
// narwhal.events.<kind>.>: what a publisher's permission allows and a
// consumer of the kind filters on. It matches both shapes, four tokens and
// a Routed kind's five (behaviour.md R-BUS-1, R-BUS-11).
func (k EventKind) Filter() string { return EventSubjectPrefix + k.Name + ".>" }

// Reasons a consumer ignores an event whose payload contradicts its
// subject (behaviour.md R-BUS-11), as EventSubjectMismatch returns them
// and the consumers' ignored counters label them.
const (
	// MismatchRouterID: the payload's router_id is not the router id the
	// subject carries, or the subject of a Routed kind carries none (four
	// tokens: an old or forged shape).
	MismatchRouterID = "router_id_mismatch"
	// MismatchEngineID: the payload's engine_id is not the engine id the
	// subject carries.
	MismatchEngineID = "engine_id_mismatch"
	// MismatchSubject: the subject is no event subject of a kind of the
	// table (an unknown kind, too many or too few tokens).
	MismatchSubject = "subject"
)

// ParseEventSubject splits an event subject into its kind's row and the
// ids it carries: id is the token after the kind (what the row's ID
// says), routerID the fifth token of a Routed kind ("" for the others).
// ok is false when subject is not within EventSubjectPrefix, names a kind
// the table has not, or has not its kind's number of tokens (four, five
// for a Routed kind).
func ParseEventSubject(subject string) (kind EventKind, id, routerID string, ok bool) {
	rest, found := strings.CutPrefix(subject, EventSubjectPrefix)
	if !found {
		return EventKind{}, "", "", false
	}
	name, rest, _ := strings.Cut(rest, ".")
	kind, known := LookupEventKind(name)
	if !known || rest == "" {
		return EventKind{}, "", "", false
	}
	id, routerID, two := strings.Cut(rest, ".")
	if id == "" || two != kind.Routed() || (two && (routerID == "" || strings.Contains(routerID, "."))) {
		return kind, "", "", false
	}
	return kind, id, routerID, true
}

// EventSubjectMismatch returns "" when an event whose payload names
// engineID and routerID (its envelope's engine_id and router_id) may
// travel on subject, else why not, one of the Mismatch reasons
// (behaviour.md R-BUS-11): the subject has its kind's shape, its engine id
// is engineID (kinds whose ID is IDEngine), its router id is routerID (a
// request event's fourth token, a Routed kind's fifth). A consumer ignores
// such an event and counts it under the reason.
func EventSubjectMismatch(subject, engineID, routerID string) string {
	kind, id, subjectRouter, ok := ParseEventSubject(subject)
	switch {
	case !ok && kind.Routed():
		return MismatchRouterID
	case !ok:
		return MismatchSubject
	case kind.ID == IDRouter && id != routerID:
		return MismatchRouterID
	case kind.ID == IDEngine && id != engineID:
		return MismatchEngineID
	case kind.Routed() && subjectRouter != routerID:
		return MismatchRouterID
	}
	return ""
}

// eventKinds is the table, in the order of behaviour.md R-BUS-1, then
// the kinds added since. Adding a kind is one row here, its payload type
// (with a Subject method) and its JSON Schema file; docs/architecture.md
// ("How to add an event kind") says what else to touch.
var eventKinds = []EventKind{
	{Name: KindFailure, ID: IDEngine, Schema: SchemaFailure,
		Publishers: []string{RoleRouter}, History: true,
		New: func() Event { return new(Failure) }},
	{Name: KindQuarantine, ID: IDEngine, Schema: SchemaQuarantine,
		Publishers: []string{RoleRouter}, History: true,
		New: func() Event { return new(Quarantine) }},
	{Name: KindHandoff, ID: IDEngine, Schema: SchemaHandoff,
		Publishers: []string{RoleRouter}, History: true,
		New: func() Event { return new(Handoff) }},
	{Name: KindRequest, ID: IDRouter, Schema: SchemaRequest,
		Publishers: []string{RoleRouter}, History: false,
		New: func() Event { return new(RequestCompleted) }},
	{Name: KindProbe, ID: IDEngine, Schema: SchemaProbe,
		Publishers: []string{RoleBreaker}, History: true,
		New: func() Event { return new(Probe) }},
	{Name: KindEligibility, ID: IDEngine, Schema: SchemaEligibility,
		Publishers: []string{RoleBreaker}, History: true,
		New: func() Event { return new(Eligibility) }},
	{Name: KindChaos, ID: IDEngine, Schema: SchemaChaos,
		Publishers: []string{RoleChaos}, History: true,
		New: func() Event { return new(Chaos) }},
	{Name: KindFleet, ID: IDEngine, Schema: SchemaFleet,
		Publishers: []string{RoleBreaker}, History: true,
		New: func() Event { return new(FleetChange) }},
	{Name: KindKVRecomputed, ID: IDEngine, Schema: SchemaKVRecomputed,
		Publishers: []string{RoleRouter}, History: true,
		New: func() Event { return new(KVRecomputed) }},
	{Name: KindAdmission, ID: IDEngine, Schema: SchemaAdmission,
		Publishers: []string{RoleBreaker}, History: false,
		New: func() Event { return new(Admission) }},
}

// EventKinds returns the table of bus event kinds, one row per kind, in
// a fixed order (the order of the credentials' permissions and of the
// history stream's sources). The rows' slices are shared: callers must
// not change them.
func EventKinds() []EventKind { return slices.Clone(eventKinds) }

// EventKindNames returns every kind's Name, in the order of EventKinds.
func EventKindNames() []string {
	names := make([]string, len(eventKinds))
	for i, k := range eventKinds {
		names[i] = k.Name
	}
	return names
}

// LookupEventKind returns the row of kind name, and false when the table
// has none.
func LookupEventKind(name string) (EventKind, bool) {
	for _, k := range eventKinds {
		if k.Name == name {
			return k, true
		}
	}
	return EventKind{}, false
}

// ValueSchemas are the schemas of SchemaFS that are not events' but KV
// bucket values' (behaviour.md R-BUS-9): every other file is the schema of
// a row of EventKinds.
func ValueSchemas() []string {
	return []string{SchemaPlacement, SchemaFleetEntry, SchemaRouterReport, SchemaRegistration}
}
