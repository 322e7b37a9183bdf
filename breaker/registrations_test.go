package breaker

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/fleet"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// deadURL is an engine URL nothing answers on: a registration with it
// stays joining, its probes failing.
const deadURL = "http://127.0.0.1:1"

// register publishes a registration as an engine would, on subject's
// engine id (the payload's own unless subject is set).
func (h *harness) register(reg schemas.Registration, subject string) {
	h.t.Helper()
	reg.Schema, reg.At = schemas.SchemaRegistration, time.Now().UTC()
	if reg.Connector == "" {
		reg.Connector = "nixl"
	}
	if reg.State == "" {
		reg.State = schemas.AskJoining
	}
	if reg.TTLS == 0 {
		reg.TTLS = 30
	}
	if reg.By == "" {
		reg.By = "agent-" + reg.EngineID
	}
	if subject == "" {
		subject = reg.EngineID
	}
	data, _ := json.Marshal(reg)
	if _, err := h.bus.JetStream().Publish(context.Background(), bus.RegistrationSubject(subject), data); err != nil {
		h.t.Fatal(err)
	}
}

// fleetIDs lists the engine ids of narwhal_fleet.
func (h *harness) fleetIDs() []string {
	h.t.Helper()
	st, err := fleet.Bind(context.Background(), h.bus)
	if err != nil {
		h.t.Fatal(err)
	}
	all, err := st.List(context.Background())
	if err != nil {
		h.t.Fatal(err)
	}
	var ids []string
	for _, l := range all {
		ids = append(ids, l.ID)
	}
	return ids
}

// refused is narwhal_breaker_registrations_refused_total{reason} of s.
func refused(s *Service, reason string) float64 {
	return testutil.ToFloat64(s.metrics.registrationsRefused.WithLabelValues(reason))
}

// TestForgedSpecNeverReachesPlacementRFLEET5 proves R-FLEET-5: a
// registration becomes a joining entry that only the breaker's checks
// make active; heartbeats with the same spec keep it active; a
// registration whose URL changed sends it back to joining, held out of
// placement and not active while its probes fail; a registration on
// another engine's subject is ignored and counted, and the engine's
// entry stays as it was.
func TestForgedSpecNeverReachesPlacementRFLEET5(t *testing.T) {
	h := newHarness(t, setup{fleet: []simSpec{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}})
	ctx := context.Background()
	if _, err := SeedFleet(ctx, h.bus, []schemas.FleetEntry{h.cfg.Fleet[0].FleetEntry("test", time.Now()), h.cfg.Fleet[1].FleetEntry("test", time.Now())}); err != nil {
		t.Fatal(err)
	}
	r := h.startLeader("breaker-1")
	d2 := simtest.Start(t, sim.Config{Role: "decode", EngineID: "d2", Model: testModel})
	h.register(schemas.Registration{EngineID: "d2", URL: d2.URL(), Role: "decode"}, "")
	testkit.WaitFor(t, waitBound, "d2 active after the checks", func() bool {
		e, _ := h.fleetEntry("d2")
		return e.State == schemas.FleetActive
	})
	if e, _ := h.fleetEntry("d2"); e.Source != schemas.SourceRegistration || e.By != "breaker-1" || e.URL != d2.URL() || e.TTLS != 30 {
		t.Fatalf("d2's entry %+v", e)
	}
	// A heartbeat with the same spec renews the key and keeps the state.
	_, rev := h.fleetEntry("d2")
	h.register(schemas.Registration{EngineID: "d2", URL: d2.URL(), Role: "decode"}, "")
	testkit.WaitFor(t, waitBound, "d2 renewed", func() bool { _, r := h.fleetEntry("d2"); return r > rev })
	if e, _ := h.fleetEntry("d2"); e.State != schemas.FleetActive {
		t.Fatalf("after a heartbeat d2 is %s, want active kept", e.State)
	}

	// A value of d2's key that is not its registration's (a forger's URL,
	// state active): the next heartbeat, which carries the engine's own
	// spec, sends it back to joining with its own URL.
	forged, _ := h.fleetEntry("d2")
	forged.URL, forged.At = deadURL, time.Now().UTC()
	fv, _ := json.Marshal(forged)
	fleetKV, err := h.bus.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fleetKV.Put(ctx, "d2", fv); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, waitBound, "the breaker saw the forged value", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.byID["d2"] != nil && r.byID["d2"].fleetEntry.URL == deadURL
	})
	joinings := func() int {
		n := 0
		for _, raw := range h.events.Of(schemas.KindFleet, "d2") {
			var ev schemas.FleetChange
			if json.Unmarshal(raw, &ev) == nil && ev.State == schemas.FleetJoining {
				n++
			}
		}
		return n
	}
	before := joinings()
	h.register(schemas.Registration{EngineID: "d2", URL: d2.URL(), Role: "decode"}, "")
	testkit.WaitFor(t, waitBound, "d2 back to joining with its own URL", func() bool {
		e, _ := h.fleetEntry("d2")
		return e.URL == d2.URL() && e.By == "breaker-1" && joinings() > before
	})
	testkit.WaitFor(t, waitBound, "d2 active again", func() bool { e, _ := h.fleetEntry("d2"); return e.State == schemas.FleetActive })

	// Another engine's subject: ignored, counted.
	_, rev = h.fleetEntry("d2")
	h.register(schemas.Registration{EngineID: "d3", URL: deadURL, Role: "decode"}, "d2")
	h.register(schemas.Registration{EngineID: "d2", URL: deadURL, Role: "decode"}, "d1")
	testkit.WaitFor(t, waitBound, "two mismatches counted", func() bool { return refused(r.Service, RefusedIDMismatch) >= 2 })
	if e, nrev := h.fleetEntry("d2"); nrev != rev || e.URL != d2.URL() {
		t.Fatalf("a registration on another engine's subject changed d2: %+v (revision %d, was %d)", e, nrev, rev)
	}
	for _, id := range []string{"d3"} {
		if e, _ := h.fleetEntry(id); e.EngineID != "" {
			t.Fatalf("%s in the fleet from a registration on d2's subject: %+v", id, e)
		}
	}

	// The URL changes: back to joining, held out of placement, and not
	// made active while nothing answers there.
	h.register(schemas.Registration{EngineID: "d2", URL: deadURL, Role: "decode"}, "")
	testkit.WaitFor(t, waitBound, "d2 joining with its new URL", func() bool {
		e, _ := h.fleetEntry("d2")
		return e.State == schemas.FleetJoining && e.URL == deadURL
	})
	testkit.WaitFor(t, waitBound, "d2 held out of placement", func() bool {
		el, ok := h.entry("d2")
		return ok && el.State == schemas.StateEjected
	})
	h.waitProbes("d2", schemas.ProbeFailure, 2)
	if e, _ := h.fleetEntry("d2"); e.State != schemas.FleetJoining {
		t.Fatalf("d2 with a dead URL is %s, want joining", e.State)
	}
	if el, _ := h.entry("d2"); el.State != schemas.StateEjected {
		t.Fatalf("d2 placeable with a URL never probed: %+v", el)
	}
	// Back to the real URL: the checks pass and it is active again.
	h.register(schemas.Registration{EngineID: "d2", URL: d2.URL(), Role: "decode"}, "")
	testkit.WaitFor(t, waitBound, "d2 active again after the checks", func() bool {
		e, _ := h.fleetEntry("d2")
		return e.State == schemas.FleetActive && e.URL == d2.URL()
	})
	// d2 has been active: its changes are fleet events.
	var states []string
	for _, raw := range h.events.Of(schemas.KindFleet, "d2") {
		var ev schemas.FleetChange
		_ = json.Unmarshal(raw, &ev)
		states = append(states, ev.State)
	}
	if !strings.Contains(strings.Join(states, ","), "active,joining") {
		t.Errorf("d2's fleet events %v, want active then joining after the URL changed", states)
	}
}

// TestOperatorEntryIsNotTakenRFLEET5 proves R-FLEET-5: a registration of
// an id the operator put in the fleet (the config file's) is refused and
// counted; the entry stays as it was.
func TestOperatorEntryIsNotTakenRFLEET5(t *testing.T) {
	h := newHarness(t, setup{fleet: []simSpec{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}})
	ctx := context.Background()
	if _, err := SeedFleet(ctx, h.bus, []schemas.FleetEntry{h.cfg.Fleet[0].FleetEntry("test", time.Now()), h.cfg.Fleet[1].FleetEntry("test", time.Now())}); err != nil {
		t.Fatal(err)
	}
	r := h.startLeader("breaker-1")
	testkit.WaitFor(t, waitBound, "the fleet loaded", r.fleetLoaded.Load)
	before, rev := h.fleetEntry("d1")
	h.register(schemas.Registration{EngineID: "d1", URL: deadURL, Role: "decode"}, "")
	testkit.WaitFor(t, waitBound, "the refusal counted", func() bool { return refused(r.Service, RefusedTaken) >= 1 })
	if e, nrev := h.fleetEntry("d1"); nrev != rev || e.URL != before.URL || e.Source != schemas.SourceConfig {
		t.Fatalf("d1 taken over: %+v", e)
	}
}

// TestFleetIsBoundedRFLEET5 proves R-FLEET-5: with membership.max_engines
// 8 the 9th and 10th new ids are refused and counted and the fleet holds
// 8; the fleet events of those never-active ids (joining, refused) are
// admission events, in NARWHAL_EVENTS and not in NARWHAL_HISTORY.
func TestFleetIsBoundedRFLEET5(t *testing.T) {
	h := newHarness(t, setup{})
	h.cfg.Membership.MaxEngines = 8
	r := h.startLeader("breaker-1")
	testkit.WaitFor(t, waitBound, "the fleet loaded", r.fleetLoaded.Load)
	for _, v := range []float64{refused(r.Service, RefusedMaxEngines), refused(r.Service, RefusedInvalid)} {
		if v != 0 {
			t.Fatalf("refusals before any registration: %v", v)
		}
	}
	for i := 1; i <= 10; i++ {
		h.register(schemas.Registration{EngineID: fmt.Sprintf("r%02d", i), URL: deadURL, Role: "decode"}, "")
		if i == 8 {
			testkit.WaitFor(t, waitBound, "8 engines in the fleet", func() bool { return len(h.fleetIDs()) == 8 })
		}
	}
	testkit.WaitFor(t, waitBound, "two refusals", func() bool { return refused(r.Service, RefusedMaxEngines) == 2 })
	if ids := h.fleetIDs(); len(ids) != 8 || ids[7] != "r08" {
		t.Fatalf("fleet %v, want r01…r08", ids)
	}
	// A payload that is no registration at all: counted as invalid.
	if _, err := h.bus.JetStream().Publish(context.Background(), bus.RegistrationSubject("r11"), []byte(`{"engine_id":"r11"}`)); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, waitBound, "the invalid one counted", func() bool { return refused(r.Service, RefusedInvalid) == 1 })
	testkit.WaitFor(t, waitBound, "admission events", func() bool {
		return len(h.events.Of(schemas.KindAdmission, "r01")) >= 1 && len(h.events.Of(schemas.KindAdmission, "r10")) >= 1
	})
	var ev schemas.Admission
	_ = json.Unmarshal(h.events.Of(schemas.KindAdmission, "r10")[0], &ev)
	if ev.State != schemas.AdmissionRefused {
		t.Errorf("r10's admission event %+v, want refused", ev)
	}
	if n := len(h.events.Of(schemas.KindFleet, "r01")); n != 0 {
		t.Errorf("%d fleet events of r01, which never was active", n)
	}

	// The history: a fleet event published after them arrives there, and
	// nothing of r01…r10 does.
	h.publish(&schemas.FleetChange{Envelope: schemas.Envelope{Schema: schemas.SchemaFleet, BreakerID: "marker", EngineID: "marker"}, State: schemas.FleetGone})
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	hist, err := h.bus.JetStream().Stream(ctx, bus.HistoryStream)
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, waitBound, "the marker in the history", func() bool {
		_, err := hist.GetLastMsgForSubject(ctx, schemas.EventSubjectPrefix+schemas.KindFleet+".marker")
		return err == nil
	})
	for i := 1; i <= 10; i++ {
		for _, kind := range []string{schemas.KindFleet, schemas.KindAdmission} {
			subj := fmt.Sprintf("%s%s.r%02d", schemas.EventSubjectPrefix, kind, i)
			if _, err := hist.GetLastMsgForSubject(ctx, subj); err == nil {
				t.Errorf("NARWHAL_HISTORY holds %s of an engine never active", subj)
			} else if err != jetstream.ErrMsgNotFound {
				t.Fatalf("%s: %v", subj, err)
			}
		}
	}
}

// TestLeavingEngineLeavesNoSeriesRFLEET5 proves R-FLEET-5: an engine that
// asks to leave is removed from the fleet, and every breaker series
// labelled with its id goes with it.
func TestLeavingEngineLeavesNoSeriesRFLEET5(t *testing.T) {
	h := newHarness(t, setup{})
	reg := prometheus.NewRegistry()
	r := h.startWith("breaker-1", func(o *Options) { o.Registry = reg })
	testkit.WaitFor(t, waitBound, "breaker-1 to lead", r.Leader)
	series := func() int {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "engine" && l.GetValue() == "r1" {
						n++
					}
				}
			}
		}
		return n
	}
	h.register(schemas.Registration{EngineID: "r1", URL: deadURL, Role: "decode"}, "")
	testkit.WaitFor(t, waitBound, "r1's series", func() bool { return series() >= 5 })
	h.register(schemas.Registration{EngineID: "r1", URL: deadURL, Role: "decode", State: schemas.AskLeaving}, "")
	testkit.WaitFor(t, waitBound, "r1 gone from the fleet", func() bool { return len(h.fleetIDs()) == 0 })
	testkit.WaitFor(t, waitBound, "r1's series gone", func() bool { return series() == 0 })
	var ev schemas.Admission
	testkit.WaitFor(t, waitBound, "r1's admission event gone", func() bool {
		for _, raw := range h.events.Of(schemas.KindAdmission, "r1") {
			if json.Unmarshal(raw, &ev) == nil && ev.State == schemas.FleetGone {
				return true
			}
		}
		return false
	})
}

// TestRegistrationLapsesWithoutBreakerRFLEET5 proves R-FLEET-4 and
// R-FLEET-5: the breaker writes a registration's key with its TTL, so an
// engine that stops heartbeating leaves the fleet within the TTL even
// when no breaker runs any more.
func TestRegistrationLapsesWithoutBreakerRFLEET5(t *testing.T) {
	h := newHarness(t, setup{})
	r := h.startLeader("breaker-1")
	testkit.WaitFor(t, waitBound, "the fleet loaded", r.fleetLoaded.Load)
	h.register(schemas.Registration{EngineID: "r1", URL: deadURL, Role: "decode", TTLS: 2}, "")
	testkit.WaitFor(t, waitBound, "r1 in the fleet", func() bool { return len(h.fleetIDs()) == 1 })
	r.stop(t)
	stopped := time.Now()
	testkit.WaitFor(t, 2*time.Second+time.Second, "r1 lapsed", func() bool { return len(h.fleetIDs()) == 0 })
	t.Logf("lapsed %v after the breaker stopped", time.Since(stopped))
}

// TestNewLeaderPicksUpRegistrationsRFLEET5 proves R-FLEET-5 across a
// leader change: registrations published while no breaker runs are
// applied by the next leader from the stream's last registrations, but
// one older than its TTL counts as lapsed and is not written.
func TestNewLeaderPicksUpRegistrationsRFLEET5(t *testing.T) {
	h := newHarness(t, setup{})
	a := h.startLeader("breaker-a")
	testkit.WaitFor(t, waitBound, "the fleet loaded", a.fleetLoaded.Load)
	h.register(schemas.Registration{EngineID: "r1", URL: deadURL, Role: "decode"}, "")
	testkit.WaitFor(t, waitBound, "r1 written by breaker-a", func() bool { e, _ := h.fleetEntry("r1"); return e.By == "breaker-a" })
	a.stop(t)
	h.register(schemas.Registration{EngineID: "r3", URL: deadURL, Role: "decode", TTLS: 0.5}, "")
	time.Sleep(time.Second) // r3's registration lapses in the stream, unread
	h.register(schemas.Registration{EngineID: "r2", URL: deadURL, Role: "decode"}, "")
	b := h.startLeader("breaker-b")
	testkit.WaitFor(t, waitBound, "r2 written by breaker-b", func() bool { e, _ := h.fleetEntry("r2"); return e.By == "breaker-b" })
	testkit.WaitFor(t, waitBound, "r1 renewed by breaker-b", func() bool { e, _ := h.fleetEntry("r1"); return e.By == "breaker-b" })
	if e, _ := h.fleetEntry("r3"); e.EngineID != "" {
		t.Fatalf("a lapsed registration written by the new leader: %+v", e)
	}
	_ = b
}
