package bus_test

import (
	"context"
	"errors"
	"io/fs"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestSchemasReachableFromTheBusRBUS3 proves the JSON Schemas of
// schemas/ are on the bus (R-BUS-3): setup writes each, byte for byte,
// into bucket narwhal_schemas under its name; a viewer (a dashboard) reads
// them; a router may not change them; a second setup writes nothing new.
func TestSchemasReachableFromTheBusRBUS3(t *testing.T) {
	e, dir := authServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	viewer := connectAs(t, e, dir, bus.RoleViewer)
	files, err := fs.Glob(schemas.SchemaFS, "*.json")
	if err != nil || len(files) < 10 {
		t.Fatalf("schema files %v: %v", files, err)
	}
	for _, f := range files {
		want, _ := schemas.SchemaFS.ReadFile(f)
		name := strings.TrimSuffix(f, ".json")
		got, err := viewer.Schema(ctx, name)
		if err != nil {
			t.Errorf("viewer reads schema %s: %v", name, err)
			continue
		}
		if string(got) != string(want) {
			t.Errorf("schema %s on the bus differs from schemas/%s", name, f)
		}
	}
	if _, err := viewer.Schema(ctx, "narwhal.nothing.v1"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Errorf("unknown schema: %v, want key not found", err)
	}

	router := connectID(t, e, dir, bus.RoleRouter, "r1")
	denied(t, router, "router rewrites a schema", "$KV.narwhal_schemas.narwhal.request.v1", func(ctx context.Context) error {
		_, err := router.JetStream().Publish(ctx, "$KV.narwhal_schemas.narwhal.request.v1", []byte(`{}`))
		return err
	})

	// Setup again (the admin's rerun): the values keep their revisions.
	admin := connectAs(t, e, dir, bus.RoleAdmin)
	kv, err := admin.JetStream().KeyValue(ctx, bus.SchemasBucket)
	if err != nil {
		t.Fatal(err)
	}
	before, err := kv.Get(ctx, schemas.SchemaRequest)
	if err != nil {
		t.Fatal(err)
	}
	if err := bus.Setup(ctx, admin, bus.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	after, err := kv.Get(ctx, schemas.SchemaRequest)
	if err != nil || after.Revision() != before.Revision() {
		t.Errorf("a second setup rewrote %s: revision %d → %v (%v)", schemas.SchemaRequest, before.Revision(), after, err)
	}
}
