package breaker

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

var (
	prefillAndDecode = []simSpec{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}
)

// TestStreakEjectsAfterEjectAfter proves R-BRK-1 and R-BRK-2: eject_after
// consecutive counted failures eject an engine; a success in between
// resets the streak; failures that do not count (overload) and failures of
// engines outside the fleet change nothing; the streak lives in the
// engine's placement entry; the ejection is published as an eligibility
// event; a success after the ejection does not readmit (R-BRK-3). Also
// R-BRK-8: every engine gets an eligible entry when the breaker takes over.
func TestStreakEjectsAfterEjectAfter(t *testing.T) {
	h := newHarness(t, setup{fleet: prefillAndDecode, readmitS: 60})
	h.startLeader("breaker-a")
	for _, id := range []string{"p1", "d1"} {
		e := h.mustEntry(id)
		if !e.Eligible || e.State != schemas.StateEligible || e.Streak != 0 || e.BreakerID != "breaker-a" {
			t.Fatalf("seeded entry of %s: %+v", id, e)
		}
		// The event reaches the test's subscription a little after the
		// entry is written.
		testkit.WaitFor(t, waitBound, "the seed event of "+id, func() bool { return len(h.eligibilities(id)) > 0 })
		evs := h.eligibilities(id)
		if len(evs) != 1 || evs[0].State != schemas.StateEligible {
			t.Fatalf("seed events of %s: %+v", id, evs)
		}
	}

	h.fail("d1", schemas.PhaseDecode, true, "p1", "d1")
	h.applied(h.fail("d1", schemas.PhaseDecode, true, "p1", "d1"))
	if e := h.mustEntry("d1"); e.Streak != 2 || !e.Eligible {
		t.Fatalf("after 2 failures: %+v", e)
	}
	h.applied(h.succeed("p1", "d1"))
	if e := h.mustEntry("d1"); e.Streak != 0 || !e.Eligible {
		t.Fatalf("after a success: %+v", e)
	}
	h.fail("d1", schemas.PhaseDecode, true, "p1", "d1")
	h.fail("d1", schemas.PhaseDecode, true, "p1", "d1")
	for range 3 {
		h.fail("d1", schemas.PhaseDecode, false, "p1", "d1") // overload: does not count
	}
	h.fail("zz", schemas.PhaseDecode, true, "p1", "zz") // not in the fleet
	h.applied(h.succeed("", ""))                        // rejected before placement: no engines
	if e := h.mustEntry("d1"); e.Streak != 2 || !e.Eligible || e.State != schemas.StateEligible {
		t.Fatalf("after 2 counted and 3 uncounted failures: %+v", e)
	}
	if _, ok := h.entry("zz"); ok {
		t.Fatal("an engine outside the fleet got a placement entry")
	}
	if e := h.mustEntry("p1"); e.Streak != 0 {
		t.Fatalf("the producer's streak moved with the consumer's: %+v", e)
	}

	h.applied(h.fail("d1", schemas.PhaseDecode, true, "p1", "d1"))
	e := h.mustEntry("d1")
	if e.Eligible || e.State != schemas.StateEjected || e.Streak != 3 || !strings.Contains(e.Reason, "ejected after 3") {
		t.Fatalf("after the third counted failure: %+v", e)
	}
	evs := h.eligibilities("d1")
	testkit.WaitFor(t, waitBound, "the ejection event", func() bool { evs = h.eligibilities("d1"); return len(evs) == 2 })
	if last := evs[1]; last.Eligible || last.State != schemas.StateEjected || last.Streak != 3 || last.ID != e.ID {
		t.Fatalf("ejection event %+v, entry %+v", last, e)
	}

	h.applied(h.succeed("p1", "d1"))
	if e := h.mustEntry("d1"); e.State != schemas.StateEjected {
		t.Fatalf("a request success readmitted an ejected engine: %+v", e)
	}
}

// TestEjectionSurvivesRestart proves R-BRK-1 and R-BRK-8 across a breaker
// restart: the ejection and the streak live in narwhal_placement, so a new
// breaker keeps the one and continues the other (writing the entries
// again in its own name and lease term, R-BUS-9); and R-BUS-7: restarting
// deletes or recreates no stream, bucket or consumer.
func TestEjectionSurvivesRestart(t *testing.T) {
	h := newHarness(t, setup{fleet: []simSpec{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}, {id: "d2", role: "decode"}}, readmitS: 60})
	// d1 is down: a probe could not readmit it even if one ran.
	h.sims["d1"].Arm(sim.Fault{Kind: sim.FaultHealthStatus})
	a := h.startLeader("breaker-a")
	h.ejectDecode("d1", "p1")
	h.fail("d2", schemas.PhaseDecode, true, "p1", "d2")
	h.applied(h.fail("d2", schemas.PhaseDecode, true, "p1", "d2"))
	created := h.created()
	a.stop(t)

	h.startLeader("breaker-b")
	// The new leader rewrites the entries once it leads, not before.
	testkit.WaitFor(t, waitBound, "breaker-b to rewrite d1's entry", func() bool { return h.mustEntry("d1").BreakerID == "breaker-b" })
	if e := h.mustEntry("d1"); e.State != schemas.StateEjected || e.Eligible || e.Streak != 3 ||
		!strings.HasPrefix(e.Reason, "ejected after 3") || e.BreakerID != "breaker-b" || e.LeaseTerm == 0 {
		t.Fatalf("after the restart d1 is %+v, want still ejected, rewritten in breaker-b's term", e)
	}
	h.applied(h.fail("d2", schemas.PhaseDecode, true, "p1", "d2"))
	if e := h.mustEntry("d2"); e.State != schemas.StateEjected || e.Streak != 3 || e.BreakerID != "breaker-b" {
		t.Fatalf("the streak did not continue across the restart: %+v", e)
	}
	if got := h.created(); got != created {
		t.Fatalf("a restart recreated something:\n before %+v\n after  %+v", created, got)
	}
}

// busObjects are the creation times of what the breaker relies on.
type busObjects struct {
	stream, placement, lease, consumer time.Time
}

func (h *harness) created() busObjects {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	js := h.bus.JetStream()
	var o busObjects
	for name, at := range map[string]*time.Time{bus.StreamName: &o.stream, "KV_" + bus.PlacementBucket: &o.placement, "KV_" + LeaseBucket: &o.lease} {
		st, err := js.Stream(ctx, name)
		if err != nil {
			h.t.Fatalf("stream %s: %v", name, err)
		}
		*at = st.CachedInfo().Created
	}
	cons, err := js.Consumer(ctx, bus.StreamName, ConsumerName)
	if err != nil {
		h.t.Fatalf("consumer %s: %v", ConsumerName, err)
	}
	o.consumer = cons.CachedInfo().Created
	return o
}

// TestOneLeaderAndGracefulHandover proves R-BRK-8: of two breakers only one
// leads, through several lease renewals; when it stops, the standby leads
// within the lease TTL, and the events published meanwhile are applied by
// it (R-BRK-1: the durable consumer loses nothing).
func TestOneLeaderAndGracefulHandover(t *testing.T) {
	h := newHarness(t, setup{fleet: prefillAndDecode, readmitS: 60})
	a, b := h.start("breaker-a"), h.start("breaker-b")
	testkit.WaitFor(t, waitBound, "a leader", func() bool { return a.Leader() || b.Leader() })
	// Over three lease lifetimes (nine renewals) never two leaders, and
	// always one.
	end := time.Now().Add(3 * h.cfg.Breaker.LeaseTTL())
	for time.Now().Before(end) {
		la, lb := a.Leader(), b.Leader()
		if la == lb {
			t.Fatalf("leaders: a %v, b %v; want exactly one", la, lb)
		}
		time.Sleep(5 * time.Millisecond)
	}
	leader, standby := a, b
	if b.Leader() {
		leader, standby = b, a
	}
	h.applied(h.fail("d1", schemas.PhaseDecode, true, "p1", "d1"))

	stopped := time.Now()
	leader.stop(t)
	seq := h.fail("d1", schemas.PhaseDecode, true, "p1", "d1")
	testkit.WaitFor(t, waitBound, "the standby to lead", standby.Leader)
	if took, ttl := time.Since(stopped), h.cfg.Breaker.LeaseTTL(); took > ttl {
		t.Errorf("handover took %v, more than the lease TTL %v", took, ttl)
	}
	h.applied(seq)
	if e := h.mustEntry("d1"); e.Streak != 2 || e.BreakerID != standby.ID() {
		t.Fatalf("after the handover: %+v, want streak 2 written by %s", e, standby.ID())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	kv, err := h.bus.JetStream().KeyValue(ctx, LeaseBucket)
	if err != nil {
		t.Fatal(err)
	}
	kve, err := kv.Get(ctx, LeaseKey)
	if err != nil {
		t.Fatal(err)
	}
	var l Lease
	if err := json.Unmarshal(kve.Value(), &l); err != nil || l.BreakerID != standby.ID() {
		t.Fatalf("lease %s (%v), want held by %s", kve.Value(), err, standby.ID())
	}
}

// TestCrashedLeaderLeaseLapses proves R-BRK-8 and R-BRK-1 when the leader
// vanishes without releasing its lease (its bus connection dies): it stops
// leading at its first failed renewal, the standby takes over once the
// lease has aged out, and failure events published while nobody led are
// all applied, once each.
func TestCrashedLeaderLeaseLapses(t *testing.T) {
	h := newHarness(t, setup{fleet: prefillAndDecode, readmitS: 60})
	a := h.startLeader("breaker-a")
	b := h.start("breaker-b")
	h.applied(h.fail("d1", schemas.PhaseDecode, true, "p1", "d1"))

	a.bus.Close() // the leader's process is gone as far as the bus can tell
	h.fail("d1", schemas.PhaseDecode, false, "p1", "d1")
	h.fail("p1", schemas.PhasePrefill, true, "p1", "d1")
	seq := h.fail("d1", schemas.PhaseDecode, true, "p1", "d1")
	if b.Leader() {
		t.Log("the standby led before the events were published; the test still proves no event is lost")
	}
	testkit.WaitFor(t, waitBound, "the old leader to step down", func() bool { return !a.Leader() })
	testkit.WaitFor(t, waitBound, "the standby to lead", b.Leader)
	h.applied(seq)
	if e := h.mustEntry("d1"); e.Streak != 2 || e.State != schemas.StateEligible {
		t.Fatalf("d1 after the takeover: %+v, want streak 2", e)
	}
	if e := h.mustEntry("p1"); e.Streak != 1 {
		t.Fatalf("p1 after the takeover: %+v, want streak 1", e)
	}
}

// TestReadmissionOnlyAfterSuccessfulProbe proves R-BRK-3 and R-BRK-5: an
// ejected engine whose health check fails stays out, probe after probe,
// with a growing backoff; once healthy, a real prefill on an eligible
// producer and a real decode on it readmit it (streak 0, an eligibility
// event), and the probe is published.
func TestReadmissionOnlyAfterSuccessfulProbe(t *testing.T) {
	h := newHarness(t, setup{fleet: prefillAndDecode})
	h.sims["d1"].Arm(sim.Fault{Kind: sim.FaultHealthStatus, Status: 503})
	s := h.startLeader("breaker-a")
	h.ejectDecode("d1", "p1")

	failed := h.waitProbes("d1", schemas.ProbeFailure, 2)
	for _, p := range failed {
		if p.Phase != schemas.PhaseDecode || !strings.Contains(p.Message, "health check: HTTP 503") || p.BreakerID != "breaker-a" {
			t.Fatalf("probe %+v", p)
		}
	}
	if e := h.mustEntry("d1"); e.State != schemas.StateEjected {
		t.Fatalf("readmitted without a successful probe: %+v", e)
	}
	if got := backoffOf(s.Service, "d1"); got < 4 {
		t.Fatalf("backoff after 2 failed probes: %d, want >= 4", got)
	}
	if n := len(probeRequests(h.sims["d1"])) + len(probeRequests(h.sims["p1"])); n != 0 {
		t.Fatalf("%d inference requests before the health check passed", n)
	}

	h.sims["d1"].Disarm()
	e := h.waitState("d1", schemas.StateEligible)
	if !e.Eligible || e.Streak != 0 || !strings.Contains(e.Reason, "readmitted") {
		t.Fatalf("readmitted entry %+v", e)
	}
	ok := h.waitProbes("d1", schemas.ProbeSuccess, 1)[0]
	if ok.ProducerID != "p1" || ok.ConsumerID != "d1" || ok.Phase != schemas.PhaseDecode {
		t.Fatalf("successful probe %+v", ok)
	}
	// The probe was real: a one-token prefill on p1 and a decode on d1 of
	// the handoff, with one backend request id.
	pre, dec := probeRequests(h.sims["p1"]), probeRequests(h.sims["d1"])
	// Untraced probes carry no trace context.
	if len(pre) != 1 || len(dec) != 1 || pre[0].Phase != "prefill" || dec[0].Phase != "decode" || pre[0].RequestID != dec[0].RequestID ||
		pre[0].Traceparent != "" || dec[0].Traceparent != "" {
		t.Fatalf("probe requests: prefill %+v decode %+v", pre, dec)
	}
	if st := h.sims["d1"].Stats(); st.KVPulled != 1 {
		t.Fatalf("the decode probe did not pull the handoff: %+v", st)
	}
	testkit.WaitFor(t, waitBound, "the readmission event", func() bool {
		evs := h.eligibilities("d1")
		return len(evs) == 3 && evs[2].State == schemas.StateEligible && evs[2].Eligible
	})
	// The stream tells it in order: the successful probe, then the
	// readmission it caused.
	probeSubject, eligibilitySubject := bus.SubjectPrefix+schemas.KindProbe+".d1", bus.SubjectPrefix+schemas.KindEligibility+".d1"
	var order []string
	for _, ev := range h.events.All() {
		if ev.Subject == probeSubject && strings.Contains(string(ev.Payload), `"outcome":"success"`) ||
			ev.Subject == eligibilitySubject && strings.Contains(string(ev.Payload), "readmitted") {
			order = append(order, ev.Subject)
		}
	}
	if len(order) != 2 || order[0] != probeSubject || order[1] != eligibilitySubject {
		t.Fatalf("events in stream order %v: want the successful probe, then the readmission", order)
	}
	testkit.WaitFor(t, waitBound, "the backoff to reset", func() bool { return backoffOf(s.Service, "d1") == 1 })
}

// TestHealthyButInferenceFailingStaysOut proves R-BRK-3: a passing health
// check is not enough; a decode engine that answers /health with 200 but
// fails its decode (HTTP 500) stays out until its inference works.
func TestHealthyButInferenceFailingStaysOut(t *testing.T) {
	h := newHarness(t, setup{fleet: prefillAndDecode})
	h.sims["d1"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500, Message: "decode is broken"})
	h.startLeader("breaker-a")
	h.ejectDecode("d1", "p1")

	for _, p := range h.waitProbes("d1", schemas.ProbeFailure, 2) {
		if p.ProducerID != "p1" || p.ConsumerID != "d1" || !strings.Contains(p.Message, "decode is broken") {
			t.Fatalf("probe %+v", p)
		}
	}
	if e := h.mustEntry("d1"); e.State != schemas.StateEjected {
		t.Fatalf("readmitted although its decode fails: %+v", e)
	}
	// The producer's handoffs of the failed probes were released, not
	// stranded (R-OWN-6).
	if st := h.sims["p1"].Stats(); st.KVHeld != 0 || st.KVReleased < 2 {
		t.Fatalf("producer after failed probes: %+v", st)
	}
	h.sims["d1"].Disarm()
	h.waitState("d1", schemas.StateEligible)
}

// TestContractMismatchKeepsEngineOut proves R-BRK-6 with an engine
// contract: an engine that came back serving another model, or as another
// engine version, stays out although it is healthy and could decode; an
// engine that matches again is readmitted.
func TestContractMismatchKeepsEngineOut(t *testing.T) {
	h := newHarness(t, setup{
		fleet:    []simSpec{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}, {id: "d2", role: "decode", version: "0.9.1"}},
		contract: &config.Contract{Model: testModel, Engine: "vllm", Version: ">=0.10", Connector: "nixl"},
	})
	h.sims["d1"].Arm(sim.Fault{Kind: sim.FaultWrongModel, Message: "other-model"})
	h.startLeader("breaker-a")
	h.ejectDecode("d1", "p1")
	h.ejectDecode("d2", "p1")

	for _, p := range h.waitProbes("d1", schemas.ProbeFailure, 2) {
		if !strings.Contains(p.Message, `breaks engine_contract.model: want "m", got models "other-model"`) {
			t.Fatalf("d1 probe %+v", p)
		}
	}
	for _, p := range h.waitProbes("d2", schemas.ProbeFailure, 2) {
		if !strings.Contains(p.Message, `breaks engine_contract.version: want ">=0.10", got "0.9.1"`) {
			t.Fatalf("d2 probe %+v", p)
		}
	}
	if n := len(probeRequests(h.sims["d1"])) + len(probeRequests(h.sims["d2"])); n != 0 {
		t.Fatalf("%d inference probes ran on engines that break the contract", n)
	}
	h.sims["d1"].Disarm()
	h.waitState("d1", schemas.StateEligible)
	before := len(h.probes("d2"))
	testkit.WaitFor(t, waitBound, "another probe of d2", func() bool { return len(h.probes("d2")) > before })
	if e := h.mustEntry("d2"); e.State != schemas.StateEjected {
		t.Fatalf("d2 readmitted against the contract: %+v", e)
	}
}

// TestWithoutContractHealthAndProbeReadmit proves R-BRK-6 for development
// fleets: without an engine contract an engine of any version is
// readmitted after a passing health check and inference probe.
func TestWithoutContractHealthAndProbeReadmit(t *testing.T) {
	h := newHarness(t, setup{fleet: []simSpec{{id: "p1", role: "prefill"}, {id: "d1", role: "decode", version: "0.9.1"}}})
	h.startLeader("breaker-a")
	h.ejectDecode("d1", "p1")
	h.waitState("d1", schemas.StateEligible)
	if p := h.waitProbes("d1", schemas.ProbeSuccess, 1)[0]; p.ProducerID != "p1" {
		t.Fatalf("probe %+v", p)
	}
}

// TestDecodeProbeUsesOriginalProducer proves R-BRK-4: after a
// crossed-decode failure the decode engine's probe decodes a new handoff
// made by the original producer — here p2, although p1 comes first in the
// fleet and is what a decode probe uses otherwise.
func TestDecodeProbeUsesOriginalProducer(t *testing.T) {
	h := newHarness(t, setup{fleet: []simSpec{{id: "p1", role: "prefill"}, {id: "p2", role: "prefill"}, {id: "d1", role: "decode"}}})
	h.startLeader("breaker-a")

	h.ejectDecode("d1", "p2")
	h.waitState("d1", schemas.StateEligible)
	if p := h.waitProbes("d1", schemas.ProbeSuccess, 1)[0]; p.ProducerID != "p2" || p.ConsumerID != "d1" {
		t.Fatalf("probe %+v, want producer p2", p)
	}
	if n := len(probeRequests(h.sims["p1"])); n != 0 {
		t.Fatalf("p1 ran %d probe prefills", n)
	}
	pre, dec := probeRequests(h.sims["p2"]), probeRequests(h.sims["d1"])
	if len(pre) != 1 || len(dec) != 1 || pre[0].RequestID != dec[0].RequestID {
		t.Fatalf("probe requests: p2 %+v, d1 %+v", pre, dec)
	}
	var body struct {
		KV struct {
			RemoteEngineID string `json:"remote_engine_id"`
		} `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(dec[0].Body, &body); err != nil || body.KV.RemoteEngineID != "p2" {
		t.Fatalf("decode probe body %s (%v): want a handoff from p2", dec[0].Body, err)
	}

	// Without a crossed-decode failure to remember, the first eligible
	// producer in fleet order makes the handoff.
	h.ejectDecode("d1", "")
	h.waitState("d1", schemas.StateEligible)
	if p := h.waitProbes("d1", schemas.ProbeSuccess, 2)[1]; p.ProducerID != "p1" {
		t.Fatalf("second probe %+v, want producer p1", p)
	}
}

// TestWholeWaveProbedInParallel proves R-BRK-7: when every decode engine
// is ejected, each cadence probes them all at once (both decodes are seen
// in flight together), and each is readmitted on its own success once the
// engines recover.
func TestWholeWaveProbedInParallel(t *testing.T) {
	h := newHarness(t, setup{fleet: []simSpec{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}, {id: "d2", role: "decode"}}})
	for _, id := range []string{"d1", "d2"} {
		h.sims[id].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 503, Message: "restarting"})
	}
	h.startLeader("breaker-a")
	// Both are ejected at once, a whole wave: one ejected a round before
	// the other (a loaded machine between two ejectDecode calls) would be
	// probed alone first and keep a longer backoff than the other.
	for range h.cfg.Recovery.EjectAfter {
		for _, id := range []string{"d1", "d2"} {
			h.fail(id, schemas.PhaseDecode, true, "p1", id)
		}
	}
	h.waitState("d1", schemas.StateEjected)
	h.waitState("d2", schemas.StateEjected)
	h.waitProbes("d1", schemas.ProbeFailure, 1)
	h.waitProbes("d2", schemas.ProbeFailure, 1)

	// The engines recover, slowly enough to be seen decoding together.
	for _, id := range []string{"d1", "d2"} {
		h.sims[id].Disarm()
		h.sims[id].Arm(sim.Fault{Kind: sim.FaultFirstTokenDelay, Phase: sim.PhaseDecode, DelayMS: 600, Count: 1})
	}
	testkit.WaitFor(t, waitBound, "both decode probes in flight together", func() bool {
		return h.sims["d1"].Stats().ActiveStreams > 0 && h.sims["d2"].Stats().ActiveStreams > 0
	})
	h.waitState("d1", schemas.StateEligible)
	h.waitState("d2", schemas.StateEligible)
}

// TestInconclusiveProbeChangesNothing proves R-BRK-5: when the probe's
// other engine fails its leg (the partner is down) or there is no partner
// at all, the probe is inconclusive: the engine is neither readmitted nor
// is its backoff grown, and it keeps the normal cadence.
func TestInconclusiveProbeChangesNothing(t *testing.T) {
	h := newHarness(t, setup{fleet: prefillAndDecode})
	s := h.startLeader("breaker-a")
	h.sims["d1"].Close() // the only consumer is down, but still eligible
	h.ejectPrefill("p1")

	for _, p := range h.waitProbes("p1", schemas.ProbeInconclusive, 3) {
		if p.Phase != schemas.PhasePrefill || p.ProducerID != "p1" || p.ConsumerID != "d1" || !strings.Contains(p.Message, "partner d1 failed its leg") {
			t.Fatalf("probe %+v", p)
		}
	}
	if got := backoffOf(s.Service, "p1"); got != 1 {
		t.Fatalf("backoff after inconclusive probes: %d, want 1", got)
	}
	if e := h.mustEntry("p1"); e.State != schemas.StateEjected || e.Streak != 3 {
		t.Fatalf("p1 after inconclusive probes: %+v", e)
	}
	if n := len(h.probes("p1")); n != len(h.waitProbes("p1", schemas.ProbeInconclusive, 3)) {
		t.Fatalf("p1 had %d probes, not all inconclusive", n)
	}

	// With d1 ejected too (and failing its own health check), p1 has no
	// partner at all.
	h.ejectDecode("d1", "p1")
	before := len(h.probes("p1"))
	var p schemas.Probe
	testkit.WaitFor(t, waitBound, "a probe of p1 without partner", func() bool {
		ps := h.probes("p1")
		for _, q := range ps[before:] {
			if strings.Contains(q.Message, "no eligible decode engine") {
				p = q
				return true
			}
		}
		return false
	})
	if p.Outcome != schemas.ProbeInconclusive || p.ConsumerID != "" {
		t.Fatalf("probe %+v", p)
	}
	if got := backoffOf(s.Service, "p1"); got != 1 {
		t.Fatalf("backoff after a probe without partner: %d, want 1", got)
	}
	h.waitProbes("d1", schemas.ProbeFailure, 1)
}

// TestBothEngineProbesSameWorker proves R-BRK-3 for a `both` engine: its
// probe is a same-worker transfer on itself, with no transfer parameters
// on either leg (R-LEG-4), and readmits it.
func TestBothEngineProbesSameWorker(t *testing.T) {
	h := newHarness(t, setup{fleet: []simSpec{{id: "b1", role: "both"}}})
	h.startLeader("breaker-a")
	h.ejectDecode("b1", "b1")
	h.waitState("b1", schemas.StateEligible)
	if p := h.waitProbes("b1", schemas.ProbeSuccess, 1)[0]; p.ProducerID != "b1" || p.ConsumerID != "b1" || p.Phase != schemas.PhaseDecode {
		t.Fatalf("probe %+v", p)
	}
	reqs := probeRequests(h.sims["b1"])
	if len(reqs) != 2 {
		t.Fatalf("b1 probe requests %+v, want a prefill and a decode", reqs)
	}
	for _, r := range reqs {
		if strings.Contains(string(r.Body), "kv_transfer_params") {
			t.Fatalf("same-worker probe leg carries transfer parameters: %s", r.Body)
		}
	}
}

// TestRunTwiceRefused checks the durable consumer's shape (R-BRK-1,
// R-BUS-7: durable, explicit acks, failure and request subjects, never
// removed for inactivity) and that a second Run of one Service is refused.
func TestRunTwiceRefused(t *testing.T) {
	h := newHarness(t, setup{fleet: prefillAndDecode, readmitS: 60})
	r := h.startLeader("breaker-a")
	if err := r.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "twice") {
		t.Fatalf("second Run: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cons, err := h.bus.JetStream().Consumer(ctx, bus.StreamName, ConsumerName)
	if err != nil {
		t.Fatal(err)
	}
	ci := cons.CachedInfo().Config
	if ci.Durable != ConsumerName || ci.AckPolicy != jetstream.AckExplicitPolicy || len(ci.FilterSubjects) != 2 ||
		ci.FilterSubjects[0] != "narwhal.events.failure.>" || ci.FilterSubjects[1] != "narwhal.events.request.>" || ci.InactiveThreshold != 0 {
		t.Fatalf("consumer config %+v", ci)
	}
}

// TestWholeFleetEjectedProbesTogether proves R-BRK-7 when every engine of
// both phases is ejected: there is no eligible partner, so the engines
// that pass their checks in the same round are paired with each other,
// and each is readmitted on its own success instead of waiting forever.
func TestWholeFleetEjectedProbesTogether(t *testing.T) {
	h := newHarness(t, setup{fleet: prefillAndDecode})
	for _, id := range []string{"p1", "d1"} {
		h.sims[id].Arm(sim.Fault{Kind: sim.FaultHealthStatus})
	}
	h.startLeader("breaker-a")
	h.ejectPrefill("p1")
	h.ejectDecode("d1", "p1")
	h.waitProbes("p1", schemas.ProbeFailure, 1)
	h.waitProbes("d1", schemas.ProbeFailure, 1)

	for _, id := range []string{"p1", "d1"} {
		h.sims[id].Disarm()
	}
	h.waitState("p1", schemas.StateEligible)
	h.waitState("d1", schemas.StateEligible)
	for _, id := range []string{"p1", "d1"} {
		if p := h.waitProbes(id, schemas.ProbeSuccess, 1)[0]; p.ProducerID != "p1" || p.ConsumerID != "d1" {
			t.Fatalf("probe of %s: %+v", id, p)
		}
	}
}

// TestDeletedConsumerIsRecreatedRBUS9 proves R-BUS-9: a client deletes the
// breaker's durable consumer; the leader notices and creates it again
// within a readmission interval, from the event after the last one it
// applied, so the failures published while it was gone are applied and
// eject the engine; it says so in its log and its metric.
func TestDeletedConsumerIsRecreatedRBUS9(t *testing.T) {
	h := newHarness(t, setup{fleet: []simSpec{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}, readmitS: 0.5})
	h.sims["d1"].Arm(sim.Fault{Kind: sim.FaultHealthStatus}) // keep it out once ejected
	h.startLeader("breaker-a")
	h.applied(h.fail("d1", schemas.PhaseDecode, true, "p1", "d1"))
	ctx := context.Background()
	if err := h.bus.JetStream().DeleteConsumer(ctx, bus.StreamName, ConsumerName); err != nil {
		t.Fatal(err)
	}
	deleted := time.Now()
	h.fail("d1", schemas.PhaseDecode, true, "p1", "d1")
	h.fail("d1", schemas.PhaseDecode, true, "p1", "d1")
	var recreated time.Time
	testkit.WaitFor(t, waitBound, "the consumer recreated", func() bool {
		octx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		if _, err := h.bus.JetStream().Consumer(octx, bus.StreamName, ConsumerName); err != nil {
			return false
		}
		recreated = time.Now()
		return true
	})
	if took := recreated.Sub(deleted); took > h.cfg.Recovery.ReadmitInterval() {
		t.Errorf("the consumer came back after %v, beyond the readmission interval %v", took, h.cfg.Recovery.ReadmitInterval())
	}
	if e := h.waitState("d1", schemas.StateEjected); e.Streak != 3 {
		t.Fatalf("d1 after the recreation: %+v, want ejected with streak 3 (the failures published while the consumer was gone applied once)", e)
	}
}

// TestTakeoverProbesEnginesWithForgedEntriesRBUS9 proves that a breaker
// taking the lease trusts no entry it did not write (R-BUS-9): d1 is
// ejected and failing; someone with write access puts a malformed
// "eligible" value on d1 and garbage on d2; the leader loses its lease and
// takes it again (a new term), reading every entry anew. d1 stays ejected
// in the new term — the forgery does not readmit a failing engine — and
// healthy d2 is probed and readmitted instead of being taken as whatever
// the garbage said.
func TestTakeoverProbesEnginesWithForgedEntriesRBUS9(t *testing.T) {
	h := newHarness(t, setup{fleet: []simSpec{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}, {id: "d2", role: "decode"}}})
	h.sims["d1"].Arm(sim.Fault{Kind: sim.FaultHealthStatus}) // its probes fail
	h.startLeader("breaker-a")
	h.ejectDecode("d1", "p1")
	term := h.mustEntry("d1").LeaseTerm

	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	for key, value := range map[string]string{"d1": `{"eligible":true,"state":"eligible"}`, "d2": `not json`} {
		if _, err := h.bus.Placement().Put(ctx, key, []byte(value)); err != nil {
			t.Fatal(err)
		}
	}
	lease, err := h.bus.JetStream().KeyValue(ctx, LeaseBucket)
	if err != nil {
		t.Fatal(err)
	}
	if err := lease.Delete(ctx, LeaseKey); err != nil { // the leader's next renewal fails: it leads again, in a new term
		t.Fatal(err)
	}
	rewritten := func(engine string) (schemas.Eligibility, bool) {
		kve, err := h.bus.Placement().Get(ctx, engine)
		if err != nil || bus.ValidatePlacement(kve.Value()) != nil {
			return schemas.Eligibility{}, false
		}
		var e schemas.Eligibility
		if json.Unmarshal(kve.Value(), &e) != nil {
			return schemas.Eligibility{}, false
		}
		return e, e.BreakerID == "breaker-a" && e.LeaseTerm > term
	}
	var d1 schemas.Eligibility
	testkit.WaitFor(t, waitBound, "d1's entry written again in a new term", func() bool {
		var ok bool
		d1, ok = rewritten("d1")
		return ok
	})
	if d1.State != schemas.StateEjected || d1.Eligible {
		t.Fatalf("d1 after the takeover: %+v, want still ejected (a forged value must not readmit it)", d1)
	}
	testkit.WaitFor(t, waitBound, "d2 readmitted after a probe", func() bool {
		e, ok := rewritten("d2")
		return ok && e.State == schemas.StateEligible && strings.Contains(e.Reason, "readmitted")
	})
	if e, _ := rewritten("d1"); e.State != schemas.StateEjected {
		t.Fatalf("d1 readmitted although its probes fail: %+v", e)
	}
}

// TestBreakerOutOfDescriptorsProbesInconclusiveRFAIL9 proves that a probe
// the breaker could not run because it ran out of something of its own
// (its dial fails with EMFILE: every descriptor of the process in use)
// blames no engine (behaviour.md R-FAIL-9, R-BRK-5): it is inconclusive,
// names the breaker's resources, and the engine's backoff does not grow,
// so that it is probed again at the normal cadence once descriptors free.
func TestBreakerOutOfDescriptorsProbesInconclusiveRFAIL9(t *testing.T) {
	h := newHarness(t, setup{fleet: prefillAndDecode})
	emfile := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("socket", syscall.EMFILE)}
	client := engines.NewClient(engines.Options{
		PrefillTimeout: time.Second, FirstTokenTimeout: time.Second, HandoffMaxAge: time.Minute,
		Transport: &http.Transport{DialContext: func(context.Context, string, string) (net.Conn, error) { return nil, emfile }},
	})
	s := h.startLeaderWith("breaker-a", func(o *Options) { o.Client = client })
	h.ejectPrefill("p1")
	for _, p := range h.waitProbes("p1", schemas.ProbeInconclusive, 2) {
		if !strings.Contains(p.Message, "breaker out of local resources (emfile") {
			t.Fatalf("probe %+v, want the breaker's resources named", p)
		}
	}
	if n := len(h.waitProbes("p1", schemas.ProbeFailure, 0)); n != 0 {
		t.Fatalf("%d probes of p1 failed: the breaker's own fault was blamed on the engine", n)
	}
	if got := backoffOf(s.Service, "p1"); got != 1 {
		t.Fatalf("backoff after probes the breaker could not run: %d, want 1", got)
	}
}
