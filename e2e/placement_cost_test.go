package e2e

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestHotTenantSpreadsColdTenantKeepsAffinityRPLACE3 runs the real
// binaries — two `narwhal router` processes on one bus, four prefill
// `narwhal sim`s that queue beyond two requests and compute each uncached
// prompt token, one decode — and proves placement by expected work
// (R-PLACE-3) from what clients see:
//
//   - a hot tenant (every request shares one 400-word context, each with
//     its own 100-word question), sent by 16 clients at once through both
//     routers, is spread over more than one producer: once the queue on
//     the engine holding the context is more work than computing the
//     context again elsewhere, an idle engine is cheaper. The previous
//     score (matched share against 1/32 per attempt) kept all of it on
//     one engine at this concurrency;
//   - a cold tenant with a 3,000-word context, asked five times one after
//     another through alternating routers meanwhile (router A told of
//     the first placement, made through router B), keeps its affinity:
//     every follow-up goes to the producer of its first request, because
//     no queue the hot tenant makes there costs as much as its context.
func TestHotTenantSpreadsColdTenantKeepsAffinityRPLACE3(t *testing.T) {
	natsURL := bustest.Start(t).ClientURL()

	ports := freePorts(t, 7)
	var sims []*simProc
	for i, d := range []struct{ id, role string }{
		{"p1", sim.RolePrefill}, {"p2", sim.RolePrefill}, {"p3", sim.RolePrefill}, {"p4", sim.RolePrefill}, {"d1", sim.RoleDecode},
	} {
		var args []string
		if d.role == sim.RolePrefill {
			args = []string{"--prefill-per-token", "100us", "--max-num-seqs", "2"}
		}
		sims = append(sims, startSim(t, d.id, d.role, hostPort(ports[i]), args...))
	}
	for _, s := range sims {
		waitHTTP(t, s.p, s.url+"/health")
	}
	path := meshConfig(t, sims)
	var routers []string
	for i, id := range []string{"ra", "rb"} {
		addr := hostPort(ports[5+i])
		p := startProcess(t, "router "+id, []string{"NARWHAL_NATS_URL=" + natsURL, "NARWHAL_ROUTER_ID=" + id},
			"router", "--config", path, "--listen", addr)
		waitHTTP(t, p, "http://"+addr+"/readyz")
		routers = append(routers, "http://"+addr)
	}
	client := &http.Client{Timeout: requestBound, Transport: &http.Transport{MaxIdleConnsPerHost: 32}}
	defer client.CloseIdleConnections()

	words := func(prefix string, n int) string {
		var b strings.Builder
		for i := range n {
			fmt.Fprintf(&b, "%s%d ", prefix, i)
		}
		return b.String()
	}
	send := func(router, context, question string) (string, error) {
		body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"system","content":%q},{"role":"user","content":%q}],"max_tokens":2}`,
			meshModel, context, question)
		resp, err := client.Post(router+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			return "", fmt.Errorf("HTTP %d", resp.StatusCode)
		}
		return resp.Header.Get("X-Narwhal-Prefill-Engine"), nil
	}

	hot := words("hot", 400)
	cold := words("cold", 3000)
	// The hot context is placed once first, so that every engine but one
	// starts without it.
	first, err := send(routers[0], hot, words("warm", 100))
	if err != nil {
		t.Fatalf("hot tenant's first request: %v", err)
	}

	const clients, perClient = 16, 4
	var (
		mu      sync.Mutex
		hotOn   = map[string]int{}
		hotErrs []error
		wg      sync.WaitGroup
	)
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for q := range perClient {
				eng, err := send(routers[c%2], hot, words(fmt.Sprintf("u%dq%d-", c, q), 100))
				mu.Lock()
				if err != nil {
					hotErrs = append(hotErrs, err)
				} else {
					hotOn[eng]++
				}
				mu.Unlock()
			}
		}()
	}

	applied := func() float64 {
		return testkit.ScrapedSum(t, client, routers[0]+"/metrics", "narwhal_prefix_batches_applied_total")
	}
	before := applied()
	coldHome, err := send(routers[1], cold, "the first question")
	if err != nil {
		t.Fatalf("cold tenant's first request: %v", err)
	}
	// Router A learns where router B placed it (the shared index,
	// R-PLACE-2) before the follow-ups alternate between them.
	testkit.WaitEvery(t, 5*time.Second, pollInterval, "router A to apply router B's placement", func() bool { return applied() > before })
	var coldOn []string
	for i := range 5 {
		eng, err := send(routers[i%2], cold, fmt.Sprintf("follow-up question %d", i))
		if err != nil {
			t.Fatalf("cold tenant's follow-up %d: %v", i, err)
		}
		coldOn = append(coldOn, eng)
	}
	wg.Wait()

	if len(hotErrs) > 0 {
		t.Fatalf("%d hot-tenant requests failed, first: %v", len(hotErrs), hotErrs[0])
	}
	t.Logf("hot tenant (first on %s): %v; cold tenant on %s, follow-ups %v", first, hotOn, coldHome, coldOn)
	if len(hotOn) < 2 {
		t.Errorf("hot tenant: all %d requests on %v; want them spread over more than one producer once the queue outweighs the context", clients*perClient, hotOn)
	}
	for i, eng := range coldOn {
		if eng != coldHome {
			t.Errorf("cold tenant's follow-up %d went to %s; want %s, which holds its 3,000-word context", i, eng, coldHome)
		}
	}
}
