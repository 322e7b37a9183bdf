package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// fleetCmd runs `narwhal fleet args…` against the cluster's bus with the
// admin credential and fails the test unless it exits 0.
func (c *cluster) fleetCmd(t *testing.T, args ...string) string {
	t.Helper()
	out, code := runNarwhalEnv(t, append([]string{"NARWHAL_NATS_URL=" + c.natsURL}, c.credsEnv(bus.RoleAdmin)...), append([]string{"fleet"}, args...)...)
	if code != 0 {
		t.Fatalf("narwhal fleet %s: exit %d\n%s", strings.Join(args, " "), code, out)
	}
	return out
}

// addSim starts one more simulator (not in the config file) with args
// added and returns it; it is stopped with the mesh.
func (c *cluster) addSim(t *testing.T, id, role string, args ...string) *simProc {
	t.Helper()
	s := &simProc{id: id, role: role, url: "http://" + hostPort(freePorts(t, 1)[0])}
	c.spawnSim(t, s, args...)
	c.extra = append(c.extra, s.p)
	c.waitSim(t, s)
	return s
}

// isFleet matches the fleet events of engine with state.
func isFleet(engine, state string) func(event) bool {
	return func(e event) bool { return e.kind == schemas.KindFleet && e.EngineID == engine && e.State == state }
}

// load sends streaming completions to every router in turn, from n
// clients, until stop is closed, and returns every reply with the time it
// was sent.
type sentStream struct {
	at  time.Time
	rep streamReply
}

func (c *cluster) load(n int, stop <-chan struct{}) func() []sentStream {
	var mu sync.Mutex
	var out []sentStream
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			for k := 0; ; k++ {
				select {
				case <-stop:
					return
				default:
				}
				r := c.routers[(i+k)%len(c.routers)]
				at := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), requestBound)
				rep := c.sendStream(ctx, r, fmt.Sprintf("the fleet changes under load %d %d", i, k), int64(i*1000+k), 12)
				cancel()
				mu.Lock()
				out = append(out, sentStream{at, rep})
				mu.Unlock()
			}
		})
	}
	return func() []sentStream {
		wg.Wait()
		return out
	}
}

// checkComplete fails the test for every reply that is not a whole 200
// stream ending in [DONE].
func checkComplete(t *testing.T, replies []sentStream) {
	t.Helper()
	bad := 0
	for _, s := range replies {
		r := s.rep
		if r.err != nil || r.status != 200 || !strings.Contains(string(r.body), "data: [DONE]") || strings.Contains(string(r.body), `"error"`) {
			bad++
			if bad <= 3 {
				t.Errorf("request %s on %s: status %d err %v body %.300s", r.id, r.router, r.status, r.err, r.body)
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d streams failed or were cut", bad, len(replies))
	}
}

// TestFleetAtRunTime proves R-FLEET-1…3 with real processes (a bus, a
// breaker, two routers, simulators) and `narwhal fleet`:
//
//   - (a) a decode engine added under load takes attempts on both
//     routers only after its inference probe succeeded, within a second
//     of it; one serving the wrong model and one failing inference with a
//     healthy /health never do, and probe events say why;
//   - (b) a drain under streaming load cuts no stream, no attempt starts
//     on the engine from a second after the drain on either router, and
//     one `drained` event follows once nothing is in flight;
//   - (e) a router started with an empty fleet: and the bucket full of
//     engines serves them.
func TestFleetAtRunTime(t *testing.T) {
	// With least privilege (R-BUS-8): each process its role's credential,
	// `narwhal fleet` the admin's.
	c := startCluster(t, clusterOptions{routers: 2, breakers: 1, simArgs: []string{"--itl", "20ms"}, auth: true})
	stop := make(chan struct{})
	replies := c.load(4, stop)
	stopped := false
	defer func() {
		if !stopped {
			close(stop)
			replies()
		}
	}()

	// (a) Add d3 under load.
	d3 := c.addSim(t, "d3", sim.RoleDecode)
	wrong := c.addSim(t, "d4", sim.RoleDecode, "--model", "another-model")
	broken := c.addSim(t, "d5", sim.RoleDecode)
	c.arm(t, broken, `{"kind":"status","status":500,"phase":"decode","message":"d5 cannot decode"}`)
	mark := c.events.Len()
	watch := c.watchAvailability("d3", true, 4*readyBound)
	c.fleetCmd(t, "add", "--id", "d3", "--url", d3.url, "--role", "decode")
	c.fleetCmd(t, "add", "--id", "d4", "--url", wrong.url, "--role", "decode")
	c.fleetCmd(t, "add", "--id", "d5", "--url", broken.url, "--role", "decode")
	var success event
	testkit.WaitEvery(t, 3*readyBound, pollInterval, "d3's successful probe", func() bool {
		// The breaker writes the readmission before it publishes the probe
		// event, so a router may place on d3 before this test reads the
		// event; what d3 itself recorded says the order: no routed request
		// before the probe's.
		if first := firstRouted(t, d3); first >= 0 && len(c.list(t, since(mark, isProbe("d3", schemas.ProbeSuccess)))) == 0 {
			if first < firstProbe(t, d3) || firstProbe(t, d3) < 0 {
				t.Fatalf("d3 received a routed request (its request %d) before any probe", first)
			}
		}
		if ev := c.list(t, since(mark, isProbe("d3", schemas.ProbeSuccess))); len(ev) > 0 {
			success = ev[0]
			return true
		}
		return false
	})
	seen := watch.wait(t)
	for i, at := range seen {
		if lag := at.Sub(success.At); lag > placementBound {
			t.Errorf("router %s placed on d3 %v after its probe succeeded, want within %v", c.routers[i].id, lag, placementBound)
		}
	}
	c.waitEvents(t, readyBound, 1, "d3's fleet event active", since(mark, isFleet("d3", schemas.FleetActive)))
	testkit.WaitEvery(t, 3*readyBound, pollInterval, "d3 serving requests of both routers", func() bool {
		byRouter := map[string]bool{}
		for _, e := range c.list(t, since(mark, func(e event) bool {
			return e.kind == schemas.KindRequest && e.ConsumerID == "d3" && e.Status == 200
		})) {
			byRouter[e.RouterID] = true
		}
		return len(byRouter) == len(c.routers)
	})
	// Without an engine contract the probe of d4 runs on the model it
	// serves, which no producer serves: a failure of d4, never a success.
	notOK := func(id string) func(event) bool {
		return func(e event) bool {
			return e.kind == schemas.KindProbe && e.EngineID == id && e.Outcome != schemas.ProbeSuccess
		}
	}
	c.waitEvents(t, 3*readyBound, 2, "two failed probes of d4 (wrong model)", since(mark, isProbe("d4", schemas.ProbeFailure)))
	c.waitEvents(t, 3*readyBound, 2, "two failed probes of d5 (failing inference)", since(mark, isProbe("d5", schemas.ProbeFailure)))
	for _, id := range []string{"d4", "d5"} {
		if n := len(c.list(t, since(mark, isProbe(id, schemas.ProbeSuccess)))); n > 0 {
			t.Errorf("%s: %d successful probes", id, n)
		}
		probes := c.list(t, since(mark, notOK(id)))
		t.Logf("%s stays out: %s", id, probes[0].Message)
		if probes[0].Message == "" {
			t.Errorf("%s's failed probe says nothing", id)
		}
		for _, r := range c.routers {
			if ok, err := available(r, id); err != nil || ok {
				t.Errorf("router %s: %s available %v (%v), want out", r.id, id, ok, err)
			}
		}
	}
	if n := len(routed(t, wrong)); n > 0 {
		t.Errorf("d4 (wrong model) received %d routed requests", n)
	}
	if n := len(routed(t, broken)); n > 0 {
		t.Errorf("d5 (failing inference) received %d routed requests", n)
	}

	// (b) Drain d1 under the streaming load.
	drainMark := c.events.Len()
	drainAt := time.Now()
	out := c.fleetCmd(t, "drain", "d1")
	t.Logf("%s", strings.TrimSpace(out))
	c.waitAvailable(t, "d1", false, placementBound)
	// Keep the load on for a while after the drain.
	testkit.WaitEvery(t, 3*readyBound, pollInterval, "a stretch of load after the drain", func() bool { return time.Since(drainAt) > 3*time.Second })
	close(stop)
	stopped = true
	all := replies()
	checkComplete(t, all)
	late := 0
	for _, s := range all {
		if s.at.After(drainAt.Add(placementBound)) && s.rep.decoder == "d1" {
			late++
		}
	}
	if late > 0 {
		t.Errorf("%d streams sent more than %v after the drain were decoded on d1", late, placementBound)
	}
	drained := c.waitEvents(t, 3*readyBound, 1, "d1 drained", since(drainMark, isFleet("d1", schemas.FleetDrained)))
	t.Logf("d1 drained %v after the drain command: %s", drained[0].At.Sub(drainAt), drained[0].Reason)
	if n := len(c.list(t, since(drainMark, isFleet("d1", schemas.FleetDrained)))); n != 1 {
		t.Errorf("%d drained events for d1, want 1", n)
	}
	t.Logf("%d streams, none cut; fleet list:\n%s", len(all), c.fleetCmd(t, "list"))

	// (e) A router with an empty fleet: serves what the bucket holds.
	empty := filepath.Join(c.dir, "empty.yaml")
	if err := os.WriteFile(empty, []byte("engine:\n  first_token_timeout_s: 2\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r3 := &routerProc{id: "r-empty", addr: hostPort(freePorts(t, 1)[0])}
	r3.url = "http://" + r3.addr
	r3.p = spawn(t, "router r-empty", append(append([]string{"NARWHAL_NATS_URL=" + c.natsURL, "NARWHAL_ROUTER_ID=" + r3.id}, clusterEnv...), c.identityEnv(t, bus.RoleRouter, r3.id)...),
		"router", "--config", empty, "--listen", r3.addr)
	c.extra = append(c.extra, r3.p)
	waitHTTP(t, r3.p, r3.url+"/readyz")
	used := map[string]bool{}
	for i := 0; i < 20 && !used["d3"]; i++ {
		rep := c.sendStream(testContext(t, requestBound), r3, "served from the bucket", int64(i), 4)
		if rep.status != 200 || rep.err != nil {
			t.Fatalf("router with an empty fleet: %d %v %s", rep.status, rep.err, rep.body)
		}
		used[rep.decoder] = true
	}
	if used["d1"] || used["d4"] || used["d5"] {
		t.Errorf("router with an empty fleet used %v: a drained or failing engine", used)
	}
	if !used["d2"] && !used["d3"] {
		t.Errorf("router with an empty fleet decoded on %v, want the bucket's engines", used)
	}
}
