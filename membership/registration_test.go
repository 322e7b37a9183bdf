package membership

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"strings"
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

// lastRegistration returns the last registration on engine id's
// subject and its stream sequence; ok is false when there is none.
func lastRegistration(t *testing.T, b *bus.Bus, id string) (reg schemas.Registration, seq uint64, ok bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := b.JetStream().Stream(ctx, bus.RegistrationsStream)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(ctx, bus.RegistrationSubject(id))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return reg, 0, false
	}
	if err != nil {
		t.Fatal(err)
	}
	reg, err = bus.ParseRegistration(m.Subject, m.Data)
	if err != nil {
		t.Fatalf("the registration published is not valid: %v\n%s", err, m.Data)
	}
	return reg, m.Sequence, true
}

// TestRegistrationHeartbeatsRFLEET5 proves R-FLEET-4 and R-FLEET-5 from
// the engine's side: Register publishes a schema-valid registration of
// the engine's own spec on its own subject, asking for joining; Run
// publishes it again every TTL/3, the same spec every time; and the
// engine writes nothing to narwhal_fleet (the breaker alone does).
func TestRegistrationHeartbeatsRFLEET5(t *testing.T) {
	b, kv := testBus(t)
	ctx := context.Background()
	const ttl = 900 * time.Millisecond // a heartbeat every 300 ms
	r, err := Register(ctx, b, spec, ttl, "agent-test", quiet)
	if err != nil {
		t.Fatal(err)
	}
	reg, first, ok := lastRegistration(t, b, "d9")
	if !ok || reg.State != schemas.AskJoining || reg.URL != spec.URL || reg.Role != "decode" || reg.By != "agent-test" || reg.TTLS != ttl.Seconds() {
		t.Fatalf("registration %+v (published: %v)", reg, ok)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	var seq uint64
	testkit.WaitFor(t, 3*time.Second, "three heartbeats", func() bool {
		reg, seq, _ = lastRegistration(t, b, "d9")
		return seq >= first+3
	})
	if reg.URL != spec.URL || reg.State != schemas.AskJoining {
		t.Fatalf("heartbeat %+v, want the engine's own spec asking joining", reg)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if e := entryOf(t, kv, "d9"); e != nil {
		t.Fatalf("the engine wrote the fleet: %+v", e)
	}
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

// TestDrainWaitsForRouters proves the agent's drain (R-FLEET-3,
// R-FLEET-5): Drain publishes state draining at once and returns only
// when the breaker made the engine draining and every router's in-flight
// report lists it with zero legs — not while one still has a leg there —
// and Leave publishes state leaving.
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
	// The test is the breaker: the engine is active when its drain starts
	// (an engine the fleet never held has nothing to drain).
	put := func(state string) {
		now := time.Now().UTC()
		entry := schemas.FleetEntry{Schema: schemas.SchemaFleetEntry, EngineID: "d9", URL: spec.URL, Role: "decode", Connector: "nixl",
			State: state, Since: now, At: now, Source: schemas.SourceRegistration, By: "breaker-x", TTLS: 2}
		v, _ := json.Marshal(entry)
		if _, err := kv.Put(ctx, "d9", v); err != nil {
			t.Fatal(err)
		}
	}
	put(schemas.FleetActive)
	drained := make(chan error, 1)
	dctx, dcancel := context.WithTimeout(ctx, 10*time.Second)
	defer dcancel()
	go func() { drained <- r.Drain(dctx) }()
	testkit.WaitFor(t, time.Second, "a registration asking draining", func() bool {
		reg, _, ok := lastRegistration(t, b, "d9")
		return ok && reg.State == schemas.AskDraining
	})
	// The breaker writes the state asked for.
	put(schemas.FleetDraining)
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
	if reg, _, _ := lastRegistration(t, b, "d9"); reg.State != schemas.AskDraining {
		t.Fatalf("while stopping: %+v, want draining asked", reg)
	}
	if err := r.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	stop()
	<-done
	if reg, _, _ := lastRegistration(t, b, "d9"); reg.State != schemas.AskLeaving {
		t.Fatalf("after Leave: %+v, want leaving asked", reg)
	}
}

// TestRegisterWithAnotherEnginesCredentialNamesTheRefusalRBUS11 proves
// that an engine registering with another engine's credential on a bus
// that enforces credentials (a real --auth server, R-BUS-11) fails with
// an error naming the permissions violation on its own subject and the
// credential that would do, engine-<id>.creds — not only a deadline.
func TestRegisterWithAnotherEnginesCredentialNamesTheRefusalRBUS11(t *testing.T) {
	dir := bustest.Credentials(t)
	e := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	b := bustest.Connect(t, e, bus.ConnectOptions{Name: "engine-d3", CredsFile: bustest.Identity(t, dir, bus.RoleEngine, "d3"),
		Role: bus.RoleEngine, ID: "d3"})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	d4 := spec
	d4.ID = "d4"
	_, err := Register(ctx, b, d4, time.Minute, "agent-d4", quiet)
	if err == nil {
		t.Fatal("engine d4 registered with engine d3's credential")
	}
	for _, want := range []string{"Permissions Violation", `"narwhal.registrations.d4"`, "engine-d4.creds", "NARWHAL_NATS_CREDS"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Register with another engine's credential: %v\nwant it to name %s", err, want)
		}
	}
}

// TestRegisterKeyEnvOfItsIDRFLEET5: Register refuses, before it touches
// the bus, a spec whose APIKeyEnv is neither empty nor the id's own
// variable (R-FLEET-5: the breaker would refuse the registration).
func TestRegisterKeyEnvOfItsIDRFLEET5(t *testing.T) {
	spec := config.EngineSpec{ID: "d-1", URL: "http://127.0.0.1:1", Role: "decode", Connector: "nixl", APIKeyEnv: "D1_API_KEY"}
	_, err := Register(context.Background(), nil, spec, time.Second, "agent-d-1", slog.New(slog.NewTextHandler(io.Discard, nil)))
	if !errors.Is(err, bus.ErrRegistrationKeyEnv) {
		t.Fatalf("Register naming D1_API_KEY: %v, want ErrRegistrationKeyEnv", err)
	}
}
