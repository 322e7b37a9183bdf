package router

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/internal/testkit"
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
	b, err := bus.Connect(ctx, bus.ConnectOptions{URL: m.url(), Name: id})
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
	if err := a.rt.JoinMesh(m.b, 5*time.Second); err != nil {
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

// TestSharedIndexRefusesHostileBatchesRBUS9: malformed batches, batches
// on another router's subject and placements on engines that are not
// placeable prefill engines of the fleet (unknown, decode only, ejected)
// change nothing and are counted.
func TestSharedIndexRefusesHostileBatchesRBUS9(t *testing.T) {
	s := newStack(t, prefixFleet(), nil)
	s.waitModels()
	m := newMeshBus(t)
	if err := s.rt.JoinMesh(m.b, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := m.b.Conn().Flush(); err != nil { // the router's subscription is in place
		t.Fatal(err)
	}
	nc := m.peer.Conn()
	var batch bus.PrefixBatch
	batch.Reset("evil")
	batch.Add("nope", []uint64{1, 2})
	batch.Add("d1", []uint64{3})
	s.rt.setEligibility("p2", false, "test") // ejected: not learned either
	batch.Add("p2", []uint64{4})
	_ = nc.Publish(bus.PrefixSubject("evil"), batch.Bytes())
	_ = nc.Publish(bus.PrefixSubject("other"), batch.Bytes()) // names evil
	_ = nc.Publish(bus.PrefixSubject("evil"), []byte("NWP1 garbage"))
	reg := s.rt.Registry()
	testkit.WaitFor(t, 5*time.Second, "the batches to be judged", func() bool {
		return testkit.GatheredSum(t, reg, "narwhal_prefix_batches_dropped_total", "reason", "invalid") == 2 &&
			testkit.GatheredSum(t, reg, "narwhal_prefix_placements_ignored_total") == 3
	})
	for _, id := range []string{"nope", "d1", "p1", "p2"} {
		if n := s.rt.PrefixIndex().Blocks(id); n != 0 {
			t.Fatalf("the index holds %d blocks of %s", n, id)
		}
	}
	batch.Reset("evil")
	batch.Add("p1", []uint64{7, 8})
	_ = nc.Publish(bus.PrefixSubject("evil"), batch.Bytes())
	testkit.WaitFor(t, 5*time.Second, "a valid placement to be learned", func() bool { return s.rt.PrefixIndex().Blocks("p1") == 2 })
}

// TestSharedIndexWarmsFromTheStreamRPLACE2: a router that joins the mesh
// after another placed learns those placements from stream
// NARWHAL_PREFIX.
func TestSharedIndexWarmsFromTheStreamRPLACE2(t *testing.T) {
	a := newStack(t, prefixFleet(), func(c *config.Config) { c.Router.ID = "rt-a" })
	a.waitModels()
	m := newMeshBus(t)
	if err := a.rt.JoinMesh(m.b, 5*time.Second); err != nil {
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
	if err := a.rt.JoinMesh(m.b, 5*time.Second); err != nil {
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
	if err := a.rt.JoinMesh(m.b, 5*time.Second); err != nil {
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
	a.rt.PrefixIndex().Engines(func(string, int) { total++ })
	if n := testkit.GatheredSum(t, a.rt.Registry(), "narwhal_prefix_batches_published_total"); n != 0 {
		t.Fatalf("A published %v batches with share_index off", n)
	}
	if n := testkit.GatheredSum(t, a.rt.Registry(), "narwhal_prefix_batches_applied_total"); n != 0 || total != 1 {
		t.Fatalf("A applied %v batches and holds %d engines with share_index off", n, total)
	}
}

// TestIndexForgetsEnginesWhoseCacheIsGoneRPLACE2: the entries of an engine
// that is ejected, not active (draining), gone from the fleet or restarted
// (its process_start_time_seconds changed) are dropped, and its queue
// reaches the scorer.
func TestIndexForgetsEnginesWhoseCacheIsGoneRPLACE2(t *testing.T) {
	var start atomic.Value
	start.Store("1700000000.5")
	fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/metrics":
			fmt.Fprintf(w, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=%q} 7\nprocess_start_time_seconds %s\n", testModel, start.Load())
		case "/v1/models":
			fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, testModel)
		default:
			http.NotFound(w, r)
		}
	}))
	defer fake.Close()
	s := newStack(t, prefixFleet(), func(c *config.Config) {
		c.Fleet = append(c.Fleet, config.EngineSpec{ID: "p9", URL: fake.URL, Role: connector.RolePrefill, Connector: "nixl"})
		c.Placement.EngineMetricsIntervalS = 0.05
	})
	s.waitModels()
	ix := s.rt.PrefixIndex()
	p9 := s.rt.fleet().byID["p9"]
	testkit.WaitFor(t, 5*time.Second, "p9's queue to be read", func() bool { return p9.waiting.Load() == 7 })

	// p9 was read at least once: its start time is known.
	ix.Record("p9", []uint64{1, 2, 3}, nil)
	start.Store("1700000100.25") // p9 restarted
	testkit.WaitFor(t, 2*time.Second, "p9's entries to be dropped", func() bool { return ix.Blocks("p9") == 0 })

	ix.Record("p1", []uint64{1, 2}, nil)
	s.rt.setEligibility("p1", false, "test")
	testkit.WaitFor(t, 2*time.Second, "ejected p1's entries to be dropped", func() bool { return ix.Blocks("p1") == 0 })

	ix.Record("p2", []uint64{1, 2}, nil)
	p2 := s.rt.fleet().byID["p2"]
	e := *p2.entry.Load()
	e.State = schemas.FleetDraining
	p2.setEntry(e)
	testkit.WaitFor(t, 2*time.Second, "draining p2's entries to be dropped", func() bool { return ix.Blocks("p2") == 0 })

	ix.Record("gone", []uint64{1}, nil)
	testkit.WaitFor(t, 2*time.Second, "the entries of an engine not in the fleet to be dropped", func() bool { return ix.Blocks("gone") == 0 })
	for _, r := range []string{"restarted", "ejected", "inactive", "removed"} {
		if n := testkit.GatheredSum(t, s.rt.Registry(), "narwhal_prefix_index_drops_total", "reason", r); n != 1 {
			t.Errorf("%v drops for %s, want 1", n, r)
		}
	}
}

// TestIndexRestartFlappingRPLACE2: an engine whose start time changes at
// every read (lying, or restarting in a loop) costs only its own entries:
// a read that finds nothing held for it drops, counts and logs nothing.
func TestIndexRestartFlappingRPLACE2(t *testing.T) {
	var reads atomic.Int64
	fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/metrics":
			fmt.Fprintf(w, "process_start_time_seconds %d\n", 1700000000+reads.Add(1))
		case "/v1/models":
			fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, testModel)
		default:
			http.NotFound(w, r)
		}
	}))
	defer fake.Close()
	s := newStack(t, prefixFleet(), func(c *config.Config) {
		c.Fleet = append(c.Fleet, config.EngineSpec{ID: "p9", URL: fake.URL, Role: connector.RolePrefill, Connector: "nixl"})
		c.Placement.EngineMetricsIntervalS = 0.02
	})
	s.waitModels()
	testkit.WaitFor(t, 5*time.Second, "p9 to be read a few times", func() bool { return reads.Load() >= 5 })
	if n := testkit.GatheredSum(t, s.rt.Registry(), "narwhal_prefix_index_drops_total", "reason", "restarted"); n != 0 {
		t.Fatalf("%v restart drops of an engine the index held nothing for", n)
	}
	s.rt.PrefixIndex().Record("p9", []uint64{1, 2, 3}, nil)
	testkit.WaitFor(t, 5*time.Second, "p9's entries to be dropped", func() bool { return s.rt.PrefixIndex().Blocks("p9") == 0 })
	seen := reads.Load()
	testkit.WaitFor(t, 5*time.Second, "p9 to be read a few times more", func() bool { return reads.Load() >= seen+5 })
	if n := testkit.GatheredSum(t, s.rt.Registry(), "narwhal_prefix_index_drops_total", "reason", "restarted"); n != 1 {
		t.Fatalf("%v restart drops, want 1: only the read that found entries", n)
	}
}
