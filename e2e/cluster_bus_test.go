package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestClusterBusRestart proves R-BUS-6 and R-BUS-2 with `narwhal bus` as a
// process: with d1 ejected, four client goroutines send requests through
// all three routers while the bus is stopped (SIGTERM) and started again
// on the same port and data dir. Every request succeeds, on the last known
// placement (d1 gets none while the bus is down, and every router stays
// ready); after the restart an eligibility change — d1's readmission —
// reaches every router. Every request answered has exactly one request
// event on the stream (buffered through the outage, or published again
// when the bus went with it in flight), none was dropped, and every
// stored event validates (R-BUS-3, in the cluster's teardown).
func TestClusterBusRestart(t *testing.T) {
	c := startCluster(t, clusterOptions{})
	d1 := c.sims["d1"]
	c.eject(t, d1)
	c.waitAvailable(t, "d1", false, placementBound)
	d1Before := len(routed(t, d1))

	ctx, cancel := context.WithCancel(context.Background())
	var (
		wg       sync.WaitGroup
		answered atomic.Int64
		mu       sync.Mutex
		ids      []string // X-Request-Id of every answered request
		bad      []string // what went wrong
	)
	for g := range 4 {
		wg.Go(func() {
			for i := g; ctx.Err() == nil; i++ {
				rep, err := c.send(ctx, c.routers[i%len(c.routers)])
				if ctx.Err() != nil {
					return
				}
				mu.Lock()
				switch {
				case err != nil:
					bad = append(bad, err.Error())
				case rep.status != http.StatusOK:
					bad = append(bad, fmt.Sprintf("router %s: HTTP %d %s", rep.router, rep.status, rep.body))
				default:
					ids = append(ids, rep.id)
					answered.Add(1)
				}
				mu.Unlock()
			}
		})
	}
	var stopOnce sync.Once
	stopClients := func() { stopOnce.Do(func() { cancel(); wg.Wait() }) }
	t.Cleanup(stopClients)

	testkit.WaitEvery(t, readyBound, pollInterval, "20 answered requests", func() bool { return answered.Load() >= 20 })
	down := time.Now()
	c.busProc.halt(t)
	n := answered.Load()
	// Down for longer than the breakers' lease, so that they lose it too.
	testkit.WaitEvery(t, readyBound, pollInterval, "30 more answered requests and a lapsed lease with the bus down", func() bool {
		return answered.Load() >= n+30 && time.Since(down) > leaseTTL+handoverMargin
	})
	if c.conn.Connected() {
		t.Fatal("the test's bus connection is still up: the bus did not stop")
	}
	for _, r := range c.routers {
		if code := r.readyzStatus(t); code != http.StatusOK {
			t.Fatalf("router %s /readyz: HTTP %d with the bus down, want 200 on its last known placement", r.id, code)
		}
	}
	if got := len(routed(t, d1)); got != d1Before {
		t.Fatalf("d1 got %d router requests with the bus down: the last known placement (d1 ejected) was not kept", got-d1Before)
	}
	outage := answered.Load() - n

	c.startBus(t)
	up := time.Now()
	t.Logf("R-BUS-6: bus down for %v; %d requests answered meanwhile", up.Sub(down).Round(time.Millisecond), outage)
	c.disarm(t, d1)
	for i, at := range c.watchAvailability("d1", true, decisionBound).wait(t) {
		t.Logf("R-BUS-6: router %s placed on d1 again %v after the bus restarted", c.routers[i].id, at.Sub(up).Round(time.Millisecond))
	}
	testkit.WaitEvery(t, readyBound, pollInterval, "d1 serving the clients again", func() bool { return len(routed(t, d1)) > d1Before })
	stopClients()
	if len(bad) > 0 {
		t.Fatalf("%d requests failed across the bus restart, first: %s", len(bad), bad[0])
	}

	// Every answered request's event is on the stream exactly once: those
	// of the outage waited in the routers' buffers, and those in flight
	// when the bus went were published again (R-BUS-3, R-BUS-6).
	var missing []string
	var duringOutage int
	testkit.WaitEvery(t, decisionBound, pollInterval, "every answered request's event on the stream", func() bool {
		stored := map[string]int{}
		duringOutage = 0
		for _, be := range c.storedEvents(t) {
			if !strings.HasPrefix(be.Subject, bus.SubjectPrefix+schemas.KindRequest+".") {
				continue
			}
			e := parseEvent(t, 0, be.Subject, be.Payload)
			stored[e.RequestID]++
			if e.At.After(down) && e.At.Before(up) {
				duringOutage++
			}
		}
		missing = missing[:0]
		for _, id := range ids {
			switch stored[id] {
			case 0:
				missing = append(missing, id)
			case 1:
			default:
				t.Fatalf("request %s has %d request events, want one (R-BUS-3)", id, stored[id])
			}
		}
		return len(missing) == 0
	})
	if duringOutage == 0 {
		t.Fatal("no request event from the outage reached the stream: routers did not buffer them")
	}
	for _, r := range c.routers {
		if n := testkit.ScrapedSum(t, probeClient, r.url+"/metrics", "narwhal_events_dropped_total"); n != 0 {
			t.Errorf("router %s dropped %v events across a short bus restart", r.id, n)
		}
	}
	t.Logf("R-BUS-6: all %d answered requests have their event on the stream, %d of them from the outage", len(ids), duringOutage)
}

// TestClusterEventsCommand runs `narwhal events --json` as a process
// (R-BUS-5) through a scenario on routers with
// recovery.failure_quarantine_s = 1: d1 fails three decodes, one at a
// time. After each of the first two, the router that saw the failure has
// d1 out at once and the other routers as soon as its quarantine event
// arrives; once the quarantine lapses d1 is back everywhere (R-QUAR-1).
// The third failure ejects d1; after the fault is cleared a probe
// readmits it. The command's output holds each event exactly as published
// (valid against its schema, the same as the stream's) in order: failure,
// its quarantine, …, the ejection, the successful probe, the readmission.
func TestClusterEventsCommand(t *testing.T) {
	const quarantine = time.Second
	c := startCluster(t, clusterOptions{routerEnv: []string{"NARWHAL_RECOVERY_FAILURE_QUARANTINE_S=1"}})
	d1 := c.sims["d1"]
	events := spawn(t, "events", []string{"NARWHAL_NATS_URL=" + c.natsURL}, "events", "--json")
	c.extra = append(c.extra, events)
	testkit.WaitEvery(t, readyBound, pollInterval, "narwhal events following the bus", func() bool {
		if events.exited() {
			events.dump(t)
			t.Fatalf("narwhal events exited: %v", events.waitErr)
		}
		return strings.Contains(events.stderr.String(), "following ")
	})

	c.arm(t, d1, `{"kind":"status","status":500,"phase":"decode","message":"d1 is broken"}`)
	for i := range ejectAfter {
		var saw *routerProc
		c.drive(t, []int{http.StatusOK, http.StatusBadGateway}, func(r reply) bool {
			for _, rp := range c.routers {
				if rp.id == r.router && r.status == http.StatusBadGateway {
					saw = rp
				}
			}
			return saw != nil
		})
		failedAt := time.Now()
		if i == ejectAfter-1 {
			break
		}
		if ok, err := available(saw, "d1"); err != nil || ok {
			t.Fatalf("router %s: d1 available=%v (%v) right after it failed there, want quarantined at once (R-QUAR-1)", saw.id, ok, err)
		}
		for j, at := range c.watchAvailability("d1", false, quarantine).wait(t) {
			t.Logf("R-QUAR-1: failure %d seen by %s: router %s had d1 out %v after the client got the 502", i+1, saw.id, c.routers[j].id, at.Sub(failedAt).Round(time.Millisecond))
		}
		c.waitAvailable(t, "d1", true, quarantine+placementBound)
		if e, _ := c.placement(t, "d1"); e.State != schemas.StateEligible || e.Streak != i+1 {
			t.Fatalf("d1's placement after %d failures: %+v, want eligible with streak %d", i+1, e, i+1)
		}
	}
	ej := c.waitEvents(t, decisionBound, 1, "d1's ejection", isEjection("d1"))[0]
	c.disarm(t, d1)
	rd := c.waitEvents(t, decisionBound, 1, "d1's readmission", after(ej, isReadmission("d1")))[0]
	testkit.WaitEvery(t, readyBound, pollInterval, "the readmission in narwhal events' output", func() bool {
		return strings.Contains(events.stdout.String(), string(rd.raw))
	})
	if err := events.stop(os.Interrupt); err != nil {
		t.Fatalf("narwhal events after SIGINT: %v", err)
	}

	// The command's d1 events, as printed.
	var printed []event
	for i, line := range strings.Split(strings.TrimSpace(events.stdout.String()), "\n") {
		if err := bus.ValidateEvent([]byte(line)); err != nil {
			t.Fatalf("narwhal events printed %s: %v", line, err)
		}
		if e := parseEvent(t, i, "", []byte(line)); e.EngineID == "d1" {
			printed = append(printed, e)
		}
	}
	// The same as the bus carried, in the same order.
	first := c.list(t, isFailure("d1"))[0]
	onBus := c.list(t, func(e event) bool { return e.EngineID == "d1" && e.seq >= first.seq && e.seq <= rd.seq })
	if len(printed) < len(onBus) {
		t.Fatalf("narwhal events printed %d events about d1, the bus carried %d since the first failure", len(printed), len(onBus))
	}
	for i, e := range onBus {
		if !bytes.Equal(printed[len(printed)-len(onBus)+i].raw, e.raw) {
			t.Fatalf("printed event %d differs from the bus's:\n%s\n%s", i, printed[len(printed)-len(onBus)+i].raw, e.raw)
		}
	}

	// The scenario in order.
	find := func(from int, what string, match func(event) bool) int {
		t.Helper()
		for i := from; i < len(printed); i++ {
			if match(printed[i]) {
				return i
			}
		}
		t.Fatalf("narwhal events: no %s after its event %d; printed:\n%s", what, from, events.stdout.String())
		return 0
	}
	next := 0
	for i := range ejectAfter {
		f := find(next, fmt.Sprintf("failure %d", i+1), func(e event) bool { return e.kind == schemas.KindFailure && e.Counts })
		q := find(f+1, fmt.Sprintf("quarantine %d", i+1), func(e event) bool { return e.kind == schemas.KindQuarantine })
		fe, qe := printed[f], printed[q]
		if qe.RouterID != fe.RouterID || qe.Reason != fe.Kind || qe.DurationS != quarantine.Seconds() {
			t.Fatalf("quarantine %s after failure %s: want the same router, reason %q, duration %v", qe.raw, fe.raw, fe.Kind, quarantine.Seconds())
		}
		next = q + 1
		if i == ejectAfter-1 {
			// The breaker's ejection and the router's last quarantine
			// both follow the last failure, in either order.
			e := find(f+1, "ejection", isEjection("d1"))
			if printed[e].Streak != ejectAfter {
				t.Fatalf("ejection %s: want streak %d", printed[e].raw, ejectAfter)
			}
			next = max(next, e+1)
		}
	}
	next = find(next, "successful probe", isProbe("d1", schemas.ProbeSuccess)) + 1
	find(next, "readmission", isReadmission("d1"))
}

// TestClusterPreflight proves R-PRE-1 with `narwhal preflight` as a
// process against four simulators and engine_contract: on a healthy fleet
// it checks every engine, probes all four role-permitted transfers and
// exits 0; when one transfer is broken (p1's next handoff descriptor
// carries garbled block ids; --parallel 1 keeps the order p1→d1 first) it
// exits non-zero and names that pair, and only it.
func TestClusterPreflight(t *testing.T) {
	c := startCluster(t, clusterOptions{enginesOnly: true, contract: true})

	out, code := runNarwhal(t, "preflight", "--config", c.cfgPath)
	if code != 0 || !strings.Contains(out, "preflight ok: 4 engines, 4 transfers") {
		t.Fatalf("preflight on a healthy fleet: exit %d\n%s", code, out)
	}
	for _, pair := range [][2]string{{"p1", "d1"}, {"p1", "d2"}, {"p2", "d1"}, {"p2", "d2"}} {
		if !regexp.MustCompile(`(?m)^` + pair[0] + `\s+` + pair[1] + `\s+ok\s`).MatchString(out) {
			t.Fatalf("preflight table has no ok row %s → %s:\n%s", pair[0], pair[1], out)
		}
	}

	c.arm(t, c.sims["p1"], `{"kind":"garble-block-ids","phase":"prefill","count":1}`)
	out, code = runNarwhal(t, "preflight", "--config", c.cfgPath, "--parallel", "1")
	if code == 0 {
		t.Fatalf("preflight with a broken transfer exited 0:\n%s", out)
	}
	if !regexp.MustCompile(`(?m)^p1\s+d1\s+FAIL\s.*malformed block ids`).MatchString(out) ||
		!strings.Contains(out, "preflight FAILED: p1 -> d1\n") {
		t.Fatalf("preflight does not name the broken pair p1 -> d1 (alone):\n%s", out)
	}
	for _, pair := range [][2]string{{"p1", "d2"}, {"p2", "d1"}, {"p2", "d2"}} {
		if !regexp.MustCompile(`(?m)^` + pair[0] + `\s+` + pair[1] + `\s+ok\s`).MatchString(out) {
			t.Fatalf("preflight table has no ok row %s → %s:\n%s", pair[0], pair[1], out)
		}
	}
}

// runNarwhal runs `narwhal args…` to its end (bounded by readyBound) with a
// clean environment and returns its stdout and stderr together and its
// exit status.
func runNarwhal(t *testing.T, args ...string) (string, int) {
	t.Helper()
	return runNarwhalEnv(t, nil, args...)
}

// runNarwhalEnv is runNarwhal with env added to the clean environment.
func runNarwhalEnv(t *testing.T, env []string, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), readyBound)
	defer cancel()
	cmd := exec.CommandContext(ctx, narwhalBin, args...)
	cmd.Env = childEnv(env...)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("narwhal %s: %v", strings.Join(args, " "), err)
	}
	if ctx.Err() != nil {
		t.Fatalf("narwhal %s still running after %v:\n%s", strings.Join(args, " "), readyBound, out.String())
	}
	return out.String(), exitCode(err)
}
