package bus_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
)

// TestWatchBucketReadsTTLMarkersRFLEET4 proves that a named bucket watch
// (R-BUS-11) reads the marker the server writes when a fleet key's TTL
// runs out (R-FLEET-4: a registration that stops heartbeating leaves the
// fleet) as the key's removal, as jetstream's own KV watch does — not as
// a value: the marker has no KV-Operation header, only
// Nats-Marker-Reason, and an empty body, which read as a put made every
// watcher refuse it as "not JSON" and keep the lapsed engine placed.
func TestWatchBucketReadsTTLMarkersRFLEET4(t *testing.T) {
	bothReaders(t, testWatchBucketReadsTTLMarkers)
}

func testWatchBucketReadsTTLMarkers(t *testing.T, direct bool) {
	e := bustest.Start(t)
	b := bustest.Connect(t, e, bus.ConnectOptions{ReadDirect: direct})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	kv, err := b.JetStream().KeyValue(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Create(ctx, "d9", []byte(`{}`), jetstream.KeyTTL(time.Second)); err != nil {
		t.Fatal(err)
	}
	updates := make(chan jetstream.KeyValueEntry, 8)
	go func() {
		_ = bus.WatchBucket(ctx, b, bus.FleetBucket, b.ConsumerName(bus.PurposeFleet),
			func(map[string]jetstream.KeyValueEntry) {}, func(e jetstream.KeyValueEntry) { updates <- e })
	}()
	select {
	case u := <-updates:
		if u.Key() != "d9" || u.Operation() != jetstream.KeyValuePurge {
			t.Fatalf("after the TTL: key %q operation %v value %q; want d9 purged", u.Key(), u.Operation(), u.Value())
		}
	case <-ctx.Done():
		t.Fatal("no update for the key whose TTL ran out")
	}
}
