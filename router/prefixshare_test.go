package router

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/schemas"
)

// sharedPrompt returns a prompt of many 64-byte blocks, distinct per tag.
func sharedPrompt(tag string) string {
	return strings.Repeat("shared context of tenant "+tag+" for every user and query. ", 20)
}

// prefillEngineOf sends content through s and returns the prefill engine
// that served it.
func (s *stack) prefillEngineOf(content string) string {
	s.t.Helper()
	resp, body := s.post(schemas.EndpointChat, chatBody(content, `"max_tokens":2`))
	if resp.StatusCode != 200 {
		s.t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	return resp.Header.Get("X-Narwhal-Prefill-Engine")
}

// prefixFleet is three prefill engines and one decode engine.
func prefixFleet() []engineDef {
	return []engineDef{{id: "p1", role: "prefill"}, {id: "p2", role: "prefill"}, {id: "p3", role: "prefill"}, {id: "d1", role: "decode"}}
}

// peerRouter starts another router over a's engines, with id, joined to
// the bus of m on a connection of its own.
func peerRouter(t *testing.T, a *stack, m *meshBus, id string, mutate func(*config.Config)) *stack {
	t.Helper()
	s := newStack(t, nil, func(c *config.Config) {
		c.Fleet = a.cfg.Fleet
		c.Router.ID = id
		if mutate != nil {
			mutate(c)
		}
	})
	s.waitModels()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.ConnectOptions{URL: m.URL(), Name: id})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	if err := s.rt.JoinMesh(b, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestSharedIndexAppliesWithin250msRPLACE2: a prefix placed through
// router A is applied by router B within 250 ms, and B then places its
// follow-up on the same engine: the routers share one index.
func TestSharedIndexAppliesWithin250msRPLACE2(t *testing.T) {
	a := newStack(t, prefixFleet(), func(c *config.Config) { c.Router.ID = "rt-a" })
	a.waitModels()
	m := newMeshBus(t)
	if err := a.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	b := peerRouter(t, a, m, "rt-b", nil)
	a.prefillEngineOf("warm the connections up") // not measured
	for i := range 5 {
		prompt := sharedPrompt(fmt.Sprint(i))
		before := map[string]int{}
		for _, id := range []string{"p1", "p2", "p3"} {
			before[id] = b.rt.PrefixIndex().Blocks(id)
		}
		// Measured from before the request reaches A, so the bound covers
		// A's placement, its batch's flush and B's apply.
		sent := time.Now()
		engine := a.prefillEngineOf(prompt + "first question")
		testkit.WaitEvery(t, 5*time.Second, time.Millisecond, "router B to apply router A's placement on "+engine, func() bool {
			return b.rt.PrefixIndex().Blocks(engine) > before[engine]
		})
		took := time.Since(sent)
		t.Logf("placement %d on %s applied by B %v after the request was sent to A", i, engine, took)
		if took > 250*time.Millisecond {
			t.Fatalf("placement %d applied by B %v after the request was sent to A, want within 250 ms", i, took)
		}
		if got := b.prefillEngineOf(prompt + "follow-up question"); got != engine {
			t.Fatalf("follow-up through B went to %s, the prefix is on %s", got, engine)
		}
	}
	if n := testkit.GatheredSum(t, a.rt.Registry(), "narwhal_prefix_batches_published_total"); n < 1 {
		t.Fatalf("A published %v batches", n)
	}
	if n := testkit.GatheredSum(t, b.rt.Registry(), "narwhal_prefix_batches_applied_total"); n < 5 {
		t.Fatalf("B applied %v batches", n)
	}
}

// TestSharedIndexWarmsFromTheStreamRPLACE2: a router that joins the mesh
// after another placed learns those placements from stream
// NARWHAL_PREFIX.
func TestSharedIndexWarmsFromTheStreamRPLACE2(t *testing.T) {
	a := newStack(t, prefixFleet(), func(c *config.Config) { c.Router.ID = "rt-a" })
	a.waitModels()
	m := newMeshBus(t)
	if err := a.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	engine := a.prefillEngineOf(sharedPrompt("warm") + "q")
	testkit.WaitFor(t, 5*time.Second, "A's batch to be published", func() bool {
		return testkit.GatheredSum(t, a.rt.Registry(), "narwhal_prefix_batches_published_total") >= 1
	})
	late := peerRouter(t, a, m, "rt-late", nil)
	testkit.WaitFor(t, 5*time.Second, "the late router to warm its index", func() bool { return late.rt.PrefixIndex().Blocks(engine) > 0 })
}

// TestSharedIndexWarmsFromItsOwnPastRPLACE2: a router restarted with the
// same id (router.id defaults to the host name) reads back the placements
// it published before the restart too, not only the other routers': the
// stream is the new process's only record of them.
func TestSharedIndexWarmsFromItsOwnPastRPLACE2(t *testing.T) {
	a := newStack(t, prefixFleet(), func(c *config.Config) { c.Router.ID = "rt-a" })
	a.waitModels()
	m := newMeshBus(t)
	if err := a.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	engine := a.prefillEngineOf(sharedPrompt("own") + "q")
	testkit.WaitFor(t, 5*time.Second, "A's batch to be published", func() bool {
		return testkit.GatheredSum(t, a.rt.Registry(), "narwhal_prefix_batches_published_total") >= 1
	})
	again := peerRouter(t, a, m, "rt-a", nil) // A after a restart
	testkit.WaitFor(t, 5*time.Second, "the restarted router to warm its index from its own placements", func() bool {
		return again.rt.PrefixIndex().Blocks(engine) > 0
	})
	if got := again.prefillEngineOf(sharedPrompt("own") + "follow-up"); got != engine {
		t.Fatalf("follow-up after the restart went to %s, the prefix is on %s", got, engine)
	}
}

// TestShareIndexOffRPLACE2: with placement.share_index false a router
// neither publishes its placements nor applies the others'.
func TestShareIndexOffRPLACE2(t *testing.T) {
	a := newStack(t, prefixFleet(), func(c *config.Config) { c.Router.ID = "rt-a"; c.Placement.ShareIndex = false })
	a.waitModels()
	m := newMeshBus(t)
	if err := a.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	b := peerRouter(t, a, m, "rt-b", nil)
	a.prefillEngineOf(sharedPrompt("alone") + "q")
	engine := b.prefillEngineOf(sharedPrompt("b's") + "q")
	// B's placement reaching a third, sharing router is the barrier: A
	// would have had it as soon.
	c := peerRouter(t, a, m, "rt-c", nil)
	testkit.WaitFor(t, 5*time.Second, "router C to learn B's placement", func() bool { return c.rt.PrefixIndex().Blocks(engine) > 0 })
	total := 0
	// Engines sized from their KV caches have an (empty) index of their
	// own: only those holding blocks count.
	a.rt.PrefixIndex().Engines(func(_ string, blocks int) {
		if blocks > 0 {
			total++
		}
	})
	if n := testkit.GatheredSum(t, a.rt.Registry(), "narwhal_prefix_batches_published_total"); n != 0 {
		t.Fatalf("A published %v batches with share_index off", n)
	}
	if n := testkit.GatheredSum(t, a.rt.Registry(), "narwhal_prefix_batches_applied_total"); n != 0 || total != 1 {
		t.Fatalf("A applied %v batches and holds %d engines with share_index off", n, total)
	}
}

// TestSharedIndexKeepsWhatAnotherRouterUsesRPLACE2: a prompt router A
// places again and again stays in router B's index while A's other
// prompts turn B's bounded index over: every placement is shared whole,
// so B's index ages the prompt as A's does, and does not evict a prefix
// as unused while the engine serves it (before, only the blocks A's
// index lacked were shared, and B lost the mesh's hottest prefix first).
func TestSharedIndexKeepsWhatAnotherRouterUsesRPLACE2(t *testing.T) {
	fleet := []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}
	a := newStack(t, fleet, func(c *config.Config) { c.Router.ID = "rt-a" })
	a.waitModels()
	m := newMeshBus(t)
	if err := a.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	b := peerRouter(t, a, m, "rt-b", func(c *config.Config) { c.Placement.PrefixIndexBlocks = 60 })
	chain := func(content string) []uint64 {
		req, err := schemas.ParseRequest(schemas.EndpointChat, []byte(chatBody(content, `"max_tokens":2`)))
		if err != nil {
			t.Fatal(err)
		}
		return prefix.AppendHashes(nil, req.AppendPrompt(nil))
	}
	hot := sharedPrompt("hot") + "the question everyone asks"
	hotChain := chain(hot)
	if len(hotChain) < 15 || len(hotChain) > 25 {
		t.Fatalf("the hot prompt is %d blocks; the test sizes B's index (60) for about 18", len(hotChain))
	}
	a.prefillEngineOf(hot)
	var last []uint64
	for i := range 8 {
		cold := sharedPrompt(fmt.Sprint("cold-", i)) + "a question nobody repeats"
		a.prefillEngineOf(cold)
		a.prefillEngineOf(hot)
		last = chain(cold)
	}
	// B has applied every batch of A's once it holds the last cold prompt
	// and the hot one's last use came after it.
	testkit.WaitFor(t, 5*time.Second, "B to apply A's placements", func() bool {
		return b.rt.PrefixIndex().Match("p1", last) == len(last)
	})
	testkit.WaitFor(t, 5*time.Second, "B to hold the prompt A keeps placing", func() bool {
		return b.rt.PrefixIndex().Match("p1", hotChain) == len(hotChain)
	})
	if got := b.rt.PrefixIndex().Blocks("p1"); got > 60 {
		t.Fatalf("B's index holds %d blocks of p1, over its bound of 60", got)
	}
}
