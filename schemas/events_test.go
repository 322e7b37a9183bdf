package schemas_test

import (
	"bytes"
	"encoding/json"
	"io/fs"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/narwhalmesh/narwhal/schemas"
	"github.com/santhosh-tekuri/jsonschema/v6"
)

const schemaIDPrefix = "https://github.com/narwhalmesh/narwhal/schemas/"

// compileSchemas compiles every schema file of SchemaFS, with format
// assertions on, keyed by schema name.
func compileSchemas(t *testing.T) map[string]*jsonschema.Schema {
	t.Helper()
	files, err := fs.Glob(schemas.SchemaFS, "*.json")
	if err != nil {
		t.Fatal(err)
	}
	c := jsonschema.NewCompiler()
	c.AssertFormat()
	names := make([]string, 0, len(files))
	for _, f := range files {
		b, err := schemas.SchemaFS.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(b))
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		name := strings.TrimSuffix(f, ".json")
		if id, _ := doc.(map[string]any)["$id"].(string); id != schemaIDPrefix+f {
			t.Errorf("%s: $id %q, want %q", f, id, schemaIDPrefix+f)
		}
		if err := c.AddResource(schemaIDPrefix+f, doc); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		names = append(names, name)
	}
	out := make(map[string]*jsonschema.Schema, len(names))
	for _, name := range names {
		sch, err := c.Compile(schemaIDPrefix + name + ".json")
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out[name] = sch
	}
	return out
}

func validate(t *testing.T, sch *jsonschema.Schema, payload []byte) error {
	t.Helper()
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(payload))
	if err != nil {
		t.Fatalf("payload is not JSON: %v", err)
	}
	return sch.Validate(inst)
}

func f64(v float64) *float64 { return &v }

func intp(v int) *int { return &v }

// requestEnv is env for a request event, which has no engine_id.
func requestEnv() schemas.Envelope {
	e := env(schemas.SchemaRequest)
	e.EngineID = ""
	return e
}

var at = time.Date(2026, 3, 1, 12, 30, 45, 123456789, time.UTC)

func env(schema string) schemas.Envelope {
	return schemas.Envelope{Schema: schema, ID: "Ev1x2y3z", At: at, RouterID: "router-a", EngineID: "d1", RequestID: "req-1"}
}

// sample is one event type's samples: full (every field set) and minimal
// (only what the schema requires).
type sample struct {
	kind          string
	full, minimal schemas.Event
}

func samples() []sample {
	breakerEnv := func(schema string) schemas.Envelope {
		return schemas.Envelope{Schema: schema, ID: "Ev9", At: at, BreakerID: "breaker-1", EngineID: "d1"}
	}
	return []sample{
		{schemas.KindRequest,
			&schemas.RequestCompleted{Envelope: requestEnv(), Endpoint: "/v1/chat/completions", Model: "m", Stream: true,
				Status: 504, ErrorKind: "first_token_timeout", ProducerID: "p1", ConsumerID: "d1", Attempts: 2,
				TTFTSeconds: f64(0.12), FirstByteSeconds: f64(0.31), DurationSeconds: 1.5, PromptTokens: intp(12), CompletionTokens: intp(7)},
			&schemas.RequestCompleted{Envelope: schemas.Envelope{Schema: schemas.SchemaRequest, ID: "Ev2", At: at, RouterID: "router-a", RequestID: "req-2"},
				Endpoint: "/v1/completions", Status: 400}},
		{schemas.KindFailure,
			&schemas.Failure{Envelope: env(schemas.SchemaFailure), Phase: schemas.PhaseDecode, Kind: "decode_silence", Status: 504,
				UpstreamStatus: 200, Message: "engine went silent between tokens", Timeout: true, Counts: true,
				ProducerID: "p1", ConsumerID: "d1", BackendRequestID: "req-1-a1", Attempt: 1},
			&schemas.Failure{Envelope: schemas.Envelope{Schema: schemas.SchemaFailure, ID: "Ev3", At: at, RouterID: "r", EngineID: "p1"},
				Phase: schemas.PhasePrefill, Kind: "connect", Status: 502, Attempt: 1}},
		{schemas.KindQuarantine,
			&schemas.Quarantine{Envelope: env(schemas.SchemaQuarantine), DurationSeconds: 10, Until: at.Add(10 * time.Second), Reason: "first_token_timeout"},
			&schemas.Quarantine{Envelope: schemas.Envelope{Schema: schemas.SchemaQuarantine, ID: "Ev4", At: at, RouterID: "r", EngineID: "d1"},
				DurationSeconds: 0.5, Until: at, Reason: "connect"}},
		{schemas.KindHandoff,
			&schemas.Handoff{Envelope: env(schemas.SchemaHandoff), Outcome: schemas.HandoffAbandoned, Reason: "client_disconnected",
				ConsumerID: "d2", BackendRequestID: "req-1-a1", Connector: "nixl", AgeSeconds: 0.4, Released: true},
			&schemas.Handoff{Envelope: schemas.Envelope{Schema: schemas.SchemaHandoff, ID: "Ev5", At: at, RouterID: "r", EngineID: "p1"},
				Outcome: schemas.HandoffAbandoned, Reason: "decode_failed", Connector: "nixl"}},
		{schemas.KindProbe,
			&schemas.Probe{Envelope: breakerEnv(schemas.SchemaProbe), Outcome: "failure", Phase: schemas.PhaseDecode,
				ProducerID: "p1", ConsumerID: "d1", Message: "engine first token timeout"},
			&schemas.Probe{Envelope: breakerEnv(schemas.SchemaProbe), Outcome: "success", Phase: schemas.PhasePrefill}},
		{schemas.KindEligibility,
			&schemas.Eligibility{Envelope: breakerEnv(schemas.SchemaEligibility), Eligible: false, State: "ejected", Reason: "ejected after 3 failures", Streak: 3},
			&schemas.Eligibility{Envelope: breakerEnv(schemas.SchemaEligibility), Eligible: true, State: "eligible"}},
		{schemas.KindFleet,
			&schemas.FleetChange{Envelope: breakerEnv(schemas.SchemaFleet), State: schemas.FleetDrained, Previous: schemas.FleetDraining, Reason: "every router reports no leg in flight"},
			&schemas.FleetChange{Envelope: breakerEnv(schemas.SchemaFleet), State: schemas.FleetGone}},
		{schemas.KindAdmission,
			&schemas.Admission{Envelope: breakerEnv(schemas.SchemaAdmission), State: schemas.AdmissionRefused, Reason: "the fleet holds membership.max_engines (8) engines"},
			&schemas.Admission{Envelope: breakerEnv(schemas.SchemaAdmission), State: schemas.FleetGone, Previous: schemas.FleetJoining}},
		{schemas.KindChaos,
			&schemas.Chaos{Envelope: schemas.Envelope{Schema: schemas.SchemaChaos, ID: "Ev10", At: at, EngineID: "d1", RequestID: "req-1-a1"},
				Action: schemas.ChaosInject, Fault: "error-object", FaultID: "error-object", Phase: schemas.PhaseDecode,
				Probability: 0.5, Count: 3, Left: 2, Expires: at.Add(time.Minute), Params: map[string]string{"code": "503", "after_tokens": "2"}},
			&schemas.Chaos{Envelope: schemas.Envelope{Schema: schemas.SchemaChaos, ID: "Ev11", At: at, EngineID: "p1"},
				Action: schemas.ChaosArm, Fault: "connect-refused", FaultID: "refuse-all", Phase: "any", Probability: 1, Expires: at}},
		{schemas.KindKVRecomputed,
			&schemas.KVRecomputed{Envelope: schemas.Envelope{Schema: schemas.SchemaKVRecomputed, ID: "Ev12", At: at, RouterID: "router-a", EngineID: "d1", RequestID: "req-1"},
				ProducerID: "p1", Connector: "nixl", BackendRequestID: "req-1-1-abc", PromptTokens: 40, CachedTokens: 0, Counts: true},
			&schemas.KVRecomputed{Envelope: schemas.Envelope{Schema: schemas.SchemaKVRecomputed, ID: "Ev13", At: at, RouterID: "r", EngineID: "d2"},
				ProducerID: "p2", Connector: "sglang", PromptTokens: 17, CachedTokens: 8}},
	}
}

// TestEverySchemaFileIsAnEvent proves R-BUS-3: SchemaFS holds exactly one
// file per event schema name, and the placement value's (R-BUS-9).
func TestEverySchemaFileIsAnEvent(t *testing.T) {
	compiled := compileSchemas(t)
	var got []string
	for name := range compiled {
		got = append(got, name)
	}
	want := []string{schemas.SchemaRequest, schemas.SchemaFailure, schemas.SchemaQuarantine, schemas.SchemaHandoff, schemas.SchemaProbe, schemas.SchemaEligibility, schemas.SchemaChaos, schemas.SchemaPlacement,
		schemas.SchemaKVRecomputed, schemas.SchemaFleet, schemas.SchemaFleetEntry, schemas.SchemaRouterReport,
		schemas.SchemaRegistration, schemas.SchemaAdmission}
	sort.Strings(got)
	sort.Strings(want)
	if !slices.Equal(got, want) {
		t.Fatalf("schema files %v, want %v", got, want)
	}
}

// TestSamplesValidate proves R-BUS-3: a marshalled event of every type,
// fully populated or minimal, validates against the schema its "schema"
// field names, and its subject is narwhal.events.<kind>.<id>, followed by
// .<router_id> for a router's events about an engine (R-BUS-1, R-BUS-11).
func TestSamplesValidate(t *testing.T) {
	compiled := compileSchemas(t)
	for _, s := range samples() {
		for _, ev := range []schemas.Event{s.full, s.minimal} {
			payload, err := json.Marshal(ev)
			if err != nil {
				t.Fatal(err)
			}
			sch := compiled[ev.Head().Schema]
			if sch == nil {
				t.Fatalf("no schema %q", ev.Head().Schema)
			}
			if err := validate(t, sch, payload); err != nil {
				t.Errorf("%s: %s\n%v", s.kind, payload, err)
			}
			id := ev.Head().EngineID
			if s.kind == schemas.KindRequest {
				id = ev.Head().RouterID
			}
			want := "narwhal.events." + s.kind + "." + id
			if k, _ := schemas.LookupEventKind(s.kind); k.Routed() {
				want += "." + ev.Head().RouterID
			}
			if ev.Subject() != want {
				t.Errorf("subject %q, want %q", ev.Subject(), want)
			}
		}
	}
}

// TestBrokenEventsFail proves the schemas reject what is not an event:
// every mutation below of a valid event fails validation.
func TestBrokenEventsFail(t *testing.T) {
	compiled := compileSchemas(t)
	type mutation struct {
		name   string
		mutate func(m map[string]any)
	}
	common := []mutation{
		{"missing schema", func(m map[string]any) { delete(m, "schema") }},
		{"other schema", func(m map[string]any) { m["schema"] = "narwhal.other.v1" }},
		{"missing id", func(m map[string]any) { delete(m, "id") }},
		{"empty id", func(m map[string]any) { m["id"] = "" }},
		{"missing at", func(m map[string]any) { delete(m, "at") }},
		{"at not a date-time", func(m map[string]any) { m["at"] = "yesterday" }},
		{"at not UTC", func(m map[string]any) { m["at"] = "2026-03-01T13:30:45.123456789+01:00" }},
		{"at a number", func(m map[string]any) { m["at"] = 1700000000 }},
		{"unknown field", func(m map[string]any) { m["extra"] = 1 }},
		{"missing engine or router id", func(m map[string]any) {
			if m["schema"] == schemas.SchemaRequest {
				delete(m, "router_id")
			} else {
				delete(m, "engine_id")
			}
		}},
	}
	specific := map[string][]mutation{
		schemas.SchemaRequest: {
			{"status a string", func(m map[string]any) { m["status"] = "200" }},
			{"status out of range", func(m map[string]any) { m["status"] = 0 }},
			{"ttft_s missing", func(m map[string]any) { delete(m, "ttft_s") }},
			{"ttft_s negative", func(m map[string]any) { m["ttft_s"] = -1 }},
			{"unknown endpoint", func(m map[string]any) { m["endpoint"] = "/v1/embeddings" }},
			{"fractional tokens", func(m map[string]any) { m["completion_tokens"] = 1.5 }},
			{"missing request_id", func(m map[string]any) { delete(m, "request_id") }},
			// A request event names its engines producer_id and
			// consumer_id; engine_id would repeat one of them.
			{"engine_id present", func(m map[string]any) { m["engine_id"] = "d1" }},
			{"negative tokens", func(m map[string]any) { m["prompt_tokens"] = -1 }},
		},
		schemas.SchemaFailure: {
			{"unknown phase", func(m map[string]any) { m["phase"] = "both" }},
			{"attempt 0", func(m map[string]any) { m["attempt"] = 0 }},
			{"counts missing", func(m map[string]any) { delete(m, "counts") }},
			{"timeout a string", func(m map[string]any) { m["timeout"] = "true" }},
			{"no router_id", func(m map[string]any) { delete(m, "router_id") }},
		},
		schemas.SchemaQuarantine: {
			{"zero duration", func(m map[string]any) { m["duration_s"] = 0 }},
			{"until not a date-time", func(m map[string]any) { m["until"] = "soon" }},
		},
		schemas.SchemaHandoff: {
			{"unknown outcome", func(m map[string]any) { m["outcome"] = "consumed?" }},
			{"released missing", func(m map[string]any) { delete(m, "released") }},
			{"negative age", func(m map[string]any) { m["age_s"] = -0.1 }},
		},
		schemas.SchemaProbe: {
			{"unknown outcome", func(m map[string]any) { m["outcome"] = "maybe" }},
			{"no breaker_id", func(m map[string]any) { delete(m, "breaker_id") }},
		},
		schemas.SchemaEligibility: {
			{"eligible disagrees with state", func(m map[string]any) { m["eligible"] = !m["eligible"].(bool) }},
			{"unknown state", func(m map[string]any) { m["state"] = "probing" }},
			{"negative streak", func(m map[string]any) { m["streak"] = -1 }},
		},
		schemas.SchemaKVRecomputed: {
			{"no router_id", func(m map[string]any) { delete(m, "router_id") }},
			{"no producer_id", func(m map[string]any) { delete(m, "producer_id") }},
			{"negative cached tokens", func(m map[string]any) { m["cached_tokens"] = -1 }},
			{"prompt tokens 0", func(m map[string]any) { m["prompt_tokens"] = 0 }},
			{"fractional cached tokens", func(m map[string]any) { m["cached_tokens"] = 1.5 }},
			{"counts missing", func(m map[string]any) { delete(m, "counts") }},
		},
		schemas.SchemaChaos: {
			{"unknown action", func(m map[string]any) { m["action"] = "arm-later" }},
			{"unknown fault", func(m map[string]any) { m["fault"] = "meteor-strike" }},
			{"fault_id with a dot", func(m map[string]any) { m["fault_id"] = "a.b" }},
			{"unknown phase", func(m map[string]any) { m["phase"] = "both" }},
			{"inject on phase any", func(m map[string]any) { m["action"], m["phase"] = "inject", "any" }},
			{"probability above 1", func(m map[string]any) { m["probability"] = 1.5 }},
			{"negative count", func(m map[string]any) { m["count"] = -1 }},
			{"left 0", func(m map[string]any) { m["left"] = 0 }},
			{"expires missing", func(m map[string]any) { delete(m, "expires") }},
			{"expires not UTC", func(m map[string]any) { m["expires"] = "2026-03-01T13:30:45+01:00" }},
			{"param not a string", func(m map[string]any) { m["params"] = map[string]any{"code": 503} }},
		},
	}
	for _, s := range samples() {
		for _, ev := range []schemas.Event{s.full, s.minimal} {
			payload, err := json.Marshal(ev)
			if err != nil {
				t.Fatal(err)
			}
			name := ev.Head().Schema
			for _, mu := range append(slices.Clone(common), specific[name]...) {
				var m map[string]any
				if err := json.Unmarshal(payload, &m); err != nil {
					t.Fatal(err)
				}
				mu.mutate(m)
				broken, _ := json.Marshal(m)
				if err := validate(t, compiled[name], broken); err == nil {
					t.Errorf("%s, %s: broken event validated: %s", name, mu.name, broken)
				}
			}
		}
	}
}

// subjectIDs are the envelope fields a schema requires although the Go
// type marks them omitempty: the id that ends the event's subject
// (R-BUS-1), and the request id of a request event (R-API-6).
var subjectIDs = map[string][]string{
	schemas.SchemaRequest:      {"router_id", "request_id"},
	schemas.SchemaFailure:      {"router_id", "engine_id"},
	schemas.SchemaQuarantine:   {"router_id", "engine_id"},
	schemas.SchemaHandoff:      {"router_id", "engine_id"},
	schemas.SchemaProbe:        {"breaker_id", "engine_id"},
	schemas.SchemaEligibility:  {"breaker_id", "engine_id"},
	schemas.SchemaChaos:        {"engine_id"},
	schemas.SchemaKVRecomputed: {"router_id", "engine_id"},
	schemas.SchemaFleet:        {"breaker_id", "engine_id"},
	schemas.SchemaAdmission:    {"breaker_id", "engine_id"},
}

// forbidden are the envelope fields a schema forbids (a property whose
// schema is "not": {}): a request event has no engine_id.
var forbidden = map[string][]string{
	schemas.SchemaRequest: {"engine_id"},
}

// TestSchemasMatchGoTypes proves the schema files and the Go types agree
// field for field: the same JSON names, each field's JSON type, and
// required = the fields without omitempty plus the subject ids; a field
// the schema forbids is a property that matches nothing.
func TestSchemasMatchGoTypes(t *testing.T) {
	for _, s := range samples() {
		name := s.full.Head().Schema
		b, err := schemas.SchemaFS.ReadFile(name + ".json")
		if err != nil {
			t.Fatal(err)
		}
		var doc struct {
			Type                 string                    `json:"type"`
			Required             []string                  `json:"required"`
			Properties           map[string]map[string]any `json:"properties"`
			AdditionalProperties *bool                     `json:"additionalProperties"`
		}
		if err := json.Unmarshal(b, &doc); err != nil {
			t.Fatal(err)
		}
		if doc.Type != "object" || doc.AdditionalProperties == nil || *doc.AdditionalProperties {
			t.Errorf("%s: want an object with additionalProperties false", name)
		}
		if c, _ := doc.Properties["schema"]["const"].(string); c != name {
			t.Errorf("%s: schema const %q", name, c)
		}

		fields := map[string]reflect.StructField{}
		var required []string
		var walk func(reflect.Type)
		walk = func(rt reflect.Type) {
			for i := range rt.NumField() {
				f := rt.Field(i)
				if f.Anonymous {
					walk(f.Type)
					continue
				}
				tag, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
				fields[tag] = f
				if !strings.Contains(opts, "omitempty") {
					required = append(required, tag)
				}
			}
		}
		walk(reflect.TypeOf(s.full).Elem())
		required = append(required, subjectIDs[name]...)
		sort.Strings(required)
		gotRequired := slices.Clone(doc.Required)
		sort.Strings(gotRequired)
		if !slices.Equal(gotRequired, required) {
			t.Errorf("%s: required %v, want %v", name, gotRequired, required)
		}
		if len(doc.Properties) != len(fields) {
			t.Errorf("%s: %d properties, Go type has %d fields", name, len(doc.Properties), len(fields))
		}
		for tag, f := range fields {
			p, ok := doc.Properties[tag]
			if !ok {
				t.Errorf("%s: Go field %s (%q) has no property", name, f.Name, tag)
				continue
			}
			if tag == "schema" {
				continue
			}
			if slices.Contains(forbidden[name], tag) {
				if not, ok := p["not"].(map[string]any); !ok || len(not) != 0 || p["type"] != nil {
					t.Errorf("%s.%s: want a forbidden property (\"not\": {}), got %v", name, tag, p)
				}
				continue
			}
			var want any
			switch {
			case f.Type == reflect.TypeFor[time.Time]():
				want = "string"
				if p["format"] != "date-time" {
					t.Errorf("%s.%s: format %v, want date-time", name, tag, p["format"])
				}
			case f.Type == reflect.TypeFor[*float64]():
				want = []any{"number", "null"}
			case f.Type == reflect.TypeFor[*int]():
				want = "integer" // omitempty: absent when unknown, never null
			case f.Type == reflect.TypeFor[map[string]string]():
				want = "object"
				if ap, _ := p["additionalProperties"].(map[string]any); ap["type"] != "string" {
					t.Errorf("%s.%s: additionalProperties %v, want string values", name, tag, p["additionalProperties"])
				}
			default:
				want = map[reflect.Kind]string{reflect.String: "string", reflect.Bool: "boolean", reflect.Int: "integer", reflect.Uint64: "integer", reflect.Float64: "number"}[f.Type.Kind()]
			}
			if !reflect.DeepEqual(p["type"], want) {
				t.Errorf("%s.%s: type %v, want %v", name, tag, p["type"], want)
			}
		}
	}
}

// TestBoundField proves that client strings put in events and logs are
// bounded: at most schemas.MaxFieldBytes bytes of the original, cut on a UTF-8
// boundary, then the marker; short strings unchanged.
func TestBoundField(t *testing.T) {
	if got := schemas.BoundField("llama-3"); got != "llama-3" {
		t.Fatalf("short string changed: %q", got)
	}
	exact := strings.Repeat("a", schemas.MaxFieldBytes)
	if got := schemas.BoundField(exact); got != exact {
		t.Fatalf("string of exactly schemas.MaxFieldBytes changed")
	}
	long := strings.Repeat("b", 1<<20)
	got := schemas.BoundField(long)
	if got != strings.Repeat("b", schemas.MaxFieldBytes)+schemas.TruncatedMarker {
		t.Fatalf("1 MiB string bounded to %d bytes: %.40q…", len(got), got)
	}
	// A 3-byte character straddling the cut is dropped whole.
	multi := strings.Repeat("a", schemas.MaxFieldBytes-1) + "€€€"
	got = schemas.BoundField(multi)
	if !utf8.ValidString(got) || got != strings.Repeat("a", schemas.MaxFieldBytes-1)+schemas.TruncatedMarker {
		t.Fatalf("cut inside a character: %q", got[len(got)-20:])
	}
}

// TestFleetValuesValidate proves R-FLEET-1, R-FLEET-3, R-FLEET-5 and R-BUS-9: a
// fleet entry, a registration and a router report as marshalled validate against their schemas,
// and the mutations a forger or a bug would make do not.
func TestFleetValuesValidate(t *testing.T) {
	compiled := compileSchemas(t)
	entry := schemas.FleetEntry{Schema: schemas.SchemaFleetEntry, EngineID: "d3", URL: "http://127.0.0.1:9003", Role: "decode",
		Connector: "nixl", DecodeSlots: 4, State: schemas.FleetJoining, Since: at, At: at, Source: schemas.SourceCommand, By: "narwhal-fleet"}
	reg := schemas.Registration{Schema: schemas.SchemaRegistration, EngineID: "d3", URL: "http://127.0.0.1:9003", Role: "decode",
		Connector: "nixl", State: schemas.AskJoining, TTLS: 15, At: at, By: "agent-d3"}
	report := schemas.RouterReport{Schema: schemas.SchemaRouterReport, RouterID: "rt-1", At: at,
		Draining: map[string]int64{"d3": 0}, InFlight: map[string]int64{"d1": 2}}
	for _, c := range []struct {
		schema string
		value  any
		bad    []func(m map[string]any)
	}{
		{schemas.SchemaFleetEntry, entry, []func(m map[string]any){
			func(m map[string]any) { m["state"] = "eligible" },
			func(m map[string]any) { m["role"] = "encoder" },
			func(m map[string]any) { m["url"] = "ftp://x" },
			func(m map[string]any) { m["engine_id"] = "d 3" },
			func(m map[string]any) { m["decode_slots"] = -1 },
			func(m map[string]any) { m["api_key"] = "secret" },
			func(m map[string]any) { delete(m, "state") },
		}},
		{schemas.SchemaRegistration, reg, []func(m map[string]any){
			func(m map[string]any) { m["state"] = "active" },
			func(m map[string]any) { m["state"] = "drained" },
			func(m map[string]any) { m["url"] = "ftp://x" },
			func(m map[string]any) { m["engine_id"] = "d3.x" },
			func(m map[string]any) { m["ttl_s"] = 0 },
			func(m map[string]any) { m["source"] = "config" },
			func(m map[string]any) { delete(m, "ttl_s") },
		}},
		{schemas.SchemaRouterReport, report, []func(m map[string]any){
			func(m map[string]any) { m["draining"] = map[string]any{"d3": -1} },
			func(m map[string]any) { m["inflight"] = map[string]any{"d 1": 1} },
			func(m map[string]any) { delete(m, "draining") },
		}},
	} {
		payload, err := json.Marshal(c.value)
		if err != nil {
			t.Fatal(err)
		}
		if err := validate(t, compiled[c.schema], payload); err != nil {
			t.Fatalf("%s: %s\n%v", c.schema, payload, err)
		}
		for i, mutate := range c.bad {
			var m map[string]any
			_ = json.Unmarshal(payload, &m)
			mutate(m)
			b, _ := json.Marshal(m)
			if validate(t, compiled[c.schema], b) == nil {
				t.Errorf("%s: mutation %d validates: %s", c.schema, i, b)
			}
		}
	}
}
