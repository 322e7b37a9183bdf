package membership

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// testBus starts an embedded, set-up bus and connects to it.
func testBus(t *testing.T) (*bus.Bus, jetstream.KeyValue) {
	t.Helper()
	b := bustest.Connect(t, bustest.Start(t), bus.ConnectOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := b.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	return b, kv
}

// entryOf returns the engine's entry in the fleet bucket, nil when the key
// is gone.
func entryOf(t *testing.T, kv jetstream.KeyValue, id string) *schemas.FleetEntry {
	t.Helper()
	e, err := kv.Get(context.Background(), id)
	if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := bus.ValidateFleetEntry(e.Value()); err != nil {
		t.Fatalf("the registration wrote an invalid entry: %v\n%s", err, e.Value())
	}
	var fe schemas.FleetEntry
	if err := json.Unmarshal(e.Value(), &fe); err != nil {
		t.Fatal(err)
	}
	return &fe
}

var spec = config.EngineSpec{ID: "d9", URL: "http://127.0.0.1:1", Role: "decode", Connector: "nixl"}

// TestRegistrationLapsesRFLEET4 proves R-FLEET-4 on the bus: Register
// writes a schema-valid entry in state joining (source registration);
// while Run heartbeats the key outlives several TTLs and keeps the state
// another writer (the breaker) gave it; once the heartbeat stops (the
// process is gone) the bucket removes the key within the TTL plus one
// second — also when another process's write without a TTL came just
// before (the registration renews the key at once after it).
func TestRegistrationLapsesRFLEET4(t *testing.T) {
	b, kv := testBus(t)
	ctx := context.Background()
	const ttl = 3 * time.Second // a heartbeat every second
	r, err := Register(ctx, b, spec, ttl, "agent-test", quiet)
	if err != nil {
		t.Fatal(err)
	}
	e := entryOf(t, kv, "d9")
	if e == nil || e.State != schemas.FleetJoining || e.Source != schemas.SourceRegistration || e.URL != spec.URL || e.By != "agent-test" {
		t.Fatalf("entry %+v", e)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()

	// The breaker makes it active (a plain put: no TTL of its own).
	active := *e
	active.State, active.By, active.Reason = schemas.FleetActive, "breaker-x", "inference probe passed"
	v, _ := json.Marshal(active)
	if _, err := kv.Put(ctx, "d9", v); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(4 * time.Second)
	for time.Now().Before(deadline) {
		if cur := entryOf(t, kv, "d9"); cur == nil || cur.State != schemas.FleetActive {
			t.Fatalf("while heartbeating: %+v, want the breaker's active state kept", cur)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Another plain put (an operator's command), and the process dies
	// right after it, before its next periodic heartbeat: the watch's
	// renewal gave the key its TTL back at once.
	if _, err := kv.Put(ctx, "d9", v); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 150*time.Millisecond, "the renewal after the foreign write (the periodic one is up to 1 s away)", func() bool {
		e := entryOf(t, kv, "d9")
		return e != nil && e.By == "agent-test" && e.State == schemas.FleetActive
	})
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	testkit.WaitFor(t, ttl+time.Second, "the key lapsed", func() bool { return entryOf(t, kv, "d9") == nil })
	t.Logf("lapsed %v after the last heartbeat could have been sent", time.Since(stopped))
}

// TestRegisterRefusesOperatorEntry: an id the operator put in the fleet
// (seeded from config) is not taken over by a registration, and stays as
// it was.
func TestRegisterRefusesOperatorEntry(t *testing.T) {
	b, kv := testBus(t)
	ctx := context.Background()
	now := time.Now().UTC()
	seeded := schemas.FleetEntry{Schema: schemas.SchemaFleetEntry, EngineID: "d9", URL: "http://127.0.0.1:2", Role: "decode", Connector: "nixl",
		State: schemas.FleetActive, Since: now, At: now, Source: schemas.SourceConfig, By: "r1"}
	v, _ := json.Marshal(seeded)
	if _, err := kv.Put(ctx, "d9", v); err != nil {
		t.Fatal(err)
	}
	if _, err := Register(ctx, b, spec, time.Second, "agent-test", quiet); !errors.Is(err, ErrTaken) {
		t.Fatalf("Register over a config entry: %v, want ErrTaken", err)
	}
	if e := entryOf(t, kv, "d9"); e == nil || e.URL != "http://127.0.0.1:2" || e.Source != schemas.SourceConfig {
		t.Fatalf("entry changed: %+v", e)
	}
}

// TestDrainWaitsForRouters proves the agent's drain (R-FLEET-3): Drain
// writes state draining at once and returns only when every router's
// in-flight report lists the engine with zero legs — not while one
// still has a leg there — and Leave removes the key.
func TestDrainWaitsForRouters(t *testing.T) {
	b, kv := testBus(t)
	ctx := context.Background()
	r, err := Register(ctx, b, spec, 2*time.Second, "agent-test", quiet)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	routers, err := b.BindBucket(ctx, bus.RoutersBucket)
	if err != nil {
		t.Fatal(err)
	}
	report := func(id string, legs int64) {
		rep := schemas.RouterReport{Schema: schemas.SchemaRouterReport, RouterID: id, At: time.Now().UTC(),
			Draining: map[string]int64{"d9": legs}, InFlight: map[string]int64{}}
		if legs > 0 {
			rep.InFlight["d9"] = legs
		}
		v, _ := json.Marshal(rep)
		if _, err := routers.Put(ctx, id, v); err != nil {
			t.Fatal(err)
		}
	}
	report("r1", 0)
	report("r2", 2)
	drained := make(chan error, 1)
	dctx, dcancel := context.WithTimeout(ctx, 10*time.Second)
	defer dcancel()
	go func() { drained <- r.Drain(dctx) }()
	testkit.WaitFor(t, time.Second, "state draining", func() bool {
		e := entryOf(t, kv, "d9")
		return e != nil && e.State == schemas.FleetDraining
	})
	select {
	case err := <-drained:
		t.Fatalf("Drain returned %v while r2 has 2 legs on the engine", err)
	case <-time.After(300 * time.Millisecond):
	}
	report("r2", 0)
	select {
	case err := <-drained:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Drain did not return once every router reported zero")
	}
	stop()
	<-done
	if e := entryOf(t, kv, "d9"); e == nil || e.State != schemas.FleetDraining {
		t.Fatalf("after the drain: %+v, want still draining until it leaves", e)
	}
	if err := r.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	if e := entryOf(t, kv, "d9"); e != nil {
		t.Fatalf("after Leave: %+v", e)
	}
}
