package bus_test

import (
	"bytes"
	"context"
	"runtime"
	"strconv"
	"testing"
	"time"
	"weak"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestWatchSnapshotForgetsTheSnapshot: once the snapshot is handed over,
// the watch holds none of its entries (R-FLEET-1's watches live for the
// process's lifetime: holding the bucket as it was at their start would
// keep every value ever snapshotted, e.g. a flooded bucket's).
func TestWatchSnapshotForgetsTheSnapshot(t *testing.T) {
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir()})
	b := connect(t, e)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	kv, err := b.BindBucket(ctx, bus.ChaosBucket)
	if err != nil {
		t.Fatal(err)
	}
	value := bytes.Repeat([]byte("x"), 4<<10)
	for i := range 4 {
		if _, err := kv.Put(ctx, "k"+strconv.Itoa(i), value); err != nil {
			t.Fatal(err)
		}
	}
	snapped := make(chan []weak.Pointer[byte], 1)
	wctx, wcancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- bus.WatchSnapshot(wctx, kv, func(snap map[string]jetstream.KeyValueEntry) {
			var ptrs []weak.Pointer[byte]
			for _, e := range snap {
				ptrs = append(ptrs, weak.Make(&e.Value()[0]))
			}
			snapped <- ptrs
		}, func(jetstream.KeyValueEntry) {})
	}()
	defer func() {
		wcancel()
		<-done
	}()
	var ptrs []weak.Pointer[byte]
	select {
	case ptrs = <-snapped:
	case <-ctx.Done():
		t.Fatal("no snapshot")
	}
	if len(ptrs) != 4 {
		t.Fatalf("snapshot of %d entries, want 4", len(ptrs))
	}
	alive := 0
	collected := func() bool {
		runtime.GC()
		alive = 0
		for _, p := range ptrs {
			if p.Value() != nil {
				alive++
			}
		}
		return alive == 0
	}
	if !testkit.Poll(5*time.Second, 20*time.Millisecond, collected) {
		t.Fatalf("%d of the snapshot's values still held by the running watch", alive)
	}
}
