package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// Shape of the exact-index mesh: small prefix caches, so that a few
// prompts sent straight to an engine evict another one whole.
const (
	// kvBlockSize is every simulator's --block-size, in tokens (words).
	kvBlockSize = 16
	// kvCacheBlocks is every prefill simulator's --kv-cache-blocks.
	kvCacheBlocks = 64
	// kvPromptBlocks is the length of the prompt followed, in blocks.
	kvPromptBlocks = 40
	// kvHeadBlocks is how much of it the other engine is given, in blocks:
	// with the exact index that engine then matches the most.
	kvHeadBlocks = 10
	// kvBound bounds each wait on the KV events' path.
	kvBound = 10 * time.Second
)

// kvMesh is the exact-index mesh: `narwhal bus --auth`, one breaker, a
// router with placement.index auto (rx) and one with approximate (ra),
// prefill sims p1 and p2 publishing KV events, each carried onto the bus
// by its own `narwhal agent --kv-events` under its engine's credential,
// and decode sim d1 with an agent.
type kvMesh struct {
	rx, ra *routerProc
	sims   map[string]*simProc
	client *http.Client
}

// startKVMesh starts the mesh and waits until both routers may place on
// every engine.
func startKVMesh(t *testing.T) *kvMesh {
	t.Helper()
	dir := t.TempDir()
	credsDir := filepath.Join(dir, "creds")
	args := []string{"bus", "creds", "--out", credsDir, "--router", "rx", "--router", "ra",
		"--engine", "p1", "--engine", "p2", "--engine", "d1"}
	if out, code := runNarwhal(t, args...); code != 0 {
		t.Fatalf("narwhal %s: exit %d\n%s", strings.Join(args, " "), code, out)
	}
	ports := freePorts(t, 8)
	busProc := startProcess(t, "bus", clusterEnv, "bus", "--listen", hostPort(ports[0]), "--data", filepath.Join(dir, "bus"), "--auth", credsDir)
	testkit.WaitEvery(t, readyBound, pollInterval, "the bus's listening line", func() bool {
		if busProc.exited() {
			busProc.dump(t)
			t.Fatalf("narwhal bus exited: %v", busProc.waitErr)
		}
		return busLine.MatchString(busProc.stdout.String())
	})
	natsURL := busLine.FindStringSubmatch(busProc.stdout.String())[1]
	cfgPath := writeConfig(t, "engine:\n  first_token_timeout_s: 5\n  decode_read_timeout_s: 5\n  prefill_timeout_s: 5\nrequest:\n  timeout_s: 20\n")

	m := &kvMesh{sims: map[string]*simProc{}, client: &http.Client{Timeout: requestBound}}
	t.Cleanup(m.client.CloseIdleConnections)
	for i, r := range []struct{ id, index string }{{"rx", "auto"}, {"ra", "approximate"}} {
		rp := &routerProc{id: r.id, addr: hostPort(ports[1+i])}
		rp.url = "http://" + rp.addr
		rp.env = append([]string{"NARWHAL_NATS_URL=" + natsURL, "NARWHAL_ROUTER_ID=" + r.id, "NARWHAL_PLACEMENT_INDEX=" + r.index,
			"NARWHAL_NATS_CREDS=" + filepath.Join(credsDir, bus.IdentityCredsFile(bus.RoleRouter, r.id))}, clusterEnv...)
		rp.p = startProcess(t, "router "+r.id, rp.env, "router", "--config", cfgPath, "--listen", rp.addr)
		if r.id == "rx" {
			m.rx = rp
		} else {
			m.ra = rp
		}
	}
	waitHTTP(t, m.rx.p, m.rx.url+"/metrics")
	waitHTTP(t, m.ra.p, m.ra.url+"/metrics")
	startProcess(t, "breaker", append([]string{"NARWHAL_NATS_URL=" + natsURL,
		"NARWHAL_NATS_CREDS=" + filepath.Join(credsDir, bus.CredsFile(bus.RoleBreaker))}, clusterEnv...), "breaker", "--config", cfgPath)

	for i, d := range []struct{ id, role string }{{"p1", sim.RolePrefill}, {"p2", sim.RolePrefill}, {"d1", sim.RoleDecode}} {
		simArgs := []string{"--block-size", fmt.Sprint(kvBlockSize)}
		agentArgs := []string{"agent", "--engine-url", "http://" + hostPort(ports[3+i]), "--id", d.id, "--role", d.role}
		if d.role == sim.RolePrefill {
			events := "tcp://" + hostPort(ports[6+i])
			simArgs = append(simArgs, "--kv-cache-blocks", fmt.Sprint(kvCacheBlocks), "--kv-events", events)
			agentArgs = append(agentArgs, "--kv-events", events)
		}
		s := startSim(t, d.id, d.role, hostPort(ports[3+i]), simArgs...)
		s.await(t)
		m.sims[d.id] = s
		startProcess(t, "agent "+d.id, []string{"NARWHAL_NATS_URL=" + natsURL,
			"NARWHAL_NATS_CREDS=" + filepath.Join(credsDir, bus.IdentityCredsFile(bus.RoleEngine, d.id))}, agentArgs...)
	}
	for _, r := range []*routerProc{m.rx, m.ra} {
		testkit.WaitEvery(t, 20*time.Second, pollInterval, "every engine placeable on router "+r.id, func() bool {
			return placeable(r, "p1") && placeable(r, "p2") && placeable(r, "d1")
		})
	}
	return m
}

// kvWords returns n distinct words tagged tag: n tokens of the simulator.
func kvWords(tag string, n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "%s%d ", tag, i)
	}
	return strings.TrimSpace(b.String())
}

// viaRouter sends prompt as a completion through r and returns the
// prefill engine that took it.
func (m *kvMesh) viaRouter(t *testing.T, r *routerProc, prompt string) string {
	t.Helper()
	body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, meshModel, prompt)
	resp, err := m.client.Post(r.url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("router %s: %v", r.id, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("router %s: HTTP %d %s", r.id, resp.StatusCode, b)
	}
	return resp.Header.Get("X-Narwhal-Prefill-Engine")
}

// direct sends prompt as a plain completion straight to engine s, past
// every router: it fills s's prefix cache (and evicts), and no router's
// approximate index hears of it.
func (m *kvMesh) direct(t *testing.T, s *simProc, prompt string) {
	t.Helper()
	body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, meshModel, prompt)
	resp, err := m.client.Post(s.url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("sim %s: %v", s.id, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("sim %s: HTTP %d %s", s.id, resp.StatusCode, b)
	}
}

// cachedTokens returns what s holds of prompt now (POST /sim/cached).
func (m *kvMesh) cachedTokens(t *testing.T, s *simProc, prompt string) int {
	t.Helper()
	body := fmt.Sprintf(`{"model":%q,"prompt":%q}`, meshModel, prompt)
	resp, err := m.client.Post(s.url+"/sim/cached", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("sim %s: %v", s.id, err)
	}
	defer resp.Body.Close()
	var c sim.Cached
	if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
		t.Fatalf("sim %s /sim/cached: %v", s.id, err)
	}
	return c.CachedTokens
}

// exactBlocks returns router r's narwhal_prefix_index_blocks of engine
// id's exact index.
func (m *kvMesh) exactBlocks(t *testing.T, r *routerProc, id string) int {
	t.Helper()
	return int(testkit.ScrapedSum(t, m.client, r.url+"/metrics", "narwhal_prefix_index_blocks", "engine", id, "index", "exact"))
}

// waitInSync waits until router r's exact index of engine s holds as
// many blocks as s's prefix cache does (GET /sim/stats), s's cache not
// changing meanwhile: the router has applied every event s published.
func (m *kvMesh) waitInSync(t *testing.T, r *routerProc, s *simProc) {
	t.Helper()
	testkit.WaitEvery(t, kvBound, pollInterval, fmt.Sprintf("router %s's exact index of %s to hold what %s holds", r.id, s.id, s.id), func() bool {
		return int64(m.exactBlocks(t, r, s.id)) == s.stats(t).PrefixCacheBlocks
	})
}

// other returns the prefill engine that is not id.
func other(id string) string {
	if id == "p1" {
		return "p2"
	}
	return "p1"
}

// evict sends distinct long prompts straight to s until s holds nothing
// of prompt, and returns how many it took.
func (m *kvMesh) evict(t *testing.T, s *simProc, tag, prompt string) int {
	t.Helper()
	for i := range 8 {
		if m.cachedTokens(t, s, prompt) == 0 {
			return i
		}
		m.direct(t, s, kvWords(fmt.Sprintf("%s%d-", tag, i), 60*kvBlockSize))
	}
	if n := m.cachedTokens(t, s, prompt); n != 0 {
		t.Fatalf("%s still holds %d tokens of the prompt after 8 evicting prompts", s.id, n)
	}
	return 8
}

// TestExactIndexFollowsEvictionRPLACE4 runs the real binaries — a bus
// with per-identity credentials, a breaker, two routers, two prefill
// sims publishing vLLM's KV events through `narwhal agent --kv-events`
// and a decode sim — and proves that the exact index follows what an
// engine holds (behaviour.md R-PLACE-4), where the approximate index
// only knows what was placed:
//
//   - a 40-block prompt A placed through router rx (placement.index
//     auto) on producer X shows up in rx's exact index of X, from X's
//     BlockStored events alone;
//   - X is then made to evict A by prompts sent to it directly, past every
//     router, and the other producer Y is given A's first 10 blocks the
//     same way; once rx's exact index holds what each engine holds, A
//     through rx goes to Y: X matches nothing, Y 10 blocks, so Y is the
//     cheaper engine by 160 tokens and a stale match on X would have won;
//   - the same steps with another prompt A' through router ra
//     (placement.index approximate) place A' back on the engine that
//     evicted it: its approximate index still believes the engine holds
//     it.
func TestExactIndexFollowsEvictionRPLACE4(t *testing.T) {
	m := startKVMesh(t)
	promptLen := kvPromptBlocks * kvBlockSize

	// Exact index, router rx.
	a := kvWords("alpha", promptLen)
	sent := time.Now()
	x := m.viaRouter(t, m.rx, a)
	answered := time.Now()
	if x != "p1" && x != "p2" {
		t.Fatalf("A placed on %q, want p1 or p2", x)
	}
	testkit.WaitEvery(t, kvBound, time.Millisecond, fmt.Sprintf("rx's exact index of %s to hold A's %d blocks", x, kvPromptBlocks), func() bool {
		return m.exactBlocks(t, m.rx, x) >= kvPromptBlocks
	})
	inIndex := time.Now()
	m.exactBlocks(t, m.rx, x)
	t.Logf("A on %s; its %d blocks in rx's exact index %v after the router answered (%v after the request was sent; one scrape of /metrics takes %v)",
		x, kvPromptBlocks, inIndex.Sub(answered), inIndex.Sub(sent), time.Since(inIndex))
	y := other(x)
	sx, sy := m.sims[x], m.sims[y]
	m.direct(t, sy, kvWords("alpha", kvHeadBlocks*kvBlockSize))
	if got := m.cachedTokens(t, sy, a); got != kvHeadBlocks*kvBlockSize {
		t.Fatalf("%s holds %d tokens of A, want its first %d blocks (%d tokens)", y, got, kvHeadBlocks, kvHeadBlocks*kvBlockSize)
	}
	n := m.evict(t, sx, "bravo", a)
	t.Logf("%s evicted A after %d prompts sent to it directly", x, n)
	m.waitInSync(t, m.rx, sx)
	m.waitInSync(t, m.rx, sy)
	if got := testkit.ScrapedSum(t, m.client, m.rx.url+"/metrics", "narwhal_prefix_exact_engines"); got != 2 {
		t.Fatalf("rx: narwhal_prefix_exact_engines %v, want 2", got)
	}
	again := m.viaRouter(t, m.rx, a)
	t.Logf("placement.index auto: A again went to %s", again)
	if again != y {
		t.Errorf("placement.index auto: A after %s evicted it went to %s; want %s, which holds its first %d blocks (a stale match on %s would win otherwise)",
			x, again, y, kvHeadBlocks, x)
	}

	// Approximate index, router ra: the same steps with A'.
	a2 := kvWords("charlie", promptLen)
	x2 := m.viaRouter(t, m.ra, a2)
	if x2 != "p1" && x2 != "p2" {
		t.Fatalf("A' placed on %q, want p1 or p2", x2)
	}
	y2 := other(x2)
	sx2, sy2 := m.sims[x2], m.sims[y2]
	m.direct(t, sy2, kvWords("charlie", kvHeadBlocks*kvBlockSize))
	m.evict(t, sx2, "delta", a2)
	if got := int(testkit.ScrapedSum(t, m.client, m.ra.url+"/metrics", "narwhal_prefix_index_blocks", "engine", x2, "index", "approximate")); got < kvPromptBlocks {
		t.Fatalf("ra: approximate index of %s holds %d blocks, want at least A's %d (its placement)", x2, got, kvPromptBlocks)
	}
	if got := int(testkit.ScrapedSum(t, m.client, m.ra.url+"/metrics", "narwhal_prefix_index_blocks", "engine", x2, "index", "exact")); got != 0 {
		t.Fatalf("ra: exact index of %s holds %d blocks under placement.index approximate, want none", x2, got)
	}
	again = m.viaRouter(t, m.ra, a2)
	t.Logf("placement.index approximate: A' first on %s, after the eviction on %s", x2, again)
	if again != x2 {
		t.Errorf("placement.index approximate: A' after %s evicted it went to %s; want %s, which its approximate index still matches", x2, again, x2)
	}
}
