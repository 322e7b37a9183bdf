package bus

import (
	"cmp"
	"context"
	"errors"
	"maps"
	"slices"

	"github.com/nats-io/nats.go/jetstream"
)

// WatchSnapshot watches every key of kv until ctx ends or the watch does:
// it gathers the bucket's current values, calls snapshot once with them
// (key → latest entry, deletions included as the watcher reports them),
// then calls update for each later put or delete, in order. It returns nil
// when ctx ends or the watch closes, and the error of setting the watch
// up otherwise; callers set it up again (the live fleet's watches,
// R-FLEET-1).
func WatchSnapshot(ctx context.Context, kv jetstream.KeyValue, snapshot func(map[string]jetstream.KeyValueEntry), update func(jetstream.KeyValueEntry)) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w, err := kv.WatchAll(wctx)
	if err != nil {
		return err
	}
	defer func() { _ = w.Stop() }()
	current := map[string]jetstream.KeyValueEntry{}
	inSnapshot := true
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-w.Updates():
			switch {
			case !ok:
				return nil
			case inSnapshot && e != nil:
				current[e.Key()] = e
			case inSnapshot:
				inSnapshot = false
				snapshot(current)
				// The snapshot's entries (each with its value) are not
				// needed any more: a watch that lives for days must not
				// hold the bucket as it was at its start.
				current = nil
			case e != nil:
				update(e)
			}
		}
	}
}

// WatchKeysOptions says what WatchKeys delivers.
type WatchKeysOptions struct {
	// IgnoreDeletes leaves deleted and purged keys out, of the first
	// values and of the changes (jetstream.IgnoreDeletes).
	IgnoreDeletes bool
	// UpdatesOnly delivers changes after now only: no first values and
	// no nil entry (jetstream.UpdatesOnly).
	UpdatesOnly bool
}

// WatchKeys watches the keys of KV bucket that match keys (a key such as
// "d1", a pattern such as "d1.*", or ">" for every key) as
// jetstream.KeyValue.Watch does: the returned watcher's Updates delivers
// the current value of each matching key (the last one per key, in
// revision order), then a nil entry, then every later change, until ctx
// ends or Stop is called; the channel is closed then. On a connection
// that reads by direct gets (Bus.ReadsDirect: a role's credential,
// behaviour.md R-BUS-11) it makes no consumer: a direct reader reads the
// bucket's stream from its oldest message, across reconnects, and a
// bucket's TTL markers come as purges (deletions with opts.IgnoreDeletes,
// left out). Otherwise it is the bucket's own watch (an ordered consumer).
// It returns a *NotSetUpError when the bucket does not exist, and the
// server's error (or the permission the credential lacks) otherwise.
func WatchKeys(ctx context.Context, b *Bus, bucket, keys string, opts WatchKeysOptions) (jetstream.KeyWatcher, error) {
	if !b.direct {
		kv, err := b.BindBucket(ctx, bucket)
		if err != nil {
			return nil, err
		}
		var jo []jetstream.WatchOpt
		if opts.IgnoreDeletes {
			jo = append(jo, jetstream.IgnoreDeletes())
		}
		if opts.UpdatesOnly {
			jo = append(jo, jetstream.UpdatesOnly())
		}
		return kv.Watch(ctx, keys, jo...)
	}
	ctx, cancel := context.WithCancel(ctx)
	w := &keyWatcher{updates: make(chan jetstream.KeyValueEntry, 64), cancel: cancel}
	send := func(e jetstream.KeyValueEntry) {
		select {
		case w.updates <- e:
		case <-ctx.Done():
		}
	}
	skip := func(e *kvEntry) bool { return opts.IgnoreDeletes && e.op != jetstream.KeyValuePut }
	current := map[string]*kvEntry{}
	inSnapshot := !opts.UpdatesOnly
	finish := func() {
		inSnapshot = false
		first := slices.SortedFunc(maps.Values(current), func(a, b *kvEntry) int { return cmp.Compare(a.revision, b.revision) })
		current = nil
		for _, e := range first {
			if !skip(e) {
				send(e)
			}
		}
		send(nil)
	}
	o := directOptions{stream: "KV_" + bucket, filter: "$KV." + bucket + "." + keys, deliver: jetstream.DeliverAllPolicy}
	o.wake = o.filter
	if opts.UpdatesOnly {
		o.deliver = jetstream.DeliverNewPolicy
	} else {
		o.onStart = func(pending uint64) {
			if pending == 0 {
				finish()
			}
		}
	}
	d, err := startDirect(ctx, b, o, func(m jetstream.Msg) {
		e, pending := entryOf(bucket, m)
		if !inSnapshot {
			if !skip(e) {
				send(e)
			}
			return
		}
		current[e.key] = e
		if pending == 0 {
			finish()
		}
	})
	if err != nil {
		cancel()
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return nil, &NotSetUpError{What: "bucket", Name: bucket}
		}
		return nil, err
	}
	w.done = d.done
	go func() {
		<-d.done
		close(w.updates)
	}()
	return w, nil
}

// keyWatcher is WatchKeys' watcher on a connection that reads by direct
// gets.
type keyWatcher struct {
	updates chan jetstream.KeyValueEntry
	cancel  context.CancelFunc
	done    <-chan struct{}
}

// Updates returns the channel of the watch's entries (see WatchKeys).
func (w *keyWatcher) Updates() <-chan jetstream.KeyValueEntry { return w.updates }

// Stop ends the watch and waits until its reader has ended; it returns
// nil, and is safe to call more than once.
func (w *keyWatcher) Stop() error {
	w.cancel()
	<-w.done
	return nil
}
