package breaker

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// fleetEntry reads engine id's entry of narwhal_fleet.
func (h *harness) fleetEntry(id string) (schemas.FleetEntry, uint64) {
	h.t.Helper()
	kv, err := h.bus.BindBucket(context.Background(), bus.FleetBucket)
	if err != nil {
		h.t.Fatal(err)
	}
	e, err := kv.Get(context.Background(), id)
	if err != nil {
		return schemas.FleetEntry{}, 0
	}
	var fe schemas.FleetEntry
	_ = json.Unmarshal(e.Value(), &fe)
	return fe, e.Revision()
}

// putReport writes a router's in-flight report.
func (h *harness) putReport(r schemas.RouterReport) {
	h.t.Helper()
	kv, err := h.bus.BindBucket(context.Background(), bus.RoutersBucket)
	if err != nil {
		h.t.Fatal(err)
	}
	r.Schema, r.At = schemas.SchemaRouterReport, time.Now().UTC()
	if r.InFlight == nil {
		r.InFlight = map[string]int64{}
	}
	b, _ := json.Marshal(r)
	if _, err := kv.Put(context.Background(), r.RouterID, b); err != nil {
		h.t.Fatal(err)
	}
}

// TestDrainWaitsForEveryRouterRFLEET3 proves R-FLEET-3 at the breaker: a
// draining engine stays draining while one router reports a leg in
// flight on it — or has not listed it yet — and becomes drained, with one
// fleet event, once every router reports zero; with a router that never
// does, membership.drain_timeout_s ends the drain. A report that is not
// valid is ignored and counted.
func TestDrainWaitsForEveryRouterRFLEET3(t *testing.T) {
	h := newHarness(t, setup{fleet: []simSpec{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}, {id: "d2", role: "decode"}}})
	h.cfg.Membership.DrainTimeoutS = 3
	ctx := context.Background()
	if _, err := SeedFleet(ctx, h.bus, []schemas.FleetEntry{
		h.cfg.Fleet[0].FleetEntry("test", time.Now()), h.cfg.Fleet[1].FleetEntry("test", time.Now()), h.cfg.Fleet[2].FleetEntry("test", time.Now()),
	}); err != nil {
		t.Fatal(err)
	}
	r := h.startLeader("breaker-1")
	testkit.WaitFor(t, waitBound, "the fleet loaded", r.fleetLoaded.Load)
	kv, _ := h.bus.BindBucket(ctx, bus.FleetBucket)
	drain := func(id string) {
		e, rev := h.fleetEntry(id)
		e.State, e.Since, e.At = schemas.FleetDraining, time.Now().UTC(), time.Now().UTC()
		b, _ := json.Marshal(e)
		if _, err := kv.Update(ctx, id, b, rev); err != nil {
			t.Fatal(err)
		}
	}

	// d1: rt-1 reports a leg, rt-2 has not seen the drain: draining.
	h.putReport(schemas.RouterReport{RouterID: "rt-1", Draining: map[string]int64{"d1": 1}})
	h.putReport(schemas.RouterReport{RouterID: "rt-2", Draining: map[string]int64{}})
	forged, _ := h.bus.BindBucket(ctx, bus.RoutersBucket)
	if _, err := forged.Put(ctx, "rt-3", []byte(`{"router_id":"rt-9"}`)); err != nil {
		t.Fatal(err)
	}
	drain("d1")
	// Each check of the drains reads the forged report and counts it:
	// three counted are three checks that left d1 draining.
	ignored := func() float64 { return testutil.ToFloat64(r.metrics.reportsIgnored.WithLabelValues(reportInvalid)) }
	testkit.WaitFor(t, waitBound, "three drain checks", func() bool { return ignored() >= 3 })
	if e, _ := h.fleetEntry("d1"); e.State != schemas.FleetDraining {
		t.Fatalf("d1 is %s with a leg in flight, want draining", e.State)
	}
	h.putReport(schemas.RouterReport{RouterID: "rt-1", Draining: map[string]int64{"d1": 0}})
	h.putReport(schemas.RouterReport{RouterID: "rt-2", Draining: map[string]int64{"d1": 0}})
	testkit.WaitFor(t, waitBound, "d1 drained", func() bool { e, _ := h.fleetEntry("d1"); return e.State == schemas.FleetDrained })
	if e, _ := h.fleetEntry("d1"); !strings.Contains(e.Reason, "every router") || e.By != "breaker-1" {
		t.Errorf("drained entry %+v", e)
	}
	testkit.WaitFor(t, waitBound, "one drained event", func() bool { return len(h.events.Of(schemas.KindFleet, "d1")) >= 1 })

	// d2: rt-1 keeps a leg forever: the drain timeout ends it.
	h.putReport(schemas.RouterReport{RouterID: "rt-1", Draining: map[string]int64{"d1": 0, "d2": 5}})
	start := time.Now()
	drain("d2")
	testkit.WaitFor(t, 3*waitBound, "d2 drained by the timeout", func() bool { e, _ := h.fleetEntry("d2"); return e.State == schemas.FleetDrained })
	if took := time.Since(start); took < 2*time.Second {
		t.Errorf("d2 drained after %v with a leg in flight, before the 3 s timeout", took)
	}
	if e, _ := h.fleetEntry("d2"); !strings.Contains(e.Reason, "timeout") {
		t.Errorf("d2 drained for %q, want the timeout", e.Reason)
	}
	var drained int
	for _, raw := range h.events.Of(schemas.KindFleet, "d1") {
		var ev schemas.FleetChange
		_ = json.Unmarshal(raw, &ev)
		if ev.State == schemas.FleetDrained {
			drained++
		}
	}
	if drained != 1 {
		t.Errorf("%d drained events for d1, want 1", drained)
	}
}
