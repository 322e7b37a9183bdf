package fleet

import (
	"errors"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestStateMachine pins the engine state machine of docs/fleet.md
// ("States"; behaviour.md R-FLEET-2, R-FLEET-3): every state against
// every step, legal or not.
func TestStateMachine(t *testing.T) {
	states := []string{schemas.FleetJoining, schemas.FleetActive, schemas.FleetDraining, schemas.FleetDrained}
	want := map[string]map[Step]string{
		schemas.FleetJoining:  {Admit: schemas.FleetActive, Drain: schemas.FleetDraining},
		schemas.FleetActive:   {Drain: schemas.FleetDraining},
		schemas.FleetDraining: {EndDrain: schemas.FleetDrained, Undrain: schemas.FleetActive},
		schemas.FleetDrained:  {Undrain: schemas.FleetJoining},
	}
	for _, from := range states {
		for _, step := range []Step{Admit, Drain, EndDrain, Undrain} {
			to, ok := Next(from, step)
			if w, legal := want[from][step]; ok != legal || to != w {
				t.Errorf("Next(%s, %s) = %q, %v; want %q, %v", from, step, to, ok, w, legal)
			}
		}
	}
	if _, ok := Next(schemas.FleetGone, Undrain); ok {
		t.Error("gone is no state an engine can be moved from")
	}
}

// TestApply: a legal step sets state, since, at, by and reason and keeps
// the rest (the spec, the source, a registration's TTL); an illegal one
// is ErrIllegal and changes nothing.
func TestApply(t *testing.T) {
	t0 := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	cur := schemas.FleetEntry{Schema: schemas.SchemaFleetEntry, EngineID: "d1", URL: "http://127.0.0.1:1", Role: "decode", Connector: "nixl",
		State: schemas.FleetJoining, Since: t0, At: t0, Source: schemas.SourceRegistration, By: "agent-d1", Reason: "registered", TTLS: 15}
	now := time.Date(2025, 1, 2, 4, 0, 0, 0, time.FixedZone("x", 3600))
	next, err := Apply(cur, Admit, "breaker-1", "checks passed", now)
	if err != nil {
		t.Fatal(err)
	}
	want := cur
	want.State, want.Since, want.At, want.By, want.Reason = schemas.FleetActive, now.UTC(), now.UTC(), "breaker-1", "checks passed"
	if next != want {
		t.Errorf("Apply = %+v\nwant %+v", next, want)
	}
	if next.Since.Location() != time.UTC {
		t.Errorf("since %v, want UTC", next.Since)
	}
	same, err := Apply(cur, EndDrain, "breaker-1", "x", now)
	if !errors.Is(err, ErrIllegal) || same != cur {
		t.Errorf("EndDrain of a joining engine: %+v, %v; want it unchanged and ErrIllegal", same, err)
	}
}

// TestRemovable: without force only an engine that never took work
// (joining) or is done with it (drained) leaves.
func TestRemovable(t *testing.T) {
	for state, want := range map[string]bool{schemas.FleetJoining: true, schemas.FleetActive: false, schemas.FleetDraining: false, schemas.FleetDrained: true} {
		if got := Removable(state); got != want {
			t.Errorf("Removable(%s) = %v, want %v", state, got, want)
		}
	}
}

// TestNewJoiningAndKeyTTL: a new engine is a schema-valid joining entry
// of the spec, the API key left out; only a registration's key carries a
// TTL.
func TestNewJoiningAndKeyTTL(t *testing.T) {
	spec := config.EngineSpec{ID: "p1", URL: "http://127.0.0.1:2", Role: connector.RolePrefill, Connector: "nixl", PrefillSlots: 2,
		APIKeyEnv: "P1_KEY", APIKey: "secret"}
	now := time.Now()
	e := NewJoining(spec, schemas.SourceCommand, "narwhal-fleet", "added", now)
	if e.State != schemas.FleetJoining || e.Source != schemas.SourceCommand || e.By != "narwhal-fleet" || e.Reason != "added" ||
		e.EngineID != "p1" || e.Role != "prefill" || e.PrefillSlots != 2 || e.APIKeyEnv != "P1_KEY" || !e.Since.Equal(now) {
		t.Errorf("NewJoining = %+v", e)
	}
	if err := Check(e); err != nil {
		t.Errorf("Check(NewJoining) = %v", err)
	}
	if ttl := KeyTTL(e); ttl != 0 {
		t.Errorf("KeyTTL of a command's entry = %v, want 0", ttl)
	}
	e.Source, e.TTLS = schemas.SourceRegistration, 1.5
	if ttl := KeyTTL(e); ttl != 1500*time.Millisecond {
		t.Errorf("KeyTTL of a registration = %v, want 1.5s", ttl)
	}
	e.EngineID = "p.1"
	if err := Check(e); err == nil {
		t.Error("Check accepted an entry with an invalid id")
	}
}
