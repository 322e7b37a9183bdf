package bus

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"sync"

	"github.com/santhosh-tekuri/jsonschema/v6"

	"github.com/narwhalmesh/narwhal/schemas"
)

// schemaIDPrefix is the $id prefix of the files in schemas.SchemaFS.
const schemaIDPrefix = "https://github.com/narwhalmesh/narwhal/schemas/"

var eventSchemas struct {
	once   sync.Once
	byName map[string]*jsonschema.Schema
	err    error
}

// ValidateEvent checks one bus message against the JSON Schema its
// "schema" field names, from schemas.SchemaFS (behaviour.md R-BUS-3), with format
// assertions on ("at" must be an RFC 3339 UTC date-time). The schemas are
// compiled once, on first use. It returns nil for a valid event, and an
// error when payload is not a JSON object, names no known schema, or does
// not match it (the error lists every violation), or when a row of
// schemas.EventKinds names a schema that has no file. Tests of every
// package that publishes use it on each message they see.
func ValidateEvent(payload []byte) error {
	var head struct {
		Schema *string `json:"schema"`
	}
	if err := json.Unmarshal(payload, &head); err != nil {
		return fmt.Errorf("bus: event is not a JSON object: %w", err)
	}
	if head.Schema == nil {
		return fmt.Errorf("bus: event has no schema field")
	}
	eventSchemas.once.Do(compileEventSchemas)
	if eventSchemas.err != nil {
		return eventSchemas.err
	}
	sch, ok := eventSchemas.byName[*head.Schema]
	if !ok {
		return fmt.Errorf("bus: unknown event schema %q", *head.Schema)
	}
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(payload))
	if err != nil {
		return fmt.Errorf("bus: event is not JSON: %w", err)
	}
	if err := sch.Validate(inst); err != nil {
		return fmt.Errorf("bus: event does not match schema %s: %w", *head.Schema, err)
	}
	return nil
}

// compileEventSchemas compiles every file of schemas.SchemaFS; a row of
// schemas.EventKinds whose schema has no file is an error.
func compileEventSchemas() {
	files, err := fs.Glob(schemas.SchemaFS, "*.json")
	if err != nil {
		eventSchemas.err = fmt.Errorf("bus: event schemas: %w", err)
		return
	}
	c := jsonschema.NewCompiler()
	c.AssertFormat()
	for _, f := range files {
		b, err := schemas.SchemaFS.ReadFile(f)
		if err == nil {
			var doc any
			doc, err = jsonschema.UnmarshalJSON(bytes.NewReader(b))
			if err == nil {
				err = c.AddResource(schemaIDPrefix+f, doc)
			}
		}
		if err != nil {
			eventSchemas.err = fmt.Errorf("bus: event schema %s: %w", f, err)
			return
		}
	}
	byName := make(map[string]*jsonschema.Schema, len(files))
	for _, f := range files {
		sch, err := c.Compile(schemaIDPrefix + f)
		if err != nil {
			eventSchemas.err = fmt.Errorf("bus: event schema %s: %w", f, err)
			return
		}
		byName[strings.TrimSuffix(f, ".json")] = sch
	}
	for _, k := range schemas.EventKinds() {
		if byName[k.Schema] == nil {
			eventSchemas.err = fmt.Errorf("bus: event kind %s: no schema file %s.json", k.Name, k.Schema)
			return
		}
	}
	eventSchemas.byName = byName
}

// ValidatePlacement checks a value of KV bucket narwhal_placement against
// schemas/narwhal.placement.v1.json (behaviour.md R-BUS-9): an eligibility object
// with its writer's breaker_id and lease_term. It returns nil for a valid
// value and an error listing what is wrong otherwise. It does not check
// that the writer holds the lease; routers do that against the lease.
func ValidatePlacement(value []byte) error {
	return validateValue(schemas.SchemaPlacement, "placement", value)
}

// ValidateFleetEntry checks a value of KV bucket narwhal_fleet against
// schemas/narwhal.engine.v1.json (behaviour.md R-FLEET-1, R-BUS-9). It returns nil
// for a valid value and an error listing what is wrong otherwise. It does
// not check that engine_id is the key; readers do.
func ValidateFleetEntry(value []byte) error {
	return validateValue(schemas.SchemaFleetEntry, "fleet", value)
}

// MaxFleetValue is the largest value of KV bucket narwhal_fleet a reader
// accepts, in bytes; a larger one is ignored as invalid (R-BUS-9).
const MaxFleetValue = 4096

// ParseFleetEntry returns the fleet entry value holds for key, or why it is
// not one: larger than MaxFleetValue, not schema-valid (narwhal.engine.v1),
// or its engine_id is not the key. Routers and the breaker judge every
// value of narwhal_fleet with it (R-FLEET-1, R-BUS-9).
func ParseFleetEntry(key string, value []byte) (schemas.FleetEntry, error) {
	var e schemas.FleetEntry
	if len(value) > MaxFleetValue {
		return e, fmt.Errorf("value larger than %d bytes", MaxFleetValue)
	}
	if err := ValidateFleetEntry(value); err != nil {
		return e, err
	}
	if err := json.Unmarshal(value, &e); err != nil {
		return e, err
	}
	if e.EngineID != key {
		return e, errors.New("engine_id is not the key")
	}
	return e, nil
}

// ValidateRouterReport checks a value of KV bucket narwhal_routers against
// schemas/narwhal.router.v1.json (behaviour.md R-FLEET-3). It returns nil for a
// valid value and an error listing what is wrong otherwise.
func ValidateRouterReport(value []byte) error {
	return validateValue(schemas.SchemaRouterReport, "router report", value)
}

// validateValue checks a bucket value against the schema named name.
func validateValue(name, what string, value []byte) error {
	eventSchemas.once.Do(compileEventSchemas)
	if eventSchemas.err != nil {
		return eventSchemas.err
	}
	sch, ok := eventSchemas.byName[name]
	if !ok {
		return fmt.Errorf("bus: no schema %s", name)
	}
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(value))
	if err != nil {
		return fmt.Errorf("bus: %s value is not JSON: %w", what, err)
	}
	if err := sch.Validate(inst); err != nil {
		return fmt.Errorf("bus: %s value does not match schema %s: %w", what, name, err)
	}
	return nil
}
