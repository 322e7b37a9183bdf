package meshview

import (
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/prefix"
)

// clock is a settable time for the load exchange's tests.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func report(routerID string, entries ...func(*bus.LoadReport)) []byte {
	var r bus.LoadReport
	r.Reset(routerID)
	for _, e := range entries {
		e(&r)
	}
	return append([]byte(nil), r.Bytes()...)
}

func entry(engineID string, prefill, decode, tokens int64) func(*bus.LoadReport) {
	return func(r *bus.LoadReport) { r.Add(engineID, prefill, decode, tokens) }
}

// TestLoadExchangeSumsAndForgetsStaleRPLACE3 proves the load exchange's
// receiving side with an injected clock: the other routers' reports are
// summed per engine into the members; a router not heard from for the
// stale bound stops counting (and one heard again counts again); an
// empty report drops the router at once; a report whose router id is not
// its subject's, or a malformed one, changes nothing and is counted.
func TestLoadExchangeSumsAndForgetsStaleRPLACE3(t *testing.T) {
	s := newStack(t, pd(), nil)
	clk := &clock{now: time.Unix(1000, 0)}
	ls := newLoadShare(s.v)
	ls.now = clk.Now
	p1, d1 := s.v.Fleet().Member("p1"), s.v.Fleet().Member("d1")

	ls.apply(bus.LoadSubject("r2"), report("r2", entry("p1", 3, 0, 3000), entry("d1", 0, 5, 0), entry("nope", 9, 9, 9)))
	clk.Add(600 * time.Millisecond)
	ls.apply(bus.LoadSubject("r3"), report("r3", entry("p1", 2, 0, 1000)))
	if p1.MeshReserved(Prefill) != 5 || p1.MeshTokens() != 4000 || d1.MeshReserved(Decode) != 5 {
		t.Fatalf("sums: p1 %d legs %d tokens, d1 %d decode legs", p1.MeshReserved(Prefill), p1.MeshTokens(), d1.MeshReserved(Decode))
	}
	// Own reservations add to the peers'.
	p1.TryReserve(Prefill)
	p1.AddTokens(50)
	if p1.MeshReserved(Prefill) != 6 || p1.MeshTokens() != 4050 {
		t.Fatalf("with this router's own: %d, %d", p1.MeshReserved(Prefill), p1.MeshTokens())
	}
	p1.Release(Prefill)
	p1.AddTokens(-50)

	// r2 was heard 600 ms ago: still counts just before the bound.
	clk.Add(399 * time.Millisecond)
	ls.expire(clk.Now())
	if p1.MeshTokens() != 4000 {
		t.Fatalf("before the bound: %d tokens", p1.MeshTokens())
	}
	clk.Add(time.Millisecond) // r2 silent for 1 s: forgotten
	ls.expire(clk.Now())
	if p1.MeshReserved(Prefill) != 2 || p1.MeshTokens() != 1000 || d1.MeshReserved(Decode) != 0 {
		t.Fatalf("r2 stale: p1 %d legs %d tokens, d1 %d", p1.MeshReserved(Prefill), p1.MeshTokens(), d1.MeshReserved(Decode))
	}
	ls.apply(bus.LoadSubject("r2"), report("r2", entry("p1", 1, 0, 10)))
	if p1.MeshTokens() != 1010 {
		t.Fatalf("r2 heard again: %d tokens", p1.MeshTokens())
	}
	ls.apply(bus.LoadSubject("r3"), report("r3")) // r3 idle now
	if p1.MeshTokens() != 10 {
		t.Fatalf("r3's empty report: %d tokens", p1.MeshTokens())
	}

	// Hostile: another router's id on r2's subject, garbage, this router's own.
	ls.apply(bus.LoadSubject("r2"), report("r4", entry("p1", 100, 0, 1e6)))
	ls.apply(bus.LoadSubject("r2"), []byte("NWL1 garbage"))
	ls.apply(bus.LoadSubject(s.v.id), report(s.v.id, entry("p1", 100, 0, 1e6)))
	if p1.MeshTokens() != 10 {
		t.Fatalf("after hostile reports: %d tokens", p1.MeshTokens())
	}
	if n := testkit.GatheredSum(t, s.reg, "narwhal_load_reports_ignored_total", "reason", "router_id_mismatch"); n != 1 {
		t.Fatalf("router_id_mismatch %v", n)
	}
	if n := testkit.GatheredSum(t, s.reg, "narwhal_load_reports_ignored_total", "reason", "invalid"); n != 1 {
		t.Fatalf("invalid %v", n)
	}
}

// TestLoadExchangePublishesOnChangeRPLACE3: a router publishes its report
// when its work changed, again every heartbeat while it has work, one
// empty report when the work went, and nothing while idle.
func TestLoadExchangePublishesOnChangeRPLACE3(t *testing.T) {
	s := newStack(t, pd(), nil)
	clk := &clock{now: time.Unix(1000, 0)}
	ls := newLoadShare(s.v)
	ls.now = clk.Now
	var sent [][]byte
	pub := func(subject string, data []byte) error {
		if subject != bus.LoadSubject(s.v.id) {
			t.Fatalf("published on %s", subject)
		}
		sent = append(sent, append([]byte(nil), data...))
		return nil
	}
	tick := func() { clk.Add(loadEvery); ls.tick(pub) }
	tick()
	if len(sent) != 1 {
		t.Fatalf("first tick: %d reports (the empty one: nothing was published before)", len(sent))
	}
	tick()
	tick()
	if len(sent) != 1 {
		t.Fatalf("idle: %d reports, want none more", len(sent))
	}
	p1 := s.v.Fleet().Member("p1")
	p1.TryReserve(Prefill)
	p1.AddTokens(700)
	tick()
	if len(sent) != 2 {
		t.Fatalf("after a reservation: %d reports", len(sent))
	}
	var got []loadEntryT
	if _, err := bus.ParseLoadReport(sent[1], func(e []byte, l bus.EngineLoad) {
		got = append(got, loadEntryT{string(e), l.Prefill, l.Decode, l.Tokens})
	}); err != nil || len(got) != 1 || got[0] != (loadEntryT{"p1", 1, 0, 700}) {
		t.Fatalf("report %v %v", got, err)
	}
	for range int(loadHeartbeat / loadEvery) {
		tick()
	}
	if len(sent) != 3 {
		t.Fatalf("unchanged work for a heartbeat: %d reports, want the heartbeat", len(sent))
	}
	p1.Release(Prefill)
	p1.AddTokens(-700)
	tick()
	tick()
	if len(sent) != 4 {
		t.Fatalf("after the release: %d reports, want one empty one", len(sent))
	}
	if _, err := bus.ParseLoadReport(sent[3], func([]byte, bus.EngineLoad) { t.Fatal("an entry in the empty report") }); err != nil {
		t.Fatal(err)
	}
}

// newBenchStack is a view of prefill engines p1…p3 and decode engine d1
// that nothing serves: the load exchange reads only its members.
func newBenchStack(b *testing.B) *View {
	cfg := config.Default()
	cfg.Router.ID = "rt-bench"
	for _, id := range []string{"p1", "p2", "p3", "d1"} {
		role := connector.RolePrefill
		if id == "d1" {
			role = connector.RoleDecode
		}
		cfg.Fleet = append(cfg.Fleet, config.EngineSpec{ID: id, URL: "http://127.0.0.1:9", Role: role, Connector: "nixl"})
	}
	if err := cfg.Validate(); err != nil {
		b.Fatal(err)
	}
	v, err := New(Options{Config: &cfg, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	return v
}

type loadEntryT struct {
	id      string
	p, d, k int64
}

// joinedPair returns two routers, rt-a and rt-b, over prefixFleet, each
// joined to one server of a real embedded NATS mesh.
func joinedPair(t *testing.T) (a, b *stack) {
	t.Helper()
	m := newMeshBus(t)
	a = newStack(t, prefixFleet(), func(c *config.Config) { c.Router.ID = "rt-a" })
	b = newStack(t, prefixFleet(), func(c *config.Config) { c.Router.ID = "rt-b" })
	a.waitModels()
	b.waitModels()
	if err := a.v.Join(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := b.v.Join(m.Peer, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	_ = m.B.Conn().Flush()
	_ = m.Peer.Conn().Flush()
	return a, b
}

// TestLoadExchangeVisibleWithin100msRPLACE3: over a real embedded NATS,
// a reservation made on one router is seen by another router's
// placement (the member's mesh counts) within 100 ms, and its release
// too.
func TestLoadExchangeVisibleWithin100msRPLACE3(t *testing.T) {
	a, b := joinedPair(t)
	pa, pb := a.v.Fleet().Member("p2"), b.v.Fleet().Member("p2")
	for round := range 3 {
		pa.TryReserve(Prefill)
		pa.AddTokens(1234)
		start := time.Now()
		testkit.WaitFor(t, time.Second, "router b to see a's reservation", func() bool { return pb.MeshTokens() == 1234 && pb.MeshReserved(Prefill) == 1 })
		if took := time.Since(start); took > 100*time.Millisecond {
			t.Fatalf("round %d: router b saw a's reservation after %v, want within 100 ms", round, took)
		}
		// With the counts comes the head: b has no attempt of its own
		// there, and still knows how long a's has been in flight.
		if h := pb.Head(time.Now().UnixNano()); h.Age <= 0 || h.Age > time.Since(start)+time.Second {
			t.Fatalf("round %d: router b's head of p2 is %+v, want a's age", round, h)
		}
		pa.Release(Prefill)
		pa.AddTokens(-1234)
		start = time.Now()
		testkit.WaitFor(t, time.Second, "router b to see a's release", func() bool { return pb.MeshTokens() == 0 && pb.MeshReserved(Prefill) == 0 })
		if took := time.Since(start); took > 100*time.Millisecond {
			t.Fatalf("round %d: router b saw a's release after %v, want within 100 ms", round, took)
		}
	}
}

// TestHeadSharedByTheMeshRPLACE3 proves the head of an engine's queue
// as the mesh knows it (Member.Head over the other routers' reports):
// another router's busy start counts where this router has no attempt
// (its cold prefill is then not counted half done); the later of the
// mesh's last end and the earliest busy start is the head's start; the
// pace is this router's own, the other routers' mean until it has one;
// a router that reports no head (an older one) leaves the zero Progress,
// and the head goes with the reports.
func TestHeadSharedByTheMeshRPLACE3(t *testing.T) {
	s, clk, ls := clockedLoadShare(t)
	p1 := s.v.Fleet().Member("p1")
	head := func(want prefix.Progress) {
		t.Helper()
		if got := p1.Head(clk.Now().UnixNano()); got != want {
			t.Fatalf("head %+v, want %+v", got, want)
		}
	}
	withHead := func(id string, l bus.EngineLoad) func(*bus.LoadReport) {
		return func(r *bus.LoadReport) { r.Append(id, l) }
	}
	ms := time.Millisecond
	head(prefix.Progress{})
	ls.apply(bus.LoadSubject("r5"), report("r5", entry("p1", 1, 0, 700)))
	head(prefix.Progress{}) // no head reported: the cost's half done
	ls.apply(bus.LoadSubject("r2"), report("r2", withHead("p1", bus.EngineLoad{Prefill: 2, Tokens: 1000, HeadBusy: 300 * ms, PaceMean: 400 * ms, PaceTokens: 500})))
	head(prefix.Progress{Age: 300 * ms, Mean: 400 * ms, MeanTokens: 500})
	clk.Add(20 * ms)
	head(prefix.Progress{Age: 320 * ms, Mean: 400 * ms, MeanTokens: 500})
	// r3's prefill there ended 50 ms ago: the next in line began then.
	ls.apply(bus.LoadSubject("r3"), report("r3", withHead("p1", bus.EngineLoad{Prefill: 1, Tokens: 300, HeadBusy: 100 * ms, HeadEnd: 50 * ms, PaceMean: 200 * ms, PaceTokens: 300})))
	head(prefix.Progress{Age: 50 * ms, Mean: 300 * ms, MeanTokens: 400})
	// This router's own attempt, queued behind theirs, and its own end
	// later still; its own pace takes over once it has one.
	if !p1.TryReserve(Prefill) {
		t.Fatal("no prefill slot")
	}
	head(prefix.Progress{Age: 50 * ms, Mean: 300 * ms, MeanTokens: 400})
	clk.Add(10 * ms)
	p1.PrefillEnded(clk.Now().UnixNano(), true, 600)
	clk.Add(30 * ms)
	if h := p1.Head(clk.Now().UnixNano()); h.Age != 30*ms || h.MeanTokens != 600 || h.Mean <= 0 {
		t.Fatalf("after this router's own end: %+v", h)
	}
	p1.Release(Prefill)
	// The reports with a head go; r5's, without, stays: the zero head.
	ls.apply(bus.LoadSubject("r2"), report("r2"))
	ls.apply(bus.LoadSubject("r3"), report("r3"))
	head(prefix.Progress{})
}

// TestLoadReportCarriesOwnHeadRPLACE3: a router's report says, per
// engine, how long its prefills there have been in flight and its pace
// there; after its last prefill there ended the engine stays in the
// report with that end, for staleAfter, and then leaves it — one empty
// report, then nothing.
func TestLoadReportCarriesOwnHeadRPLACE3(t *testing.T) {
	s, clk, ls := clockedLoadShare(t)
	var sent []bus.EngineLoad
	var reports int
	pub := func(_ string, data []byte) error {
		reports++
		sent = sent[:0]
		_, err := bus.ParseLoadReport(data, func(e []byte, l bus.EngineLoad) {
			if string(e) == "p1" {
				sent = append(sent, l)
			}
		})
		return err
	}
	p1 := s.v.Fleet().Member("p1")
	if !p1.TryReserve(Prefill) {
		t.Fatal("no prefill slot")
	}
	p1.AddTokens(640)
	clk.Add(time.Since(clk.Now()) + 200*time.Millisecond) // the injected clock after the reservation's
	ls.tick(pub)
	if len(sent) != 1 || sent[0].Prefill != 1 || sent[0].Tokens != 640 || sent[0].HeadBusy < 200*time.Millisecond || sent[0].HeadBusy > time.Minute || sent[0].HeadEnd != 0 {
		t.Fatalf("with a prefill in flight: %+v", sent)
	}
	p1.PrefillEnded(clk.Now().UnixNano(), true, 640)
	p1.Release(Prefill)
	p1.AddTokens(-640)
	clk.Add(loadEvery)
	ls.tick(pub)
	if len(sent) != 1 || sent[0].Prefill != 0 || sent[0].HeadBusy != 0 || sent[0].HeadEnd != loadEvery || sent[0].PaceTokens != 640 || sent[0].PaceMean <= 0 {
		t.Fatalf("after the end: %+v", sent)
	}
	n := reports
	for range int(loadStaleAfter / loadEvery) {
		clk.Add(loadEvery)
		ls.tick(pub)
	}
	if len(sent) != 0 || reports > n+2 {
		t.Fatalf("a second after the end: %d reports more, the last with %+v; want one heartbeat at most and one empty", reports-n, sent)
	}
	n = reports
	clk.Add(loadEvery)
	ls.tick(pub)
	if reports != n {
		t.Fatalf("idle: %d reports more", reports-n)
	}
}

// BenchmarkLoadExchangeTick measures one tick of the load exchange on
// each side, over a real embedded NATS: this router's report of 4
// engines encoded and published (its work changed since the last), and
// one peer's report parsed and summed into the members. A router does
// this at most 20 times a second whatever its request rate, plus one
// apply per peer report (R-PLACE-3).
func BenchmarkLoadExchangeTick(b *testing.B) {
	m := bustest.NewMesh(b, "router")
	s := newBenchStack(b)
	ls := newLoadShare(s)
	nc := m.B.Conn()
	peer := report("r2", entry("p1", 3, 0, 3000), entry("p2", 1, 0, 900), entry("p3", 2, 0, 40), entry("d1", 0, 7, 0))
	subject := bus.LoadSubject("r2")
	p1 := s.Fleet().Member("p1")
	b.ReportAllocs()
	cpu := testkit.CPUTime()
	for i := 0; b.Loop(); i++ {
		p1.AddTokens(int64(i&1)*2 - 1) // a change every tick: a publish every tick
		ls.tick(nc.Publish)
		ls.apply(subject, peer)
	}
	testkit.ReportCPUPerOp(b, cpu)
}

// TestPeerPlacementsCannotPushOutOwnRPLACE4: a flood of the other
// routers' placements on one engine (500 a second for 2 s, past its 64
// slots) leaves this router's own credits whole — one still in flight
// and one in its 250 ms grace — and each of theirs lasts as long as the
// slots allow (64 ÷ 500 a second), never longer than peerPlacedMaxLife.
func TestPeerPlacementsCannotPushOutOwnRPLACE4(t *testing.T) {
	s := newStack(t, pd(), nil)
	clk := &clock{now: time.Unix(1000, 0)}
	ls := newLoadShare(s.v)
	ls.now = clk.Now
	p1 := s.v.Fleet().Member("p1")
	open, graced := chainOf(1, 30), chainOf(2, 30)
	p1.Inflight().Add(open, clk.Now().UnixNano())
	tk := p1.Inflight().Add(graced, clk.Now().UnixNano())
	p1.Inflight().Settle(tk, clk.Now().Add(250*time.Millisecond).UnixNano())
	var last []uint64
	for i := range 1000 {
		last = chainOf(uint64(100+i), 30)
		msg, _ := bus.AppendPlaced(nil, "r2", "p1", last)
		ls.applyPlaced(bus.LoadSubject("r2"), msg)
		if i < 100 {
			clk.Add(2 * time.Millisecond) // 200 ms of it within the grace
		}
	}
	now := clk.Now().UnixNano()
	if p1.InflightMatch(open, now) != 30 || p1.InflightMatch(graced, now) != 30 {
		t.Fatalf("own credits after the flood: in flight %d, in grace %d blocks; want 30 each",
			p1.InflightMatch(open, now), p1.InflightMatch(graced, now))
	}
	if p1.InflightMatch(last, now) != 30 {
		t.Fatal("the latest of the other router's placements is not credited")
	}
	if n := p1.InflightMatch(last, clk.Now().Add(peerPlacedMaxLife).UnixNano()); n != 0 {
		t.Fatalf("another router's credit outlived peerPlacedMaxLife: %d blocks", n)
	}
}

// chainOf returns n distinct chained keys seeded by seed (not token
// keys: Inflight matches any chain).
func chainOf(seed uint64, n int) []uint64 {
	keys := make([]uint64, n)
	for i := range keys {
		keys[i] = seed<<32 | uint64(i+1)
	}
	return keys
}

// BenchmarkPlacedShare measures one placement in flight on each side
// (R-PLACE-4), over a real embedded NATS, with the end of its attempt:
// this router's 125-key prompt (2,000 tokens) encoded and published
// (SharePlaced, once a placement by the exact index) and its end
// (SharePlacedEnd), and another router's parsed and credited to its
// engine (applyPlaced, once per placement of each other router), then
// settled (applyPlacedEnd).
func BenchmarkPlacedShare(b *testing.B) {
	m := bustest.NewMesh(b, "router")
	s := newBenchStack(b)
	ls := newLoadShare(s)
	ls.nc = m.B.Conn()
	s.loads.Store(ls)
	keys := make([]uint64, 125)
	for i := range keys {
		keys[i] = uint64(i)*0x9e3779b97f4a7c15 + 7
	}
	peer, _ := bus.AppendPlaced(nil, "r2", "p2", keys)
	peerEnd, _ := bus.AppendPlacedEnd(nil, "r2", "p2", 125, keys[124], bus.PlacedCompleted)
	subject := bus.LoadSubject("r2")
	p1 := s.Fleet().Member("p1")
	var buf []byte
	b.ReportAllocs()
	cpu := testkit.CPUTime()
	count, last := bus.PlacedChain(keys)
	for b.Loop() {
		buf, _ = s.SharePlaced(p1, keys, buf)
		ls.applyPlaced(subject, peer)
		s.SharePlacedEnd(p1, count, last, true)
		ls.applyPlacedEnd(subject, peerEnd)
	}
	testkit.ReportCPUPerOp(b, cpu)
}

// TestEngineCountsMeetTheLegsOfTheirMomentRPLACE3 proves that the
// engine's own counts (read from its /metrics every few seconds) are set
// against the mesh's legs of the moment they were read, not of now
// (R-PLACE-3): legs that ended since the read are not taken for work the
// mesh did not send, and legs begun since are not subtracted twice.
func TestEngineCountsMeetTheLegsOfTheirMomentRPLACE3(t *testing.T) {
	s := newStack(t, pd(), nil)
	p1 := s.v.Fleet().Member("p1")
	for range 3 {
		p1.TryReserve(Prefill)
	}
	p1.SetWaiting(1)
	p1.SetRunning(2) // the engine's 3 requests are the mesh's 3 legs
	if got := p1.LegsAtRead(); got != 3 {
		t.Fatalf("legs at the read: %d, want 3", got)
	}
	for range 3 {
		p1.Release(Prefill) // the legs end before the next read
	}
	if got := p1.LegsAtRead(); got != 3 {
		t.Fatalf("legs at the read after they ended: %d, want still 3 (the read's moment)", got)
	}
	c := prefix.Candidate{Waiting: p1.Waiting(), Running: p1.Running(), Legs: p1.LegsAtRead()}
	w := &prefix.Work{Blocks: 8, PromptBytes: 8 * prefix.BlockBytes, Ratio: prefix.DefaultTokenRatio, PerRequest: 1000}
	if got, want := c.Cost(w), prefix.DefaultTokenRatio.Tokens(8*prefix.BlockBytes); got != want {
		t.Fatalf("cost %d, want %d: the engine's counts were all the mesh's own legs, nothing foreign", got, want)
	}
	p1.SetRunning(0)
	if got := p1.LegsAtRead(); got != 0 {
		t.Fatalf("legs at the next read: %d, want 0", got)
	}
}

// TestPlacementsInFlightSharedRPLACE4: over a real embedded NATS, a
// prompt router a placed on p2 by its exact index (SharePlaced) credits
// p2 in router b's view — its Inflight matches the prompt's keys — and
// in a's own only through a's placement, never twice. The credit lasts
// until a says the attempt ended (SharePlacedEnd), peerPlacedMaxLife at
// most: past peerPlacedGrace after a prefill that completed, at once
// after one that did not.
func TestPlacementsInFlightSharedRPLACE4(t *testing.T) {
	a, b := joinedPair(t)
	keys := prefix.AppendTokenKeys(nil, make([]uint32, 16*40), 16, 0)
	pa, pb := a.v.Fleet().Member("p2"), b.v.Fleet().Member("p2")
	if buf, ok := a.v.SharePlaced(pa, keys, nil); !ok || !bus.IsPlaced(buf) {
		t.Fatalf("SharePlaced published %v, encoded a placement %v", ok, bus.IsPlaced(buf))
	}
	at := time.Now().UnixNano()
	testkit.WaitFor(t, 2*time.Second, "router b to credit p2 with a's placement", func() bool {
		return pb.InflightMatch(keys, at) == len(keys)
	})
	if n := pa.InflightMatch(keys, at); n != 0 {
		t.Fatalf("router a credited itself with its own shared placement (%d blocks): only its attempt may", n)
	}
	if n := b.v.Fleet().Member("p1").InflightMatch(keys, at); n != 0 {
		t.Fatalf("p1 credited with p2's placement: %d blocks", n)
	}
	// Its attempt has not ended: the credit outlasts a queue of seconds
	// (the fixed 1 s it once had). A probe past a credit's end frees it,
	// so each test of an end looks at now before it looks past the end.
	if n := pb.InflightMatch(keys, time.Now().Add(3*time.Second).UnixNano()); n != len(keys) {
		t.Fatalf("the credit of an attempt still in flight ends within 3 s: %d blocks", n)
	}
	ended := func(n float64) func() bool {
		return func() bool {
			return testkit.GatheredSum(t, b.reg, "narwhal_prefix_inflight_shared_total", "outcome", placedEnded) == n
		}
	}
	count, last := bus.PlacedChain(keys)
	before := time.Now()
	a.v.SharePlacedEnd(pa, count, last, true)
	testkit.WaitFor(t, 2*time.Second, "router b to settle the credit of a's completed prefill", ended(1))
	// Settled at its arrival plus the grace, so not before before+grace.
	if n := pb.InflightMatch(keys, before.Add(peerPlacedGrace-time.Millisecond).UnixNano()); n != len(keys) {
		t.Fatalf("the credit of a completed prefill ended before its grace: %d blocks", n)
	}
	if n := pb.InflightMatch(keys, time.Now().Add(peerPlacedGrace).UnixNano()); n != 0 {
		t.Fatalf("the credit of a completed prefill outlived its grace: %d blocks", n)
	}
	// A second attempt of the prompt, whose prefill fails: dropped at once.
	_, _ = a.v.SharePlaced(pa, keys, nil)
	testkit.WaitFor(t, 2*time.Second, "router b to credit the second placement", func() bool {
		return pb.InflightMatch(keys, time.Now().UnixNano()) == len(keys)
	})
	a.v.SharePlacedEnd(pa, count, last, false)
	testkit.WaitFor(t, 2*time.Second, "router b to drop the credit of a's failed prefill", ended(2))
	if n := pb.InflightMatch(keys, time.Now().UnixNano()); n != 0 {
		t.Fatalf("the credit of a failed prefill kept: %d blocks", n)
	}
	for r, want := range map[*stack]map[string]float64{
		a: {placedPublished: 2, placedEndPublished: 2},
		b: {placedApplied: 2, placedEnded: 2, placedEndUnmatched: 0},
	} {
		for outcome, w := range want {
			if v := testkit.GatheredSum(t, r.reg, "narwhal_prefix_inflight_shared_total", "outcome", outcome); v != w {
				t.Fatalf("%s %v, want %v", outcome, v, w)
			}
		}
	}
}

// TestPlacementEndsOnlyShortenRPLACE4: another router's end of an attempt
// settles only the credit of the prompt it names, by its count and last
// key, and only ever shortens it: an end naming a prompt never placed,
// the prompt's head alone, or an engine outside the fleet settles
// nothing and is counted; a forged or malformed end is refused and
// counted (R-BUS-9, R-BUS-11), and one router's end, on its own subject,
// never settles another router's credit of the same prompt. Applying
// one allocates nothing.
func TestPlacementEndsOnlyShortenRPLACE4(t *testing.T) {
	s := newStack(t, pd(), nil)
	clk := &clock{now: time.Unix(1000, 0)}
	ls := newLoadShare(s.v)
	ls.now = clk.Now
	p1 := s.v.Fleet().Member("p1")
	keys := chainOf(7, 30)
	placed, _ := bus.AppendPlaced(nil, "r2", "p1", keys)
	subject := bus.LoadSubject("r2")
	ls.applyPlaced(subject, placed)
	end := func(router, engine string, count int, last uint64, o bus.PlacedOutcome) []byte {
		msg, ok := bus.AppendPlacedEnd(nil, router, engine, count, last, o)
		if !ok {
			t.Fatalf("encoded no end for %q %q %d", router, engine, count)
		}
		return msg
	}
	later := clk.Now().Add(5 * time.Second).UnixNano()
	for name, msg := range map[string][]byte{
		"another prompt":     end("r2", "p1", 30, 999, bus.PlacedFailed),
		"the prompt's head":  end("r2", "p1", 10, keys[9], bus.PlacedFailed),
		"an unknown engine":  end("r2", "nope", 30, keys[29], bus.PlacedFailed),
		"a forged router id": end("r3", "p1", 30, keys[29], bus.PlacedFailed),
		"another router's":   end("r3", "p1", 30, keys[29], bus.PlacedFailed), // on r3's own subject, below
		"a truncated end":    end("r2", "p1", 30, keys[29], bus.PlacedFailed)[:20],
	} {
		on := subject
		if name == "another router's" {
			on = bus.LoadSubject("r3") // r3 may speak for itself, not end r2's credit
		}
		ls.applyPlacedEnd(on, msg)
		if n := p1.InflightMatch(keys, later); n != 30 {
			t.Fatalf("%s settled the credit: %d blocks at 5 s", name, n)
		}
	}
	for reason, want := range map[string]float64{loadIgnoredRouterMismatch: 1, loadIgnoredInvalid: 1} {
		if v := testkit.GatheredSum(t, s.reg, "narwhal_load_reports_ignored_total", "reason", reason); v != want {
			t.Fatalf("ignored %s %v, want %v", reason, v, want)
		}
	}
	for outcome, want := range map[string]float64{placedEndUnmatched: 3, placedUnknownEngine: 1, placedEnded: 0} {
		if v := testkit.GatheredSum(t, s.reg, "narwhal_prefix_inflight_shared_total", "outcome", outcome); v != want {
			t.Fatalf("%s %v, want %v", outcome, v, want)
		}
	}
	count, last := bus.PlacedChain(keys)
	ls.applyPlacedEnd(subject, end("r2", "p1", count, last, bus.PlacedCompleted))
	now := clk.Now().UnixNano()
	if p1.InflightMatch(keys, now+int64(peerPlacedGrace)-1) != 30 {
		t.Fatal("a completed prefill's credit ends before its grace")
	}
	clk.Add(peerPlacedGrace / 2)
	ls.applyPlacedEnd(subject, end("r2", "p1", count, last, bus.PlacedCompleted)) // would lengthen it
	// (A probe past a credit's end frees it: look before, then past.)
	if n := p1.InflightMatch(keys, now+int64(peerPlacedGrace)-1); n != 30 {
		t.Fatalf("a second end shortened the credit instead of leaving it: %d blocks", n)
	}
	if n := p1.InflightMatch(keys, now+int64(peerPlacedGrace)); n != 0 {
		t.Fatalf("a second end lengthened the credit: %d blocks", n)
	}
	ls.applyPlaced(subject, placed)
	failed := end("r2", "p1", count, last, bus.PlacedFailed)
	ls.applyPlacedEnd(subject, failed)
	if n := p1.InflightMatch(keys, clk.Now().UnixNano()); n != 0 {
		t.Fatalf("a failed prefill's credit kept: %d blocks", n)
	}
	if a := testkit.LeastAllocs(100, func() {
		ls.applyPlaced(subject, placed)
		ls.applyPlacedEnd(subject, failed)
	}); a != 0 {
		t.Fatalf("a placement and its end allocate %v times", a)
	}
}

// TestForgedPlacementsInFlightRefusedRPLACE4: a placement in flight whose
// router id is not its subject's, a malformed one, or one on an engine
// outside the fleet credits nothing and is counted.
func TestForgedPlacementsInFlightRefusedRPLACE4(t *testing.T) {
	s := newStack(t, pd(), nil)
	ls := newLoadShare(s.v)
	keys := []uint64{11, 12, 13}
	p1 := s.v.Fleet().Member("p1")
	forged, _ := bus.AppendPlaced(nil, "r3", "p1", keys)
	ls.applyPlaced(bus.LoadSubject("r2"), forged)
	ls.applyPlaced(bus.LoadSubject("r2"), forged[:len(forged)-3])
	gone, _ := bus.AppendPlaced(nil, "r2", "nope", keys)
	ls.applyPlaced(bus.LoadSubject("r2"), gone)
	if n := p1.InflightMatch(keys, time.Now().UnixNano()); n != 0 {
		t.Fatalf("a forged placement credited p1 with %d blocks", n)
	}
	for reason, want := range map[string]float64{loadIgnoredRouterMismatch: 1, loadIgnoredInvalid: 1} {
		if v := testkit.GatheredSum(t, s.reg, "narwhal_load_reports_ignored_total", "reason", reason); v != want {
			t.Errorf("ignored{reason=%s} = %v, want %v", reason, v, want)
		}
	}
	if v := testkit.GatheredSum(t, s.reg, "narwhal_prefix_inflight_shared_total", "outcome", placedUnknownEngine); v != 1 {
		t.Errorf("unknown_engine %v, want 1", v)
	}
	good, _ := bus.AppendPlaced(nil, "r2", "p1", keys)
	ls.applyPlaced(bus.LoadSubject("r2"), good)
	if n := p1.InflightMatch(keys, time.Now().UnixNano()); n != 3 {
		t.Fatalf("a valid placement credited %d blocks, want 3", n)
	}
}
