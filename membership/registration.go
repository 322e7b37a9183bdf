// Package membership keeps an engine in the live fleet by its own
// announcement: a registration published on the engine's own subject,
// narwhal.registrations.<engine_id> of stream NARWHAL_REGISTRATIONS,
// at once and every TTL/3 (a heartbeat). The engine asks; the leading
// breaker alone writes the fleet (behaviour.md R-FLEET-4, R-FLEET-5):
// it writes the engine's key in narwhal_fleet with the registration's
// TTL, renews it on each heartbeat, and sends an engine whose spec
// changed back through its checks. `narwhal sim --register` and `narwhal
// agent` use it; docs/fleet.md describes it.
package membership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
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
// over (the breaker refuses it too).
var ErrTaken = errors.New("the engine id is in the fleet already, not as a registration")

// Registration is one engine's registration (behaviour.md R-FLEET-4,
// R-FLEET-5): Run publishes it every TTL/3 with the engine's own spec
// and the state it asks for (joining; draining once Drain was called);
// the leading breaker writes the engine's key of narwhal_fleet with a
// TTL of TTL and renews it on each heartbeat it reads, so a process that
// stops heartbeating — killed, partitioned — leaves the fleet when the
// TTL lapses, even with no breaker running (the bucket removes the key
// and every router takes the engine out of placement, R-FLEET-1). Its
// methods are not safe for concurrent use, except that Drain and Leave
// may be called while Run runs.
type Registration struct {
	spec  config.EngineSpec
	ttl   time.Duration
	by    string
	log   *slog.Logger
	js    jetstream.JetStream
	b     *bus.Bus
	store *fleet.Store

	mu    sync.Mutex
	asked string        // the state asked for: schemas.AskJoining, then AskDraining or AskLeaving
	wakeC chan struct{} // a change of asked: Run publishes at once
}

// Register announces spec — the engine as a config file's fleet entry
// would describe it; its APIKey is not used, only the name APIKeyEnv
// goes on the bus — on the bus b with a TTL of ttl
// (membership.registration_ttl_s), asking for state joining: the
// leading breaker writes it into narwhal_fleet as joining and checks it
// as readmission does before any router places on it (R-FLEET-2),
// published by by (e.g. "agent-d3"). An earlier registration of the same
// id (a restart) is replaced. It returns ErrTaken when the id belongs to
// an entry seeded from a config file or added by a command, an error
// wrapping bus.ErrRegistrationKeyEnv when spec.APIKeyEnv is neither empty
// nor schemas.EngineKeyEnv(spec.ID) (behaviour.md R-FLEET-5), a
// *bus.NotSetUpError when the fleet bucket or stream
// NARWHAL_REGISTRATIONS is missing, and the bus's error when the publish
// is refused — naming, when the bus reported a permissions violation on
// the engine's subject (another engine's credential: R-BUS-11), the
// violation and the credential that would do, engine-<id>.creds. The caller has checked spec (today `narwhal agent`'s and
// `narwhal sim`'s flag checks).
func Register(ctx context.Context, b *bus.Bus, spec config.EngineSpec, ttl time.Duration, by string, log *slog.Logger) (*Registration, error) {
	if ttl <= 0 {
		return nil, fmt.Errorf("membership: registration TTL %v: must be > 0", ttl)
	}
	if want := schemas.EngineKeyEnv(spec.ID); spec.APIKeyEnv != "" && spec.APIKeyEnv != want {
		return nil, fmt.Errorf("membership: engine %s: api_key_env %s: a registration names only %s (%w)", spec.ID, spec.APIKeyEnv, want, bus.ErrRegistrationKeyEnv)
	}
	if log == nil {
		log = slog.Default()
	}
	store, err := fleet.Bind(ctx, b)
	if err != nil {
		return nil, err
	}
	r := &Registration{spec: spec, ttl: ttl, by: by, log: log, js: b.JetStream(), b: b, store: store,
		asked: schemas.AskJoining, wakeC: make(chan struct{}, 1)}
	cur, err := r.current(ctx)
	if err != nil {
		return nil, err
	}
	if cur != nil && cur.Source != schemas.SourceRegistration {
		return nil, fmt.Errorf("membership: engine %s (source %s): %w", spec.ID, cur.Source, ErrTaken)
	}
	if err := r.publish(ctx, schemas.AskJoining); err != nil {
		return nil, err
	}
	log.Info("engine registered: the breaker admits it to the live fleet", "engine_id", spec.ID, "url", spec.URL, "role", spec.Role, "ttl", ttl)
	return r, nil
}

// Value returns the registration Run publishes now, asking for state.
func (r *Registration) Value(state string) schemas.Registration {
	s := r.spec
	return schemas.Registration{
		Schema: schemas.SchemaRegistration, EngineID: s.ID, URL: s.URL, Role: string(s.Role), Connector: s.Connector,
		PrefillSlots: s.PrefillSlots, DecodeSlots: s.DecodeSlots, BootstrapPort: s.BootstrapPort, APIKeyEnv: s.APIKeyEnv,
		State: state, TTLS: r.ttl.Seconds(), At: time.Now().UTC(), By: r.by,
	}
}

// publish publishes the registration asking for state on the engine's
// own subject, waiting for the stream's acknowledgement.
func (r *Registration) publish(ctx context.Context, state string) error {
	data, err := json.Marshal(r.Value(state))
	if err != nil {
		return err
	}
	if _, err := r.js.Publish(ctx, bus.RegistrationSubject(r.spec.ID), data); err != nil {
		if errors.Is(err, jetstream.ErrNoStreamResponse) {
			return fmt.Errorf("membership: engine %s: %w (%w)", r.spec.ID, &bus.NotSetUpError{What: "stream", Name: bus.RegistrationsStream}, err)
		}
		return r.publishError(err)
	}
	return nil
}

// publishError is the error of a refused or unanswered publish of the
// registration: when the bus reported a permissions violation on the
// engine's subject it names it and the engine's own credential file (the
// violation reaches the connection apart from the publish, which
// otherwise fails only by its deadline).
func (r *Registration) publishError(err error) error {
	id := r.spec.ID
	subject := bus.RegistrationSubject(id)
	if perm := r.b.PermissionError(); perm != nil && strings.Contains(perm.Error(), `"`+subject+`"`) {
		return fmt.Errorf("membership: engine %s: the bus refuses its registration (%v): NARWHAL_NATS_CREDS must be this engine's own file, %s (narwhal bus creds --out DIR --engine %s): %w",
			id, perm, bus.IdentityCredsFile(bus.RoleEngine, id), id, err)
	}
	return fmt.Errorf("membership: engine %s: publish its registration: %w", id, err)
}

// current returns the engine's entry in the fleet bucket; nil when the
// key is absent or deleted, or holds no valid entry.
func (r *Registration) current(ctx context.Context) (*schemas.FleetEntry, error) {
	e, _, err := r.store.Get(ctx, r.spec.ID)
	var invalid *fleet.InvalidError
	switch {
	case errors.Is(err, fleet.ErrNotInFleet), errors.As(err, &invalid):
		return nil, nil
	case err != nil:
		return nil, err
	}
	return &e, nil
}

// ask sets the state asked for and wakes Run.
func (r *Registration) ask(state string) {
	r.mu.Lock()
	r.asked = state
	r.mu.Unlock()
	select {
	case r.wakeC <- struct{}{}:
	default:
	}
}

// askedState returns the state asked for.
func (r *Registration) askedState() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.asked
}

// Run publishes the registration every TTL/3 until ctx ends — with the
// engine's own spec every time, so that the breaker's renewal of its
// key never carries another writer's URL (R-FLEET-5) — and at once when
// Drain changes the state asked for; a failed publish (a bus hiccup) is
// retried after a tenth of the TTL and logged once per episode. It
// returns nil when ctx ends; the key then lapses after the TTL unless
// Leave asks for its removal first.
func (r *Registration) Run(ctx context.Context) error {
	every, retry := r.ttl/3, r.ttl/10
	wait := every
	failing := false
	for {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-r.wakeC:
			t.Stop()
		case <-t.C:
		}
		state := r.askedState()
		if state == schemas.AskLeaving {
			return nil
		}
		pctx, cancel := context.WithTimeout(ctx, every)
		err := r.publish(pctx, state)
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

// Drain asks for the engine to be drained (behaviour.md R-FLEET-3): it
// publishes state draining at once (Run keeps asking it) and waits until
// no router has a leg in flight on the engine — the breaker made it
// draining and then drained, or it is draining and every router's
// in-flight report (bucket narwhal_routers) lists it with zero
// (fleet.DrainDone; with no report at all it waits on, for the breaker's
// word or ctx) — or until its key is gone, or ctx ends. It returns nil
// when drained, ctx's error otherwise. Without a leading breaker the
// fleet keeps the engine's state, and Drain waits for ctx.
func (r *Registration) Drain(ctx context.Context) error {
	r.ask(schemas.AskDraining)
	if err := r.publish(ctx, schemas.AskDraining); err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		cur, err := r.current(ctx)
		if err == nil && (cur == nil || cur.State == schemas.FleetDrained) {
			return nil
		}
		if err == nil && cur.State == schemas.FleetDraining && routersDone(ctx, r.b, r.spec.ID) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// routersDone reports whether the routers' reports in bucket
// narwhal_routers say every router is done with engine id
// (fleet.DrainDone), at least one router reporting: a router that has
// not seen the drain yet does not list it. It reads them through the
// engine's own consumer name (fleet.ReadReportsOwn, behaviour.md
// R-BUS-11).
func routersDone(ctx context.Context, b *bus.Bus, id string) bool {
	reports, _, err := fleet.ReadReportsOwn(ctx, b)
	return err == nil && fleet.DrainDone(id, reports, fleet.BusyWithoutReports)
}

// Leave publishes state leaving: the leading breaker deletes the
// engine's key (every router takes it out of placement within a second,
// R-FLEET-1). Run stops heartbeating once Leave was called; without a
// leading breaker the key lapses after the TTL.
func (r *Registration) Leave(ctx context.Context) error {
	r.ask(schemas.AskLeaving)
	err := r.publish(ctx, schemas.AskLeaving)
	if err == nil {
		r.log.Info("engine asked to leave the live fleet", "engine_id", r.spec.ID)
	}
	return err
}
