package breaker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/internal/pause"
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
// there yet — create-if-absent, so that seeding from a config file never
// overwrites newer runtime state (an engine drained or re-added with
// `narwhal fleet`) — and returns how many it created (behaviour.md R-FLEET-1).
// The caller is the process that seeds: `narwhal breaker` in a mesh, a
// single-node `narwhal router`. It returns the bus's error for anything
// but an existing key.
func SeedFleet(ctx context.Context, b *bus.Bus, entries []schemas.FleetEntry) (int, error) {
	kv, err := b.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		return 0, err
	}
	created := 0
	for _, e := range entries {
		data, err := json.Marshal(e)
		if err != nil {
			return created, err
		}
		octx, cancel := context.WithTimeout(ctx, opTimeout)
		_, err = kv.Create(octx, e.EngineID, data)
		cancel()
		switch {
		case err == nil:
			created++
		case errors.Is(err, jetstream.ErrKeyExists):
		default:
			return created, fmt.Errorf("breaker: seed the fleet with %s: %w", e.EngineID, err)
		}
	}
	return created, nil
}

// watchFleet keeps a watch on narwhal_fleet while ctx lasts, applying each
// engine's arrival, state change and removal to the breaker's fleet
// (R-FLEET-1). Every breaker watches, leading or not, so that a new
// leader starts from the live fleet.
func (s *Service) watchFleet(ctx context.Context) {
	warned := false
	for ctx.Err() == nil {
		err := s.watchFleetOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil && !warned {
			s.log.Warn("breaker fleet watch could not be set up; retrying", "err", err)
			warned = true
		} else if err == nil {
			warned = false
		}
		if !pause.For(ctx, setupRetry) {
			return
		}
	}
}

func (s *Service) watchFleetOnce(ctx context.Context) error {
	octx, cancel := context.WithTimeout(ctx, opTimeout)
	kv, err := s.bus.BindBucket(octx, bus.FleetBucket)
	cancel()
	if err != nil {
		return err
	}
	s.fleetKV.Store(&kv)
	return bus.WatchSnapshot(ctx, kv, func(snapshot map[string]jetstream.KeyValueEntry) {
		s.applyFleetSnapshot(ctx, snapshot)
		s.fleetLoaded.Store(true)
	}, func(e jetstream.KeyValueEntry) { s.applyFleetValue(ctx, e, true) })
}

// applyFleetSnapshot applies a full read of narwhal_fleet: every key, then
// the removal of every engine without one except those of the config file
// the bucket never held (they are being seeded).
func (s *Service) applyFleetSnapshot(ctx context.Context, snapshot map[string]jetstream.KeyValueEntry) {
	for _, e := range snapshot {
		s.applyFleetValue(ctx, e, false)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var gone []string
	for _, e := range s.fleet {
		if _, ok := snapshot[e.ID]; !ok && !e.fromConfig {
			gone = append(gone, e.ID)
		}
	}
	for _, id := range gone {
		s.removeEngine(id, false)
	}
}

// applyFleetValue applies one entry of narwhal_fleet. live is set for a
// change after the watch's first full read: the leader then publishes a
// fleet event for a change it did not make itself. A joining engine gets
// a placement entry "ejected, joining" so that the next readmission round
// probes it (R-FLEET-2).
func (s *Service) applyFleetValue(ctx context.Context, kve jetstream.KeyValueEntry, live bool) {
	key := kve.Key()
	s.mu.Lock()
	defer s.mu.Unlock()
	if kve.Operation() != jetstream.KeyValuePut {
		s.removeEngine(key, live)
		return
	}
	entry, err := bus.ParseFleetEntry(key, kve.Value())
	var eng engines.Engine
	if err == nil {
		eng, err = engines.FromFleetEntry(entry)
	}
	if err != nil {
		s.metrics.fleetIgnored.Inc()
		s.log.Warn("breaker ignores a fleet value; the engine keeps its state", "engine_id", key, "revision", kve.Revision(), "err", err)
		return
	}
	e := s.byID[key]
	prev := ""
	if e != nil && engines.SameSpec(e.fleetEntry, entry) {
		prev = e.fleetEntry.State
		e.fleetEntry, e.fleetRev = entry, kve.Revision()
	} else {
		if e != nil {
			prev = e.fleetEntry.State
		}
		ne := &engine{Engine: eng, fleetEntry: entry, fleetRev: kve.Revision(), backoff: 1, nextProbe: time.Now()}
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
			s.publishFleet(e.ID, entry.State, prev, entry.Reason)
		}
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
	s.log.Info("breaker: engine left the live fleet", "engine_id", id)
	if live && s.leader.Load() {
		s.publishFleet(id, schemas.FleetGone, e.fleetEntry.State, "removed from the live fleet")
	}
}

// publishFleet publishes a fleet event.
func (s *Service) publishFleet(id, state, prev, reason string) {
	s.publish(&schemas.FleetChange{
		Envelope: schemas.Envelope{Schema: schemas.SchemaFleet, ID: nuid.Next(), At: time.Now().UTC(), BreakerID: s.id, EngineID: id},
		State:    state, Previous: prev, Reason: reason,
	})
}

// setFleetState writes e's fleet entry in state, revision-checked against
// the entry last seen (so that an operator's change in between wins), and
// publishes the fleet event. Called with s.mu held, while leading.
func (s *Service) setFleetState(ctx context.Context, e *engine, state, reason string) error {
	kvp := s.fleetKV.Load()
	if kvp == nil {
		return errors.New("breaker: the fleet bucket is not bound yet")
	}
	next := e.fleetEntry
	prev := next.State
	now := time.Now().UTC()
	next.State, next.Since, next.At, next.By, next.Reason = state, now, now, s.id, reason
	data, err := json.Marshal(next)
	if err != nil {
		return err
	}
	octx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	var rev uint64
	if ttl := config.Seconds(next.TTLS); next.Source == schemas.SourceRegistration && ttl > 0 {
		// A registration's key keeps its TTL through the breaker's write:
		// a plain update would leave it without one, and an engine killed
		// before its next heartbeat would never lapse (R-FLEET-4).
		var ack *jetstream.PubAck
		ack, err = s.bus.JetStream().Publish(octx, "$KV."+bus.FleetBucket+"."+e.ID, data,
			jetstream.WithMsgTTL(ttl), jetstream.WithExpectLastSequencePerSubject(e.fleetRev))
		if ack != nil {
			rev = ack.Sequence
		}
	} else {
		rev, err = (*kvp).Update(octx, e.ID, data, e.fleetRev)
	}
	if err != nil {
		return err
	}
	e.fleetEntry, e.fleetRev = next, rev
	s.publishFleet(e.ID, state, prev, reason)
	s.log.Info("breaker: fleet state changed", "engine_id", e.ID, "state", state, "previous", prev, "reason", reason)
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
// (R-FLEET-3). A router whose report has not listed the engine yet has
// not seen the drain: it counts as busy. A report that is not valid is
// ignored (counted). With no router at all the engine is drained at once.
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
		} else if err == nil {
			busy := 0
			for _, r := range reports {
				if n, ok := r.Draining[e.ID]; !ok || n > 0 {
					busy++
				}
			}
			if busy == 0 {
				reason = fmt.Sprintf("every router (%d) reports no leg in flight", len(reports))
			}
		}
		if reason == "" {
			continue
		}
		s.mu.Lock()
		if s.byID[e.ID] == e && e.fleetEntry.State == schemas.FleetDraining {
			if err := s.setFleetState(ctx, e, schemas.FleetDrained, reason); err != nil {
				s.log.Warn("breaker could not record a drained engine; trying again", "engine_id", e.ID, "err", err)
			}
		}
		s.mu.Unlock()
	}
}

// routerReports reads every valid router report of narwhal_routers: the
// first, full delivery of a watch (the breaker's credential may watch the
// bucket, not read single keys).
func (s *Service) routerReports(ctx context.Context) ([]schemas.RouterReport, error) {
	octx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	kv, err := s.bus.BindBucket(octx, bus.RoutersBucket)
	if err != nil {
		return nil, err
	}
	w, err := kv.WatchAll(octx, jetstream.IgnoreDeletes())
	if err != nil {
		return nil, err
	}
	defer func() { _ = w.Stop() }()
	var out []schemas.RouterReport
	for {
		select {
		case <-octx.Done():
			return nil, octx.Err()
		case kve, ok := <-w.Updates():
			if !ok {
				return nil, errors.New("breaker: the routers' watch ended")
			}
			if kve == nil {
				return out, nil // the end of the full delivery
			}
			var r schemas.RouterReport
			if bus.ValidateRouterReport(kve.Value()) != nil || json.Unmarshal(kve.Value(), &r) != nil || r.RouterID != kve.Key() {
				s.metrics.reportsIgnored.Inc()
				continue
			}
			out = append(out, r)
		}
	}
}
