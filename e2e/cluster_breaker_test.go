package e2e

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/breaker"
	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestClusterEjectionProbeReadmission runs the breaker's whole cycle on
// one engine across three routers and two breakers, all processes:
//
//   - R-BRK-1, R-BRK-2, R-BRK-8: d1 fails eject_after decode streams (HTTP
//     500, sent through every router) and is ejected; every router stops
//     placing on it within a second of the ejecting eligibility event, and
//     no router sends it a request afterwards.
//   - R-BRK-3: while its /health is 200 but its decodes still fail, the
//     inference probes fail and d1 stays out across several readmission
//     intervals; once the fault is cleared, a successful probe readmits it
//     and every router places on it again.
//   - R-BRK-4: every failure was a crossed decode from p2 (p1 answers 429,
//     which counts for nothing), so every probe prefills on p2 — a new
//     handoff for each probe, pulled by that probe's decode on d1.
//   - R-BRK-6 without engine_contract: d1 ejected again and restarted as
//     another engine version is readmitted after its health check and probe.
//
// The breakers' lease is long here (10 s): the crossed-decode producer and
// the probe backoff live in the leader's memory (docs/architecture.md), so
// a busy machine that stalled the leader past a 1 s lease would hand over
// and legitimately probe with another producer. Handover has its own test.
func TestClusterEjectionProbeReadmission(t *testing.T) {
	c := startCluster(t, clusterOptions{breakerEnv: []string{"NARWHAL_BREAKER_LEASE_TTL_S=10"}})
	p1, p2, d1 := c.sims["p1"], c.sims["p2"], c.sims["d1"]

	c.arm(t, p1, `{"kind":"status","status":429,"phase":"prefill","message":"p1 is busy"}`)
	c.arm(t, d1, `{"kind":"status","status":500,"phase":"decode","message":"d1 is broken"}`)
	watch := c.watchAvailability("d1", false, decisionBound)
	c.failTimes(t, ejectAfter, http.StatusTooManyRequests)
	ej := c.waitEvents(t, decisionBound, 1, "d1's ejection", isEjection("d1"))[0]
	seen := watch.wait(t)
	c.disarm(t, p1)
	for i, at := range seen {
		lag := at.Sub(ej.At)
		t.Logf("R-BRK-8: router %s stopped placing on d1 %v after the ejecting eligibility event", c.routers[i].id, lag.Round(time.Millisecond))
		if lag > placementBound {
			t.Errorf("router %s applied d1's ejection %v after the event, more than %v (R-BRK-8)", c.routers[i].id, lag, placementBound)
		}
	}

	// The ejection followed exactly eject_after counted crossed-decode
	// failures p2 → d1, and came from the breaker after the last of them.
	fails := c.list(t, isFailure("d1"))
	if len(fails) != ejectAfter {
		t.Fatalf("%d failure events of d1, want %d", len(fails), ejectAfter)
	}
	for _, f := range fails {
		if !f.Counts || f.Phase != schemas.PhaseDecode || f.ProducerID != "p2" || f.ConsumerID != "d1" || f.Status != http.StatusBadGateway {
			t.Fatalf("failure event %s: want a counted decode failure p2 → d1 with status 502", f.raw)
		}
	}
	if ej.Eligible || ej.Streak != ejectAfter || ej.BreakerID == "" || ej.seq < fails[ejectAfter-1].seq {
		t.Fatalf("ejection %s: want eligible false, streak %d, from a breaker, after the last failure", ej.raw, ejectAfter)
	}

	// No router sends d1 a request while it is out (probes aside).
	before := len(routed(t, d1))
	for i := range 20 {
		if rep := c.mustSend(t, c.routers[i%len(c.routers)]); rep.status != http.StatusOK {
			t.Fatalf("router %s answered HTTP %d %s with d1 out", rep.router, rep.status, rep.body)
		}
	}
	if got := len(routed(t, d1)); got != before {
		t.Fatalf("d1 received %d router requests while ejected (R-BRK-1)", got-before)
	}

	// Health passes, inference fails: d1 stays out.
	resp, err := probeClient.Get(d1.url + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("d1 /health: HTTP %d, want 200 for this part", resp.StatusCode)
	}
	probes := c.waitEvents(t, decisionBound, 3, "three probes of d1", after(ej, isProbe("d1", "")))
	for _, p := range probes {
		if p.Outcome != schemas.ProbeFailure || p.Phase != schemas.PhaseDecode || p.ProducerID != "p2" || p.ConsumerID != "d1" {
			t.Fatalf("probe %s: want a failed decode probe with a new handoff from p2, the producer of the failed crossed decodes (R-BRK-3, R-BRK-4)", p.raw)
		}
	}
	if span := probes[2].At.Sub(probes[0].At); span < 2*readmitInterval {
		t.Fatalf("three probes within %v: want them at least two readmission intervals apart", span)
	}
	if rd := c.list(t, after(ej, isReadmission("d1"))); len(rd) > 0 {
		t.Fatalf("d1 readmitted although its inference fails: %s", rd[0].raw)
	}
	for _, r := range c.routers {
		if ok, err := available(r, "d1"); err != nil || ok {
			t.Fatalf("router %s: d1 available=%v (%v) while its probes fail", r.id, ok, err)
		}
	}
	t.Logf("R-BRK-3: d1 stayed out through %d failed probes over %v", len(probes), probes[len(probes)-1].At.Sub(ej.At).Round(time.Millisecond))

	// R-BRK-4: each probe decode on d1 pulled a handoff that p2 produced
	// for that same probe (same X-Request-Id, remote_engine_id p2); p1
	// prefilled no probe.
	if got := probed(t, p1, "prefill"); len(got) != 0 {
		t.Fatalf("p1 ran %d probe prefills, want none: the probe must use p2", len(got))
	}
	checkProbeHandoffs(t, probed(t, p2, "prefill"), probed(t, d1, "decode"), "p2", len(probes))

	// Recovery: the fault is cleared; a successful probe readmits d1.
	c.disarm(t, d1)
	watch = c.watchAvailability("d1", true, decisionBound)
	rd := c.waitEvents(t, decisionBound, 1, "d1's readmission", after(ej, isReadmission("d1")))[0]
	c.checkReadmittedByProbe(t, ej, rd)
	for i, at := range watch.wait(t) {
		lag := at.Sub(rd.At)
		t.Logf("R-BRK-8: router %s placed on d1 again %v after the readmitting eligibility event", c.routers[i].id, lag.Round(time.Millisecond))
		if lag > placementBound {
			t.Errorf("router %s applied d1's readmission %v after the event (R-BRK-8)", c.routers[i].id, lag)
		}
	}
	before = len(routed(t, d1))
	c.drive(t, []int{http.StatusOK}, func(reply) bool { return len(routed(t, d1)) > before })

	// R-BRK-6 without engine_contract: another version passes.
	ej = c.eject(t, d1)
	c.restartSim(t, d1, "--engine-version", "0.9.0")
	rd = c.waitEvents(t, decisionBound, 1, "d1's readmission as version 0.9.0", after(ej, isReadmission("d1")))[0]
	c.checkReadmittedByProbe(t, ej, rd)
	var v engines.EngineVersion
	getJSON(t, d1.url+"/version", &v)
	if v.Version != "0.9.0" {
		t.Fatalf("d1 reports version %q after the restart", v.Version)
	}
}

// checkProbeHandoffs checks R-BRK-4 on what the engines recorded: every
// probe decode pulled a descriptor whose remote_engine_id is producer,
// made by a probe prefill on producer with the same backend request id;
// at least n decodes were probed.
func checkProbeHandoffs(t *testing.T, prefills, decodes []sim.RecordedRequest, producer string, n int) {
	t.Helper()
	made := map[string]bool{}
	for _, r := range prefills {
		made[r.RequestID] = true
	}
	if len(decodes) < n {
		t.Fatalf("%d probe decodes recorded, want at least %d", len(decodes), n)
	}
	seen := map[string]bool{}
	for _, r := range decodes {
		var body struct {
			KV struct {
				RemoteEngineID string `json:"remote_engine_id"`
			} `json:"kv_transfer_params"`
		}
		if err := json.Unmarshal(r.Body, &body); err != nil {
			t.Fatalf("probe decode %s: %v", r.RequestID, err)
		}
		if !made[r.RequestID] || body.KV.RemoteEngineID != producer {
			t.Fatalf("probe decode %s pulled from %q, want a handoff %s made for this probe (R-BRK-4)", r.RequestID, body.KV.RemoteEngineID, producer)
		}
		if seen[r.RequestID] {
			t.Fatalf("probe id %s decoded twice: a probe reused a handoff", r.RequestID)
		}
		seen[r.RequestID] = true
	}
}

// TestClusterEngineContract proves R-BRK-6 with engine_contract pinned
// (model, engine vllm, version >=0.10, connector nixl): an ejected engine
// that comes back as another version (restarted with --engine-version
// 0.9.0 on the same port) or serving another model (the wrong-model fault)
// passes its health check but fails lifecycle validation, so its probes
// fail and it stays out; once it matches the contract again it is
// readmitted after a successful probe.
func TestClusterEngineContract(t *testing.T) {
	c := startCluster(t, clusterOptions{contract: true})
	d1 := c.sims["d1"]

	ej := c.eject(t, d1)
	c.restartSim(t, d1, "--engine-version", "0.9.0")
	c.waitEvents(t, decisionBound, 2, "two probes of d1 failing engine_contract.version", after(ej, func(e event) bool {
		return isProbe("d1", schemas.ProbeFailure)(e) && strings.Contains(e.Message, "engine_contract.version")
	}))
	if rd := c.list(t, after(ej, isReadmission("d1"))); len(rd) > 0 {
		t.Fatalf("d1 readmitted as version 0.9.0 against the contract: %s", rd[0].raw)
	}
	c.restartSim(t, d1) // the pinned version again
	rd := c.waitEvents(t, decisionBound, 1, "d1's readmission as a matching version", after(ej, isReadmission("d1")))[0]
	c.checkReadmittedByProbe(t, ej, rd)
	c.waitAvailable(t, "d1", true, placementBound)

	ej = c.eject(t, d1)
	c.disarm(t, d1)
	c.arm(t, d1, `{"kind":"wrong-model","message":"another-model"}`)
	c.waitEvents(t, decisionBound, 2, "two probes of d1 failing engine_contract.model", after(ej, func(e event) bool {
		return isProbe("d1", schemas.ProbeFailure)(e) && strings.Contains(e.Message, "engine_contract.model")
	}))
	if rd := c.list(t, after(ej, isReadmission("d1"))); len(rd) > 0 {
		t.Fatalf("d1 readmitted while serving another model: %s", rd[0].raw)
	}
	for _, r := range c.routers {
		if ok, err := available(r, "d1"); err != nil || ok {
			t.Fatalf("router %s: d1 available=%v (%v) against the contract", r.id, ok, err)
		}
	}
	c.disarm(t, d1)
	rd = c.waitEvents(t, decisionBound, 1, "d1's readmission with the pinned model", after(ej, isReadmission("d1")))[0]
	c.checkReadmittedByProbe(t, ej, rd)
}

// TestClusterWholeWave proves R-BRK-7: with both decode engines ejected,
// every router answers 503 "no eligible engine for decode" with
// Retry-After (and /readyz says why); once the engines are healthy again
// the breaker probes them and readmits each on its own success, and
// requests succeed on every router.
func TestClusterWholeWave(t *testing.T) {
	c := startCluster(t, clusterOptions{})
	d1, d2 := c.sims["d1"], c.sims["d2"]
	for _, s := range []*simProc{d1, d2} {
		c.arm(t, s, `{"kind":"status","status":500,"phase":"decode","message":"`+s.id+` is broken"}`)
	}
	c.drive(t, []int{http.StatusBadGateway, http.StatusServiceUnavailable}, func(reply) bool {
		return len(c.list(t, isEjection("d1"))) > 0 && len(c.list(t, isEjection("d2"))) > 0
	})
	ej1 := c.list(t, isEjection("d1"))[0]
	ej2 := c.list(t, isEjection("d2"))[0]
	c.waitAvailable(t, "d1", false, placementBound)
	c.waitAvailable(t, "d2", false, placementBound)

	for _, r := range c.routers {
		rep := c.mustSend(t, r)
		obj, ok := schemas.ParseError([]byte(rep.body))
		if rep.status != http.StatusServiceUnavailable || !ok || !strings.HasPrefix(obj.Message, "no eligible engine for decode") {
			t.Fatalf("router %s: HTTP %d %s, want 503 no eligible engine for decode", r.id, rep.status, rep.body)
		}
		if n, err := strconv.Atoi(rep.retryAfter); err != nil || n < 1 {
			t.Fatalf("router %s: Retry-After %q, want a positive number of seconds", r.id, rep.retryAfter)
		}
		resp, err := probeClient.Get(r.url + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		var ready struct {
			Problems []string `json:"problems"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&ready)
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(strings.Join(ready.Problems, ";"), "no eligible engine for decode") {
			t.Fatalf("router %s /readyz: HTTP %d %v, want 503 naming decode", r.id, resp.StatusCode, ready.Problems)
		}
	}

	c.disarm(t, d1)
	c.disarm(t, d2)
	rd1 := c.waitEvents(t, decisionBound, 1, "d1's readmission", after(ej1, isReadmission("d1")))[0]
	rd2 := c.waitEvents(t, decisionBound, 1, "d2's readmission", after(ej2, isReadmission("d2")))[0]
	c.checkReadmittedByProbe(t, ej1, rd1)
	c.checkReadmittedByProbe(t, ej2, rd2)
	t.Logf("R-BRK-7: d1 readmitted %v and d2 %v after their ejection", rd1.At.Sub(ej1.At).Round(time.Millisecond), rd2.At.Sub(ej2.At).Round(time.Millisecond))
	// Ejected together, they are probed together: each round probes the
	// whole wave, so the round of each one's successful probe probed the
	// other too, well within half an interval of it. (Their successful
	// probes themselves may be a round apart: the two disarms are two
	// calls, and a round may fall between them.)
	for _, pair := range [][2]string{{"d1", "d2"}, {"d2", "d1"}} {
		ej := map[string]event{"d1": ej1, "d2": ej2}
		rd := map[string]event{"d1": rd1, "d2": rd2}
		ok := c.list(t, after(ej[pair[0]], isProbe(pair[0], schemas.ProbeSuccess)))[0]
		if rd[pair[1]].At.Before(ok.At.Add(-readmitInterval / 2)) {
			// The other was readmitted a round or more before: the wave
			// was over, and the other is probed no more.
			continue
		}
		gap := time.Duration(1<<63 - 1)
		for _, p := range c.list(t, after(ej[pair[1]], isProbe(pair[1], ""))) {
			gap = min(gap, p.At.Sub(ok.At).Abs())
		}
		if gap >= readmitInterval/2 {
			t.Fatalf("the round of %s's successful probe did not probe %s: its nearest probe is %v away (R-BRK-7)", pair[0], pair[1], gap)
		}
	}
	c.waitAvailable(t, "d1", true, placementBound)
	c.waitAvailable(t, "d2", true, placementBound)
	for i := range 2 * len(c.routers) {
		if rep := c.mustSend(t, c.routers[i%len(c.routers)]); rep.status != http.StatusOK {
			t.Fatalf("router %s: HTTP %d %s after the readmissions", rep.router, rep.status, rep.body)
		}
	}
}

// TestClusterBreakerHandover proves R-BRK-8 and R-BRK-1 across breaker
// processes: the active breaker applies two failures of d1 and is killed
// (SIGKILL); a third failure is published while nobody leads; the standby
// takes the lease within the lease TTL (plus its campaign period) and
// applies that failure from the durable consumer, ejecting d1 — no failure
// event is lost. Then R-BUS-7: restarting a router and a breaker, and a
// clean handover to the restarted breaker, keep the stream, both buckets,
// the breakers' consumer and a dashboard's own consumer (creation times
// unchanged, nothing lost).
func TestClusterBreakerHandover(t *testing.T) {
	c := startCluster(t, clusterOptions{})
	d1 := c.sims["d1"]

	ctx := testContext(t, readyBound)
	const dashboard = "e2e-dashboard"
	if _, err := c.conn.JetStream().CreateOrUpdateConsumer(ctx, bus.StreamName, jetstream.ConsumerConfig{
		Durable: dashboard, AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: bus.SubjectPrefix + ">",
	}); err != nil {
		t.Fatal(err)
	}
	streamBefore := c.streamInfo(t, bus.StreamName)
	placementBefore := c.streamInfo(t, "KV_"+bus.PlacementBucket)
	leaseBefore := c.streamInfo(t, "KV_"+breaker.LeaseBucket)
	consumerBefore := c.consumerInfo(t, breaker.ConsumerName)
	dashboardBefore := c.consumerInfo(t, dashboard)

	leaderID := c.leader(t)
	active := c.breakerOf(leaderID)
	if active == nil {
		t.Fatalf("lease holder %q is none of the breakers", leaderID)
	}
	standby := c.breakers[0]
	if standby == active {
		standby = c.breakers[1]
	}

	c.arm(t, d1, `{"kind":"status","status":500,"phase":"decode","message":"d1 is broken"}`)
	c.failTimes(t, ejectAfter-1)
	testkit.WaitEvery(t, decisionBound, pollInterval, "d1's streak 2 applied and every event acknowledged", func() bool {
		e, _ := c.placement(t, "d1")
		ci := c.consumerInfo(t, breaker.ConsumerName)
		return e.Streak == ejectAfter-1 && ci.NumAckPending == 0 && ci.NumPending == 0
	})

	killed := time.Now()
	active.crash()
	c.failTimes(t, 1)
	c.waitEvents(t, readyBound, ejectAfter, "the last failure event of d1 on the bus", isFailure("d1"))
	if l := c.leader(t); l != "" && l != leaderID {
		t.Fatalf("%s already led when the failure was published; the test needs it published while nobody leads", l)
	}
	var newLeader string
	testkit.WaitEvery(t, decisionBound, pollInterval, "the standby taking the lease", func() bool {
		newLeader = c.leader(t)
		return c.breakerOf(newLeader) == standby
	})
	handover := time.Since(killed)
	t.Logf("R-BRK-8: the standby leads %v after the leader was killed (lease TTL %v)", handover.Round(time.Millisecond), leaseTTL)
	if handover > leaseTTL+handoverMargin {
		t.Errorf("handover took %v, more than the lease TTL %v + %v", handover, leaseTTL, handoverMargin)
	}
	ej := c.waitEvents(t, decisionBound, 1, "d1's ejection by the new leader", isEjection("d1"))[0]
	if ej.BreakerID != newLeader || ej.Streak != ejectAfter {
		t.Fatalf("ejection %s: want it from %s with streak %d (two failures before the kill, one after)", ej.raw, newLeader, ejectAfter)
	}
	testkit.WaitEvery(t, decisionBound, pollInterval, "every breaker event acknowledged", func() bool {
		ci := c.consumerInfo(t, breaker.ConsumerName)
		return ci.NumAckPending == 0 && ci.NumPending == 0
	})

	// Restarts: the killed breaker comes back, router r2 restarts, and the
	// leader stops cleanly, handing the lease to the restarted breaker.
	restarted := c.startBreaker(t)
	r2 := c.routers[1]
	r2.p.halt(t)
	c.spawnRouter(t, r2)
	waitHTTP(t, r2.p, r2.url+"/readyz")
	stopped := time.Now()
	standby.halt(t)
	testkit.WaitEvery(t, decisionBound, pollInterval, "the restarted breaker taking the lease", func() bool {
		return c.breakerOf(c.leader(t)) == restarted
	})
	t.Logf("R-BRK-8: after a clean stop the restarted breaker leads %v later", time.Since(stopped).Round(time.Millisecond))
	if e, _ := c.placement(t, "d1"); e.State != schemas.StateEjected {
		t.Fatalf("d1's placement after the handovers: %+v, want still ejected", e)
	}

	for _, s := range []struct {
		name   string
		before *jetstream.StreamInfo
	}{{bus.StreamName, streamBefore}, {"KV_" + bus.PlacementBucket, placementBefore}, {"KV_" + breaker.LeaseBucket, leaseBefore}} {
		now := c.streamInfo(t, s.name)
		if !now.Created.Equal(s.before.Created) {
			t.Errorf("stream %s created %v, before the restarts %v: it was recreated (R-BUS-7)", s.name, now.Created, s.before.Created)
		}
		if s.name != "KV_"+breaker.LeaseBucket && now.State.Msgs < s.before.State.Msgs {
			t.Errorf("stream %s holds %d messages, %d before the restarts (R-BUS-7)", s.name, now.State.Msgs, s.before.State.Msgs)
		}
	}
	for _, cs := range []struct {
		name   string
		before *jetstream.ConsumerInfo
	}{{breaker.ConsumerName, consumerBefore}, {dashboard, dashboardBefore}} {
		now := c.consumerInfo(t, cs.name)
		if !now.Created.Equal(cs.before.Created) {
			t.Errorf("consumer %s created %v, before %v: it was recreated (R-BUS-7)", cs.name, now.Created, cs.before.Created)
		}
		if now.Delivered.Stream < cs.before.Delivered.Stream {
			t.Errorf("consumer %s at stream sequence %d, before %d: its position was lost", cs.name, now.Delivered.Stream, cs.before.Delivered.Stream)
		}
	}
}
