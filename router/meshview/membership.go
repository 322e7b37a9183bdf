package meshview

import (
	"context"
	"encoding/json"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/engines"
	livefleet "github.com/narwhalmesh/narwhal/fleet"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Tuning of the live fleet (behaviour.md §9a).
const (
	// reportEvery is how often a router writes its in-flight report to
	// narwhal_routers (R-FLEET-3); well inside bus.RouterReportTTL.
	reportEvery = time.Second
	// fleetRetry is the pause before a failed fleet watch is set up
	// again.
	fleetRetry = 250 * time.Millisecond
)

// Reasons a fleet value is ignored: the reason label of
// narwhal_fleet_ignored_total (R-BUS-9).
const fleetIgnoredInvalid = "invalid"

// watchFleet keeps the fleet watch (fleet.Watch) on KV bucket
// narwhal_fleet until the router shuts down (R-FLEET-1): each watch's
// first, full read of the bucket is applied as a snapshot (an engine
// without a key leaves, except one of this router's config file, which
// is seeded there, and one with a deleted key leaves), then every change
// is applied as it arrives — a push, well within the second R-FLEET-1
// allows. A watch that ends (the connection was lost and its consumer
// with it) is set up again, with a new full read; loaded is called after
// each full read.
func (v *View) watchFleet(b *bus.Bus, loaded func()) {
	livefleet.Watch(v.base, b, livefleet.Watcher{
		OnSnapshot: func(s livefleet.Snapshot) {
			v.applyFleetSnapshot(s.Values)
			v.log.Info("fleet loaded", "keys", len(s.Values), "engines", len(v.Fleet().members), "took", s.Took)
			loaded()
		},
		OnChange:     v.applyFleetValue,
		Retry:        fleetRetry,
		SetupTimeout: watchSetupTimeout,
		Log:          v.log,
	})
}

// applyFleetSnapshot applies a full read of narwhal_fleet: every key's
// value, then the removal of every engine without one — except the
// engines of this router's config file that the bucket never held (they
// are seeded there by whoever seeds it: kept, and logged).
func (v *View) applyFleetSnapshot(values map[string]livefleet.Change) {
	for _, c := range values {
		v.applyFleetValue(c)
	}
	v.fleetMu.Lock()
	defer v.fleetMu.Unlock()
	cur := v.Fleet()
	var gone []string
	for _, m := range cur.members {
		if _, ok := values[m.ID]; ok {
			continue
		}
		if m.fromConfig {
			v.log.Info("engine of the config file is not in the live fleet yet; kept until the bucket names it", "engine_id", m.ID)
			continue
		}
		gone = append(gone, m.ID)
	}
	for _, id := range gone {
		v.removeMember(id, "not in the live fleet")
	}
}

// applyFleetValue applies one value of narwhal_fleet, as fleet.Watch
// judged it: a deleted or purged key removes the engine — it receives no
// new attempt; attempts running on it finish by their own rules, since
// the request holds its member (R-FLEET-1) — and a valid entry adds the
// engine, changes its state, or, when its spec changed, builds it anew.
// A value that is not a valid entry for its key (c.Invalid) is ignored:
// the engine keeps its state, the first per key is logged and every one
// counted in narwhal_fleet_ignored_total (R-BUS-9).
func (v *View) applyFleetValue(c livefleet.Change) {
	key := c.ID
	v.fleetMu.Lock()
	defer v.fleetMu.Unlock()
	if c.Deleted {
		delete(v.fleetIgnoredLogged, key)
		v.removeMember(key, "removed from the live fleet")
		return
	}
	if c.Invalid != nil {
		v.metrics.fleetIgnored.WithLabelValues(fleetIgnoredInvalid).Inc()
		if !v.fleetIgnoredLogged[key] {
			v.fleetIgnoredLogged[key] = true
			v.log.Warn("fleet value ignored; the engine keeps its state", "engine_id", key, "reason", fleetIgnoredInvalid, "detail", c.Invalid.Error())
		}
		return
	}
	entry, eng := c.Entry, c.Engine
	delete(v.fleetIgnoredLogged, key)
	cur := v.Fleet()
	if m := cur.byID[key]; m != nil && engines.SameSpec(*m.entry.Load(), entry) {
		if prev := m.SetEntry(entry); prev != entry.State {
			v.log.Info("fleet state changed", "engine_id", key, "state", entry.State, "previous", prev, "reason", entry.Reason)
		}
		return
	}
	eligible, known := v.knownEligible[key]
	if !known {
		eligible = true // no placement entry: no verdict stands against it (R-BUS-2)
	}
	m := NewMember(eng, entry, eligible)
	next := &Fleet{byID: make(map[string]*Member, len(cur.members)+1)}
	replaced := false
	for _, old := range cur.members {
		if old.ID == key {
			old.active.Store(false) // a holder of the old member places nothing more on it
			next.members = append(next.members, m)
			replaced = true
		} else {
			next.members = append(next.members, old)
		}
	}
	if !replaced {
		next.members = append(next.members, m)
	}
	for _, x := range next.members {
		next.byID[x.ID] = x
	}
	v.live.Store(next)
	v.metrics.initEngine(m)
	if v.joined != nil {
		v.joined(m)
	}
	v.log.Info("engine joined the live fleet", "engine_id", key, "url", entry.URL, "role", entry.Role, "state", entry.State, "replaced", replaced)
	v.goFn(func() { v.refreshMember(v.base, m) })
}

// removeMember takes engine id out of the fleet, if it is in it, and
// deletes its series: the view's, then the owner's (Options.Left;
// behaviour.md R-FLEET-5); the prefix index's entries of it go at the
// index's next check. Called with fleetMu held.
func (v *View) removeMember(id, why string) {
	cur := v.Fleet()
	old := cur.byID[id]
	if old == nil {
		return
	}
	old.active.Store(false)
	next := &Fleet{byID: make(map[string]*Member, len(cur.members))}
	for _, m := range cur.members {
		if m.ID != id {
			next.members = append(next.members, m)
			next.byID[m.ID] = m
		}
	}
	v.live.Store(next)
	v.metrics.forgetEngine(id)
	if v.left != nil {
		v.left(id)
	}
	v.log.Info("engine left the live fleet; no new attempt goes there, running ones finish", "engine_id", id, "why", why, "legs_in_flight", old.Legs())
}

// reportLoop writes the router's in-flight report to narwhal_routers
// every reportEvery while the router runs (R-FLEET-3): its legs per
// engine, and for every engine it sees draining or drained its legs
// there, zeros included, so that the breaker knows when every router is
// done with a draining engine. A report that cannot be written (bus
// down) is skipped; the next one says the same and more.
func (v *View) reportLoop(b *bus.Bus) {
	var kv jetstream.KeyValue
	t := time.NewTicker(reportEvery)
	defer t.Stop()
	warned := false
	for {
		if b.Connected() {
			ctx, cancel := context.WithTimeout(v.base, watchSetupTimeout)
			var err error
			if kv == nil {
				kv, err = b.BindBucket(ctx, bus.RoutersBucket)
			}
			if err == nil {
				value, _ := json.Marshal(v.report())
				_, err = kv.Put(ctx, v.id, value)
			}
			cancel()
			switch {
			case err != nil && !warned && v.base.Err() == nil:
				v.log.Warn("in-flight report not written; retrying every second", "err", err)
				warned = true
			case err == nil && warned:
				v.log.Info("in-flight report written again")
				warned = false
			}
		}
		select {
		case <-v.base.Done():
			return
		case <-t.C:
		}
	}
}

// report returns the router's in-flight report (schemas.RouterReport).
func (v *View) report() schemas.RouterReport {
	r := schemas.RouterReport{Schema: schemas.SchemaRouterReport, RouterID: v.id, At: time.Now().UTC(),
		Draining: map[string]int64{}, InFlight: map[string]int64{}}
	for _, m := range v.Fleet().members {
		legs := max(m.Legs(), 0)
		if s := m.State(); s == schemas.FleetDraining || s == schemas.FleetDrained {
			r.Draining[m.ID] = legs
		}
		if legs > 0 {
			r.InFlight[m.ID] = legs
		}
		if ms := m.models.Load(); ms != nil && len(*ms) > 0 {
			if r.Models == nil {
				r.Models = map[string][]string{}
			}
			r.Models[m.ID] = boundModels(*ms)
		}
	}
	return r
}

// FleetIDs returns the ids of the engines in the router's fleet now, in
// fleet order, with their fleet states (R-FLEET-1).
func (v *View) FleetIDs() map[string]string {
	out := map[string]string{}
	for _, m := range v.Fleet().members {
		out[m.ID] = m.State()
	}
	return out
}

// boundModels returns at most the first 64 of an engine's model names,
// each cut to 256 bytes, as the router report's schema allows: an engine
// listing more, or longer names, must not make the report invalid.
func boundModels(ms []string) []string {
	if len(ms) > 64 {
		ms = ms[:64]
	}
	out := make([]string, len(ms))
	for i, m := range ms {
		if len(m) > 256 {
			m = m[:256]
		}
		out[i] = m
	}
	return out
}
