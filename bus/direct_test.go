package bus_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestDirectReaderReadsEveryEventOnceInOrderRBUS11 proves the direct
// reader of a role credential's process (behaviour.md R-BUS-11: it owns
// no consumer) on a stream longer than several of its batches: every
// stored event is delivered once, in order, then every event published
// while it follows, and the account holds no consumer of it.
func TestDirectReaderReadsEveryEventOnceInOrderRBUS11(t *testing.T) {
	testkit.CheckLeaks(t)
	e := bustest.Start(t)
	pub := connect(t, e)
	reader := bustest.Connect(t, e, bus.ConnectOptions{ReadDirect: true})
	if !reader.ReadsDirect() {
		t.Fatal("ReadDirect set, but the connection reads through consumers")
	}
	const stored, live = 700, 300 // stored: several batches of 256
	publish := func(from, n int) {
		t.Helper()
		for i := from; i < from+n; i++ {
			ev := failure("d1")
			ev.ID = fmt.Sprintf("e%04d", i)
			bustest.Publish(t, pub, ev)
		}
	}
	publish(0, stored)
	var mu sync.Mutex
	var ids []string
	stop, err := bus.Subscribe(context.Background(), reader, "", true, func(_ string, payload []byte) {
		var head struct{ ID string }
		_ = json.Unmarshal(payload, &head)
		mu.Lock()
		ids = append(ids, head.ID)
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	publish(stored, live)
	ok := testkit.Poll(waitBound, 10*time.Millisecond, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(ids) >= stored+live
	})
	mu.Lock()
	got := append([]string(nil), ids...)
	mu.Unlock()
	if !ok || len(got) != stored+live {
		t.Fatalf("delivered %d events, want %d", len(got), stored+live)
	}
	for i, id := range got {
		if want := fmt.Sprintf("e%04d", i); id != want {
			t.Fatalf("event %d is %s, want %s (every event once, in order)", i, id, want)
		}
	}
	for key := range consumerState(t, pub) {
		t.Errorf("the direct reader left consumer %s", key)
	}
}
