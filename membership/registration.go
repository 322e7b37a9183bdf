// Package membership keeps an engine in the live fleet by its own
// announcement: a registration in KV bucket narwhal_fleet that carries a
// TTL and lasts only while a heartbeat renews it (behaviour.md R-FLEET-4). `narwhal
// sim --register` and `narwhal agent` use it; docs/fleet.md describes it.
package membership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Spec is what an engine announces of itself: the fields of a
// schemas.FleetEntry that describe it (id, base URL, role, connector,
// slot limits — 0 for none — and the name of the variable holding its
// API key, "" for none).
type Spec struct {
	ID        string
	URL       string
	Role      string
	Connector string
	// BootstrapPort is a prefill SGLang engine's bootstrap port; 0 for
	// other engines.
	BootstrapPort int
	PrefillSlots  int
	DecodeSlots   int
	APIKeyEnv     string
}

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
	spec Spec
	ttl  time.Duration
	by   string
	log  *slog.Logger
	js   jetstream.JetStream
	kv   jetstream.KeyValue

	draining chan struct{} // closed by Drain: Run then writes state draining
}

// subject is the KV subject of the engine's key.
func (r *Registration) subject() string { return "$KV." + bus.FleetBucket + "." + r.spec.ID }

// Register announces spec in bucket narwhal_fleet of b with a TTL of ttl
// (membership.registration_ttl_s) in state joining — the breaker checks
// it as readmission does before any router places on it (R-FLEET-2) —
// written by by (e.g. "agent-d3"). An earlier registration of the same id
// (a restart) is replaced. It returns ErrTaken when the id belongs to an
// entry seeded from a config file or added by a command, and the bus's
// error when the bucket is missing or the write is refused.
func Register(ctx context.Context, b *bus.Bus, spec Spec, ttl time.Duration, by string, log *slog.Logger) (*Registration, error) {
	if ttl <= 0 {
		return nil, fmt.Errorf("membership: registration TTL %v: must be > 0", ttl)
	}
	if log == nil {
		log = slog.Default()
	}
	kv, err := b.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		return nil, err
	}
	r := &Registration{spec: spec, ttl: ttl, by: by, log: log, js: b.JetStream(), kv: kv, draining: make(chan struct{})}
	cur, rev, err := r.current(ctx)
	if err != nil {
		return nil, err
	}
	if cur != nil && cur.Source != schemas.SourceRegistration {
		return nil, fmt.Errorf("membership: engine %s (source %s): %w", spec.ID, cur.Source, ErrTaken)
	}
	if err := r.write(ctx, r.entry(schemas.FleetJoining, "registered by "+by), rev, cur != nil); err != nil {
		return nil, err
	}
	log.Info("engine registered in the live fleet", "engine_id", spec.ID, "url", spec.URL, "role", spec.Role, "ttl", ttl)
	return r, nil
}

// entry returns the registration's fleet entry in state, now.
func (r *Registration) entry(state, reason string) schemas.FleetEntry {
	now := time.Now().UTC()
	return schemas.FleetEntry{
		Schema: schemas.SchemaFleetEntry, EngineID: r.spec.ID, URL: r.spec.URL, Role: r.spec.Role, Connector: r.spec.Connector,
		BootstrapPort: r.spec.BootstrapPort, PrefillSlots: r.spec.PrefillSlots, DecodeSlots: r.spec.DecodeSlots, APIKeyEnv: r.spec.APIKeyEnv,
		State: state, Since: now, At: now, Source: schemas.SourceRegistration, By: r.by, Reason: reason,
		TTLS: r.ttl.Seconds(),
	}
}

// current returns the engine's entry in the bucket and its revision; nil
// (and revision 0) when the key is absent or deleted. A value that is no
// valid entry counts as absent.
func (r *Registration) current(ctx context.Context) (*schemas.FleetEntry, uint64, error) {
	e, err := r.kv.Get(ctx, r.spec.ID)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound), errors.Is(err, jetstream.ErrKeyDeleted):
		return nil, 0, nil
	case err != nil:
		return nil, 0, err
	}
	var fe schemas.FleetEntry
	if bus.ValidateFleetEntry(e.Value()) != nil || json.Unmarshal(e.Value(), &fe) != nil || fe.EngineID != r.spec.ID {
		return nil, e.Revision(), nil
	}
	return &fe, e.Revision(), nil
}

// write puts entry under the engine's key with the registration's TTL;
// when exists, only if the key's revision is still rev (so that a state
// the breaker wrote meanwhile is not overwritten).
func (r *Registration) write(ctx context.Context, entry schemas.FleetEntry, rev uint64, exists bool) error {
	value, err := json.Marshal(entry)
	if err != nil {
		return err
	}
	opts := []jetstream.PublishOpt{jetstream.WithMsgTTL(r.ttl)}
	if exists || rev > 0 {
		opts = append(opts, jetstream.WithExpectLastSequencePerSubject(rev))
	}
	_, err = r.js.Publish(ctx, r.subject(), value, opts...)
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
		next = r.entry(schemas.FleetJoining, "registered again by "+r.by)
	case cur.Source != schemas.SourceRegistration:
		return fmt.Errorf("membership: engine %s (source %s): %w", r.spec.ID, cur.Source, ErrTaken)
	default:
		next = *cur
		next.At, next.By, next.TTLS = time.Now().UTC(), r.by, r.ttl.Seconds()
		if draining && cur.State != schemas.FleetDraining && cur.State != schemas.FleetDrained {
			next.State, next.Since, next.Reason, next.By = schemas.FleetDraining, next.At, "the engine is stopping: drained by "+r.by, r.by
		}
	}
	return r.write(ctx, next, rev, cur != nil || rev > 0)
}

// foreign reports whether value, a write of the engine's key seen by the
// watch, was written by another process (the heartbeat writes by = its
// own name).
func (r *Registration) foreign(value []byte) bool {
	var e schemas.FleetEntry
	return json.Unmarshal(value, &e) != nil || e.By != r.by
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
	var foreign <-chan jetstream.KeyValueEntry
	if w, err := r.kv.Watch(ctx, r.spec.ID, jetstream.UpdatesOnly()); err == nil {
		defer func() { _ = w.Stop() }()
		foreign = w.Updates()
	}
	for {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-r.wake():
			t.Stop()
		case e, ok := <-foreign:
			t.Stop()
			if !ok {
				foreign = nil
				wait = 0
				continue
			}
			if e == nil || e.Operation() != jetstream.KeyValuePut || !r.foreign(e.Value()) {
				wait = every
				continue
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
// router's in-flight report (bucket narwhal_routers) lists it with zero —
// or until ctx ends. It returns nil when drained, ctx's error otherwise;
// Run must be running or have run (the key must exist).
func (r *Registration) Drain(ctx context.Context) error {
	if !r.isDraining() {
		close(r.draining)
	}
	if err := r.heartbeat(ctx); err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	routers, err := bindRouters(ctx, r)
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

// bindRouters binds bucket narwhal_routers (the routers' in-flight
// reports).
func bindRouters(ctx context.Context, r *Registration) (jetstream.KeyValue, error) {
	return r.js.KeyValue(ctx, bus.RoutersBucket)
}

// routersDone reports whether every router's fresh report lists engine
// id as draining with zero legs in flight, and at least one router
// reports: a router that has not seen the drain yet does not list it.
func routersDone(ctx context.Context, kv jetstream.KeyValue, id string) bool {
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		return false
	}
	n := 0
	for key := range keys.Keys() {
		e, err := kv.Get(ctx, key)
		if err != nil {
			_ = keys.Stop()
			return false
		}
		var rep schemas.RouterReport
		if bus.ValidateRouterReport(e.Value()) != nil || json.Unmarshal(e.Value(), &rep) != nil {
			continue // not a report: it speaks for no router
		}
		legs, listed := rep.Draining[id]
		if !listed || legs != 0 {
			_ = keys.Stop()
			return false
		}
		n++
	}
	return n > 0
}

// Leave removes the engine's key from the fleet at once (every router
// takes it out of placement within a second, R-FLEET-1); Run should have
// ended first, or it registers the engine again.
func (r *Registration) Leave(ctx context.Context) error {
	err := r.kv.Delete(ctx, r.spec.ID)
	if err == nil {
		r.log.Info("engine left the live fleet", "engine_id", r.spec.ID)
	}
	return err
}
