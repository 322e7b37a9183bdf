package schemas

import "embed"

// SchemaFS holds the JSON Schema (draft 2020-12) of every bus event, one
// file per schema name at the root: "<name>.json", e.g.
// "narwhal.failure.v1.json" for SchemaFailure (behaviour.md R-BUS-3). Each file's
// $id is "https://github.com/narwhalmesh/narwhal/schemas/<name>.json". The
// schemas match the event types of this package field for field, with
// "additionalProperties": false, "schema" as a const and "at" as an
// RFC 3339 UTC date-time; a dashboard or a test validates a message by the
// file its "schema" field names. Every file is the Schema of a row of
// EventKinds, or one of ValueSchemas: narwhal.placement.v1.json
// (SchemaPlacement) is the schema of a narwhal_placement value,
// narwhal.engine.v1.json and narwhal.router.v1.json those of the fleet's
// and the routers' buckets.
//
//go:embed *.json
var SchemaFS embed.FS
