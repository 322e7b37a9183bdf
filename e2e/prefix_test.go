package e2e

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestSharedPrefixIndexAcrossRoutersRPLACE2 runs the real binaries — two
// `narwhal router` processes on one bus, four prefill and one decode
// `narwhal sim` — and proves the shared index (R-PLACE-2): a prefix first
// placed through router A lands on the same prefill engine when its
// follow-up arrives through router B. With four producers, chance would
// do that for all four prefixes once in 256 runs.
func TestSharedPrefixIndexAcrossRoutersRPLACE2(t *testing.T) {
	natsURL := bustest.Start(t).ClientURL()

	ports := freePorts(t, 7)
	var sims []*simProc
	for i, d := range []struct{ id, role string }{
		{"p1", sim.RolePrefill}, {"p2", sim.RolePrefill}, {"p3", sim.RolePrefill}, {"p4", sim.RolePrefill}, {"d1", sim.RoleDecode},
	} {
		sims = append(sims, startSim(t, d.id, d.role, hostPort(ports[i])))
	}
	for _, s := range sims {
		waitHTTP(t, s.p, s.url+"/health")
	}
	path := meshConfig(t, sims)
	type router struct{ id, url string }
	var routers []router
	for i, id := range []string{"ra", "rb"} {
		addr := hostPort(ports[5+i])
		p := startProcess(t, "router "+id, []string{"NARWHAL_NATS_URL=" + natsURL, "NARWHAL_ROUTER_ID=" + id},
			"router", "--config", path, "--listen", addr)
		waitHTTP(t, p, "http://"+addr+"/readyz")
		routers = append(routers, router{id, "http://" + addr})
	}
	a, b := routers[0], routers[1]
	client := &http.Client{Timeout: requestBound}
	defer client.CloseIdleConnections()
	send := func(r router, content string) string {
		t.Helper()
		body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"system","content":%q},{"role":"user","content":"and one question"}],"max_tokens":2}`, meshModel, content)
		resp, err := client.Post(r.url+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatalf("router %s: %v", r.id, err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("router %s: HTTP %d", r.id, resp.StatusCode)
		}
		return resp.Header.Get("X-Narwhal-Prefill-Engine")
	}
	applied := func() float64 {
		return testkit.ScrapedSum(t, client, b.url+"/metrics", "narwhal_prefix_batches_applied_total")
	}
	for i := range 4 {
		prefix := strings.Repeat(fmt.Sprintf("tenant %d shares this long context with all of its users. ", i), 24)
		before := applied()
		first := send(a, prefix)
		testkit.WaitEvery(t, 5*time.Second, pollInterval, "router B to apply router A's placement", func() bool { return applied() > before })
		if follow := send(b, prefix); follow != first {
			t.Fatalf("prefix %d: placed on %s through router A, its follow-up through router B went to %s", i, first, follow)
		}
	}
}
