package fleet

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// lockedLog is a slog text handler's output, safe to read while written.
type lockedLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// recorder keeps what a Watch delivered.
type recorder struct {
	mu        sync.Mutex
	snapshots []Snapshot
	changes   []Change
	bound     int
}

func (r *recorder) watcher(log *slog.Logger) Watcher {
	return Watcher{
		OnSnapshot: func(s Snapshot) { r.mu.Lock(); r.snapshots = append(r.snapshots, s); r.mu.Unlock() },
		OnChange:   func(c Change) { r.mu.Lock(); r.changes = append(r.changes, c); r.mu.Unlock() },
		OnBind:     func(*Store) { r.mu.Lock(); r.bound++; r.mu.Unlock() },
		Retry:      50 * time.Millisecond,
		Log:        log,
	}
}

func (r *recorder) state() ([]Snapshot, []Change, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Snapshot(nil), r.snapshots...), append([]Change(nil), r.changes...), r.bound
}

// TestWatchSnapshotThenChanges proves the one watch loop (behaviour.md
// R-FLEET-1, R-BUS-9): a bucket that is missing is retried (logged once)
// until it exists; the first delivery is a full snapshot — every key,
// each judged: valid, invalid, deleted — and then every change follows
// in order, a value that is no entry marked Invalid, a removal Deleted.
func TestWatchSnapshotThenChanges(t *testing.T) {
	b := testBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), testBound)
	defer cancel()
	if err := b.JetStream().DeleteKeyValue(ctx, bus.FleetBucket); err != nil {
		t.Fatal(err)
	}
	var logs lockedLog
	log := slog.New(slog.NewTextHandler(&logs, nil))
	var rec recorder
	wctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); Watch(wctx, b, rec.watcher(log)) }()
	defer func() { stop(); <-done }()
	testkit.WaitFor(t, 2*time.Second, "a few failed set-ups", func() bool { return strings.Contains(logs.String(), "fleet watch could not be set up") })
	// A hold check, not a wait: over 200 ms (four retries at 50 ms) the
	// failure must still have been logged once only.
	time.Sleep(200 * time.Millisecond)
	if n := strings.Count(logs.String(), "fleet watch could not be set up"); n != 1 {
		t.Errorf("%d set-up failures logged, want 1 per run of failures:\n%s", n, logs.String())
	}

	// The admin sets the bus up, with d1 and d2 already there; d2 is
	// removed and d3 is not an entry before the watch binds.
	if err := bus.Setup(ctx, b, bus.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	kv, err := b.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"d1", "d2"} {
		v, _ := json.Marshal(entry(id))
		if _, err := kv.Put(ctx, id, v); err != nil {
			t.Fatal(err)
		}
	}
	_ = kv.Delete(ctx, "d2")
	_, _ = kv.Put(ctx, "d3", []byte(`{"engine_id":"d3"}`))
	testkit.WaitFor(t, 5*time.Second, "the snapshot", func() bool { s, _, _ := rec.state(); return len(s) == 1 })
	snaps, _, bound := rec.state()
	vals := snaps[0].Values
	if bound != 1 || len(vals) > 3 {
		t.Fatalf("bound %d times, snapshot %+v", bound, vals)
	}
	// The watch may have bound the bucket between the writes above: what
	// it holds must be each key's value at that moment, judged.
	// A watch bound before d1 was written gets d1 as its first change.
	early := 0
	c, ok := vals["d1"]
	if !ok {
		early = 1
		testkit.WaitFor(t, 5*time.Second, "d1 as the first change", func() bool { _, cs, _ := rec.state(); return len(cs) > 0 })
		_, cs, _ := rec.state()
		c = cs[0]
	}
	if c.ID != "d1" || c.Invalid != nil || c.Deleted || c.Entry.State != schemas.FleetActive || c.Engine.ID != "d1" {
		t.Errorf("snapshot d1: %+v", c)
	}
	if c, ok := vals["d3"]; ok && c.Invalid == nil {
		t.Errorf("snapshot d3 (not an entry) judged valid: %+v", c)
	}

	// Then the changes, in order.
	drained, _ := Apply(entry("d1"), Drain, "narwhal-fleet", "test", time.Now())
	v, _ := json.Marshal(drained)
	if _, err := kv.Put(ctx, "d1", v); err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "d1", []byte(`not json`)); err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(ctx, "d1"); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 15*time.Second, "three changes of d1", func() bool {
		_, cs, _ := rec.state()
		n := 0
		for _, c := range cs {
			if c.ID == "d1" {
				n++
			}
		}
		return n >= 3+early
	})
	_, cs, _ := rec.state()
	var d1 []Change
	for _, c := range cs {
		if c.ID == "d1" {
			d1 = append(d1, c)
		}
	}
	d1 = d1[len(d1)-3:]
	if d1[0].Invalid != nil || d1[0].Entry.State != schemas.FleetDraining || d1[0].By != "narwhal-fleet" {
		t.Errorf("drain: %+v", d1[0])
	}
	if d1[1].Invalid == nil || d1[1].Deleted {
		t.Errorf("a value that is no entry: %+v", d1[1])
	}
	if !d1[2].Deleted || d1[0].Revision >= d1[1].Revision || d1[1].Revision >= d1[2].Revision {
		t.Errorf("removal: %+v (revisions %d %d %d)", d1[2], d1[0].Revision, d1[1].Revision, d1[2].Revision)
	}
}

// TestWritesFollowsOneKey: Writes delivers the writes of one key after
// it was set up — not its current value, nor other keys — and closes its
// channel when ctx ends.
func TestWritesFollowsOneKey(t *testing.T) {
	b := testBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), testBound)
	defer cancel()
	st, err := Bind(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	rev, err := st.Create(ctx, entry("d1"))
	if err != nil {
		t.Fatal(err)
	}
	wctx, stop := context.WithCancel(ctx)
	writes, err := st.Writes(wctx, "d1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Create(ctx, entry("d2")); err != nil {
		t.Fatal(err)
	}
	next, _ := Apply(entry("d1"), Drain, "breaker-1", "test", time.Now())
	if _, err := st.Update(ctx, next, rev, 0); err != nil {
		t.Fatal(err)
	}
	select {
	case c := <-writes:
		if c.ID != "d1" || c.By != "breaker-1" || c.Entry.State != schemas.FleetDraining {
			t.Errorf("first write seen: %+v", c)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no write of d1 seen")
	}
	stop()
	for range writes {
	}
}
