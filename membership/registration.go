// Package membership keeps an engine in the live fleet by its own
// announcement: a registration in KV bucket narwhal_fleet that carries a
// TTL and lasts only while a heartbeat renews it (behaviour.md R-FLEET-4). `narwhal
// sim --register` and `narwhal agent` use it; docs/fleet.md describes it.
package membership

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/fleet"
	"github.com/narwhalmesh/narwhal/schemas"
)

// ErrTaken is returned by Register when the engine id is in the fleet
// already with an entry the fleet's operator made (seeded from a config
// file or added with `narwhal fleet add`): a registration never takes it
// over.
var ErrTaken = errors.New("the engine id is in the fleet already, not as a registration")

// Registration is one engine's registration in KV bucket narwhal_fleet
// (behaviour.md R-FLEET-4): its key carries a TTL of TTL, and Run renews it every
// TTL/3 (a heartbeat), keeping the state the breaker or an operator gave
// it; a process that stops heartbeating — killed, partitioned — leaves
// the fleet when the TTL lapses (the bucket removes the key and every
// router takes the engine out of placement, R-FLEET-1). Its methods are
// not safe for concurrent use, except that Drain and Leave may be called
// while Run runs.
type Registration struct {
	spec  config.EngineSpec
	ttl   time.Duration
	by    string
	log   *slog.Logger
	js    jetstream.JetStream
	store *fleet.Store

	draining chan struct{} // closed by Drain: Run then writes state draining
}

// Register announces spec — the engine as a config file's fleet entry
// would describe it; its APIKey is not used, only the name APIKeyEnv
// goes on the bus — in bucket narwhal_fleet of b with a TTL of ttl
// (membership.registration_ttl_s) in state joining — the breaker checks
// it as readmission does before any router places on it (R-FLEET-2) —
// written by by (e.g. "agent-d3"). An earlier registration of the same id
// (a restart) is replaced. It returns ErrTaken when the id belongs to an
// entry seeded from a config file or added by a command, and the bus's
// error when the bucket is missing or the write is refused. The caller
// has checked spec (today `narwhal agent`'s and `narwhal sim`'s flag
// checks).
func Register(ctx context.Context, b *bus.Bus, spec config.EngineSpec, ttl time.Duration, by string, log *slog.Logger) (*Registration, error) {
	if ttl <= 0 {
		return nil, fmt.Errorf("membership: registration TTL %v: must be > 0", ttl)
	}
	if log == nil {
		log = slog.Default()
	}
	store, err := fleet.Bind(ctx, b)
	if err != nil {
		return nil, err
	}
	r := &Registration{spec: spec, ttl: ttl, by: by, log: log, js: b.JetStream(), store: store, draining: make(chan struct{})}
	cur, rev, err := r.current(ctx)
	if err != nil {
		return nil, err
	}
	if cur != nil && cur.Source != schemas.SourceRegistration {
		return nil, fmt.Errorf("membership: engine %s (source %s): %w", spec.ID, cur.Source, ErrTaken)
	}
	if err := r.write(ctx, r.entry("registered by "+by), rev, cur != nil); err != nil {
		return nil, err
	}
	log.Info("engine registered in the live fleet", "engine_id", spec.ID, "url", spec.URL, "role", spec.Role, "ttl", ttl)
	return r, nil
}

// entry returns the registration's fleet entry in state joining, now.
func (r *Registration) entry(reason string) schemas.FleetEntry {
	e := fleet.NewJoining(r.spec, schemas.SourceRegistration, r.by, reason, time.Now())
	e.TTLS = r.ttl.Seconds()
	return e
}

// current returns the engine's entry in the bucket and its revision; nil
// (and revision 0) when the key is absent or deleted. A value that is no
// valid entry counts as absent (with its revision).
func (r *Registration) current(ctx context.Context) (*schemas.FleetEntry, uint64, error) {
	e, rev, err := r.store.Get(ctx, r.spec.ID)
	var invalid *fleet.InvalidError
	switch {
	case errors.Is(err, fleet.ErrNotInFleet):
		return nil, 0, nil
	case errors.As(err, &invalid):
		return nil, invalid.Revision, nil
	case err != nil:
		return nil, 0, err
	}
	return &e, rev, nil
}

// write puts entry under the engine's key with the registration's TTL;
// when exists, only if the key's revision is still rev (so that a state
// the breaker wrote meanwhile is not overwritten).
func (r *Registration) write(ctx context.Context, entry schemas.FleetEntry, rev uint64, exists bool) error {
	var err error
	if exists || rev > 0 {
		_, err = r.store.Update(ctx, entry, rev, r.ttl)
	} else {
		_, err = r.store.Put(ctx, entry, r.ttl)
	}
	return err
}

// heartbeat renews the registration once: it rewrites the engine's
// current entry — the state, since and reason the breaker or an operator
// gave it kept; state draining once Drain was called — with a fresh TTL.
// A key that is gone (the TTL lapsed during a bus outage, or an operator
// removed it) is registered anew in state joining, unless draining.
func (r *Registration) heartbeat(ctx context.Context) error {
	cur, rev, err := r.current(ctx)
	if err != nil {
		return err
	}
	draining := r.isDraining()
	var next schemas.FleetEntry
	switch {
	case cur == nil && draining:
		return nil // gone while draining: nothing to keep
	case cur == nil:
		r.log.Warn("registration was gone from the live fleet; registering again", "engine_id", r.spec.ID)
		next = r.entry("registered again by " + r.by)
	case cur.Source != schemas.SourceRegistration:
		return fmt.Errorf("membership: engine %s (source %s): %w", r.spec.ID, cur.Source, ErrTaken)
	default:
		next = *cur
		next.At, next.By, next.TTLS = time.Now().UTC(), r.by, r.ttl.Seconds()
		if draining {
			// From joining or active; an engine draining or drained
			// already keeps its state (fleet.Next refuses the step).
			if drained, err := fleet.Apply(next, fleet.Drain, r.by, "the engine is stopping: drained by "+r.by, next.At); err == nil {
				next = drained
			}
		}
	}
	return r.write(ctx, next, rev, cur != nil || rev > 0)
}

func (r *Registration) isDraining() bool {
	select {
	case <-r.draining:
		return true
	default:
		return false
	}
}

// Run renews the registration every TTL/3 until ctx ends, retrying a
// failed renewal (a revision race with the breaker, a bus hiccup) after a
// tenth of the TTL; it logs a failure once per episode. It also watches
// the key and renews it at once after another process's write (the
// breaker's, `narwhal fleet drain`'s), so that the latest value carries
// the TTL whoever wrote it. It returns nil when ctx ends; the key then
// lapses after the TTL unless Leave removes it first.
func (r *Registration) Run(ctx context.Context) error {
	every, retry := r.ttl/3, r.ttl/10
	wait := every
	failing := false
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	writes, err := r.store.Writes(wctx, r.spec.ID)
	if err != nil {
		writes = nil
	}
	for {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-r.wake():
			t.Stop()
		case c, ok := <-writes:
			t.Stop()
			if !ok {
				writes = nil
				wait = 0
				continue
			}
			if c.Deleted || c.By == r.by {
				wait = every
				continue // a removal, or its own heartbeat
			}
		case <-t.C:
		}
		hctx, cancel := context.WithTimeout(ctx, every)
		err := r.heartbeat(hctx)
		cancel()
		switch {
		case err != nil && ctx.Err() != nil:
			return nil
		case err != nil:
			if !failing {
				r.log.Warn("registration heartbeat failed; retrying", "engine_id", r.spec.ID, "err", err)
				failing = true
			}
			wait = retry
		default:
			if failing {
				r.log.Info("registration heartbeat works again", "engine_id", r.spec.ID)
				failing = false
			}
			wait = every
		}
	}
}

// wake returns the channel that wakes Run for an immediate heartbeat:
// Drain's, once, so the draining state is written at once.
func (r *Registration) wake() <-chan struct{} {
	if r.isDraining() {
		return nil
	}
	return r.draining
}

// Drain asks for the engine to be drained (behaviour.md R-FLEET-3): it writes
// state draining at once (Run keeps it so) and waits until no router has
// a leg in flight on the engine — the breaker marked it drained, or every
// router's in-flight report (bucket narwhal_routers) lists it with zero
// (fleet.DrainDone; with no report at all it waits on, for the breaker's
// word or ctx) — or until ctx ends. It returns nil when drained, ctx's
// error otherwise; Run must be running or have run (the key must exist).
func (r *Registration) Drain(ctx context.Context) error {
	if !r.isDraining() {
		close(r.draining)
	}
	if err := r.heartbeat(ctx); err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	routers, err := r.js.KeyValue(ctx, bus.RoutersBucket)
	if err != nil {
		return err
	}
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		cur, _, err := r.current(ctx)
		if err == nil && (cur == nil || cur.State == schemas.FleetDrained) {
			return nil
		}
		if err == nil && cur.State == schemas.FleetDraining && routersDone(ctx, routers, r.spec.ID) {
			return nil
		}
		if err == nil && cur.State != schemas.FleetDraining {
			_ = r.heartbeat(ctx) // the breaker's write raced ours: draining again
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// routersDone reports whether the routers' reports in kv say every
// router is done with engine id (fleet.DrainDone), at least one router
// reporting: a router that has not seen the drain yet does not list it.
func routersDone(ctx context.Context, kv jetstream.KeyValue, id string) bool {
	reports, _, err := fleet.ReadReports(ctx, kv)
	return err == nil && fleet.DrainDone(id, reports, fleet.BusyWithoutReports)
}

// Leave removes the engine's key from the fleet at once (every router
// takes it out of placement within a second, R-FLEET-1); Run should have
// ended first, or it registers the engine again.
func (r *Registration) Leave(ctx context.Context) error {
	err := r.store.Delete(ctx, r.spec.ID, 0)
	if err == nil {
		r.log.Info("engine left the live fleet", "engine_id", r.spec.ID)
	}
	return err
}
