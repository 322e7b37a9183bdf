// Package fleet owns the live fleet (behaviour.md §9a): KV bucket
// narwhal_fleet, one key per engine id whose value is a
// schemas.FleetEntry (docs/fleet.md). It holds the one typed store over
// the bucket (Store: get, create, revision-checked update, delete, list),
// the engine state machine (Step, Next, Apply: joining, active, draining,
// drained, and the legal transitions as one table), the one watch loop
// of the bucket (Watch: a full snapshot, then every change, set up again
// after it ends) and the rule that says when a drain is over
// (DrainDone). `narwhal fleet` and the breaker — which applies the
// engines' registrations (behaviour.md R-FLEET-5) — write the fleet only
// through it; package membership reads it.
package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Errors of the Store's methods; each is wrapped with the engine id.
var (
	// ErrNotInFleet: the engine's key is absent or deleted.
	ErrNotInFleet = errors.New("not in the fleet")
	// ErrExists: Create found a value under the key.
	ErrExists = errors.New("already in the fleet")
	// ErrChanged: the key's revision is not the one the write was checked
	// against: another process wrote it since it was read.
	ErrChanged = errors.New("changed meanwhile")
)

// InvalidError is returned by Store.Get for a key whose value is not a
// fleet entry for it (behaviour.md R-BUS-9: larger than
// bus.MaxFleetValue, not schema-valid, or another engine's id). Readers
// ignore such a value; Revision lets a writer replace it
// revision-checked.
type InvalidError struct {
	// ID is the key.
	ID string
	// Revision is the key's revision.
	Revision uint64
	// Err says what is wrong with the value.
	Err error
}

// Error returns "fleet: engine <id>: its entry is not valid: <why>".
func (e *InvalidError) Error() string {
	return "fleet: engine " + e.ID + ": its entry is not valid: " + e.Err.Error()
}

// Unwrap returns what is wrong with the value.
func (e *InvalidError) Unwrap() error { return e.Err }

// Store is KV bucket narwhal_fleet of one bus connection, typed: every
// value it returns is a schemas.FleetEntry judged by bus.ParseFleetEntry
// (R-BUS-9). It writes the entries it is given as they are; Check says
// beforehand whether readers will apply one (`narwhal fleet add` refuses
// what they would not). Its methods are safe for concurrent use.
type Store struct {
	kv jetstream.KeyValue
	js jetstream.JetStream
	b  *bus.Bus // its watches (bus.WatchKeys: no consumer with a role's credential, R-BUS-11)
}

// Bind binds bucket narwhal_fleet of b. It returns a *bus.NotSetUpError
// when the bucket does not exist (the admin has not set the bus up,
// R-BUS-8) and the bus's error otherwise.
func Bind(ctx context.Context, b *bus.Bus) (*Store, error) {
	kv, err := b.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		return nil, err
	}
	return &Store{kv: kv, js: b.JetStream(), b: b}, nil
}

// subject is the KV subject of engine id's key.
func subject(id string) string { return "$KV." + bus.FleetBucket + "." + id }

// Check returns what is wrong with e as a value of narwhal_fleet, nil
// when it is a valid entry for its key (schema narwhal.engine.v1, at
// most bus.MaxFleetValue bytes): every reader ignores a value Check
// refuses (R-BUS-9).
func Check(e schemas.FleetEntry) error {
	data, err := json.Marshal(e)
	if err != nil {
		return err
	}
	_, err = bus.ParseFleetEntry(e.EngineID, data)
	return err
}

// Get returns engine id's entry and its revision. It returns an error
// wrapping ErrNotInFleet for an absent or deleted key, an *InvalidError
// for a value that is not an entry for id, and the bus's error otherwise.
func (s *Store) Get(ctx context.Context, id string) (schemas.FleetEntry, uint64, error) {
	kve, err := s.kv.Get(ctx, id)
	if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
		return schemas.FleetEntry{}, 0, fmt.Errorf("fleet: engine %s: %w", id, ErrNotInFleet)
	}
	if err != nil {
		return schemas.FleetEntry{}, 0, fmt.Errorf("fleet: engine %s: %w", id, err)
	}
	e, err := bus.ParseFleetEntry(id, kve.Value())
	if err != nil {
		return schemas.FleetEntry{}, kve.Revision(), &InvalidError{ID: id, Revision: kve.Revision(), Err: err}
	}
	return e, kve.Revision(), nil
}

// Create writes e under its key when the key holds no value (absent, or
// deleted: a removed engine may come back) and returns the new revision:
// `narwhal fleet add` and the seeding of the config file's fleet, which
// never overwrites newer runtime state (R-FLEET-1). It returns an error
// wrapping ErrExists when the key holds a value, and the bus's error
// otherwise.
func (s *Store) Create(ctx context.Context, e schemas.FleetEntry) (uint64, error) {
	data, err := json.Marshal(e)
	if err != nil {
		return 0, fmt.Errorf("fleet: engine %s: %w", e.EngineID, err)
	}
	rev, err := s.kv.Create(ctx, e.EngineID, data)
	if errors.Is(err, jetstream.ErrKeyExists) {
		return 0, fmt.Errorf("fleet: engine %s: %w", e.EngineID, ErrExists)
	}
	if err != nil {
		return 0, fmt.Errorf("fleet: engine %s: %w", e.EngineID, err)
	}
	return rev, nil
}

// Update writes e under its key only if the key's revision is still rev
// (so that a change another process made since rev was read is never
// lost), with a per-key TTL of ttl when ttl > 0 (a registration's key,
// KeyTTL, R-FLEET-4; 0: no TTL), and returns the new revision. It returns
// an error wrapping ErrChanged when the revision is another, and the
// bus's error otherwise.
func (s *Store) Update(ctx context.Context, e schemas.FleetEntry, rev uint64, ttl time.Duration) (uint64, error) {
	data, err := json.Marshal(e)
	if err != nil {
		return 0, fmt.Errorf("fleet: engine %s: %w", e.EngineID, err)
	}
	var next uint64
	if ttl > 0 {
		var ack *jetstream.PubAck
		ack, err = s.js.Publish(ctx, subject(e.EngineID), data, jetstream.WithMsgTTL(ttl), jetstream.WithExpectLastSequencePerSubject(rev))
		if ack != nil {
			next = ack.Sequence
		}
	} else {
		next, err = s.kv.Update(ctx, e.EngineID, data, rev)
	}
	return next, changed(e.EngineID, err)
}

// Put writes e under its key whatever the key holds, with a per-key TTL
// of ttl when ttl > 0, and returns the new revision: a registration of an
// engine whose key is absent (R-FLEET-4). It returns the bus's error.
func (s *Store) Put(ctx context.Context, e schemas.FleetEntry, ttl time.Duration) (uint64, error) {
	data, err := json.Marshal(e)
	if err != nil {
		return 0, fmt.Errorf("fleet: engine %s: %w", e.EngineID, err)
	}
	if ttl <= 0 {
		rev, err := s.kv.Put(ctx, e.EngineID, data)
		return rev, changed(e.EngineID, err)
	}
	ack, err := s.js.Publish(ctx, subject(e.EngineID), data, jetstream.WithMsgTTL(ttl))
	if err != nil {
		return 0, changed(e.EngineID, err)
	}
	return ack.Sequence, nil
}

// Delete removes engine id's key — every router drops the engine;
// attempts running on it finish (R-FLEET-1) — only if its revision is
// still rev, or whatever it holds when rev is 0. It returns an error
// wrapping ErrChanged when the revision is another.
func (s *Store) Delete(ctx context.Context, id string, rev uint64) error {
	var opts []jetstream.KVDeleteOpt
	if rev != 0 {
		opts = append(opts, jetstream.LastRevision(rev))
	}
	return changed(id, s.kv.Delete(ctx, id, opts...))
}

// changed returns err wrapped with engine id, and with ErrChanged for a
// revision mismatch; nil for nil.
func changed(id string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists):
		return fmt.Errorf("fleet: engine %s: %w (%w)", id, ErrChanged, err)
	default:
		return fmt.Errorf("fleet: engine %s: %w", id, err)
	}
}

// Listed is one key of narwhal_fleet as List read it.
type Listed struct {
	// ID is the key.
	ID string
	// Entry is the key's entry; only ID and EngineID are set when Invalid
	// is.
	Entry schemas.FleetEntry
	// Revision is the key's revision.
	Revision uint64
	// Invalid says why the value is not an entry for the key (R-BUS-9);
	// nil for a valid one.
	Invalid error
}

// List returns every key of narwhal_fleet that holds a value, sorted by
// engine id, each with its entry or why it is not one. It reads the
// bucket through one watch's first, full delivery (what a viewer's
// credential allows).
func (s *Store) List(ctx context.Context) ([]Listed, error) {
	all, err := readAll(ctx, s.b, bus.FleetBucket)
	if err != nil {
		return nil, fmt.Errorf("fleet: list the fleet: %w", err)
	}
	out := make([]Listed, 0, len(all))
	for _, kve := range all {
		l := Listed{ID: kve.Key(), Revision: kve.Revision()}
		l.Entry, l.Invalid = bus.ParseFleetEntry(kve.Key(), kve.Value())
		if l.Invalid != nil {
			l.Entry = schemas.FleetEntry{EngineID: kve.Key()}
		}
		out = append(out, l)
	}
	slices.SortFunc(out, func(a, b Listed) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// WaitDrained watches engine id until it is drained (R-FLEET-3) or its
// key is gone, and returns its entry then, with gone set for a removed
// key. It returns ctx's error when ctx ends first, and an error when the
// watch cannot be set up or ends. A value that is not an entry for id
// is passed over.
func (s *Store) WaitDrained(ctx context.Context, id string) (entry schemas.FleetEntry, gone bool, err error) {
	w, err := bus.WatchKeys(ctx, s.b, bus.FleetBucket, id, bus.WatchKeysOptions{})
	if err != nil {
		return entry, false, fmt.Errorf("fleet: watch engine %s: %w", id, err)
	}
	defer func() { _ = w.Stop() }()
	for {
		select {
		case <-ctx.Done():
			return entry, false, ctx.Err()
		case kve, ok := <-w.Updates():
			if !ok {
				return entry, false, fmt.Errorf("fleet: the watch of engine %s ended", id)
			}
			if kve == nil {
				continue
			}
			if kve.Operation() != jetstream.KeyValuePut {
				return entry, true, nil
			}
			if e, err := bus.ParseFleetEntry(id, kve.Value()); err == nil && e.State == schemas.FleetDrained {
				return e, false, nil
			}
		}
	}
}

// readAll returns every value of KV bucket of b through one watch's
// first, full delivery (deleted keys left out; bus.WatchKeys: no consumer
// with a role's credential, R-BUS-11), or why it could not.
func readAll(ctx context.Context, b *bus.Bus, bucket string) ([]jetstream.KeyValueEntry, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w, err := bus.WatchKeys(ctx, b, bucket, ">", bus.WatchKeysOptions{IgnoreDeletes: true})
	if err != nil {
		return nil, err
	}
	defer func() { _ = w.Stop() }()
	var out []jetstream.KeyValueEntry
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case kve, ok := <-w.Updates():
			if !ok {
				return nil, errors.New("the watch ended")
			}
			if kve == nil {
				return out, nil // the end of the full delivery
			}
			out = append(out, kve)
		}
	}
}

// seedBound bounds each write of Seed.
const seedBound = 5 * time.Second

// Seed writes every entry to narwhal_fleet of b that has no key there yet
// — create-if-absent, so that seeding from a config file never
// overwrites newer runtime state (an engine drained or re-added with
// `narwhal fleet`) — and returns how many it created (behaviour.md
// R-FLEET-1). The caller is the process that seeds: `narwhal breaker` in
// a mesh, a single-node `narwhal router`. It returns the bus's error for
// anything but an existing key.
func Seed(ctx context.Context, b *bus.Bus, entries []schemas.FleetEntry) (int, error) {
	s, err := Bind(ctx, b)
	if err != nil {
		return 0, err
	}
	created := 0
	for _, e := range entries {
		octx, cancel := context.WithTimeout(ctx, seedBound)
		_, err := s.Create(octx, e)
		cancel()
		switch {
		case err == nil:
			created++
		case errors.Is(err, ErrExists):
		default:
			return created, fmt.Errorf("fleet: seed the fleet with %s: %w", e.EngineID, err)
		}
	}
	return created, nil
}
