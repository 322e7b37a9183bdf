package breaker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/fleet"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Tuning of the breaker's part of the live fleet (behaviour.md §9a).
const (
	// drainCheckEvery is how often the leader reads the routers' reports
	// for the draining engines (R-FLEET-3).
	drainCheckEvery = 500 * time.Millisecond
	// joiningReason is the placement reason of an engine that joined the
	// fleet and has not passed the readmission checks yet (R-FLEET-2).
	joiningReason = "joining the fleet: placeable once the health, contract and inference probe checks pass"
)

// SeedFleet writes every entry to KV bucket narwhal_fleet that has no key
// there yet and returns how many it created: fleet.Seed, create-if-absent,
// so that seeding from a config file never overwrites newer runtime
// state (behaviour.md R-FLEET-1). The caller is the process that seeds:
// `narwhal breaker` in a mesh, a single-node `narwhal router`. It returns
// the bus's error for anything but an existing key.
func SeedFleet(ctx context.Context, b *bus.Bus, entries []schemas.FleetEntry) (int, error) {
	return fleet.Seed(ctx, b, entries)
}

// watchFleet keeps the fleet watch (fleet.Watch) on narwhal_fleet while
// ctx lasts, applying each engine's arrival, state change and removal to
// the breaker's fleet (R-FLEET-1). Every breaker watches, leading or not,
// so that a new leader starts from the live fleet.
func (s *Service) watchFleet(ctx context.Context) {
	fleet.Watch(ctx, s.bus, fleet.Watcher{
		OnBind: func(st *fleet.Store) { s.fleetStore.Store(st) },
		OnSnapshot: func(snap fleet.Snapshot) {
			s.applyFleetSnapshot(ctx, snap)
			s.fleetLoaded.Store(true)
		},
		OnChange:     func(c fleet.Change) { s.applyFleetValue(ctx, c, true) },
		Retry:        setupRetry,
		SetupTimeout: opTimeout,
		Log:          s.log,
		Purpose:      bus.PurposeBreakerFleet,
	})
}

// applyFleetSnapshot applies a full read of narwhal_fleet: every key, then
// the removal of every engine without one except those of the config file
// the bucket never held (they are being seeded).
func (s *Service) applyFleetSnapshot(ctx context.Context, snap fleet.Snapshot) {
	for _, c := range snap.Values {
		s.applyFleetValue(ctx, c, false)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var gone []string
	for _, e := range s.fleet {
		if _, ok := snap.Values[e.ID]; !ok && !e.fromConfig {
			gone = append(gone, e.ID)
		}
	}
	for _, id := range gone {
		s.removeEngine(id, false)
	}
}

// applyFleetValue applies one value of narwhal_fleet. live is set for a
// change after the watch's first full read: the leader then publishes a
// fleet event for a change it did not make itself. A joining engine gets
// a placement entry "ejected, joining" so that the next readmission round
// probes it (R-FLEET-2). A value that is no valid entry is ignored and
// counted: the engine keeps its state (R-BUS-9).
func (s *Service) applyFleetValue(ctx context.Context, c fleet.Change, live bool) {
	key := c.ID
	s.mu.Lock()
	defer s.mu.Unlock()
	if c.Deleted {
		s.removeEngine(key, live)
		return
	}
	if c.Invalid != nil {
		s.metrics.fleetIgnored.Inc()
		s.log.Warn("breaker ignores a fleet value; the engine keeps its state", "engine_id", key, "revision", c.Revision, "err", c.Invalid)
		return
	}
	entry := c.Entry
	e := s.byID[key]
	prev := ""
	if e != nil && c.Revision < e.fleetRev {
		return // an older value than the breaker's own write, delivered late
	}
	if e != nil && engines.SameSpec(e.fleetEntry, entry) {
		prev = e.fleetEntry.State
		e.fleetEntry, e.fleetRev = entry, c.Revision
	} else {
		if e != nil {
			prev = e.fleetEntry.State
		}
		ne := &engine{Engine: c.Engine, fleetEntry: entry, fleetRev: c.Revision, backoff: 1, nextProbe: time.Now()}
		if e != nil {
			ne.wasActive = e.wasActive
		}
		known := s.byID[key] != nil
		s.replaceEngine(ne)
		e = ne
		if !known && s.leader.Load() {
			octx, cancel := context.WithTimeout(ctx, opTimeout)
			if err := s.reload(octx, e); err != nil {
				s.log.Warn("breaker could not read a new engine's placement entry", "engine_id", key, "err", err)
			}
			cancel()
		}
		s.log.Info("breaker: engine in the live fleet", "engine_id", key, "state", entry.State, "url", entry.URL)
	}
	if prev == entry.State {
		return
	}
	if s.leader.Load() {
		if entry.State == schemas.FleetJoining {
			s.holdJoining(ctx, e)
		}
		if live && entry.By != s.id {
			s.publishFleet(e, entry.State, prev, entry.Reason)
		}
	}
	if entry.State == schemas.FleetActive {
		e.wasActive = true
	}
}

// holdJoining writes e's placement entry as ejected for joining, so that
// routers keep it out and the next readmission round probes it
// (R-FLEET-2). Called with s.mu held, while leading.
func (s *Service) holdJoining(ctx context.Context, e *engine) {
	if e.rev == 0 || e.entry.BreakerID != s.id || e.entry.LeaseTerm != s.term.Load() {
		octx, cancel := context.WithTimeout(ctx, opTimeout)
		_ = s.reload(octx, e)
		cancel()
	}
	_, err := s.update(ctx, e, false, func(cur schemas.Eligibility) (schemas.Eligibility, error) {
		if cur.State == schemas.StateEjected && cur.Reason == joiningReason {
			return cur, errNoChange
		}
		return schemas.Eligibility{State: schemas.StateEjected, Reason: joiningReason}, nil
	})
	if err != nil && !errors.Is(err, errNoChange) {
		s.log.Warn("breaker could not hold a joining engine out of placement", "engine_id", e.ID, "err", err)
	}
	e.backoff, e.nextProbe = 1, time.Now()
}

// replaceEngine puts e into the fleet in place of the engine with its id,
// or at the end. Called with s.mu held.
func (s *Service) replaceEngine(e *engine) {
	for i, old := range s.fleet {
		if old.ID == e.ID {
			e.entry, e.rev = old.entry, old.rev
			e.fromConfig = old.fromConfig
			s.fleet[i] = e
			s.byID[e.ID] = e
			return
		}
	}
	s.fleet = append(s.fleet, e)
	s.byID[e.ID] = e
	s.metrics.initEngine(e.ID)
}

// removeEngine takes engine id out of the breaker's fleet. Called with
// s.mu held.
func (s *Service) removeEngine(id string, live bool) {
	e := s.byID[id]
	if e == nil {
		return
	}
	delete(s.byID, id)
	for i, x := range s.fleet {
		if x == e {
			s.fleet = append(s.fleet[:i:i], s.fleet[i+1:]...)
			break
		}
	}
	s.metrics.dropEngine(id)
	s.log.Info("breaker: engine left the live fleet", "engine_id", id)
	if live && s.leader.Load() {
		s.publishFleet(e, schemas.FleetGone, e.fleetEntry.State, "removed from the live fleet")
	}
}

// publishFleet publishes e's change to state from prev: a fleet event, or
// — for a registered engine never seen active, moving to any state but
// active — an admission event, which NARWHAL_HISTORY does not keep
// (R-FLEET-5).
func (s *Service) publishFleet(e *engine, state, prev, reason string) {
	env := schemas.Envelope{ID: schemas.NewEventID(), At: time.Now().UTC(), BreakerID: s.id, EngineID: e.ID}
	if e.fleetEntry.Source == schemas.SourceRegistration && !e.wasActive && state != schemas.FleetActive {
		env.Schema = schemas.SchemaAdmission
		s.publish(&schemas.Admission{Envelope: env, State: state, Previous: prev, Reason: reason})
		return
	}
	env.Schema = schemas.SchemaFleet
	s.publish(&schemas.FleetChange{Envelope: env, State: state, Previous: prev, Reason: reason})
}

// setFleetState moves e's fleet entry by step (fleet.Apply: the state
// machine's table) and writes it revision-checked against the entry last
// seen (so that an operator's change in between wins) — a registration's
// key with its TTL (fleet.KeyTTL: a plain update would leave it without
// one, and an engine killed before its next heartbeat would never lapse,
// R-FLEET-4) — then publishes the fleet event. Called with s.mu held,
// while leading.
func (s *Service) setFleetState(ctx context.Context, e *engine, step fleet.Step, reason string) error {
	st := s.fleetStore.Load()
	if st == nil {
		return errors.New("breaker: the fleet bucket is not bound yet")
	}
	prev := e.fleetEntry.State
	next, err := fleet.Apply(e.fleetEntry, step, s.id, reason, time.Now())
	if err != nil {
		return err
	}
	octx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	rev, err := st.Update(octx, next, e.fleetRev, fleet.KeyTTL(next))
	if err != nil {
		return err
	}
	e.fleetEntry, e.fleetRev = next, rev
	if next.State == schemas.FleetActive {
		e.wasActive = true
	}
	s.publishFleet(e, next.State, prev, reason)
	s.log.Info("breaker: fleet state changed", "engine_id", e.ID, "state", next.State, "previous", prev, "reason", reason)
	return nil
}

// drainLoop checks the draining engines every drainCheckEvery while ctx
// lasts (the lease is held) (R-FLEET-3).
func (s *Service) drainLoop(ctx context.Context) {
	t := time.NewTicker(drainCheckEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.checkDrains(ctx)
		}
	}
}

// checkDrains makes each draining engine drained once every router's
// report (KV bucket narwhal_routers) lists it with no leg in flight, or
// membership.drain_timeout_s has passed since it began draining
// (R-FLEET-3): fleet.DrainDone, where a router whose report has not
// listed the engine yet has not seen the drain and counts as busy, and
// where no router at all ends the drain at once. A report that is not
// valid is ignored (counted); while the reports cannot be read only the
// timeout ends a drain.
func (s *Service) checkDrains(ctx context.Context) {
	s.mu.Lock()
	var draining []*engine
	for _, e := range s.fleet {
		if e.fleetEntry.State == schemas.FleetDraining {
			draining = append(draining, e)
		}
	}
	s.mu.Unlock()
	if len(draining) == 0 {
		return
	}
	reports, err := s.routerReports(ctx)
	if err != nil {
		s.log.Debug("breaker: routers' reports unreadable", "err", err)
		reports = nil
	}
	timeout := s.cfg.Membership.DrainTimeout()
	for _, e := range draining {
		reason := ""
		s.mu.Lock()
		since := e.fleetEntry.Since
		s.mu.Unlock()
		if timeout > 0 && time.Since(since) >= timeout {
			reason = fmt.Sprintf("drain timeout of %v passed", timeout)
		} else if err == nil && fleet.DrainDone(e.ID, reports, fleet.DoneWithoutReports) {
			reason = fmt.Sprintf("every router (%d) reports no leg in flight", len(reports))
		}
		if reason == "" {
			continue
		}
		s.mu.Lock()
		if s.byID[e.ID] == e && e.fleetEntry.State == schemas.FleetDraining {
			if err := s.setFleetState(ctx, e, fleet.EndDrain, reason); err != nil {
				s.log.Warn("breaker could not record a drained engine; trying again", "engine_id", e.ID, "err", err)
			}
		}
		s.mu.Unlock()
	}
}

// routerReports reads every valid router report of narwhal_routers
// (fleet.ReadReports: through a watch's full delivery, by direct gets
// with the breaker's credential, R-BUS-11) and counts the
// values it ignored.
func (s *Service) routerReports(ctx context.Context) ([]schemas.RouterReport, error) {
	octx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	reports, ignored, err := fleet.ReadReports(octx, s.bus)
	s.metrics.reportsIgnored.WithLabelValues(reportInvalid).Add(float64(ignored.Invalid))
	s.metrics.reportsIgnored.WithLabelValues(schemas.MismatchRouterID).Add(float64(ignored.RouterIDMismatch))
	return reports, err
}
