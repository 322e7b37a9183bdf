package fleet

import (
	"errors"
	"fmt"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Step is what moves an engine of the live fleet from one state to
// another (behaviour.md R-FLEET-2, R-FLEET-3): the readmission checks
// passing, a drain, its end, an undrain. Removing the key (state "gone"
// in fleet events) is no step: it is Store.Delete, legal from every state
// (Removable says when without force).
type Step string

// The steps of the engine state machine; transitions says from which
// state each leads to which.
const (
	// Admit: the leading breaker's readmission checks (health, the
	// contract when there is one, an inference probe) passed on a joining
	// engine (R-FLEET-2).
	Admit Step = "admit"
	// Drain: `narwhal fleet drain`, or the engine's own drain when it
	// stops (`narwhal agent` on SIGTERM): no new placement (R-FLEET-3).
	Drain Step = "drain"
	// EndDrain: every router reports no leg in flight on the draining
	// engine (DrainDone), or membership.drain_timeout_s passed; written by
	// the leading breaker (R-FLEET-3).
	EndDrain Step = "end drain"
	// Undrain: `narwhal fleet undrain`.
	Undrain Step = "undrain"
)

// transitions is the engine state machine, the one table of its legal
// transitions (docs/fleet.md "States"): from a state, a step leads to
// the state named. A pair that is not here is refused (Next, Apply).
var transitions = []struct {
	from string
	step Step
	to   string
}{
	{schemas.FleetJoining, Admit, schemas.FleetActive},
	{schemas.FleetJoining, Drain, schemas.FleetDraining},
	{schemas.FleetActive, Drain, schemas.FleetDraining},
	{schemas.FleetDraining, EndDrain, schemas.FleetDrained},
	{schemas.FleetDraining, Undrain, schemas.FleetActive},
	// A drained engine is checked again before it is placed on: it may
	// have been restarted as something else.
	{schemas.FleetDrained, Undrain, schemas.FleetJoining},
}

// Next returns the state step leads to from state from, and false when
// the step is not legal there (e.g. Drain of an engine already draining
// or drained, Undrain of an active one).
func Next(from string, step Step) (string, bool) {
	for _, t := range transitions {
		if t.from == from && t.step == step {
			return t.to, true
		}
	}
	return "", false
}

// ErrIllegal is wrapped by Apply's error when a step is not legal from
// the engine's state.
var ErrIllegal = errors.New("not a transition of the engine state machine")

// Apply returns cur moved by step: its state the one Next names, since
// and at now (UTC), by and reason as given; every other field is kept
// (the spec, the source, a registration's ttl_s). It returns an error
// wrapping ErrIllegal when step is not legal from cur's state.
func Apply(cur schemas.FleetEntry, step Step, by, reason string, now time.Time) (schemas.FleetEntry, error) {
	to, ok := Next(cur.State, step)
	if !ok {
		return cur, fmt.Errorf("fleet: engine %s: %s from %s: %w", cur.EngineID, step, cur.State, ErrIllegal)
	}
	now = now.UTC()
	cur.State, cur.Since, cur.At, cur.By, cur.Reason = to, now, now, by, reason
	return cur, nil
}

// Removable reports whether an engine in state may leave the fleet
// without force: it is drained (no router has a leg on it, R-FLEET-3) or
// joining (it never took work, R-FLEET-2). Any engine may be removed by
// force; its running attempts still finish (R-FLEET-1).
func Removable(state string) bool {
	return state == schemas.FleetDrained || state == schemas.FleetJoining
}

// NewJoining returns spec as a new entry of narwhal_fleet in state
// joining (R-FLEET-2: placeable only once the breaker's checks pass),
// from source (schemas.SourceCommand or schemas.SourceRegistration),
// written by by at now (UTC) for reason. The API key stays out: only
// spec.APIKeyEnv goes on the bus. A registration's caller sets TTLS.
func NewJoining(spec config.EngineSpec, source, by, reason string, now time.Time) schemas.FleetEntry {
	e := spec.FleetEntry(by, now)
	e.State, e.Source, e.Reason = schemas.FleetJoining, source, reason
	return e
}

// KeyTTL returns the TTL a write of e's key carries so that a
// registration keeps lapsing after its last write (R-FLEET-4): its ttl_s
// for an entry of source registration, 0 (no TTL) for every other entry.
func KeyTTL(e schemas.FleetEntry) time.Duration {
	if ttl := config.Seconds(e.TTLS); e.Source == schemas.SourceRegistration && ttl > 0 {
		return ttl
	}
	return 0
}
