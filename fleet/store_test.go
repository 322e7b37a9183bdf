package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// testBound bounds each test's bus operations.
const testBound = 10 * time.Second

// testBus starts an embedded, set-up bus and connects to it.
func testBus(t *testing.T) *bus.Bus {
	t.Helper()
	emb, err := bus.StartEmbedded(bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(emb.Shutdown)
	ctx, cancel := context.WithTimeout(context.Background(), testBound)
	defer cancel()
	b, err := bus.Connect(ctx, bus.ConnectOptions{URL: emb.ClientURL(), Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b
}

// entry returns a valid active entry of engine id, seeded from a config.
func entry(id string) schemas.FleetEntry {
	now := time.Now().UTC()
	return schemas.FleetEntry{Schema: schemas.SchemaFleetEntry, EngineID: id, URL: "http://127.0.0.1:1", Role: "decode", Connector: "nixl",
		State: schemas.FleetActive, Since: now, At: now, Source: schemas.SourceConfig, By: "test"}
}

// TestStoreRevisionChecked proves the store's writes (behaviour.md
// R-FLEET-1): Create never overwrites a value but takes a removed key
// back, Update and Delete only at the revision read (ErrChanged
// otherwise), Get tells an absent key (ErrNotInFleet) from a value that
// is no entry for it (InvalidError, with its revision), and List returns
// every key sorted, the invalid ones marked.
func TestStoreRevisionChecked(t *testing.T) {
	b := testBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), testBound)
	defer cancel()
	st, err := Bind(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := st.Get(ctx, "d1"); !errors.Is(err, ErrNotInFleet) {
		t.Fatalf("Get of an absent key: %v, want ErrNotInFleet", err)
	}
	rev, err := st.Create(ctx, entry("d1"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Create(ctx, entry("d1")); !errors.Is(err, ErrExists) {
		t.Fatalf("Create over a value: %v, want ErrExists", err)
	}
	e, got, err := st.Get(ctx, "d1")
	if err != nil || got != rev || e.State != schemas.FleetActive {
		t.Fatalf("Get = %+v, %d, %v; want the entry at %d", e, got, err, rev)
	}
	next, err := Apply(e, Drain, "narwhal-fleet", "test", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	rev2, err := st.Update(ctx, next, rev, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Update(ctx, next, rev, 0); !errors.Is(err, ErrChanged) {
		t.Fatalf("Update at a stale revision: %v, want ErrChanged", err)
	}
	if err := st.Delete(ctx, "d1", rev); !errors.Is(err, ErrChanged) {
		t.Fatalf("Delete at a stale revision: %v, want ErrChanged", err)
	}
	if err := st.Delete(ctx, "d1", rev2); err != nil {
		t.Fatal(err)
	}
	if _, _, err := st.Get(ctx, "d1"); !errors.Is(err, ErrNotInFleet) {
		t.Fatalf("Get of a deleted key: %v, want ErrNotInFleet", err)
	}
	if _, err := st.Create(ctx, entry("d1")); err != nil {
		t.Fatalf("Create of a removed engine: %v", err)
	}

	// A value that names another engine, and one that is no entry at all.
	kv, err := b.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	other, _ := json.Marshal(entry("d9"))
	badRev, err := kv.Put(ctx, "d2", other)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "d3", []byte(`{"schema":"x"}`)); err != nil {
		t.Fatal(err)
	}
	var invalid *InvalidError
	if _, _, err := st.Get(ctx, "d2"); !errors.As(err, &invalid) || invalid.Revision != badRev {
		t.Fatalf("Get of another engine's value: %v, want an InvalidError at revision %d", err, badRev)
	}
	if _, err := st.Create(ctx, entry("p0")); err != nil {
		t.Fatal(err)
	}
	listed, err := st.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, l := range listed {
		ids = append(ids, l.ID)
		if valid := l.Invalid == nil; valid != (l.ID == "d1" || l.ID == "p0") || l.Entry.EngineID != l.ID {
			t.Errorf("listed %s: %+v", l.ID, l)
		}
	}
	if !slices.Equal(ids, []string{"d1", "d2", "d3", "p0"}) {
		t.Errorf("List ids %v, want d1 d2 d3 p0", ids)
	}
}

// TestStoreKeepsRegistrationTTL proves R-FLEET-4 at the store: a write
// with a TTL (a registration's, the breaker's of a registration) makes
// the key lapse that long after it; Put writes whatever the key holds.
func TestStoreKeepsRegistrationTTL(t *testing.T) {
	b := testBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), testBound)
	defer cancel()
	st, err := Bind(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	e := entry("d5")
	e.Source, e.TTLS, e.State = schemas.SourceRegistration, 1, schemas.FleetJoining
	rev, err := st.Put(ctx, e, KeyTTL(e))
	if err != nil {
		t.Fatal(err)
	}
	next, _ := Apply(e, Admit, "breaker-1", "checks passed", time.Now())
	if _, err := st.Update(ctx, next, rev, KeyTTL(next)); err != nil {
		t.Fatal(err)
	}
	written := time.Now()
	testkit.WaitFor(t, 3*time.Second, "the registration's key lapsed", func() bool {
		_, _, err := st.Get(ctx, "d5")
		return errors.Is(err, ErrNotInFleet)
	})
	if took := time.Since(written); took < 500*time.Millisecond {
		t.Errorf("the key lapsed %v after a write with a TTL of 1s", took)
	}
}

// TestSeedAndWaitDrained: Seed creates only what the bucket does not
// hold (R-FLEET-1), and WaitDrained returns once the engine is drained
// or gone (R-FLEET-3).
func TestSeedAndWaitDrained(t *testing.T) {
	b := testBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), testBound)
	defer cancel()
	st, err := Bind(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	drainingD1, _ := Apply(entry("d1"), Drain, "narwhal-fleet", "test", time.Now())
	if _, err := st.Create(ctx, drainingD1); err != nil {
		t.Fatal(err)
	}
	n, err := Seed(ctx, b, []schemas.FleetEntry{entry("d1"), entry("d2")})
	if err != nil || n != 1 {
		t.Fatalf("Seed = %d, %v; want 1 created", n, err)
	}
	if e, _, _ := st.Get(ctx, "d1"); e.State != schemas.FleetDraining {
		t.Fatalf("Seed overwrote d1: %+v", e)
	}
	done := make(chan schemas.FleetEntry, 1)
	go func() {
		e, gone, err := st.WaitDrained(ctx, "d1")
		if err != nil || gone {
			t.Errorf("WaitDrained(d1) = %v, %v", gone, err)
		}
		done <- e
	}()
	// Give WaitDrained time to be watching (nothing can signal that); if
	// it is not yet, it reads the drained value first and passes anyway.
	time.Sleep(100 * time.Millisecond)
	e, rev, _ := st.Get(ctx, "d1")
	drained, _ := Apply(e, EndDrain, "breaker-1", "every router (0) reports no leg in flight", time.Now())
	if _, err := st.Update(ctx, drained, rev, 0); err != nil {
		t.Fatal(err)
	}
	select {
	case e := <-done:
		if e.State != schemas.FleetDrained || e.Reason != drained.Reason {
			t.Errorf("WaitDrained returned %+v", e)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("WaitDrained did not return once d1 was drained")
	}
	if err := st.Delete(ctx, "d2", 0); err != nil {
		t.Fatal(err)
	}
	if _, gone, err := st.WaitDrained(ctx, "d2"); err != nil || !gone {
		t.Errorf("WaitDrained of a removed engine = %v, %v; want gone", gone, err)
	}
	short, stop := context.WithTimeout(ctx, 200*time.Millisecond)
	defer stop()
	if _, _, err := st.WaitDrained(short, "d9"); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("WaitDrained past its bound: %v", err)
	}
}

// TestReadReportsRBUS11: the routers' valid reports are read, the others
// — not a report (behaviour.md R-BUS-9), or a valid report under key r2
// whose router_id says r9 (one router speaking for another, R-BUS-11) —
// ignored and counted apart; an empty bucket is no report at all.
func TestReadReportsRBUS11(t *testing.T) {
	b := testBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), testBound)
	defer cancel()
	kv, err := b.BindBucket(ctx, bus.RoutersBucket)
	if err != nil {
		t.Fatal(err)
	}
	reports, ignored, err := ReadReports(ctx, b)
	if err != nil || len(reports) != 0 || ignored.Total() != 0 {
		t.Fatalf("empty bucket: %v, %d, %v", reports, ignored, err)
	}
	put := func(key string, r schemas.RouterReport) {
		r.Schema, r.At, r.InFlight = schemas.SchemaRouterReport, time.Now().UTC(), map[string]int64{}
		v, _ := json.Marshal(r)
		if _, err := kv.Put(ctx, key, v); err != nil {
			t.Fatal(err)
		}
	}
	put("r1", schemas.RouterReport{RouterID: "r1", Draining: map[string]int64{"d1": 0}})
	put("r2", schemas.RouterReport{RouterID: "r9", Draining: map[string]int64{"d1": 0}})
	if _, err := kv.Put(ctx, "r3", []byte(`{"router_id":"r3"}`)); err != nil {
		t.Fatal(err)
	}
	put("r4", schemas.RouterReport{RouterID: "r4", Draining: map[string]int64{"d1": 2}})
	if err := kv.Delete(ctx, "r4"); err != nil {
		t.Fatal(err)
	}
	reports, ignored, err = ReadReports(ctx, b)
	if err != nil || len(reports) != 1 || reports[0].RouterID != "r1" || ignored != (ReportsIgnored{Invalid: 1, RouterIDMismatch: 1}) {
		t.Fatalf("ReadReports = %+v, %+v ignored, %v; want r1 alone, 1 invalid, 1 of another router", reports, ignored, err)
	}
}
