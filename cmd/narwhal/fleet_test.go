package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/fleet"
	"github.com/narwhalmesh/narwhal/schemas"
	"time"
)

// fleetState returns every key of narwhal_fleet with its revision and
// value: what a command that changes nothing must leave as it was.
func fleetState(t *testing.T, kv jetstream.KeyValue) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cmdTestBound)
	defer cancel()
	lister, err := kv.ListKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	for k := range lister.Keys() {
		e, err := kv.Get(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&out, "%s@%d=%s\n", k, e.Revision(), e.Value())
	}
	return out.String()
}

// runFleetCmd runs `narwhal fleet args…` and returns its output and error.
func runFleetCmd(args ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), cmdTestBound)
	defer cancel()
	err := runFleet(ctx, args, &stdout, &stderr)
	return stdout.String() + stderr.String(), err
}

// TestFleetCommandBadInputChangesNothing proves behaviour.md §14 and R-FLEET-1:
// `narwhal fleet` refuses each invalid input with an error naming what is
// wrong — a duplicate id, a bad URL, an unknown role or connector, a
// negative slot count, a bad id, removing an engine that is not drained,
// undraining an active one, draining or removing one that is not in the
// fleet — and each leaves narwhal_fleet exactly as it was (keys,
// revisions, values).
func TestFleetCommandBadInputChangesNothing(t *testing.T) {
	b := eventsBus(t)
	ctx := context.Background()
	kv, err := b.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := runFleetCmd("add", "--id", "d1", "--url", "http://127.0.0.1:9001", "--role", "decode", "--decode-slots", "4"); err != nil {
		t.Fatalf("add d1: %v\n%s", err, out)
	}
	// An active engine as a seed would write it.
	active := schemas.FleetEntry{Schema: schemas.SchemaFleetEntry, EngineID: "p1", URL: "http://127.0.0.1:9000", Role: "prefill", Connector: "nixl",
		State: schemas.FleetActive, Source: schemas.SourceConfig, By: "test"}
	data, _ := json.Marshal(active)
	if _, err := kv.Create(ctx, "p1", data); err != nil {
		t.Fatal(err)
	}
	before := fleetState(t, kv)
	for _, c := range []struct {
		name string
		args []string
		want string
	}{
		{"duplicate id", []string{"add", "--id", "d1", "--url", "http://127.0.0.1:9009", "--role", "decode"}, "already in the fleet"},
		{"url without scheme", []string{"add", "--id", "d2", "--url", "127.0.0.1:9002", "--role", "decode"}, "--url"},
		{"url of another scheme", []string{"add", "--id", "d2", "--url", "ftp://127.0.0.1:9002", "--role", "decode"}, "--url"},
		{"url with a query", []string{"add", "--id", "d2", "--url", "http://127.0.0.1:9002/?x=1", "--role", "decode"}, "--url"},
		{"unknown role", []string{"add", "--id", "d2", "--url", "http://127.0.0.1:9002", "--role", "encoder"}, "--role"},
		{"no role", []string{"add", "--id", "d2", "--url", "http://127.0.0.1:9002"}, "--role"},
		{"unknown connector", []string{"add", "--id", "d2", "--url", "http://127.0.0.1:9002", "--role", "decode", "--connector", "lmcache9"}, "--connector"},
		{"negative slots", []string{"add", "--id", "d2", "--url", "http://127.0.0.1:9002", "--role", "decode", "--decode-slots", "-1"}, "--decode-slots"},
		{"bad id", []string{"add", "--id", "d.2", "--url", "http://127.0.0.1:9002", "--role", "decode"}, "--id"},
		{"bad api key variable", []string{"add", "--id", "d2", "--url", "http://127.0.0.1:9002", "--role", "decode", "--api-key-env", "1 X"}, "api_key_env"},
		{"remove an active engine", []string{"remove", "p1"}, "drain it first"},
		{"undrain an active engine", []string{"undrain", "p1"}, "not draining"},
		{"drain an unknown engine", []string{"drain", "d9"}, "not in the fleet"},
		{"remove an unknown engine", []string{"remove", "d9"}, "not in the fleet"},
		{"remove an unknown engine by force", []string{"remove", "d9", "--force"}, "not in the fleet"},
		{"drain two engines", []string{"drain", "p1", "d1"}, "exactly one engine id"},
		{"drain a bad id", []string{"drain", "p.1"}, "engine id"},
	} {
		out, err := runFleetCmd(c.args...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one naming %q\n%s", c.name, err, c.want, out)
		}
		if after := fleetState(t, kv); after != before {
			t.Errorf("%s changed the fleet:\nbefore %s\nafter  %s", c.name, before, after)
		}
	}
}

// TestFleetCommandLifecycle proves behaviour.md §14 and R-FLEET-2/3: add writes a
// joining entry, drain makes it draining, undrain active again, a drained
// engine undrains to joining, remove deletes a drained one, and list
// shows each engine with its state (--json: one object per line, nothing when empty).
func TestFleetCommandLifecycle(t *testing.T) {
	b := eventsBus(t)
	ctx := context.Background()
	st, err := fleet.Bind(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	state := func(id string) string {
		e, _, err := fleetGet(ctx, st, id)
		if err != nil {
			return err.Error()
		}
		return e.State
	}
	step := func(want string, args ...string) {
		t.Helper()
		if out, err := runFleetCmd(args...); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
		if got := state("d3"); got != want {
			t.Fatalf("after %v: state %q, want %q", args, got, want)
		}
	}
	if out, err := runFleetCmd("list", "--json"); err != nil || out != "" {
		t.Errorf("list --json of an empty fleet: %v %q, want nothing", err, out)
	}
	step(schemas.FleetJoining, "add", "--id", "d3", "--url", "http://127.0.0.1:9003/", "--role", "decode")
	e, rev, _ := fleetGet(ctx, st, "d3")
	if e.URL != "http://127.0.0.1:9003" || e.Source != schemas.SourceCommand || e.Connector != "nixl" {
		t.Errorf("added entry %+v", e)
	}
	// The breaker makes it active after its checks; here, by hand.
	if err := fleetStep(ctx, st, e, rev, fleet.Admit, "test", e.At); err != nil {
		t.Fatal(err)
	}
	step(schemas.FleetDraining, "drain", "d3")
	step(schemas.FleetDraining, "drain", "d3") // already draining: left as it is
	step(schemas.FleetActive, "undrain", "d3")
	step(schemas.FleetDraining, "drain", "d3")
	e, rev, _ = fleetGet(ctx, st, "d3")
	if err := fleetStep(ctx, st, e, rev, fleet.EndDrain, "test", e.At); err != nil {
		t.Fatal(err)
	}
	// Two routers report what d3 listed to them: list shows the union.
	rk, err := b.BindBucket(ctx, bus.RoutersBucket)
	if err != nil {
		t.Fatal(err)
	}
	for id, ms := range map[string][]string{"r1": {"model-b", "model-a"}, "r2": {"model-a"}} {
		rep, _ := json.Marshal(schemas.RouterReport{Schema: schemas.SchemaRouterReport, RouterID: id, At: time.Now().UTC(),
			Draining: map[string]int64{"d3": 0}, InFlight: map[string]int64{}, Models: map[string][]string{"d3": ms}})
		if err := bus.ValidateRouterReport(rep); err != nil {
			t.Fatalf("report %s: %v", rep, err)
		}
		if _, err := rk.Put(ctx, id, rep); err != nil {
			t.Fatal(err)
		}
	}
	out, err := runFleetCmd("list")
	if err != nil || !strings.Contains(out, "d3") || !strings.Contains(out, "drained") || !strings.Contains(out, "model-a,model-b") {
		t.Errorf("list (want d3 drained with model-a,model-b): %v\n%s", err, out)
	}
	out, err = runFleetCmd("list", "--json")
	var row fleetRow
	if err != nil || strings.Count(out, "\n") != 1 || json.Unmarshal([]byte(out), &row) != nil || row.EngineID != "d3" ||
		strings.Join(row.Models, ",") != "model-a,model-b" {
		t.Errorf("list --json (want one line holding d3 with its models): %v\n%s", err, out)
	}
	step(schemas.FleetJoining, "undrain", "d3")
	if out, err := runFleetCmd("remove", "d3"); err != nil { // joining: never took work
		t.Fatalf("remove a joining engine: %v\n%s", err, out)
	}
	if got := state("d3"); !strings.Contains(got, "not in the fleet") {
		t.Errorf("after remove: %s", got)
	}
	out, err = runFleetCmd("list", "--json")
	if err != nil || out != "" {
		t.Errorf("list --json after remove: %v %q, want nothing", err, out)
	}
}
