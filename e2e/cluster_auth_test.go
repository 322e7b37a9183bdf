package e2e

import (
	"fmt"
	"maps"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestClusterLeastPrivilege proves R-BUS-8 with the real binary: `narwhal
// bus creds` writes the credentials and `narwhal bus --auth` enforces them;
// routers, a breaker and a chaos proxy each with its role's credential run
// an ejection and a readmission through the bus; `narwhal events` and
// `narwhal chaos list` with the viewer's credential read and change
// nothing; `narwhal chaos arm` with the router's credential and a router
// without any credential fail naming the refusal, and change nothing.
func TestClusterLeastPrivilege(t *testing.T) {
	c := startCluster(t, clusterOptions{auth: true, routers: 2, breakers: 1, chaos: []string{"d2"}})
	d1 := c.sims["d1"]

	// The mesh works under least privilege: failures published by the
	// routers, consumed by the breaker, ejection written to placement and
	// applied by every router, readmission after a probe.
	ej := c.eject(t, d1)
	watch := c.watchAvailability("d1", true, decisionBound)
	c.disarm(t, d1)
	rd := c.waitEvents(t, decisionBound, 1, "d1's readmission", after(ej, isReadmission("d1")))[0]
	c.checkReadmittedByProbe(t, ej, rd)
	watch.wait(t)

	// The chaos role arms through the proxy; the fault strikes.
	c.chaosCommand(t, "arm", "--engine", "d2", "--fault", "http-status", "--param", "code=503", "--count", "1")
	armed := false
	c.drive(t, []int{http.StatusOK, http.StatusBadGateway, http.StatusServiceUnavailable}, func(r reply) bool {
		armed = armed || len(c.list(t, func(e event) bool { return e.subject == "narwhal.events.chaos.d2" })) >= 2
		return armed
	})

	before := replicasOn(t, c.conn)
	streamBefore := c.streamConfig(t)

	// A viewer: `narwhal events` prints the history, `narwhal chaos list`
	// the armed faults; neither changes anything.
	viewer := append([]string{"NARWHAL_NATS_URL=" + c.natsURL}, c.credsEnv(bus.RoleViewer)...)
	events := spawn(t, "events", viewer, "events", "--since", "all", "--json")
	testkit.WaitEvery(t, readyBound, pollInterval, "narwhal events printing d1's readmission", func() bool {
		if events.exited() {
			events.dump(t)
			t.Fatalf("narwhal events exited: %v", events.waitErr)
		}
		return strings.Contains(events.stdout.String(), string(rd.raw))
	})
	events.halt(t)
	if out, code := runNarwhalEnv(t, viewer, "chaos", "list"); code != 0 {
		t.Errorf("narwhal chaos list with the viewer's credential: exit %d\n%s", code, out)
	}

	// A router's credential may not arm chaos.
	router := append([]string{"NARWHAL_NATS_URL=" + c.natsURL}, c.identityEnv(t, bus.RoleRouter, "r1")...)
	out, code := runNarwhalEnv(t, router, "chaos", "arm", "--engine", "d1", "--fault", "http-status", "--connect-timeout", "2s")
	if code == 0 || !strings.Contains(out, "ermissions") {
		t.Errorf("narwhal chaos arm with the router's credential: exit %d, want a permissions violation:\n%s", code, out)
	}
	if n := len(c.list(t, func(e event) bool { return e.subject == "narwhal.events.chaos.d1" })); n != 0 {
		t.Errorf("%d chaos events about d1 after the refused arm", n)
	}

	// No credential: a router exits at once, naming the refusal.
	start := time.Now()
	out, code = runNarwhalEnv(t, []string{"NARWHAL_NATS_URL=" + c.natsURL, "NARWHAL_ROUTER_ID=r9"},
		"router", "--config", c.cfgPath, "--listen", "127.0.0.1:0")
	if code == 0 || !strings.Contains(out, "uthorization") {
		t.Errorf("a router without a credential: exit %d, want an authorization violation:\n%s", code, out)
	}
	t.Logf("R-BUS-8: a router without a credential exited %d after %v", code, time.Since(start).Round(time.Millisecond))

	if after := replicasOn(t, c.conn); !maps.Equal(before, after) {
		t.Errorf("replicas changed from %v to %v", before, after)
	}
	if got := c.streamConfig(t); got != streamBefore {
		t.Errorf("the stream's settings changed:\n%s\n%s", streamBefore, got)
	}
	checkReplicas(t, c.conn, 1)

	// Every role's permissions suffice for its work: the only violations
	// the server logged are the refused arm's.
	for line := range strings.Lines(c.busProc.stderr.String()) {
		if strings.Contains(line, "Violation") && !strings.Contains(line, `$KV.narwhal_chaos.d1.`) {
			t.Errorf("the bus logged a permissions violation of normal work: %s", line)
		}
	}
}

// streamConfig returns the stream's settings as a comparable string.
func (c *cluster) streamConfig(t *testing.T) string {
	t.Helper()
	st, err := c.conn.JetStream().Stream(testContext(t, readyBound), bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	return fmt.Sprintf("subjects=%v max_age=%v max_bytes=%d duplicates=%v replicas=%d storage=%v",
		cfg.Subjects, cfg.MaxAge, cfg.MaxBytes, cfg.Duplicates, cfg.Replicas, cfg.Storage)
}
