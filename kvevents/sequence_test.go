package kvevents

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/prefix"
)

// chainEvents returns n BlockStored events of one block each, hashes
// first…first+n-1 chained from none, over toks, and toks' keys.
func chainEvents(first, n int, toks []uint32) ([]map[string]any, []uint64) {
	var evs []map[string]any
	var parent any
	for i := 0; i < n; i++ {
		evs = append(evs, stored([]any{first + i}, parent, toks[i*16:(i+1)*16], nil))
		parent = first + i
	}
	return evs, prefix.AppendTokenKeys(nil, toks, 16, 0)
}

// TestAgentFillsGapFromReplayRPLACE4 (R-PLACE-4): a message the agent
// missed (sent only to vLLM's replay buffer) is asked for on the replay
// socket — vLLM's protocol, served by libzmq's ROUTER in Python — when
// the next one shows the gap: the routers see every stored key once, in
// chain order, and no KVLost.
func TestAgentFillsGapFromReplayRPLACE4(t *testing.T) {
	testkit.CheckLeaks(t)
	kb := startBus(t, "e1")
	py := startPublisher(t)
	pub, rep := py.open(true)
	_, reg := runAgent(t, kb, Config{Sources: []Source{{Rank: 0, Endpoint: pub, Replay: rep}}})
	py.subscribed(1)
	evs, want := chainEvents(1, 4, tokens(0, 64))
	py.send("array", false, evs[0])
	py.send("map", true, evs[1]) // lost on the way
	py.send("map", true, evs[2]) // lost on the way
	py.send("array", false, evs[3])
	testkit.WaitFor(t, waitBound, "all four keys", func() bool { return len(kb.got.keys(bus.KVStored, bus.KVGPU)) >= 4 })
	// One more live message: the replay went past the held one, which
	// is not applied twice.
	more := tokens(1000, 16)
	py.send("array", false, stored([]any{99}, 4, more, nil))
	testkit.WaitFor(t, waitBound, "the fifth key", func() bool { return len(kb.got.keys(bus.KVStored, bus.KVGPU)) >= 5 })
	got := kb.got.keys(bus.KVStored, bus.KVGPU)
	want = append(want, prefix.TokenBlockKey(want[3], more, 0))
	if !slices.Equal(got, want) {
		t.Fatalf("stored keys %x, want each of %x once", got, want)
	}
	if v := series(t, reg, "narwhal_agent_kv_gaps_total", "outcome", gapReplayed); v != 1 {
		t.Fatalf("gaps replayed = %v, want 1", v)
	}
	if n := kb.got.count(bus.KVLost, 0); n != 0 {
		t.Fatalf("%d KVLost after a gap the replay filled", n)
	}
}

// TestAgentReadsRecentPastAtStartRPLACE4 (R-PLACE-4): an agent that
// starts after the engine published reads vLLM's replay buffer from
// sequence 0 at its first message, so blocks stored before it started
// are known.
func TestAgentReadsRecentPastAtStartRPLACE4(t *testing.T) {
	testkit.CheckLeaks(t)
	kb := startBus(t, "e1")
	py := startPublisher(t)
	pub, rep := py.open(true)
	evs, want := chainEvents(1, 3, tokens(0, 48))
	py.send("array", false, evs[0]) // nobody subscribed yet
	py.send("array", false, evs[1])
	runAgent(t, kb, Config{Sources: []Source{{Rank: 0, Endpoint: pub, Replay: rep}}})
	py.subscribed(1)
	py.send("array", false, evs[2])
	testkit.WaitFor(t, waitBound, "the three keys", func() bool { return len(kb.got.keys(bus.KVStored, bus.KVGPU)) >= 3 })
	if got := kb.got.keys(bus.KVStored, bus.KVGPU); !slices.Equal(got, want) {
		t.Fatalf("stored keys %x, want %x", got, want)
	}
}

// TestAgentPublishesKVLostRPLACE4 (R-PLACE-4): a gap the agent cannot
// fill — no replay socket, a replay buffer that no longer holds the
// missed message, a replay socket that does not answer within the bound
// — is published as KVLost for the rank, the rank's map is cleared (a
// child of a block from before is then unknown), and what follows is
// carried again.
func TestAgentPublishesKVLostRPLACE4(t *testing.T) {
	testkit.CheckLeaks(t)
	for _, tc := range []struct {
		name   string
		replay bool
		setup  func(py *pyPublisher)
	}{
		{"no replay socket", false, func(*pyPublisher) {}},
		{"replay buffer moved on", true, func(py *pyPublisher) { py.do(map[string]any{"op": "forget"}) }},
		{"replay socket silent", true, func(py *pyPublisher) { py.do(map[string]any{"op": "replay_mode", "mode": "silent"}) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kb := startBus(t, "e1")
			py := startPublisher(t)
			pub, rep := py.open(tc.replay)
			_, reg := runAgent(t, kb, Config{Sources: []Source{{Rank: 0, Endpoint: pub, Replay: rep}}})
			py.subscribed(1)
			evs, want := chainEvents(1, 3, tokens(0, 48))
			py.send("array", false, evs[0])
			testkit.WaitFor(t, waitBound, "the first key", func() bool { return len(kb.got.keys(bus.KVStored, bus.KVGPU)) == 1 })
			py.send("array", true, evs[1]) // lost on the way
			tc.setup(py)
			py.send("array", false, evs[2]) // its parent is the lost one
			testkit.WaitFor(t, waitBound, "KVLost for rank 0", func() bool { return kb.got.count(bus.KVLost, 0) == 1 })
			testkit.WaitFor(t, waitBound, "the child counted", func() bool {
				return series(t, reg, "narwhal_agent_kv_events_total", "outcome", outUnknownParent) == 1
			})
			if v := series(t, reg, "narwhal_agent_kv_gaps_total", "outcome", gapLost); v != 1 {
				t.Fatalf("gaps lost = %v, want 1", v)
			}
			if v := series(t, reg, "narwhal_agent_kv_blocks", "rank", "0"); v != 0 {
				t.Fatalf("narwhal_agent_kv_blocks = %v after the loss, want 0", v)
			}
			// Carried again: a new chain after the loss.
			py.send("map", false, stored([]any{50}, nil, tokens(900, 16), nil))
			testkit.WaitFor(t, waitBound, "the new chain", func() bool {
				k := kb.got.keys(bus.KVStored, bus.KVGPU)
				return len(k) == 2 && k[0] == want[0] && k[1] == prefix.AppendTokenKeys(nil, tokens(900, 16), 16, 0)[0]
			})
		})
	}
}

// TestAgentPublisherRestartRPLACE4 (R-PLACE-4): the publisher restarts
// on its endpoint and counts from 0 again; the agent connects again by
// itself (zmq4 does not), publishes KVCleared for the rank (what the old
// run held is gone) and carries the new run's events.
func TestAgentPublisherRestartRPLACE4(t *testing.T) {
	testkit.CheckLeaks(t)
	kb := startBus(t, "e1")
	py := startPublisher(t)
	pub, _ := py.open(false)
	_, reg := runAgent(t, kb, Config{Sources: []Source{{Rank: 0, Endpoint: pub}}})
	py.subscribed(1)
	evs, want := chainEvents(1, 3, tokens(0, 48))
	py.send("array", false, evs[0])
	py.send("array", false, evs[1])
	py.send("array", false, evs[2])
	testkit.WaitFor(t, waitBound, "the old run's keys", func() bool { return len(kb.got.keys(bus.KVStored, bus.KVGPU)) == 3 })

	py.do(map[string]any{"op": "restart"})
	py.subscribed(1) // the agent's SUB connected to the new run
	fresh := tokens(5000, 16)
	py.send("map", false, stored([]any{1}, nil, fresh, nil))
	testkit.WaitFor(t, waitBound, "KVCleared and the new run's key", func() bool {
		return kb.got.count(bus.KVCleared, 0) == 1 && len(kb.got.keys(bus.KVStored, bus.KVGPU)) == 4
	})
	ops := kb.got.all()
	if ops[len(ops)-2].Op != bus.KVCleared || ops[len(ops)-1].Keys[0] != prefix.AppendTokenKeys(nil, fresh, 16, 0)[0] {
		t.Fatalf("after the restart: %+v, want KVCleared then the new run's key", ops[len(ops)-2:])
	}
	if got := kb.got.keys(bus.KVStored, bus.KVGPU)[:3]; !slices.Equal(got, want) {
		t.Fatalf("old run's keys %x, want %x", got, want)
	}
	if v := series(t, reg, "narwhal_agent_kv_gaps_total", "outcome", gapRestarted); v != 1 {
		t.Fatalf("gaps restarted = %v, want 1", v)
	}
	if v := series(t, reg, "narwhal_agent_kv_connections_total", "outcome", connConnected); v < 2 {
		t.Fatalf("connections = %v, want the first and the one after the restart", v)
	}
	if n := kb.got.count(bus.KVLost, 0); n != 0 {
		t.Fatalf("%d KVLost: a restart from 0 lost nothing of the new run", n)
	}
}

// TestAgentBusAwayRPLACE4 (R-PLACE-4): while the bus is away the agent
// keeps reading its publisher, drops the batches it cannot publish
// (counted; at most Queue wait) instead of blocking or growing, and once
// the bus is back publishes KVLost for the rank, then carries events
// again.
func TestAgentBusAwayRPLACE4(t *testing.T) {
	testkit.CheckLeaks(t)
	dir := bustest.Credentials(t)
	store := t.TempDir()
	ep := freeEndpoint(t)
	port, _ := strconv.Atoi(ep[strings.LastIndex(ep, ":")+1:])
	opts := bus.EmbeddedOptions{Dir: store, Port: port, AuthDir: dir}
	emb := bustest.StartWith(t, opts)
	kb := &kvBus{emb: emb, got: &batches{}}
	kb.engine = bustest.Connect(t, emb, bus.ConnectOptions{Name: "engine-e1", Role: bus.RoleEngine, ID: "e1",
		CredsFile: bustest.Identity(t, dir, bus.RoleEngine, "e1")})
	kb.router = bustest.Connect(t, emb, bus.ConnectOptions{Name: "router-r1", Role: bus.RoleRouter, ID: "r1",
		CredsFile: bustest.Identity(t, dir, bus.RoleRouter, "r1")})
	kb.got.subscribe(t, kb.router.Conn())

	py := startPublisher(t)
	pub, _ := py.open(false)
	_, reg := runAgent(t, kb, Config{Sources: []Source{{Rank: 0, Endpoint: pub}}, Queue: 2})
	py.subscribed(1)
	py.send("array", false, stored([]any{1}, nil, tokens(0, 16), nil))
	testkit.WaitFor(t, waitBound, "the first key", func() bool { return len(kb.got.keys(bus.KVStored, bus.KVGPU)) == 1 })

	emb.Shutdown()
	testkit.WaitFor(t, waitBound, "the agent's bus connection down", func() bool { return !kb.engine.Connected() })
	const away = 20
	for i := 0; i < away; i++ {
		py.send("array", false, stored([]any{100 + i}, nil, tokens(uint32(16*i), 16), nil))
	}
	testkit.WaitFor(t, waitBound, "every message read while the bus is away", func() bool {
		return series(t, reg, "narwhal_agent_kv_messages_total", "outcome", msgApplied) == 1+away
	})
	testkit.WaitFor(t, waitBound, "the batches dropped", func() bool {
		return series(t, reg, "narwhal_agent_kv_batches_total", "outcome", "dropped") >= 1
	})

	emb = bustest.StartWith(t, opts)
	testkit.WaitFor(t, waitBound, "both connections back", func() bool { return kb.engine.Connected() && kb.router.Connected() })
	// The agent may publish before the router's subscription is back:
	// look in NARWHAL_PREFIX, where a router warms up from.
	admin := bustest.Connect(t, emb, bus.ConnectOptions{Name: "admin", CredsFile: bustest.CredsFile(dir, bus.RoleAdmin)})
	testkit.WaitFor(t, waitBound, "KVLost for rank 0 once the bus is back", func() bool {
		return kb.got.count(bus.KVLost, 0) >= 1 || storedLost(t, admin, "e1")
	})
	fresh := tokens(9000, 16)
	py.send("map", false, stored([]any{500}, nil, fresh, nil))
	testkit.WaitFor(t, waitBound, "events carried again", func() bool {
		k := kb.got.keys(bus.KVStored, bus.KVGPU)
		return k[len(k)-1] == prefix.AppendTokenKeys(nil, fresh, 16, 0)[0]
	})
	published := series(t, reg, "narwhal_agent_kv_batches_total", "outcome", "published")
	dropped := series(t, reg, "narwhal_agent_kv_batches_total", "outcome", "dropped")
	t.Logf("batches: %v published, %v dropped", published, dropped)
}

// storedLost reports whether stream NARWHAL_PREFIX holds a batch of
// engineID with a KVLost op of rank 0.
func storedLost(t *testing.T, admin *bus.Bus, engineID string) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	st, err := admin.JetStream().Stream(ctx, bus.PrefixStream)
	if err != nil {
		return false
	}
	info, err := st.Info(ctx)
	if err != nil {
		return false
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && seq > 0; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if err != nil || m.Subject != bus.KVSubject(engineID) {
			continue
		}
		_, ops, err := bus.ParseKVBatch(m.Data)
		if err != nil {
			t.Fatalf("NARWHAL_PREFIX holds a batch the router cannot parse: %v", err)
		}
		for _, o := range ops {
			if o.Op == bus.KVLost && o.Rank == 0 {
				return true
			}
		}
	}
	return false
}

// TestAgentCheckpointsRPLACE4: every Checkpoint the agent restates what
// each rank holds: a KVCleared of the rank followed, in the same batch,
// by every key it knows, by medium (what a router that read the engine's
// batches from their middle needs to be exact). A rank whose events were
// lost is not restated (the agent does not know what it holds) until
// the engine clears it.
func TestAgentCheckpointsRPLACE4(t *testing.T) {
	testkit.CheckLeaks(t)
	kb := startBus(t, "e1")
	py := startPublisher(t)
	pub, _ := py.open(false)
	_, reg := runAgent(t, kb, Config{Sources: []Source{{Rank: 0, Endpoint: pub}}, Checkpoint: 50 * time.Millisecond})
	py.subscribed(1)

	chain := tokens(100, 48)
	keys := prefix.AppendTokenKeys(nil, chain, 16, 0)
	py.send("array", false, stored([]any{1, 2, 3}, nil, chain, nil))
	py.send("map", false, stored([]any{1}, nil, chain[:16], map[string]any{"medium": "CPU_PINNED"}))
	py.send("map", false, removed("GPU", 3))
	restated := func() (gpu, cpu []uint64, ok bool) {
		ops := kb.got.all()
		last := -1
		for i, e := range ops {
			if e.Op == bus.KVCleared && e.Rank == 0 {
				last = i
			}
		}
		if last < 0 {
			return nil, nil, false
		}
		for _, e := range ops[last+1:] {
			if e.Op != bus.KVStored {
				return nil, nil, false
			}
			switch e.Medium {
			case bus.KVGPU:
				gpu = append(gpu, e.Keys...)
			case bus.KVCPU:
				cpu = append(cpu, e.Keys...)
			}
		}
		slices.Sort(gpu)
		return gpu, cpu, len(gpu) == 2 && len(cpu) == 1
	}
	testkit.WaitFor(t, waitBound, "a checkpoint of the two GPU blocks and the CPU one", func() bool { _, _, ok := restated(); return ok })
	gpu, cpu, _ := restated()
	want := slices.Clone(keys[:2])
	slices.Sort(want)
	if !slices.Equal(gpu, want) || cpu[0] != keys[0] {
		t.Fatalf("checkpoint: GPU %x CPU %x, want GPU %x CPU %x", gpu, cpu, want, keys[:1])
	}
	// One batch holds the clear and the keys: a router never applies the
	// clear without them.
	ops, in := kb.got.all(), kb.got.batchIndexes()
	last := -1
	for i, e := range ops {
		if e.Op == bus.KVCleared {
			last = i
		}
	}
	for i := last; i < len(ops) && i < len(in); i++ {
		if in[i] != in[last] {
			t.Fatalf("the checkpoint's ops span batches %d and %d", in[last], in[i])
		}
	}
	if v := series(t, reg, "narwhal_agent_kv_checkpoints_total", "rank", "0", "outcome", "published"); v < 1 {
		t.Fatalf("checkpoints published = %v", v)
	}

	// A gap without a replay socket: the rank is lost, not restated.
	py.send("array", true, stored([]any{9}, nil, chain[:16], nil))
	py.send("array", false, stored([]any{10}, nil, chain[:16], nil))
	testkit.WaitFor(t, waitBound, "the KVLost", func() bool { return kb.got.count(bus.KVLost, 0) == 1 })
	testkit.WaitFor(t, waitBound, "checkpoints skipped for the lost rank", func() bool {
		return series(t, reg, "narwhal_agent_kv_checkpoints_total", "rank", "0", "outcome", "skipped_lost") >= 2
	})
	ops = kb.got.all()
	for i := len(ops) - 1; i >= 0 && ops[i].Op != bus.KVLost; i-- {
		if ops[i].Op == bus.KVCleared {
			t.Fatalf("a checkpoint of a lost rank was published: %+v", ops[i:])
		}
	}
	py.send("map", false, map[string]any{"type": "AllBlocksCleared"})
	clears := kb.got.count(bus.KVCleared, 0)
	testkit.WaitFor(t, waitBound, "checkpoints again after the clear", func() bool { return kb.got.count(bus.KVCleared, 0) >= clears+2 })
}
