package e2e

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
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
	emb, err := bus.StartEmbedded(bus.EmbeddedOptions{Dir: t.TempDir(), Host: "127.0.0.1", Port: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(emb.Shutdown)
	natsURL := emb.ClientURL()

	ports := freePorts(t, 7)
	var sims []*simProc
	for i, d := range []struct{ id, role string }{
		{"p1", sim.RolePrefill}, {"p2", sim.RolePrefill}, {"p3", sim.RolePrefill}, {"p4", sim.RolePrefill}, {"d1", sim.RoleDecode},
	} {
		s := &simProc{id: d.id, role: d.role, url: "http://" + hostPort(ports[i])}
		s.p = startProcess(t, "sim "+d.id, nil, "sim", "--role", d.role, "--listen", hostPort(ports[i]),
			"--engine-id", d.id, "--model", meshModel, "--kv-listen", "127.0.0.1:0")
		sims = append(sims, s)
	}
	var cfg strings.Builder
	cfg.WriteString("engine:\n  first_token_timeout_s: 5\n  decode_read_timeout_s: 5\n  prefill_timeout_s: 5\nrequest:\n  timeout_s: 20\nfleet:\n")
	for _, s := range sims {
		waitHTTP(t, s.p, s.url+"/health")
		fmt.Fprintf(&cfg, "  - id: %s\n    url: %s\n    role: %s\n    connector: nixl\n", s.id, s.url, s.role)
	}
	path := filepath.Join(t.TempDir(), "narwhal.yaml")
	if err := os.WriteFile(path, []byte(cfg.String()), 0o600); err != nil {
		t.Fatal(err)
	}
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
