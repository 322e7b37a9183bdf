package e2e

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	kvprobe "github.com/narwhalmesh/narwhal/engines/probe"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Settings of the storm.
const (
	// stormClients is the number of concurrent clients.
	stormClients = 32
	// stormPeriod is how long the faults stay armed: the scenario disarms
	// them all at this offset.
	stormPeriod = 12 * time.Second
	// stormMaxTokens is the output limit of the storm's requests; with
	// the simulators' --itl of 10 ms a request streams for about 120 ms.
	stormMaxTokens = 12
	// stormSeed is the seed of the storm's requests.
	stormSeed = 7
	// stormMinRequests is the least number of requests a storm must have
	// sent for its figures to mean something.
	stormMinRequests = 300
	// maxProblems bounds the defects a storm reports one by one.
	maxProblems = 10
	// stormEjectAfter is the storm's recovery.eject_after: a tenth of the
	// faulty engines' requests is struck, so two counted strikes in a row
	// happen several times a storm.
	stormEjectAfter = 2
	// stormTail is how long after the disarm failures of requests struck
	// during the storm may still arrive: the longest injected delay (3 s)
	// plus the cluster's 2 s engine timeouts and a margin.
	stormTail = 6 * time.Second
)

// stormScenario is the `narwhal chaos run` file of the storm: at 0 s it
// arms four faults with probability 0.025 each — 10 % of the requests in
// all — on p1's prefill legs and four on d1's decode legs — timeouts (delays of 3 s against the cluster's 2 s
// engine timeouts), connection resets, 5xx, a garbled descriptor, a 502 on decode,
// a silence and an error object after output — and at stormPeriod
// disarms everything.
var stormScenario = fmt.Sprintf(`steps:
  - at: 0s
    arm: {engine: p1, fault: connect-refused, id: storm-reset, phase: prefill, prob: 0.025, for: 1m}
  - at: 0s
    arm: {engine: p1, fault: connect-delay, id: storm-slow-prefill, phase: prefill, prob: 0.025, for: 1m, params: {delay_ms: 3000}}
  - at: 0s
    arm: {engine: p1, fault: http-status, id: storm-503, phase: prefill, prob: 0.025, for: 1m, params: {code: 503}}
  - at: 0s
    arm: {engine: p1, fault: garble-block-ids, id: storm-garble, phase: prefill, prob: 0.025, for: 1m}
  - at: 0s
    arm: {engine: d1, fault: first-token-delay, id: storm-slow-token, phase: decode, prob: 0.025, for: 1m, params: {delay_ms: 3000}}
  - at: 0s
    arm: {engine: d1, fault: mid-stream-silence, id: storm-silence, phase: decode, prob: 0.025, for: 1m, params: {after_tokens: 3}}
  - at: 0s
    arm: {engine: d1, fault: error-object, id: storm-error, phase: decode, prob: 0.025, for: 1m, params: {after_tokens: 2, code: 500}}
  - at: 0s
    arm: {engine: d1, fault: http-status, id: storm-502, phase: decode, prob: 0.025, for: 1m, params: {code: 502}}
  - at: %s
    disarm: {all: true}
`, stormPeriod)

// stormFaulty are the engines the storm arms faults on; stormHealthy the
// others.
var (
	stormFaulty  = []string{"p1", "d1"}
	stormHealthy = []string{"p2", "d2"}
)

// stormTally counts what the storm's clients got.
type stormTally struct {
	mu         sync.Mutex
	requests   int
	classes    map[string]int
	httpErrors map[int]int // by HTTP status
	terminal   map[int]int // by terminal event code
	slowest    time.Duration
	problems   []string // the first defects, described
}

func (s *stormTally) add(rep streamReply, out outcome) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.requests++
	s.classes[out.class]++
	s.slowest = max(s.slowest, rep.elapsed)
	switch out.class {
	case outcomeOK:
	case outcomeHTTPError:
		s.httpErrors[out.code]++
	case outcomeTerminal:
		s.terminal[out.code]++
	default:
		if len(s.problems) < maxProblems {
			s.problems = append(s.problems, fmt.Sprintf("request %s via %s after %v: %s: %s", rep.id, rep.router, rep.elapsed.Round(time.Millisecond), out.class, out.detail))
		}
	}
}

// TestChaosStorm runs a storm of mixed faults (R-CHAOS-2): four simulators
// behind chaos proxies, two routers (one retry per request, R-RETRY-2), one
// breaker, eject_after 2; `narwhal chaos run` arms eight faults of
// probability 0.025 each (10 % in all) on p1 (prefill) and d1 (decode) for stormPeriod while 32
// clients send streaming completions, each with its own prompt, through
// both routers. It checks that
//
//   - every request ends in exactly one of: the whole output sim.Generate
//     predicts then data: [DONE]; an OpenAI-shaped HTTP error; a prefix of
//     that output then one terminal error event and nothing after it —
//     none hung (each is bounded), none cut without an error, none with a
//     duplicated, spliced or missing token (R-FAIL-1, R-FAIL-2, R-FAIL-5,
//     R-RETRY-4, R-TMO-5);
//   - each request ended as its router's request event says (R-BUS-1);
//   - a mix of faults struck p1's and d1's requests, and both were
//     ejected during the storm, p2 and d2 never (R-BRK-1, R-BRK-2);
//   - after the disarm p1 and d1 end up readmitted, each after a
//     successful probe, on every router (R-BRK-3, R-BRK-8).
//
// The figures are logged.
func TestChaosStorm(t *testing.T) {
	eject := fmt.Sprintf("NARWHAL_RECOVERY_EJECT_AFTER=%d", stormEjectAfter)
	c := startCluster(t, clusterOptions{
		routers:    2,
		breakers:   1,
		chaos:      chaosEngines,
		simArgs:    []string{"--itl", "10ms"},
		routerEnv:  []string{eject, "NARWHAL_RECOVERY_RETRY_ATTEMPTS=1"},
		breakerEnv: []string{eject},
	})
	c.transport.MaxIdleConnsPerHost = 2 * stormClients

	// A normal request through the proxies succeeds.
	prompt := "before the storm"
	want, _ := sim.Generate(prompt, stormSeed, stormMaxTokens, nil, false)
	for _, r := range c.routers {
		rep := c.sendStream(testContext(t, requestBound), r, prompt, stormSeed, stormMaxTokens)
		if out := classifyStream(rep, want); out.class != outcomeOK {
			t.Fatalf("request %s via %s before the storm: %s %s", rep.id, r.id, out.class, out.detail)
		}
	}

	path := filepath.Join(c.dir, "storm.yaml")
	if err := os.WriteFile(path, []byte(stormScenario), 0o600); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	scenario := startProcess(t, "chaos run", []string{"NARWHAL_NATS_URL=" + c.natsURL}, "chaos", "run", path)
	tally := &stormTally{classes: map[string]int{}, httpErrors: map[int]int{}, terminal: map[int]int{}}
	stop := start.Add(stormPeriod + readyBound) // in case the scenario does not end
	var wg sync.WaitGroup
	for w := range stormClients {
		wg.Go(func() {
			for n := 0; !scenario.exited() && time.Now().Before(stop); n++ {
				prompt := fmt.Sprintf("storm client %d request %d", w, n)
				want, _ := sim.Generate(prompt, stormSeed, stormMaxTokens, nil, false)
				ctx, cancel := context.WithTimeout(context.Background(), requestBound)
				rep := c.sendStream(ctx, c.routers[(w+n)%len(c.routers)], prompt, stormSeed, stormMaxTokens)
				cancel()
				tally.add(rep, classifyStream(rep, want))
			}
		})
	}
	wg.Wait()
	stormEnd := time.Now()
	if !scenario.exited() {
		t.Fatalf("narwhal chaos run still running %v after the start", stop.Sub(start))
	}
	if err := scenario.stop(nil); err != nil || !strings.Contains(scenario.stdout.String(), "scenario done") {
		scenario.dump(t)
		t.Fatalf("narwhal chaos run: %v", err)
	}

	// The clients' figures.
	ok, httpErr, term := tally.classes[outcomeOK], tally.classes[outcomeHTTPError], tally.classes[outcomeTerminal]
	t.Logf("storm: %d clients, %v, %d requests: %d complete, %d HTTP errors %v, %d terminal error events %v; hung %d, broken %d, truncated %d, wrong text %d, malformed %d; slowest %v",
		stormClients, stormEnd.Sub(start).Round(time.Millisecond), tally.requests, ok, httpErr, tally.httpErrors, term, tally.terminal,
		tally.classes[outcomeHung], tally.classes[outcomeBroken], tally.classes[outcomeTruncated], tally.classes[outcomeWrongText], tally.classes[outcomeMalformed],
		tally.slowest.Round(time.Millisecond))
	for _, p := range tally.problems {
		t.Error(p)
	}
	if bad := tally.requests - ok - httpErr - term; bad != 0 {
		t.Fatalf("%d of %d requests ended in neither complete output nor exactly one well-formed error", bad, tally.requests)
	}
	if tally.requests < stormMinRequests || ok == 0 || httpErr+term == 0 {
		t.Fatalf("%d requests, %d complete, %d failed: want at least %d, with successes and failures", tally.requests, ok, httpErr+term, stormMinRequests)
	}

	// After the disarm every engine ends up available on every router.
	for _, id := range chaosEngines {
		c.waitAvailable(t, id, true, decisionBound)
	}
	recovered := time.Now()

	// Every request ended as its router's event says.
	var requests []event
	testkit.WaitEvery(t, readyBound, pollInterval, fmt.Sprintf("%d request events", tally.requests), func() bool {
		requests = c.list(t, func(e event) bool {
			return e.kind == schemas.KindRequest && strings.HasPrefix(e.RequestID, "e2e-chaos-")
		})
		return len(requests) >= tally.requests+len(c.routers)
	})
	var evOK, evHTTP, evTerm int
	for _, e := range requests {
		switch {
		case e.Status == 200 && e.ErrorKind == "":
			evOK++
		case e.Status == 200:
			evTerm++
		default:
			evHTTP++
		}
	}
	evOK -= len(c.routers) // the requests before the storm
	if evOK != ok || evHTTP != httpErr || evTerm != term {
		t.Fatalf("request events: %d complete, %d HTTP errors, %d terminal errors; the clients saw %d, %d, %d", evOK, evHTTP, evTerm, ok, httpErr, term)
	}

	all := c.list(t, func(event) bool { return true })
	var disarmAt time.Time
	injected := map[string]int{} // by fault id
	struckBy := map[string]int{} // distinct faults that struck, by engine
	for _, e := range all {
		ce, isChaos := asChaos(t, e)
		switch {
		case isChaos && ce.Action == schemas.ChaosDisarm && disarmAt.IsZero():
			disarmAt = e.At
		case isChaos && ce.Action == schemas.ChaosInject && !strings.HasPrefix(e.RequestID, kvprobe.RequestIDPrefix):
			if injected[ce.FaultID] == 0 {
				struckBy[e.EngineID]++
			}
			injected[ce.FaultID]++
		}
	}
	if disarmAt.IsZero() {
		t.Fatal("no disarm event from the scenario")
	}
	t.Logf("storm: injections into client requests by fault: %v; router retries: %v", injected, retriesOf(t, c))
	// Each faulty engine's faults strike tens of times in a storm, but an
	// engine that its probes keep out for long may see a fault strike only
	// a few times: ask for a mix, not for every fault.
	for _, id := range stormFaulty {
		if struckBy[id] < 2 {
			t.Errorf("%d different faults struck %s's requests, want a mix of at least 2", struckBy[id], id)
		}
	}
	for _, id := range stormHealthy {
		if struckBy[id] != 0 {
			t.Errorf("faults struck %s, which has none armed", id)
		}
	}

	// The breaker's decisions, per engine.
	for _, id := range chaosEngines {
		failures := map[string]int{}
		counted := 0
		for _, e := range all {
			if isFailure(id)(e) {
				failures[e.Kind]++
				if e.Counts {
					counted++
				}
			}
		}
		var ejections, readmissions []event
		for _, e := range all {
			switch {
			case isEjection(id)(e):
				ejections = append(ejections, e)
			case isReadmission(id)(e):
				readmissions = append(readmissions, e)
			}
		}
		t.Logf("%s: %d failures (%d counted) %v; ejected at %s; readmitted at %s (after the disarm: %s)", id, sumValues(failures), counted, failures,
			offsets(ejections, start), offsets(readmissions, start), offsets(readmissions, disarmAt))
		if slices.Contains(stormHealthy, id) {
			if len(ejections) != 0 {
				t.Errorf("%s, which no fault struck, was ejected: %s", id, ejections[0].raw)
			}
			continue
		}
		// Struck requests end up to a timeout after the strike, so the
		// streak that ejects an engine may complete just after the
		// disarm; every strike still came from the storm.
		if len(ejections) == 0 || !ejections[0].At.Before(disarmAt.Add(stormTail)) {
			t.Errorf("%s was not ejected by the storm's failures (R-BRK-1)", id)
			continue
		}
		last := ejections[len(ejections)-1]
		rd := c.list(t, after(last, isReadmission(id)))
		if len(rd) == 0 {
			t.Errorf("%s was not readmitted after its last ejection at %s", id, offsets([]event{last}, start))
			continue
		}
		c.checkReadmittedByProbe(t, last, rd[0])
		if e, ok := c.placement(t, id); !ok || !e.Eligible {
			t.Errorf("%s's placement entry after the storm: %+v, want eligible", id, e)
		}
	}
	t.Logf("storm: every engine available on every router %v after the disarm", recovered.Sub(disarmAt).Round(time.Millisecond))
}

// offsets formats the times of events as offsets from t0, e.g.
// "[+1.203s +4.511s]".
func offsets(events []event, t0 time.Time) string {
	parts := make([]string, len(events))
	for i, e := range events {
		parts[i] = fmt.Sprintf("%+.3fs", e.At.Sub(t0).Seconds())
	}
	return "[" + strings.Join(parts, " ") + "]"
}

func sumValues(m map[string]int) int {
	n := 0
	for v := range maps.Values(m) {
		n += v
	}
	return n
}

// retriesOf returns narwhal_retries_total of every router, by router id.
func retriesOf(t *testing.T, c *cluster) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, r := range c.routers {
		out[r.id] = testkit.ScrapedSum(t, probeClient, r.url+"/metrics", "narwhal_retries_total")
	}
	return out
}
