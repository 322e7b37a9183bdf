package meshview

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/engines"
	livefleet "github.com/narwhalmesh/narwhal/fleet"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/schemas"
)

// kvWait bounds every wait on the bus of these tests.
const kvWait = 5 * time.Second

// kvMesh is a bus that enforces the mesh's credentials, with the
// credentials' directory: routers and engines connect with their own.
type kvMesh struct {
	t   *testing.T
	emb *bus.Embedded
	dir string
}

func newKVMesh(t *testing.T) *kvMesh {
	dir := bustest.Credentials(t)
	return &kvMesh{t: t, dir: dir, emb: bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, AuthDir: dir})}
}

// connect connects kind's process id (bus.RoleEngine, bus.RoleRouter)
// with its own credential.
func (k *kvMesh) connect(kind, id string) *bus.Bus {
	return bustest.Connect(k.t, k.emb, bus.ConnectOptions{Name: kind + "-" + id,
		CredsFile: bustest.Identity(k.t, k.dir, kind, id), Role: kind, ID: id})
}

// join starts a router's view over prefixFleet (its id rt-test, as every
// stack's) joined to k with its own credential, and waits for the first
// warm-up's end; before, when set, is applied to the view before it joins.
func (k *kvMesh) join(before func(*View)) *stack {
	s := newStack(k.t, prefixFleet(), nil)
	s.waitModels()
	if before != nil {
		before(s.v)
	}
	own := k.connect(bus.RoleRouter, s.cfg.Router.ID)
	if err := s.v.Join(own, 500*time.Millisecond); err != nil {
		k.t.Fatal(err)
	}
	if err := own.Conn().Flush(); err != nil {
		k.t.Fatal(err)
	}
	return s
}

// kvAgent publishes an engine's KV batches as `narwhal agent` does, on
// its own subject with its own credential.
type kvAgent struct {
	t     *testing.T
	b     *bus.Bus
	id    string
	epoch uint64
	seq   uint64
	batch bus.KVBatch
}

func (k *kvMesh) agent(id string, epoch uint64) *kvAgent {
	return &kvAgent{t: k.t, b: k.connect(bus.RoleEngine, id), id: id, epoch: epoch}
}

// kvOp is one op of a batch.
type kvOp struct {
	op     bus.KVOp
	rank   int
	medium bus.KVMedium
	keys   []uint64
}

// send publishes the agent's next batch of ops and flushes.
func (a *kvAgent) send(ops ...kvOp) {
	a.t.Helper()
	a.seq++
	a.publishAs(a.id, a.epoch, a.seq, ops...)
}

// publishAs publishes a batch naming engine named, epoch and seq on the
// agent's own subject.
func (a *kvAgent) publishAs(named string, epoch, seq uint64, ops ...kvOp) {
	a.t.Helper()
	a.batch.Reset(named, epoch, seq, 16)
	for _, o := range ops {
		if !a.batch.Add(o.op, o.rank, o.medium, o.keys) {
			a.t.Fatalf("op %+v not added", o)
		}
	}
	if err := a.b.Conn().Publish(bus.KVSubject(a.id), a.batch.Bytes()); err != nil {
		a.t.Fatal(err)
	}
	if err := a.b.Conn().Flush(); err != nil {
		a.t.Fatal(err)
	}
}

func stored(keys []uint64) kvOp  { return kvOp{op: bus.KVStored, keys: keys} }
func removed(keys []uint64) kvOp { return kvOp{op: bus.KVRemoved, keys: keys} }
func cleared() kvOp              { return kvOp{op: bus.KVCleared} }
func lost() kvOp                 { return kvOp{op: bus.KVLost} }

// tokenChain returns the keys of n blocks of 16 tokens seeded by seed,
// and the tokens.
func tokenChain(seed uint32, n int) ([]uint64, []uint32) {
	tokens := make([]uint32, 16*n)
	for i := range tokens {
		tokens[i] = seed*100000 + uint32(i)
	}
	return prefix.AppendTokenKeys(nil, tokens, 16, 0), tokens
}

// gpuMatch is what s's exact index matches of keys on engine id, -1 when
// the engine's index is not exact.
func gpuMatch(s *stack, id string, keys []uint64) int {
	m, ok := s.v.MatchExact(id, keys)
	if !ok {
		return -1
	}
	return m.GPU
}

// kvCount is narwhal_kv_batches_total{outcome}.
func kvCount(t *testing.T, s *stack, outcome string) float64 {
	return testkit.GatheredSum(t, s.reg, "narwhal_kv_batches_total", "outcome", outcome)
}

// TestRouterAppliesEngineKVBatchesRPLACE4: over a bus that enforces the
// credentials, engine p1's agent publishes under its own credential and
// the router's exact index follows it: stored blocks match, removed ones
// stop the match, KVLost makes the engine inexact until a KVCleared, a
// seq gap the stream cannot fill drops it (counted gap), and an agent's
// new run read from its first batch is exact again and holds nothing of
// the last; narwhal_prefix_index_blocks{index="exact"} and
// narwhal_prefix_exact_engines report it.
func TestRouterAppliesEngineKVBatchesRPLACE4(t *testing.T) {
	k := newKVMesh(t)
	s := k.join(nil)
	a := k.agent("p1", 11)
	keys, _ := tokenChain(1, 12)
	wait := func(what string, want int) {
		t.Helper()
		testkit.WaitFor(t, kvWait, what, func() bool { return gpuMatch(s, "p1", keys) == want })
	}
	a.send(stored(keys[:8]))
	wait("8 stored blocks to match", 8)
	if n := testkit.GatheredSum(t, s.reg, "narwhal_prefix_index_blocks", "engine", "p1", "index", "exact"); n != 8 {
		t.Errorf("narwhal_prefix_index_blocks{p1,exact} = %v, want 8", n)
	}
	if n := testkit.GatheredSum(t, s.reg, "narwhal_prefix_exact_engines"); n != 1 {
		t.Errorf("narwhal_prefix_exact_engines = %v, want 1", n)
	}
	a.send(removed(keys[5:6]))
	wait("block 5 removed to stop the match", 5)
	a.send(lost())
	wait("KVLost to make p1 inexact", -1)
	a.send(stored(keys[:10]))
	a.send(cleared(), stored(keys[:3]))
	wait("KVCleared to make p1 exact again", 3)

	// A gap the stream cannot fill: seq 9 and 10 were never published.
	a.seq += 2
	a.send(stored(keys[:6]))
	wait("a gap to drop p1", -1)
	if n := kvCount(t, s, "gap"); n != 1 {
		t.Errorf("gap batches %v, want 1", n)
	}
	a.epoch, a.seq = 12, 0
	a.send(stored(keys[6:9]))
	wait("a new run from its first batch: exact, nothing of the last run", 0)
	if n := s.v.ExactIndex().Lookup("p1").Blocks(); n != 3 {
		t.Fatalf("p1 holds %d blocks after a new run's first batch, want its 3", n)
	}
	if n := kvCount(t, s, "applied"); n != 7 {
		t.Errorf("applied %v batches, want 7", n)
	}

	// Gap after gap (a hostile credential's flood): every one counted,
	// one log line.
	for range 20 {
		a.seq += 2
		a.send(stored(keys[:6]))
	}
	testkit.WaitFor(t, kvWait, "21 gaps counted", func() bool { return kvCount(t, s, "gap") == 21 })
	if n := strings.Count(s.log.String(), "KV batches missed"); n != 1 {
		t.Errorf("%d log lines for 21 gaps of one engine within %v, want 1", n, shareLogEvery)
	}
}

// TestForgedKVBatchesRefusedRPLACE4 (R-BUS-11, R-BUS-9): engine p1's
// credential cannot publish on p2's subject (the server refuses it,
// nothing reaches the router); a batch naming p2 on p1's own subject is
// refused as refused_id_mismatch; garbage as refused_invalid; the
// batches of an engine outside the fleet (its own credential, its own
// subject) are ignored as unknown_engine and make no entry. p1's own
// batch, after them, applies.
func TestForgedKVBatchesRefusedRPLACE4(t *testing.T) {
	k := newKVMesh(t)
	s := k.join(nil)
	p1 := k.agent("p1", 5)
	keys, _ := tokenChain(2, 6)
	var b bus.KVBatch
	b.Reset("p2", 5, 1, 16)
	b.Add(bus.KVStored, 0, bus.KVGPU, keys)
	_ = p1.b.Conn().Publish(bus.KVSubject("p2"), b.Bytes())
	testkit.WaitFor(t, kvWait, "the server's permissions violation", func() bool {
		err := p1.b.PermissionError()
		return err != nil && errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), bus.KVSubject("p2"))
	})
	p1.publishAs("p2", 5, 1, stored(keys))
	if err := p1.b.Conn().Publish(bus.KVSubject("p1"), []byte("NWK1 garbage")); err != nil {
		t.Fatal(err)
	}
	p9 := k.agent("p9", 5)
	p9.send(stored(keys))
	testkit.WaitFor(t, kvWait, "the batches to be judged", func() bool {
		return kvCount(t, s, "refused_id_mismatch") == 1 && kvCount(t, s, "refused_invalid") == 1 && kvCount(t, s, "unknown_engine") == 1
	})
	for _, id := range []string{"p2", "p9"} {
		if e := s.v.ExactIndex().Lookup(id); e != nil && (e.Blocks() > 0 || e.Exact()) {
			t.Fatalf("%s: %d blocks, exact %v, from forged batches", id, e.Blocks(), e.Exact())
		}
	}
	if s.v.ExactIndex().Lookup("p9") != nil {
		t.Fatal("an engine outside the fleet has an entry")
	}
	if n := kvCount(t, s, "applied"); n != 0 {
		t.Fatalf("applied %v batches, want none", n)
	}
	p1.send(stored(keys))
	testkit.WaitFor(t, kvWait, "p1's own batch to apply", func() bool { return gpuMatch(s, "p1", keys) == 6 })
}

// TestExactIndexWarmedAfterRestartRPLACE4: a router that starts after an
// engine's agent published (its run from the first batch) warms its
// exact index from stream NARWHAL_PREFIX: it holds what was stored and
// not what was removed, and is exact; the batches that follow apply live.
func TestExactIndexWarmedAfterRestartRPLACE4(t *testing.T) {
	k := newKVMesh(t)
	a := k.agent("p1", 21)
	keys, _ := tokenChain(3, 10)
	other, _ := tokenChain(4, 4)
	a.send(stored(keys[:7]))
	a.send(stored(other))
	a.send(removed(other[2:]), removed(keys[6:7]))
	// The stream holds the three batches before the router starts.
	admin := bustest.Connect(t, k.emb, bus.ConnectOptions{Name: "admin", CredsFile: bustest.CredsFile(k.dir, bus.RoleAdmin)})
	testkit.WaitFor(t, kvWait, "the stream to hold p1's batches", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		m, err := admin.JetStream().Stream(ctx, bus.PrefixStream)
		if err != nil {
			return false
		}
		msg, err := m.GetLastMsgForSubject(ctx, bus.KVSubject("p1"))
		if err != nil {
			return false
		}
		h, err := bus.CheckKVBatch(msg.Data)
		return err == nil && h.Seq == 3
	})
	s := k.join(nil)
	testkit.WaitFor(t, kvWait, "the warm-up to apply p1's batches", func() bool { return gpuMatch(s, "p1", keys) == 6 })
	if m, _ := s.v.MatchExact("p1", other); m.GPU != 2 {
		t.Fatalf("the other chain matches %d blocks, want the 2 not removed", m.GPU)
	}
	if n := s.v.ExactIndex().Lookup("p1").Blocks(); n != 8 {
		t.Fatalf("p1 holds %d blocks, want 8 (6 + 2)", n)
	}
	a.send(stored(keys[6:9]))
	testkit.WaitFor(t, kvWait, "a live batch after the warm-up", func() bool { return gpuMatch(s, "p1", keys) == 9 })
}

// TestKVGapFilledFromTheStreamRPLACE4: a live batch after batches the
// router missed (its subscription did not deliver them; the stream holds
// them) is preceded by them, read back from NARWHAL_PREFIX: the engine
// stays exact and nothing is counted as a gap.
func TestKVGapFilledFromTheStreamRPLACE4(t *testing.T) {
	k := newKVMesh(t)
	s := newStack(t, prefixFleet(), nil)
	s.waitModels()
	own := k.connect(bus.RoleRouter, s.cfg.Router.ID)
	kv := newKVShare(s.v) // not subscribed: the test hands it the live batches
	sub, err := own.Conn().SubscribeSync(bus.KVSubjectPrefix + "*")
	if err != nil {
		t.Fatal(err)
	}
	if err := own.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	a := k.agent("p1", 31)
	keys, _ := tokenChain(5, 10)
	for i := range 5 {
		a.send(stored(keys[2*i : 2*i+2]))
	}
	var msgs []*nats.Msg
	for range 5 {
		m, err := sub.NextMsg(kvWait)
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, m)
	}
	kv.receive(own, msgs[0])
	// The stream may take the last batch a moment after the subscription
	// delivered it.
	testkit.WaitFor(t, kvWait, "the stream to hold p1's fifth batch", func() bool {
		st, err := own.JetStream().Stream(context.Background(), bus.PrefixStream)
		return err == nil && st.CachedInfo().State.LastSeq >= 5
	})
	kv.receive(own, msgs[4]) // 2, 3 and 4 missed live
	if got := gpuMatch(s, "p1", keys); got != 10 {
		t.Fatalf("after the fill: match %d, want 10, exact", got)
	}
	if n := kvCount(t, s, "gap"); n != 0 {
		t.Fatalf("%v gaps counted, want 0: the stream filled it", n)
	}
	if n := kvCount(t, s, "applied"); n != 5 {
		t.Fatalf("applied %v, want 5", n)
	}
}

// TestExactIndexDroppedWithTheEngineRPLACE4: an engine that is ejected,
// starts draining or is replaced in the fleet (another URL: another
// process) has its exact index dropped (placed by the approximate index
// until a KVCleared), counted by reason; a KVCleared after it makes it
// exact again.
func TestExactIndexDroppedWithTheEngineRPLACE4(t *testing.T) {
	k := newKVMesh(t)
	s := k.join(nil)
	keys, _ := tokenChain(6, 4)
	agents := map[string]*kvAgent{}
	for _, id := range []string{"p1", "p2", "p3"} {
		agents[id] = k.agent(id, 41)
		agents[id].send(stored(keys))
	}
	testkit.WaitFor(t, kvWait, "every engine exact", func() bool {
		return gpuMatch(s, "p1", keys) == 4 && gpuMatch(s, "p2", keys) == 4 && gpuMatch(s, "p3", keys) == 4
	})
	s.v.setEligibility("p1", false, "test")
	p2 := s.v.Fleet().Member("p2")
	e := *p2.entry.Load()
	e.State = schemas.FleetDraining
	p2.SetEntry(e)
	p3 := s.v.Fleet().Member("p3")
	entry := *p3.entry.Load()
	entry.URL = s.sims["p1"].URL() // another process behind p3's id
	s.v.replaceForTest(t, entry)
	for _, id := range []string{"p1", "p2", "p3"} {
		testkit.WaitFor(t, kvWait, id+" dropped", func() bool { return gpuMatch(s, id, keys) == -1 })
	}
	for _, r := range []string{"ejected", "inactive", "restarted"} {
		if n := testkit.GatheredSum(t, s.reg, "narwhal_prefix_exact_drops_total", "reason", r); n != 1 {
			t.Errorf("%v exact drops for %s, want 1", n, r)
		}
	}
	agents["p1"].send(stored(keys))
	agents["p3"].send(cleared(), stored(keys[:2]))
	testkit.WaitFor(t, kvWait, "p3 exact after a KVCleared", func() bool { return gpuMatch(s, "p3", keys) == 2 })
	if gpuMatch(s, "p1", keys) != -1 {
		t.Fatal("p1 exact again without a KVCleared")
	}
}

// BenchmarkKVBatchApply is one live KV batch (64 stored keys, then 64
// removed, one engine) checked and applied to the exact index, steady
// state. Target: 0 allocs/op.
func BenchmarkKVBatchApply(b *testing.B) {
	s := newStack(b, prefixFleet(), nil)
	kv := newKVShare(s.v)
	keys, _ := tokenChain(7, 64)
	var st, rm bus.KVBatch
	seq := uint64(0)
	at := time.Now()
	b.ReportAllocs()
	for b.Loop() {
		seq++
		st.Reset("p1", 1, seq, 16)
		st.Add(bus.KVStored, 0, bus.KVGPU, keys)
		kv.apply("narwhal.kv.p1", st.Bytes(), at, false)
		seq++
		rm.Reset("p1", 1, seq, 16)
		rm.Add(bus.KVRemoved, 0, bus.KVGPU, keys)
		kv.apply("narwhal.kv.p1", rm.Bytes(), at, false)
	}
	if !s.v.ExactIndex().Lookup("p1").Exact() {
		b.Fatal("p1 not exact")
	}
}

// BenchmarkKVBatchLatency measures how long an engine's batch takes from
// its agent's publish to the router's exact index (over an embedded NATS
// on loopback, the credentials enforced): p50 and p99 in ms. Target: p99
// within 100 ms.
func BenchmarkKVBatchLatency(b *testing.B) {
	dir := bustest.Credentials(b)
	emb := bustest.StartWith(b, bus.EmbeddedOptions{Dir: b.TempDir(), Port: -1, AuthDir: dir})
	connect := func(kind, id string) *bus.Bus {
		return bustest.Connect(b, emb, bus.ConnectOptions{Name: kind + "-" + id, CredsFile: bustest.Identity(b, dir, kind, id), Role: kind, ID: id})
	}
	s := newStack(b, prefixFleet(), nil)
	s.waitModels()
	if err := s.v.Join(connect(bus.RoleRouter, s.cfg.Router.ID), 500*time.Millisecond); err != nil {
		b.Fatal(err)
	}
	eng := connect(bus.RoleEngine, "p1")
	keys, _ := tokenChain(8, 4096)
	var batch bus.KVBatch
	var lat []time.Duration
	seq := uint64(0)
	for i := 0; b.Loop(); i++ {
		seq++
		batch.Reset("p1", 1, seq, 16)
		k := keys[i%len(keys) : i%len(keys)+1]
		batch.Add(bus.KVStored, 0, bus.KVGPU, k)
		start := time.Now()
		if err := eng.Conn().Publish(bus.KVSubject("p1"), batch.Bytes()); err != nil {
			b.Fatal(err)
		}
		for s.v.ExactIndex().Lookup("p1") == nil || s.v.ExactIndex().Lookup("p1").Check(1, seq) != prefix.SeqDuplicate {
			if time.Since(start) > kvWait {
				b.Fatal("a batch did not reach the index")
			}
			time.Sleep(20 * time.Microsecond)
		}
		lat = append(lat, time.Since(start))
	}
	reportLatencies(b, lat)
}

// reportLatencies reports a latency benchmark's p50 and p99 of lat (in
// ms, as p50-ms and p99-ms); lat is sorted in place.
func reportLatencies(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2])/1e6, "p50-ms")
	b.ReportMetric(float64(lat[min(len(lat)-1, len(lat)*99/100)])/1e6, "p99-ms")
}

// replaceForTest applies entry to the view as the live fleet's watch
// does: an entry of another spec builds the engine anew.
func (v *View) replaceForTest(t *testing.T, entry schemas.FleetEntry) {
	t.Helper()
	eng, err := engines.FromFleetEntry(entry)
	if err != nil {
		t.Fatal(err)
	}
	v.applyFleetValue(livefleet.Change{ID: entry.EngineID, Entry: entry, Engine: eng})
}

// TestWarmUpOfLargeKVBatchesRPLACE4: an engine that fills stream
// NARWHAL_PREFIX with the largest batches (600 of 192 KiB: 115 MiB, more
// than the 64 MiB the server queues for one client) does not cut a
// starting router off its bus: the warm-up reads every batch once, in
// one go, and the router's connection is never dropped (a pull of 1,024
// such batches made the server drop the router as a slow consumer, and
// the router read the stream again on every reconnection).
func TestWarmUpOfLargeKVBatchesRPLACE4(t *testing.T) {
	k := newKVMesh(t)
	p1 := k.agent("p1", 5)
	big := make([]uint64, bus.KVMaxKeys)
	for i := range big {
		big[i] = uint64(i + 1)
	}
	const n = 600
	for range n {
		p1.send(stored(big), stored(big), stored(big))
	}
	// 115 MiB through the race detector, with other test packages on
	// two cores, took the warm-up past its 10 s limit in CI: the limits
	// here guard against a hang, not for speed (BenchmarkKVBatchApply
	// and the warm-up's rate are measured apart).
	s := k.join(func(v *View) { v.warmLimit = time.Minute })
	testkit.WaitFor(t, time.Minute, "the warm-up to read every batch", func() bool {
		return testkit.GatheredSum(t, s.reg, "narwhal_prefix_warmup_batches_total", "outcome", "read") >= n
	})
	if got := testkit.GatheredSum(t, s.reg, "narwhal_prefix_warmup_batches_total", "outcome", "read"); got != n {
		t.Fatalf("the warm-ups read %v batches, want %d once", got, n)
	}
	if got := testkit.GatheredSum(t, s.reg, "narwhal_prefix_warmup_batches_total", "outcome", "missed"); got != 0 {
		t.Fatalf("%v batches missed", got)
	}
	if got := kvCount(t, s, "applied"); got != n {
		t.Fatalf("applied %v batches, want %d", got, n)
	}
	if got := kvCount(t, s, "duplicate"); got != 0 {
		t.Fatalf("%v batches read twice", got)
	}
	if nc := s.v.meshBus.Load().Conn(); nc.Stats().Reconnects != 0 || !nc.IsConnected() {
		t.Fatalf("the router's connection: %d reconnections, connected %v", nc.Stats().Reconnects, nc.IsConnected())
	}
}

// TestExactAgainFromACheckpointRPLACE4: a router that starts when the
// stream no longer holds the start of an agent's run (the run began more
// than the stream's 10 minutes ago, or another engine's flood of large
// batches pushed its first batches out of the stream's 256 MiB; here the
// stream holds p2's batches from seq 41 on) is not exact for p2 — it
// cannot vouch for what p2 holds — until p2's agent restates its blocks
// (a checkpoint: a KVCleared of the rank and every block, `narwhal agent
// --kv-events-checkpoint`); then it is, with exactly those blocks, and
// p2's next batches apply on top.
func TestExactAgainFromACheckpointRPLACE4(t *testing.T) {
	k := newKVMesh(t)
	p2 := k.agent("p2", 7)
	p2.seq = 40
	keys, _ := tokenChain(9, 10)
	p2.send(stored(keys[:6]))
	p2.send(removed(keys[4:6]))
	p2.send(stored(keys[4:5]))
	s := k.join(nil)
	testkit.WaitFor(t, kvWait, "the warm-up to read p2's batches", func() bool { return kvCount(t, s, "applied") == 3 })
	if got := gpuMatch(s, "p2", keys); got != -1 {
		t.Fatalf("p2 read from the middle of its run matches %d blocks exactly, want not exact", got)
	}
	p2.send(cleared(), stored(keys[:5]))
	testkit.WaitFor(t, kvWait, "p2 exact from its checkpoint", func() bool { return gpuMatch(s, "p2", keys) == 5 })
	if n := s.v.ExactIndex().Lookup("p2").Blocks(); n != 5 {
		t.Fatalf("p2 holds %d blocks, want the checkpoint's 5", n)
	}
	p2.send(stored(keys[5:8]))
	testkit.WaitFor(t, kvWait, "a batch after the checkpoint", func() bool { return gpuMatch(s, "p2", keys) == 8 })
}
