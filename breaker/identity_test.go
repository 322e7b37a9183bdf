package breaker

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestForgedRouterEventsIgnoredRBUS11 proves R-BUS-11 at the breaker: a
// failure event whose payload names another router than its subject's
// fifth token, one on a four-token subject (an old or forged shape), one
// whose engine is not its subject's, and a request event whose router is
// not its subject's are acknowledged, applied to no streak, and counted
// in narwhal_breaker_events_ignored_total{reason}; the same failures on
// their own subjects eject the engine.
func TestForgedRouterEventsIgnoredRBUS11(t *testing.T) {
	h := newHarness(t, setup{fleet: prefillAndDecode, readmitS: 60})
	r := h.startLeader("breaker-a")
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	// raw publishes a payload on subject with a plain connection, as a
	// router credential of another id (or a forger) could.
	raw := func(subject string, ev schemas.Event) uint64 {
		t.Helper()
		head := ev.Head()
		head.ID, head.At = nuid.Next(), time.Now().UTC()
		payload, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		ack, err := h.bus.JetStream().Publish(ctx, subject, payload, jetstream.WithMsgID(head.ID))
		if err != nil {
			t.Fatalf("publishing on %s: %v", subject, err)
		}
		return ack.Sequence
	}
	failure := func(engine string) *schemas.Failure {
		return &schemas.Failure{
			Envelope: schemas.Envelope{Schema: schemas.SchemaFailure, RouterID: "test-router", EngineID: engine, RequestID: "req-" + nuid.Next()},
			Phase:    schemas.PhaseDecode, Kind: "first_token_timeout", Status: 504, Message: "test fault",
			Timeout: true, Counts: true, ProducerID: "p1", ConsumerID: engine, Attempt: 1,
		}
	}
	ignored := func(reason string) float64 {
		return testutil.ToFloat64(r.metrics.eventsIgnored.WithLabelValues(reason))
	}

	h.applied(h.fail("d1", schemas.PhaseDecode, true, "p1", "d1"))
	h.applied(h.fail("d1", schemas.PhaseDecode, true, "p1", "d1"))
	for range 2 {
		raw("narwhal.events.failure.d1.other-router", failure("d1"))
		raw("narwhal.events.failure.d1", failure("d1"))
	}
	raw("narwhal.events.failure.p1.test-router", failure("d1"))
	h.applied(raw("narwhal.events.request.other-router", &schemas.RequestCompleted{
		Envelope: schemas.Envelope{Schema: schemas.SchemaRequest, RouterID: "test-router", RequestID: "req-" + nuid.Next()},
		Endpoint: schemas.EndpointChat, Model: testModel, Status: 200, ProducerID: "p1", ConsumerID: "d1", Attempts: 1,
	}))
	if e := h.mustEntry("d1"); e.Streak != 2 || e.State != schemas.StateEligible {
		t.Fatalf("after 2 failures and 6 forged events: %+v, want streak 2, eligible", e)
	}
	if e := h.mustEntry("p1"); e.Streak != 0 {
		t.Fatalf("a failure on p1's subject about d1 moved p1's streak: %+v", e)
	}
	if got := ignored(schemas.MismatchRouterID); got != 5 {
		t.Errorf("events ignored for router_id_mismatch: %v, want 5", got)
	}
	if got := ignored(schemas.MismatchEngineID); got != 1 {
		t.Errorf("events ignored for engine_id_mismatch: %v, want 1", got)
	}
	h.applied(h.fail("d1", schemas.PhaseDecode, true, "p1", "d1"))
	if e := h.mustEntry("d1"); e.State != schemas.StateEjected {
		t.Fatalf("the third failure on its own subject did not eject: %+v", e)
	}
}

// TestForgedRouterReportIgnoredRBUS11 proves R-BUS-11 at the breaker's
// drain check: a valid in-flight report under key rt-2 whose payload says
// rt-1 (one router speaking for another) holding a leg on the draining
// engine is ignored and counted in
// narwhal_breaker_router_reports_ignored_total{reason="router_id_mismatch"};
// rt-1's own report of no leg ends the drain.
func TestForgedRouterReportIgnoredRBUS11(t *testing.T) {
	h := newHarness(t, setup{fleet: prefillAndDecode})
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	if _, err := SeedFleet(ctx, h.bus, []schemas.FleetEntry{
		h.cfg.Fleet[0].FleetEntry("test", time.Now()), h.cfg.Fleet[1].FleetEntry("test", time.Now()),
	}); err != nil {
		t.Fatal(err)
	}
	r := h.startLeader("breaker-1")
	testkit.WaitFor(t, waitBound, "the fleet loaded", r.fleetLoaded.Load)
	h.putReport(schemas.RouterReport{RouterID: "rt-1", Draining: map[string]int64{"d1": 0}})
	forged := schemas.RouterReport{Schema: schemas.SchemaRouterReport, RouterID: "rt-1", At: time.Now().UTC(),
		InFlight: map[string]int64{"d1": 5}, Draining: map[string]int64{"d1": 5}}
	value, _ := json.Marshal(forged)
	if err := bus.ValidateRouterReport(value); err != nil {
		t.Fatalf("the forged report is not a valid one: %v", err)
	}
	routers, err := h.bus.BindBucket(ctx, bus.RoutersBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := routers.Put(ctx, "rt-2", value); err != nil {
		t.Fatal(err)
	}
	fleetKV, err := h.bus.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	e, rev := h.fleetEntry("d1")
	e.State, e.Since, e.At = schemas.FleetDraining, time.Now().UTC(), time.Now().UTC()
	b, _ := json.Marshal(e)
	if _, err := fleetKV.Update(ctx, "d1", b, rev); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, waitBound, "d1 drained", func() bool { e, _ := h.fleetEntry("d1"); return e.State == schemas.FleetDrained })
	if got := testutil.ToFloat64(r.metrics.reportsIgnored.WithLabelValues(schemas.MismatchRouterID)); got < 1 {
		t.Errorf("reports ignored for router_id_mismatch: %v, want at least 1", got)
	}
	if got := testutil.ToFloat64(r.metrics.reportsIgnored.WithLabelValues(reportInvalid)); got != 0 {
		t.Errorf("the forged report was counted invalid (%v times): it is a valid report of another key", got)
	}
}
