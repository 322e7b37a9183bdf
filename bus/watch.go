package bus

import (
	"context"

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
