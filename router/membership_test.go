package router

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// placeableIDs returns the ids of the engines placement may choose now
// for phase p, sorted.
func (rt *Router) placeableIDs(p phase) []string {
	now := time.Now().UnixNano()
	var out []string
	for _, m := range rt.fleet().Members() {
		if m.Can(p) && m.Available(now) {
			out = append(out, m.ID)
		}
	}
	slices.Sort(out)
	return out
}

// TestLiveFleetRFLEET1 proves R-FLEET-1…3 and R-BUS-9 on one router: an
// engine written to narwhal_fleet joins the router's fleet, is not placed
// on while joining, takes attempts within a second of becoming active;
// a draining engine takes no new attempt within a second and the
// router's report in narwhal_routers lists it with its legs; a removed
// engine leaves; malformed or forged values are ignored and counted, the
// engine keeping its state.
func TestLiveFleetRFLEET1(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	m := newMeshBus(t)
	if err := s.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	// The config's engines are kept while the bucket has no key for them.
	if got := len(s.rt.FleetIDs()); got != 4 {
		t.Fatalf("fleet after join: %v", s.rt.FleetIDs())
	}
	d3 := simtest.Start(t, sim.Config{Role: "decode", EngineID: "d3", Model: testModel})
	m.PutFleet("d3", schemas.FleetEntry{EngineID: "d3", URL: d3.URL(), Role: "decode", State: schemas.FleetJoining})
	testkit.WaitFor(t, time.Second, "d3 in the fleet, joining", func() bool { return s.rt.FleetIDs()["d3"] == schemas.FleetJoining })
	testkit.WaitFor(t, 3*time.Second, "d3's models known", func() bool {
		mb := s.rt.fleet().Member("d3")
		return mb != nil && mb.Models() != nil
	})
	for range 20 {
		if eng, _ := s.decodeEngineOf("joining"); eng == "d3" {
			t.Fatal("a joining engine served a request")
		}
	}
	m.PutFleet("d3", schemas.FleetEntry{EngineID: "d3", URL: d3.URL(), Role: "decode", State: schemas.FleetActive})
	testkit.WaitFor(t, time.Second, "d3 placeable", func() bool {
		for _, id := range s.rt.placeableIDs(decodePhase) {
			if id == "d3" {
				return true
			}
		}
		return false
	})
	served := false
	for range 40 {
		if eng, code := s.decodeEngineOf("active"); code == 200 && eng == "d3" {
			served = true
			break
		}
	}
	if !served {
		t.Fatal("active d3 served none of 40 requests")
	}

	// Drain d1: out of placement within a second, reported with 0 legs.
	spec := s.cfg.Fleet[2]
	m.PutFleet("d1", schemas.FleetEntry{EngineID: "d1", URL: spec.URL, Role: "decode", State: schemas.FleetDraining})
	testkit.WaitFor(t, time.Second, "d1 out of placement", func() bool {
		for _, id := range s.rt.placeableIDs(decodePhase) {
			if id == "d1" {
				return false
			}
		}
		return true
	})
	for range 20 {
		if eng, _ := s.decodeEngineOf("draining"); eng == "d1" {
			t.Fatal("a draining engine served a request")
		}
	}
	routers, err := m.Peer.BindBucket(context.Background(), bus.RoutersBucket)
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 3*time.Second, "the router's report lists d1 with no leg", func() bool {
		e, err := routers.Get(context.Background(), "rt-test")
		if err != nil || bus.ValidateRouterReport(e.Value()) != nil {
			return false
		}
		var r schemas.RouterReport
		_ = json.Unmarshal(e.Value(), &r)
		n, ok := r.Draining["d1"]
		return ok && n == 0
	})

	// Forged or malformed values for d2: ignored, counted, d2 unchanged.
	ignored := func() float64 {
		return testkit.GatheredSum(t, s.rt.Registry(), "narwhal_fleet_ignored_total", "reason", "invalid")
	}
	// The bucket keeps one value per key, so each value is judged before
	// the next replaces it (a watch that lags would see only the last).
	before := ignored()
	m.PutFleetRaw("d2", []byte(`{"not":"an entry"}`))
	testkit.WaitFor(t, 3*time.Second, "the first ignored value counted", func() bool { return ignored() >= before+1 })
	m.PutFleet("d2", schemas.FleetEntry{EngineID: "d9", URL: spec.URL, Role: "decode", State: schemas.FleetDraining})
	testkit.WaitFor(t, 3*time.Second, "the second ignored value counted", func() bool { return ignored() >= before+2 })
	m.PutFleetRaw("d2", []byte(`garbage`))
	testkit.WaitFor(t, 3*time.Second, "three ignored values counted", func() bool { return ignored() >= before+3 })
	if st := s.rt.FleetIDs()["d2"]; st != schemas.FleetActive {
		t.Errorf("d2 after forged values: %q, want active", st)
	}

	// Removal: d3 leaves.
	kv, _ := m.Peer.BindBucket(context.Background(), bus.FleetBucket)
	if err := kv.Delete(context.Background(), "d3"); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, time.Second, "d3 gone", func() bool { _, ok := s.rt.FleetIDs()["d3"]; return !ok })
}

// TestEmptyConfigFleetServesTheBucketRFLEET1 proves R-FLEET-1: a router
// whose config lists no engine serves the engines the bucket holds.
func TestEmptyConfigFleetServesTheBucketRFLEET1(t *testing.T) {
	s := newStack(t, nil, nil)
	m := newMeshBus(t)
	for _, d := range pd() {
		srv := simtest.Start(t, sim.Config{Role: d.role, EngineID: d.id, Model: testModel})
		m.PutFleet(d.id, schemas.FleetEntry{EngineID: d.id, URL: srv.URL(), Role: d.role, State: schemas.FleetActive, Source: schemas.SourceConfig, By: "test"})
	}
	if err := s.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 3*time.Second, "four engines with models", func() bool {
		f := s.rt.fleet()
		if len(f.Members()) != 4 {
			return false
		}
		for _, mb := range f.Members() {
			if mb.Models() == nil {
				return false
			}
		}
		return true
	})
	if eng, code := s.decodeEngineOf("from the bucket"); code != 200 || eng == "" {
		t.Fatalf("request: %d on %q", code, eng)
	}
}

// TestLeftEnginesLeaveNoSeriesRFLEET5 proves R-FLEET-5's last clause on
// one router: 20 engines added to the live fleet get their series (faults
// by phase and kind, recomputes, credential refusals, prefix index blocks,
// reservations, availability); once they leave — 10 keys deleted, 10
// purged — /metrics names none of them, and a fault counted for one after
// it left creates no series again.
func TestLeftEnginesLeaveNoSeriesRFLEET5(t *testing.T) {
	s := newStack(t, pd(), func(c *config.Config) { c.Placement.Policy = config.PolicyPrefix })
	s.waitModels()
	m := newMeshBus(t)
	if err := s.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	roles := []string{"prefill", "decode", "both"}
	ids := make([]string, 20)
	for i := range ids {
		ids[i] = fmt.Sprintf("gone-%02d", i)
		m.PutFleet(ids[i], schemas.FleetEntry{EngineID: ids[i], URL: s.cfg.Fleet[0].URL, Role: roles[i%3], State: schemas.FleetActive})
	}
	testkit.WaitFor(t, 3*time.Second, "the 20 engines in the fleet", func() bool {
		for _, id := range ids {
			if s.rt.FleetIDs()[id] != schemas.FleetActive {
				return false
			}
		}
		return true
	})
	for i, id := range ids {
		s.rt.metrics.fault(s.rt.inFleet, id, schemas.PhaseDecode, string(engines.KindOverload))
		s.rt.metrics.recomputed(s.rt.inFleet, ids[(i+1)%len(ids)], id)
		s.rt.view.RefuseCredentials(s.rt.fleet().Member(id), 401, "test")
		s.rt.PrefixIndex().Learn(id, []uint64{uint64(i) + 1})
	}
	naming := func(id string) int {
		_, body := s.get("/metrics")
		n := 0
		for _, line := range strings.Split(string(body), "\n") {
			if !strings.HasPrefix(line, "#") && strings.Contains(line, `"`+id+`"`) {
				n++
			}
		}
		return n
	}
	if n := naming("gone-02"); n < 16 {
		t.Fatalf("/metrics has %d series naming gone-02 while it is in the fleet, want at least 16", n)
	}
	kv, err := m.Peer.BindBucket(context.Background(), bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	for i, id := range ids {
		if i%2 == 0 {
			err = kv.Delete(context.Background(), id)
		} else {
			err = kv.Purge(context.Background(), id)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	testkit.WaitFor(t, 3*time.Second, "the 20 engines gone", func() bool {
		fl := s.rt.FleetIDs()
		for _, id := range ids {
			if _, ok := fl[id]; ok {
				return false
			}
		}
		return true
	})
	s.rt.metrics.fault(s.rt.inFleet, "gone-00", schemas.PhasePrefill, string(engines.KindConnectError))
	s.rt.metrics.recomputed(s.rt.inFleet, "p1", "gone-01")
	left := func() []string {
		_, body := s.get("/metrics")
		var out []string
		for _, line := range strings.Split(string(body), "\n") {
			if !strings.HasPrefix(line, "#") && strings.Contains(line, `"gone-`) {
				out = append(out, line)
			}
		}
		return out
	}
	if !testkit.Poll(3*time.Second, 20*time.Millisecond, func() bool { return len(left()) == 0 }) {
		t.Fatalf("/metrics still names engines that left:\n%s", strings.Join(left(), "\n"))
	}
	if n := naming("p1"); n == 0 {
		t.Fatal("/metrics names p1 no more: the series of the engines that stayed went too")
	}
}
