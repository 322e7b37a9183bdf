package chaos

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Bucket is the JetStream KV bucket of armed faults: key
// <engine_id>.<fault_id>, value a Fault as JSON (behaviour.md R-CHAOS-1).
// The admin creates it (bus.Setup, R-BUS-8); OpenStore only binds.
const Bucket = bus.ChaosBucket

// Bounds of the store's operations.
const (
	// spendAttempts bounds the revision-checked retries of one decrement.
	spendAttempts = 16
)

// Store is bucket narwhal_chaos on one bus connection: arming, listing and
// disarming faults, and the revision-checked decrement of a fault's count.
// It publishes an arm or disarm event (schemas.Chaos) for each change it
// makes when it has a publisher. Safe for concurrent use.
type Store struct {
	nc     *nats.Conn
	b      *bus.Bus // its watches (bus.WatchKeys: no consumer with a role's credential, R-BUS-11)
	js     jetstream.JetStream
	kv     jetstream.KeyValue
	pub    *bus.Publisher
	prefix string // the subject prefix of the bucket's keys, "$KV.narwhal_chaos."
	// keyTTL is whether the server keeps per-key TTLs (NATS ≥ 2.11). Without
	// them a key lasts until it is deleted or the bucket's MaxAge.
	keyTTL bool
}

// OpenStore binds to bucket narwhal_chaos as the admin made it (bus.Setup;
// it creates and changes nothing, R-BUS-8) and returns a Store on it; keys
// get their own TTLs when the bucket allows them (NATS >= 2.11). pub, when
// not nil, receives the arm and disarm events; the caller keeps owning it.
// It returns a *bus.NotSetUpError when the bucket does not exist, and the
// server's error when it cannot be read.
func OpenStore(ctx context.Context, b *bus.Bus, pub *bus.Publisher) (*Store, error) {
	kv, err := b.BindBucket(ctx, Bucket)
	if err != nil {
		return nil, err
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("bucket %s: %w", Bucket, err)
	}
	keyTTL := st.LimitMarkerTTL() > 0
	return &Store{nc: b.Conn(), b: b, js: b.JetStream(), kv: kv, pub: pub, prefix: "$KV." + Bucket + ".", keyTTL: keyTTL}, nil
}

// Arm stores f in the bucket, replacing any fault with the same engine and
// fault id, and publishes an arm event. It fills in ID (the fault's name
// when empty), Phase ("any" when empty), Left (= Count), ArmedAt (now) and
// Expires (now + d; d = 0 means DefaultFor), and gives the key a TTL of d
// so that a forgotten fault ends by itself. It returns the fault as stored,
// or an error when d is negative or above MaxFor, f fails Validate, or the
// bus does not take the write.
func (s *Store) Arm(ctx context.Context, f Fault, d time.Duration) (Fault, error) {
	if d == 0 {
		d = DefaultFor
	}
	if d < 0 || d > MaxFor {
		return Fault{}, fmt.Errorf("expiry %v is not within 0…%v", d, MaxFor)
	}
	if f.ID == "" {
		f.ID = f.Name
	}
	if f.Phase == "" {
		f.Phase = PhaseAny
	}
	now := time.Now().UTC()
	f.Left = f.Count
	f.ArmedAt = now
	f.Expires = now.Add(d)
	if err := f.Validate(); err != nil {
		return Fault{}, err
	}
	value, err := json.Marshal(&f)
	if err != nil {
		return Fault{}, err
	}
	if _, err := s.put(ctx, f.Key(), value, 0, false, d); err != nil {
		return Fault{}, fmt.Errorf("arm %s: %w", f.Key(), err)
	}
	s.publish(f.event(schemas.ChaosArm))
	return f, nil
}

// List returns the armed faults that have not expired, of engineID or of
// every engine when engineID is "", sorted by engine id then fault id.
func (s *Store) List(ctx context.Context, engineID string) ([]Fault, error) {
	entries, err := s.entries(ctx, engineID)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	out := make([]Fault, 0, len(entries))
	for _, e := range entries {
		if !e.fault.Expired(now) {
			out = append(out, e.fault)
		}
	}
	return out, nil
}

// Disarm deletes armed faults and publishes a disarm event for each that
// had not expired yet: every fault of every engine when engineID is "",
// every fault of engineID when faultID is "", else the one fault. It
// returns the faults it disarmed (expired ones not included), sorted as
// List sorts them, and an error when faultID is given without engineID or
// the bus fails.
func (s *Store) Disarm(ctx context.Context, engineID, faultID string) ([]Fault, error) {
	if engineID == "" && faultID != "" {
		return nil, errors.New("disarm: a fault id needs an engine id")
	}
	entries, err := s.entries(ctx, engineID)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	var out []Fault
	for _, e := range entries {
		if faultID != "" && e.fault.ID != faultID {
			continue
		}
		if err := s.kv.Delete(ctx, e.key); err != nil {
			return out, fmt.Errorf("disarm %s: %w", e.key, err)
		}
		if !e.fault.Expired(now) {
			out = append(out, e.fault)
			s.publish(e.fault.event(schemas.ChaosDisarm))
		}
	}
	return out, nil
}

// storedFault is one key of the bucket with its decoded value.
type storedFault struct {
	key      string
	revision uint64
	fault    Fault
}

// entries reads the current keys of engineID ("" = all engines), expired
// ones included; values that are no Fault are skipped.
func (s *Store) entries(ctx context.Context, engineID string) ([]storedFault, error) {
	filter := ">"
	if engineID != "" {
		if !validID(engineID) {
			return nil, fmt.Errorf("engine id %q: want letters, digits, '-' or '_'", engineID)
		}
		filter = engineID + ".*"
	}
	// The watch's subscription lives until its context ends: end it here.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w, err := bus.WatchKeys(ctx, s.b, Bucket, filter, bus.WatchKeysOptions{IgnoreDeletes: true})
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", Bucket, err)
	}
	defer w.Stop()
	var out []storedFault
	for {
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("list %s: %w", Bucket, context.Cause(ctx))
		case e, ok := <-w.Updates():
			if !ok {
				return nil, fmt.Errorf("list %s: watch ended", Bucket)
			}
			if e == nil { // the initial values are all delivered
				slices.SortFunc(out, func(a, b storedFault) int {
					return cmp.Or(cmp.Compare(a.fault.EngineID, b.fault.EngineID), cmp.Compare(a.fault.ID, b.fault.ID))
				})
				return out, nil
			}
			if sf, ok := decodeEntry(e); ok {
				out = append(out, sf)
			}
		}
	}
}

// decodeEntry decodes a put entry of the bucket; ok is false for a value
// that is not a valid Fault stored under its own key.
func decodeEntry(e jetstream.KeyValueEntry) (storedFault, bool) {
	var f Fault
	if json.Unmarshal(e.Value(), &f) != nil || f.Key() != e.Key() || f.Validate() != nil {
		return storedFault{}, false
	}
	return storedFault{key: e.Key(), revision: e.Revision(), fault: f}, true
}

// spend takes one strike from the counted fault under key with a
// revision-checked update (deleting the key when it reaches 0), retrying
// when another proxy changed the key meanwhile. ok is false when the fault
// is gone, expired, spent or unlimited (Count 0: nothing to spend); the
// returned Fault is the fault after the strike.
func (s *Store) spend(ctx context.Context, key string) (f Fault, ok bool, err error) {
	for range spendAttempts {
		e, err := s.kv.Get(ctx, key)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return Fault{}, false, nil
		}
		if err != nil {
			return Fault{}, false, err
		}
		sf, valid := decodeEntry(e)
		if !valid || sf.fault.Count == 0 || sf.fault.Left <= 0 || sf.fault.Expired(time.Now()) {
			return Fault{}, false, nil
		}
		f = sf.fault
		f.Left--
		if f.Left == 0 {
			err = s.kv.Delete(ctx, key, jetstream.LastRevision(e.Revision()))
		} else {
			var value []byte
			if value, err = json.Marshal(&f); err != nil {
				return Fault{}, false, err
			}
			_, err = s.put(ctx, key, value, e.Revision(), true, time.Until(f.Expires))
		}
		if err == nil {
			return f, true, nil
		}
		if !revisionConflict(err) {
			return Fault{}, false, err
		}
	}
	return Fault{}, false, fmt.Errorf("spend %s: too many concurrent updates", key)
}

// put writes value under key with the remaining lifetime ttl as the key's
// TTL (rounded up to whole seconds, at least 1 s), and, when expect is set,
// only if the key's current revision is revision.
func (s *Store) put(ctx context.Context, key string, value []byte, revision uint64, expect bool, ttl time.Duration) (uint64, error) {
	msg := &nats.Msg{Subject: s.prefix + key, Data: value}
	var opts []jetstream.PublishOpt
	if expect {
		opts = append(opts, jetstream.WithExpectLastSequencePerSubject(revision))
	}
	if s.keyTTL {
		opts = append(opts, jetstream.WithMsgTTL(keyTTL(ttl)))
	}
	ack, err := s.js.PublishMsg(ctx, msg, opts...)
	if err != nil {
		return 0, err
	}
	return ack.Sequence, nil
}

// keyTTL rounds a remaining lifetime up to the whole seconds a per-message
// TTL takes, at least one.
func keyTTL(d time.Duration) time.Duration {
	if d < time.Second {
		return time.Second
	}
	return (d + time.Second - 1).Truncate(time.Second)
}

// revisionConflict reports whether err is a failed revision check.
func revisionConflict(err error) bool {
	if errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return true
	}
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) &&
		(apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
			apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}

// watch starts a watch of engineID's keys: their current values, a nil
// entry, then every change.
func (s *Store) watch(ctx context.Context, engineID string) (jetstream.KeyWatcher, error) {
	return bus.WatchKeys(ctx, s.b, Bucket, engineID+".*", bus.WatchKeysOptions{})
}

// publish hands ev to the store's publisher, if any.
func (s *Store) publish(ev schemas.Event) {
	if s.pub != nil {
		s.pub.Publish(ev)
	}
}
