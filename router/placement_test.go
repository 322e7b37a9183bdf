package router

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/connector/nixl"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/router/meshview"
	"github.com/narwhalmesh/narwhal/schemas"
)

// placementRig is a router with only what placement needs: a view of a
// fleet of placeable members (no watch runs) and a placer with the given
// policy. Every member's /v1/models is served by the rig's engines
// server, each engine's answer set by refreshWith.
type placementRig struct {
	rt *Router
	f  *fleet

	mu      sync.Mutex
	answers map[string]modelsAnswer // by engine id
	tokens  map[*member][]int64     // each producer's placements' reserved tokens, not released yet
}

// modelsAnswer is what an engine of the rig answers GET /v1/models with.
type modelsAnswer struct {
	status int
	models []string
}

// serveModels answers GET /<id>/v1/models for each rig engine id.
func (g *placementRig) serveModels(w http.ResponseWriter, r *http.Request) {
	id, ok := strings.CutSuffix(strings.TrimPrefix(r.URL.Path, "/"), "/v1/models")
	g.mu.Lock()
	a, known := g.answers[id]
	g.mu.Unlock()
	if !ok || !known {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(a.status)
	var b strings.Builder
	b.WriteString(`{"object":"list","data":[`)
	for i, m := range a.models {
		if i > 0 {
			b.WriteString(",")
		}
		b.WriteString(`{"id":"` + m + `","object":"model"}`)
	}
	b.WriteString(`]}`)
	_, _ = w.Write([]byte(b.String()))
}

// refreshWith makes engine m answer its /v1/models with status and
// models, and has the rig's view read every engine's again.
func refreshWith(t testing.TB, g *placementRig, m *member, status int, models ...string) {
	t.Helper()
	g.mu.Lock()
	g.answers[m.ID] = modelsAnswer{status: status, models: models}
	g.mu.Unlock()
	g.rt.view.RefreshModels(context.Background())
}

// rigSlots is the slot limit per phase of every rig member: far above
// the loads the tests set, reached only where a test fills an engine.
const rigSlots = 64

func newPlacementRig(t testing.TB, policy string, ids ...string) *placementRig {
	t.Helper()
	g := &placementRig{answers: map[string]modelsAnswer{}}
	srv := httptest.NewServer(http.HandlerFunc(g.serveModels))
	t.Cleanup(srv.Close)
	cfg := config.Default()
	cfg.Placement.Policy = policy
	for _, id := range ids {
		role := connector.RolePrefill
		switch id[0] {
		case 'd':
			role = connector.RoleDecode
		case 'b':
			role = connector.RoleBoth
		}
		cfg.Fleet = append(cfg.Fleet, config.EngineSpec{ID: id, URL: srv.URL + "/" + id, Role: role, Connector: "nixl", PrefillSlots: rigSlots, DecodeSlots: rigSlots})
		g.answers[id] = modelsAnswer{status: 200, models: []string{"m"}}
	}
	pl, err := newPlacer(cfg.Placement)
	if err != nil {
		t.Fatal(err)
	}
	v, err := meshview.New(meshview.Options{Config: &cfg, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), KeepsIndex: pl.policy.weighsPrefix()})
	if err != nil {
		t.Fatal(err)
	}
	g.rt = &Router{view: v, mesh: v, placer: pl}
	g.f = g.rt.fleet()
	v.RefreshModels(context.Background())
	for _, m := range g.f.Members() {
		if !m.Serves("m") {
			t.Fatalf("rig engine %s lists %v", m.ID, m.Models())
		}
	}
	return g
}

// testMember returns a placeable member of engine id with role: eligible,
// active, listing model "m", its connector nixl, without slot limits.
func testMember(id string, role connector.Role) *member {
	m := meshview.NewMember(engines.Engine{ID: id, Role: role, Connector: nixl.Nixl{}}, schemas.FleetEntry{State: schemas.FleetActive}, true)
	m.SetModels([]string{"m"})
	return m
}

// setLoad makes m's reserved slots of phase p n, by reserving or
// releasing them.
func setLoad(t testing.TB, m *member, p phase, n int64) {
	t.Helper()
	for m.Reserved(p) > n {
		m.Release(p)
	}
	for m.Reserved(p) < n {
		if !m.TryReserve(p) {
			t.Fatalf("%s: %d slots of %s reserved, its limit reached", m.ID, m.Reserved(p), p)
		}
	}
}

// fill reserves every slot of phase p that m has left.
func fill(m *member, p phase) {
	for m.TryReserve(p) {
	}
}

// placeLeast places phase p of model on f by load alone (as every decode
// leg is placed) with buffers of its own.
func placeLeast(f *fleet, model string, p phase, avoid []*member) (*member, error) {
	return place(f, model, p, avoid, "", leastLoaded{}, nil, new(placeScratch))
}

// guarded returns the rig's prefix policy's count of placements
// decided by the imbalance guard.
func (g *placementRig) guarded() float64 {
	return testutil.ToFloat64(g.rt.placer.policy.(*prefixPolicy).guarded)
}

// chatRequest is a chat request with a long shared system prompt and a
// user question.
func chatRequest(t testing.TB, system, question string) *schemas.Request {
	t.Helper()
	body := `{"model":"m","messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"` + question + `"}]}`
	r, err := schemas.ParseRequest(schemas.EndpointChat, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// place places one attempt's legs for req with the rig's router and
// returns them (their slots reserved).
func (g *placementRig) place(t testing.TB, req *schemas.Request, avoid *avoidSet) (prod, cons *member) {
	t.Helper()
	c := &call{rt: g.rt, req: req, attempts: 1}
	defer c.releasePlacement()
	if avoid == nil {
		avoid = &avoidSet{}
	}
	prod, cons, f := c.placeLegs(avoid)
	if f != nil {
		t.Fatalf("placement failed: %v", f)
	}
	g.mu.Lock()
	if g.tokens == nil {
		g.tokens = map[*member][]int64{}
	}
	g.tokens[prod] = append(g.tokens[prod], c.prefillTokens)
	g.mu.Unlock()
	return prod, cons
}

// release gives back the slots of a placement and the producer's
// tokens of its latest one not released yet, as the request's end does.
func (g *placementRig) release(prod, cons *member) {
	prod.Release(prefillPhase)
	cons.Release(decodePhase)
	g.mu.Lock()
	if ts := g.tokens[prod]; len(ts) > 0 {
		prod.AddTokens(-ts[len(ts)-1])
		g.tokens[prod] = ts[:len(ts)-1]
	}
	g.mu.Unlock()
}

var longSystem = strings.Repeat("You are a narwhal who answers questions about the Arctic. ", 40)

// TestPrefixPlacementFollowsThePrefixRPLACE2: a prompt whose prefix was
// placed on an engine goes back there while the load is even; a prompt
// no engine has seen goes to the least loaded; the index records what
// was placed, and the OnPlaced function gets every block of each
// placed prompt — the ones the index held too, whose recency the other
// routers refresh with them.
func TestPrefixPlacementFollowsThePrefixRPLACE2(t *testing.T) {
	g := newPlacementRig(t, config.PolicyPrefix, "p1", "p2", "p3", "p4", "d1", "d2")
	var mu sync.Mutex
	var published [][]uint64
	g.rt.OnPlaced(func(id string, hashes []uint64) {
		mu.Lock()
		published = append(published, slices.Clone(hashes))
		mu.Unlock()
	})
	// chains are the requests' whole chains, as the router hashes them.
	var chains [][]uint64
	chainOf := func(r *schemas.Request) *schemas.Request {
		chains = append(chains, prefix.AppendHashes(nil, r.AppendPrompt(nil)))
		return r
	}
	first, cons := g.place(t, chainOf(chatRequest(t, longSystem, "how cold is the water?")), nil)
	g.release(first, cons)
	if cons.Role != connector.RoleDecode {
		t.Fatalf("the decode went to %s", cons.ID)
	}
	blocks := g.rt.PrefixIndex().Blocks(first.ID)
	if blocks < 30 {
		t.Fatalf("the index holds %d blocks for %s after a ~2.4 KB prompt", blocks, first.ID)
	}
	for i := range 40 {
		// Another engine one attempt busier than the others: still the
		// matched one wins (a few attempts cost less than the match).
		setLoad(t, first, prefillPhase, int64(i%3))
		p, c := g.place(t, chainOf(chatRequest(t, longSystem, "question "+strings.Repeat("x", i))), nil)
		g.release(p, c)
		if p != first {
			t.Fatalf("follow-up %d went to %s, the prefix is on %s", i, p.ID, first.ID)
		}
	}
	setLoad(t, first, prefillPhase, 0)
	mu.Lock()
	if len(published) != len(chains) || len(chains[0]) != blocks {
		t.Fatalf("%d placements published, want %d; the first prompt is %d blocks, its index %d", len(published), len(chains), len(chains[0]), blocks)
	}
	for i, hs := range published {
		// Each placement publishes its prompt's whole chain: the shared
		// system prompt's blocks the index held, and its question's.
		if !slices.Equal(hs, chains[i]) {
			t.Fatalf("placement %d published %d blocks, not its prompt's whole chain of %d", i, len(hs), len(chains[i]))
		}
	}
	mu.Unlock()
	// A different system prompt matches nothing: least loaded, spread.
	seen := map[string]bool{}
	g.f.Member("p1").AddTokens(100) // the work of p1's one attempt
	defer g.f.Member("p1").AddTokens(-100)
	for i := range 40 {
		setLoad(t, g.f.Member("p1"), prefillPhase, 1)
		p, c := g.place(t, chatRequest(t, fmt.Sprintf("tenant %d: ", i)+longSystem, "q"), nil)
		g.release(p, c)
		if p.ID == "p1" {
			t.Fatalf("an unseen prompt went to the busier p1")
		}
		seen[p.ID] = true
	}
	if len(seen) != 3 {
		t.Fatalf("unseen prompts went to %v, want spread over p2, p3, p4", seen)
	}
}

// TestPrefixPlacementGuardRPLACE2: when the outstanding attempts are too
// uneven (both thresholds crossed) the least loaded engine wins over the
// one holding the prefix; below either threshold, the prefix holds when
// the load penalty allows.
func TestPrefixPlacementGuardRPLACE2(t *testing.T) {
	g := newPlacementRig(t, config.PolicyPrefix, "p1", "p2", "d1")
	req := chatRequest(t, longSystem, "q")
	hot, c := g.place(t, req, nil)
	g.release(hot, c)
	other := g.f.Member("p1")
	if hot == other {
		other = g.f.Member("p2")
	}
	// 40 − 5 = 35 > 32 and 40 > 1.5 × 5: the guard chooses by load.
	setLoad(t, hot, prefillPhase, 40)
	setLoad(t, other, prefillPhase, 5)
	guarded := g.guarded()
	if p, c := g.place(t, req, nil); p != other {
		t.Fatalf("guard: placed on %s, want the least loaded %s", p.ID, other.ID)
	} else {
		g.release(p, c)
	}
	// The load penalty alone would also avoid the hot engine here: the
	// guard must be what decided.
	if n := g.guarded() - guarded; n != 1 {
		t.Fatalf("%v placements decided by the guard, want 1", n)
	}
	// The engine's own queue counts as load in the score too.
	setLoad(t, hot, prefillPhase, 0)
	setLoad(t, other, prefillPhase, 0)
	g.rt.SetEngineWaiting(hot.ID, 100)
	if p, c := g.place(t, req, nil); p != other {
		t.Fatalf("100 waiting on the matched engine: placed on %s, want %s", p.ID, other.ID)
	} else {
		g.release(p, c)
	}
	g.rt.SetEngineWaiting(hot.ID, -3)
	if hot.Waiting() != 0 {
		t.Fatal("a negative queue was stored")
	}
	g.rt.PrefixIndex().Drop(other.ID) // the placements above recorded the prompt there too
	if p, c := g.place(t, req, nil); p != hot {
		t.Fatalf("even load: placed on %s, want the matched %s", p.ID, hot.ID)
	} else {
		g.release(p, c)
	}
}

// TestPrefixPlacementNeverOverridesEligibilityRPLACE1: the engine that
// holds the prompt's prefix is never chosen while it is quarantined,
// ejected, draining, out of slots, refusing credentials or not serving
// the model — the score only orders the engines that may be chosen.
func TestPrefixPlacementNeverOverridesEligibilityRPLACE1(t *testing.T) {
	g := newPlacementRig(t, config.PolicyPrefix, "p1", "p2", "d1")
	req := chatRequest(t, longSystem, "q")
	hot, c := g.place(t, req, nil)
	g.release(hot, c)
	other := g.f.Member("p1")
	if hot == other {
		other = g.f.Member("p2")
	}
	entry := schemas.FleetEntry{State: schemas.FleetActive}
	cases := []struct {
		name        string
		break_, fix func()
	}{
		{"quarantined", func() { hot.Quarantine(time.Now().Add(time.Hour)) }, func() { hot.Quarantine(time.Unix(0, 0)) }},
		{"ejected", func() { hot.SetEligible(false) }, func() { hot.SetEligible(true) }},
		{"draining", func() {
			e := entry
			e.State = schemas.FleetDraining
			hot.SetEntry(e)
		}, func() { hot.SetEntry(entry) }},
		{"out of slots", func() { fill(hot, prefillPhase) }, func() { setLoad(t, hot, prefillPhase, 0) }},
		{"refusing credentials", func() { refreshWith(t, g, hot, 401) }, func() { refreshWith(t, g, hot, 200, "m") }},
		{"not serving the model", func() { refreshWith(t, g, hot, 200, "other") }, func() { refreshWith(t, g, hot, 200, "m") }},
	}
	for _, tc := range cases {
		tc.break_()
		for range 20 {
			p, c := g.place(t, req, nil)
			g.release(p, c)
			if p == hot {
				t.Fatalf("%s: the matched engine was chosen", tc.name)
			}
		}
		tc.fix()
		g.rt.PrefixIndex().Drop(other.ID) // the placements above recorded the prompt there too
		if p, c := g.place(t, req, nil); p != hot {
			t.Fatalf("after %s ended: placed on %s, want the matched %s again", tc.name, p.ID, hot.ID)
		} else {
			g.release(p, c)
		}
	}
	// Every producer out: no engine, nothing reserved.
	hot.SetEligible(false)
	other.SetEligible(false)
	c2 := &call{rt: g.rt, req: req, attempts: 1}
	if _, _, f := c2.placeLegs(&avoidSet{}); f == nil || f.Kind != engines.KindNoEngine {
		t.Fatalf("no producer: %v", f)
	}
	c2.releasePlacement()
	if g.f.Member("d1").Reserved(decodePhase) != 0 {
		t.Fatal("a decode slot was reserved without a producer")
	}
}

// TestPrefixPlacementRetryAvoidsFailedRRETRY3: a retry never goes back to
// the producer that failed while another may take it, however well it
// matches; only when none other can does it return there.
func TestPrefixPlacementRetryAvoidsFailedRRETRY3(t *testing.T) {
	g := newPlacementRig(t, config.PolicyPrefix, "p1", "p2", "d1")
	req := chatRequest(t, longSystem, "q")
	hot, c := g.place(t, req, nil)
	g.release(hot, c)
	avoid := &avoidSet{}
	avoid[prefillPhase] = []*member{hot}
	for range 20 {
		p, c := g.place(t, req, avoid)
		g.release(p, c)
		if p == hot {
			t.Fatal("the retry went back to the failed producer")
		}
	}
	for _, m := range g.f.Members() {
		if m != hot && m.Role.CanPrefill() {
			m.SetEligible(false)
		}
	}
	if p, c := g.place(t, req, avoid); p != hot {
		t.Fatalf("only the failed producer left: placed on %s", p.ID)
	} else {
		g.release(p, c)
	}
}

// TestPrefixPlacementSameWorkerRPLACE2: under the prefix policy a
// same-worker producer keeps the decode (the whole attempt where the
// prefix is), unless the decode must avoid it or it has no decode slot:
// then the least loaded consumer takes it.
func TestPrefixPlacementSameWorkerRPLACE2(t *testing.T) {
	g := newPlacementRig(t, config.PolicyPrefix, "b1", "b2", "b3")
	req := chatRequest(t, longSystem, "q")
	for range 20 {
		p, c := g.place(t, req, nil)
		g.release(p, c)
		if p != c {
			t.Fatalf("same-worker producer %s, decode on %s", p.ID, c.ID)
		}
	}
	hot, _ := g.place(t, req, nil)
	hot.Release(prefillPhase)
	hot.Release(decodePhase)
	avoid := &avoidSet{}
	avoid[decodePhase] = []*member{hot}
	if p, c := g.place(t, req, avoid); p != hot || c == hot {
		t.Fatalf("decode avoiding %s: prefill %s, decode %s", hot.ID, p.ID, c.ID)
	} else {
		g.release(p, c)
	}
	fill(hot, decodePhase)
	if p, c := g.place(t, req, nil); p != hot || c == hot {
		t.Fatalf("no decode slot on %s: prefill %s, decode %s", hot.ID, p.ID, c.ID)
	} else {
		g.release(p, c)
	}
	// least_loaded keeps choosing the legs apart.
	ll := newPlacementRig(t, config.PolicyLeastLoaded, "b1", "b2")
	crossed := 0
	for range 40 {
		p, c := ll.place(t, req, nil)
		ll.release(p, c)
		if p != c {
			crossed++
		}
	}
	if crossed == 0 {
		t.Fatal("least_loaded never crossed the legs")
	}
}

// TestRandomPlacementSpreadsRPLACE1: the random policy picks uniformly
// among the producers that may be chosen, never another.
func TestRandomPlacementSpreadsRPLACE1(t *testing.T) {
	g := newPlacementRig(t, config.PolicyRandom, "p1", "p2", "p3", "d1")
	g.f.Member("p3").SetEligible(false)
	setLoad(t, g.f.Member("p1"), prefillPhase, 10)
	counts := map[string]int{}
	req := chatRequest(t, longSystem, "q")
	for range 400 {
		p, c := g.place(t, req, nil)
		g.release(p, c)
		counts[p.ID]++
	}
	if counts["p3"] != 0 || counts["p1"] < 140 || counts["p2"] < 140 {
		t.Fatalf("random placements %v: want p1 and p2 about evenly, never p3", counts)
	}
	if g.rt.PrefixIndex().Blocks("p1") != 0 {
		t.Fatal("the random policy recorded prefixes")
	}
}

// TestPrefixPlacementEndToEndRPLACE2 runs real requests through a router
// over simulators: follow-ups of a conversation go to the producer of its
// first request, and narwhal_prefix_index_blocks reports the index.
func TestPrefixPlacementEndToEndRPLACE2(t *testing.T) {
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "p2", role: "prefill"}, {id: "p3", role: "prefill"}, {id: "d1", role: "decode"}}, nil)
	s.waitModels()
	system := strings.Repeat("A long shared context about narwhals. ", 30)
	body := func(q string) string {
		return `{"model":"` + testModel + `","max_tokens":2,"messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"` + q + `"}]}`
	}
	resp, b := s.post(schemas.EndpointChat, body("first"))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	first := resp.Header.Get("X-Narwhal-Prefill-Engine")
	for i := range 10 {
		resp, b := s.post(schemas.EndpointChat, body("follow-up "+strings.Repeat("?", i)))
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
		if got := resp.Header.Get("X-Narwhal-Prefill-Engine"); got != first {
			t.Fatalf("follow-up %d prefilled on %s, the conversation's prefix is on %s", i, got, first)
		}
	}
	mfs, err := s.rt.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if v, found := testkit.Sum(mfs, "narwhal_prefix_index_blocks", "engine", first); !found || v < 15 {
		t.Fatalf("narwhal_prefix_index_blocks{engine=%s} = %v (found %v), want the prompt's blocks", first, v, found)
	}
	for _, id := range []string{"p1", "p2", "p3"} {
		if id == first {
			continue
		}
		if v, found := testkit.Sum(mfs, "narwhal_prefix_index_blocks", "engine", id); !found || v != 0 {
			t.Fatalf("narwhal_prefix_index_blocks{engine=%s} = %v (found %v), want 0", id, v, found)
		}
	}
	if v, _ := testkit.Sum(mfs, "narwhal_prefix_placements_total", "decision", "matched"); v != 10 {
		t.Fatalf("narwhal_prefix_placements_total{decision=matched} = %v, want the 10 follow-ups", v)
	}
}

// BenchmarkPrefixPlacement2000Tokens is one whole prefix placement of a
// 2,000-token chat prompt (about 8,000 bytes: a long system prompt and
// six turns) over 4 producers whose indexes are full, one holding the
// conversation: rendering, hashing, matching, scoring, reserving both
// legs, its tokens and recording the blocks at the producer (R-PLACE-2,
// R-PLACE-3). The hash and cost alone are
// prefix.BenchmarkPrefixScore2000Tokens. 0 allocs/op.
func BenchmarkPrefixPlacement2000Tokens(b *testing.B) {
	g := newPlacementRig(b, config.PolicyPrefix, "p1", "p2", "p3", "p4", "d1")
	var sb strings.Builder
	sb.WriteString(`{"model":"m","messages":[{"role":"system","content":"` + strings.Repeat("You are a narwhal. ", 200) + `"}`)
	for i := range 6 {
		sb.WriteString(`,{"role":"user","content":"` + strings.Repeat("narwhals use their tusks to sense the water around them.\\n ", 13) + string(rune('a'+i)) + `"}`)
	}
	sb.WriteString(`]}`)
	req, err := schemas.ParseRequest(schemas.EndpointChat, []byte(sb.String()))
	if err != nil {
		b.Fatal(err)
	}
	ix := g.rt.PrefixIndex()
	for i, id := range []string{"p1", "p2", "p3", "p4"} {
		for j := 0; ix.Blocks(id) < ix.Capacity(); j++ {
			p := []byte(strings.Repeat(string(rune('A'+i))+string(rune('a'+j%26))+string(rune('a'+j/26%26)), 8000/3))
			ix.Learn(id, prefix.AppendHashes(nil, p))
		}
	}
	hot, c := g.place(b, req, nil)
	g.release(hot, c)
	var avoid avoidSet
	call := &call{rt: g.rt, req: req, attempts: 1}
	b.ReportAllocs()
	b.ResetTimer()
	cpu := testkit.CPUTime()
	for b.Loop() {
		p, c, f := call.placeLegs(&avoid)
		if f != nil || p != hot {
			b.Fatalf("placed on %v (%v), the prompt is on %s", p, f, hot.ID)
		}
		call.releasePlacement()
		p.Release(prefillPhase)
		c.Release(decodePhase)
		p.AddTokens(-call.prefillTokens)
	}
	testkit.ReportCPUPerOp(b, cpu)
}

// TestPrefixPlacementShortPromptsSpreadRPLACE2: a prompt shorter than
// prefix.MinScoredBlocks is placed by load, so the same short request
// sent again and again still reaches every producer.
func TestPrefixPlacementShortPromptsSpreadRPLACE2(t *testing.T) {
	g := newPlacementRig(t, config.PolicyPrefix, "p1", "p2", "p3", "d1")
	req := chatRequest(t, "be brief", "the same short question, again and again")
	seen := map[string]int{}
	for range 60 {
		p, c := g.place(t, req, nil)
		g.release(p, c)
		seen[p.ID]++
	}
	if len(seen) != 3 {
		t.Fatalf("a repeated short prompt went to %v, want every producer", seen)
	}
}

// TestPolicyFromConfigRPLACE1: a placement policy is built once from
// placement.policy — prefix weighs the prompt and keeps a same-worker
// producer's decode, least_loaded and random do neither — and a name
// that is none of them, the empty one included, makes New fail: the
// default is config.Default's alone.
func TestPolicyFromConfigRPLACE1(t *testing.T) {
	for _, tc := range []struct {
		name                     string
		weighsPrefix, sameWorker bool
	}{
		{config.PolicyPrefix, true, true},
		{config.PolicyLeastLoaded, false, false},
		{config.PolicyRandom, false, false},
	} {
		cfg := config.Default().Placement
		cfg.Policy = tc.name
		pl, err := newPlacer(cfg)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if pl.policy.weighsPrefix() != tc.weighsPrefix || pl.policy.sameWorker() != tc.sameWorker {
			t.Errorf("%s: weighsPrefix %v sameWorker %v, want %v %v", tc.name, pl.policy.weighsPrefix(), pl.policy.sameWorker(), tc.weighsPrefix, tc.sameWorker)
		}
	}
	if got := config.Default().Placement.Policy; got != config.PolicyPrefix {
		t.Fatalf("config.Default's policy is %q, want %q", got, config.PolicyPrefix)
	}
	for _, name := range []string{"", "round_robin"} {
		cfg := config.Default()
		cfg.Placement.Policy = name
		if _, err := New(Options{Config: &cfg}); err == nil || !strings.Contains(err.Error(), "placement.policy") {
			t.Errorf("policy %q: New returned %v, want an error naming placement.policy", name, err)
		}
	}
}
