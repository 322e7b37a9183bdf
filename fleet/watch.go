package fleet

import (
	"context"
	"encoding/json"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/internal/pause"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Change is one value of narwhal_fleet as a watch delivers it, judged as
// every process judges it (behaviour.md R-FLEET-1, R-BUS-9): a removal,
// a valid entry with the engine it describes, or a value to ignore.
type Change struct {
	// ID is the key: the engine's id.
	ID string
	// Revision is the value's revision.
	Revision uint64
	// Deleted is set when the key was deleted or purged (a removal, or a
	// registration that lapsed): the engine leaves the fleet; attempts
	// running on it finish (R-FLEET-1).
	Deleted bool
	// Entry is the engine's entry; set when neither Deleted nor Invalid
	// is.
	Entry schemas.FleetEntry
	// Engine is Entry as an engine (engines.FromFleetEntry).
	Engine engines.Engine
	// Invalid says why the value is not an entry for the key, or names no
	// engine a process can build (bus.ParseFleetEntry,
	// engines.FromFleetEntry): it is ignored and the engine keeps its
	// state (R-BUS-9); nil otherwise.
	Invalid error
	// By is the writer the value names (its "by"), read even from a value
	// that is Invalid; "" when it names none. A registration tells its
	// own writes from another process's with it.
	By string
}

// changeOf judges one value of the bucket.
func changeOf(kve jetstream.KeyValueEntry) Change {
	c := Change{ID: kve.Key(), Revision: kve.Revision()}
	if kve.Operation() != jetstream.KeyValuePut {
		c.Deleted = true
		return c
	}
	var by struct {
		By string `json:"by"`
	}
	if json.Unmarshal(kve.Value(), &by) == nil {
		c.By = by.By
	}
	c.Entry, c.Invalid = bus.ParseFleetEntry(c.ID, kve.Value())
	if c.Invalid == nil {
		c.Engine, c.Invalid = engines.FromFleetEntry(c.Entry)
	}
	if c.Invalid != nil {
		c.Entry = schemas.FleetEntry{}
	}
	return c
}

// Snapshot is the first, full read of narwhal_fleet by one watch.
type Snapshot struct {
	// Values holds every key of the bucket, by engine id, deleted keys
	// included (Deleted): an engine without a key here has no place in
	// the fleet, unless the process keeps it for a reason of its own (an
	// engine of its config file that is being seeded).
	Values map[string]Change
	// Took is how long the read took from the watch's set-up.
	Took time.Duration
}

// Watcher is what Watch delivers to and how it retries.
type Watcher struct {
	// OnSnapshot is called with the first, full read of every watch,
	// each time the watch is set up (again): the process resynchronises
	// its fleet with it.
	OnSnapshot func(Snapshot)
	// OnChange is called with every change after the snapshot, in
	// order, as it arrives: a push, well within the second R-FLEET-1
	// allows.
	OnChange func(Change)
	// OnBind, when set, is called with the bucket each time the watch
	// binds it, before the snapshot (the breaker writes through it).
	OnBind func(*Store)
	// Retry is the pause before a watch that could not be set up or ended
	// is set up again; 250 ms when 0.
	Retry time.Duration
	// SetupTimeout bounds the binding of the bucket; 5 s when 0.
	SetupTimeout time.Duration
	// Log receives the watch's warnings; slog.Default() when nil.
	Log *slog.Logger
	// Purpose names the watch's consumer (bus.Bus.ConsumerName,
	// behaviour.md R-BUS-11): bus.PurposeFleet when empty (a router's);
	// the breaker's is bus.PurposeBreakerFleet, so that the two on one
	// connection (a single node) keep consumers of their own.
	Purpose string
}

// Watch keeps a watch on KV bucket narwhal_fleet of b until ctx ends
// (R-FLEET-1), on the caller's goroutine: the first values of a watch
// are a full read of the bucket, delivered at once to OnSnapshot, then
// every change goes to OnChange as it arrives. A watch that ends — the
// connection was lost and its consumer with it — or cannot be set up (the
// bucket is missing, the bus is down) is set up again after Retry, with
// a new full read. A failure to set up is logged once per run of
// failures; a watch that ended is logged each time. Watch returns, with
// nothing more logged, once the bus revoked or refused b's credential
// (bus.Bus.CredentialRefused).
func Watch(ctx context.Context, b *bus.Bus, w Watcher) {
	if w.Retry <= 0 {
		w.Retry = 250 * time.Millisecond
	}
	if w.SetupTimeout <= 0 {
		w.SetupTimeout = 5 * time.Second
	}
	if w.Log == nil {
		w.Log = slog.Default()
	}
	warned := false
	for ctx.Err() == nil {
		err := watchOnce(ctx, b, w)
		if ctx.Err() != nil {
			return
		}
		if b.CredentialRefused() != nil {
			// Revoked or refused for good (R-BUS-11): no watch will come
			// up again; the process says so (bus.Bus.CredentialRefused).
			return
		}
		if err != nil && !warned {
			w.Log.Warn("fleet watch could not be set up; retrying", "err", err)
			warned = true
		} else if err == nil {
			warned = false
			w.Log.Warn("fleet watch ended; setting it up again and resynchronising")
		}
		if !pause.For(ctx, w.Retry) {
			return
		}
	}
}

// watchOnce runs one watch of narwhal_fleet until it ends; it returns
// why it could not be set up, nil when it ran and ended.
func watchOnce(ctx context.Context, b *bus.Bus, w Watcher) error {
	bctx, cancel := context.WithTimeout(ctx, w.SetupTimeout)
	s, err := Bind(bctx, b)
	cancel()
	if err != nil {
		return err
	}
	if w.OnBind != nil {
		w.OnBind(s)
	}
	start := time.Now()
	// Through a consumer of the process's own name (R-BUS-11), made again
	// under it from the next revision when it is lost.
	purpose := w.Purpose
	if purpose == "" {
		purpose = bus.PurposeFleet
	}
	return bus.WatchBucket(ctx, b, bus.FleetBucket, b.ConsumerName(purpose), func(snapshot map[string]jetstream.KeyValueEntry) {
		values := make(map[string]Change, len(snapshot))
		for key, kve := range snapshot {
			values[key] = changeOf(kve)
		}
		w.OnSnapshot(Snapshot{Values: values, Took: time.Since(start)})
	}, func(kve jetstream.KeyValueEntry) { w.OnChange(changeOf(kve)) })
}

// Writes watches engine id's key and delivers every write after now (not
// its current value) on the returned channel until ctx ends or the watch
// does; the channel is closed then. It returns the bus's error when the
// watch cannot be set up. A registration follows its key with it
// (R-FLEET-4).
func (s *Store) Writes(ctx context.Context, id string) (<-chan Change, error) {
	w, err := bus.WatchKeys(ctx, s.b, bus.FleetBucket, id, bus.WatchKeysOptions{UpdatesOnly: true})
	if err != nil {
		return nil, err
	}
	out := make(chan Change)
	go func() {
		defer close(out)
		defer func() { _ = w.Stop() }()
		for {
			select {
			case <-ctx.Done():
				return
			case kve, ok := <-w.Updates():
				if !ok {
					return
				}
				if kve == nil {
					continue
				}
				select {
				case out <- changeOf(kve):
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return out, nil
}
