package meshview

import (
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/schemas"
)

// senderReceiver is two routers over the same engine ids; what the
// sender's tick publishes the receiver applies at once (a hop of 0).
// reports counts the sender's publishes.
func senderReceiver(t *testing.T) (ls, lr *loadShare, pub func(string, []byte) error, reports *int) {
	snd := newStack(t, pd(), nil)
	rcv := newStack(t, pd(), func(c *config.Config) { c.Router.ID = "rt-recv" })
	ls, lr = newLoadShare(snd.v), newLoadShare(rcv.v)
	n := 0
	pub = func(subject string, data []byte) error {
		n++
		lr.apply(subject, data)
		return nil
	}
	return ls, lr, pub, &n
}

// TestHeadRestartWithSameCountsIsPublishedRPLACE3: a prefill that ends
// and the next of the same estimate reserved within one tick leave the
// counts as they were, but the head began anew: the report goes out, and
// the other router's head starts where the sender's does (else it would
// keep the old start until the heartbeat, and a cold prefill just begun
// would look done).
func TestHeadRestartWithSameCountsIsPublishedRPLACE3(t *testing.T) {
	ls, lr, pub, reports := senderReceiver(t)
	sp1, rp1 := ls.v.Fleet().Member("p1"), lr.v.Fleet().Member("p1")
	if !sp1.TryReserve(Prefill) {
		t.Fatal("no prefill slot")
	}
	sp1.AddTokens(800)
	ls.tick(pub)
	before := *reports
	ls.tick(pub)
	if *reports != before {
		t.Fatal("a tick with nothing changed published")
	}
	end := time.Now().UnixNano() + int64(time.Millisecond)
	sp1.PrefillEnded(end, true, 800)
	sp1.Release(Prefill)
	if !sp1.TryReserve(Prefill) { // the same counts: one prefill, 800 tokens
		t.Fatal("no prefill slot")
	}
	ls.tick(pub)
	if *reports != before+1 {
		t.Fatalf("%d reports after a head ended and the next began in one tick, want 1", *reports-before)
	}
	at := end + int64(time.Second)
	own, seen := sp1.Head(at), rp1.Head(at)
	if d := seen.Age - own.Age; d < -time.Millisecond || d > time.Millisecond {
		t.Fatalf("the sender's head %+v, the receiver's %+v: want the same age", own, seen)
	}
}

// TestPeerEndKeptWhileBusyRPLACE3: a router with prefills still in
// flight keeps telling its last end, however long ago (a prefill may
// take more than the 1 s an idle router's end is told for), so that the
// others take the head's start from it as the sender does, not from the
// start of the whole busy period.
func TestPeerEndKeptWhileBusyRPLACE3(t *testing.T) {
	ls, lr, pub, _ := senderReceiver(t)
	clk := &clock{now: time.Now()}
	ls.now, lr.now = clk.Now, clk.Now
	sp1, rp1 := ls.v.Fleet().Member("p1"), lr.v.Fleet().Member("p1")
	for range 2 {
		if !sp1.TryReserve(Prefill) {
			t.Fatal("no prefill slot")
		}
	}
	sp1.AddTokens(2000)
	tick := func(n int) {
		for range n {
			clk.Add(loadEvery)
			ls.tick(pub)
			lr.expire(clk.Now())
		}
	}
	tick(60)                                           // 300 ms
	sp1.PrefillEnded(clk.Now().UnixNano(), true, 1000) // the first ends; the second computes
	sp1.Release(Prefill)
	sp1.AddTokens(-1000)
	tick(240) // 1.2 s more: past the 1 s an idle router's end is told for
	// A router that joins now hears the end from the next report.
	late := newLoadShare(newStack(t, pd(), func(c *config.Config) { c.Router.ID = "rt-late" }).v)
	late.now = clk.Now
	clk.Add(loadHeartbeat)
	ls.tick(func(subject string, data []byte) error { late.apply(subject, data); return pub(subject, data) })
	now := clk.Now().UnixNano()
	own, seen, joined := sp1.Head(now), rp1.Head(now), late.v.Fleet().Member("p1").Head(now)
	if own.Age < time.Second || seen.Age != own.Age || joined.Age != own.Age {
		t.Fatalf("1.7 s into the second prefill: the sender's head age %v, the receiver's %v, the one that joined late %v",
			own.Age, seen.Age, joined.Age)
	}
	// The end stays known after the sender's reports stop carrying it.
	sp1.PrefillEnded(clk.Now().UnixNano(), true, 1000)
	sp1.Release(Prefill)
	sp1.AddTokens(-1000)
	tick(300) // 1.5 s: the sender idle, its end aged out of its reports
	if !rp1.TryReserve(Prefill) {
		t.Fatal("no prefill slot")
	}
	defer rp1.Release(Prefill)
	if got, want := rp1.headStart(), max(rp1.headBusy.Load(), now); got < want {
		t.Fatalf("the receiver's next head starts at %d, before the sender's last end %d", got, want)
	}
}

// endedAhead is an idle member whose last prefill ended an hour ahead
// of the clock (the clock stepped back after it).
func endedAhead(t *testing.T) *Member {
	t.Helper()
	m := NewMember(engines.Engine{ID: "p1"}, schemas.FleetEntry{}, true)
	if !m.TryReserve(Prefill) {
		t.Fatal("no prefill slot")
	}
	m.PrefillEnded(time.Now().Add(time.Hour).UnixNano(), true, 100)
	m.Release(Prefill)
	return m
}

// clockedLoadShare is a stack and its load exchange on a clock of the
// test's own, starting now.
func clockedLoadShare(t *testing.T) (*stack, *clock, *loadShare) {
	t.Helper()
	s := newStack(t, pd(), nil)
	clk := &clock{now: time.Now()}
	ls := newLoadShare(s.v)
	ls.now = clk.Now
	return s, clk, ls
}

// TestHeadAfterAClockStepBackRPLACE3: every moment of the head later
// than now (the wall clock stepped back since) is taken as now, so the
// head's age grows from the step instead of staying zero until the clock
// catches up, and an idle engine's end leaves the reports 1 s after it.
func TestHeadAfterAClockStepBackRPLACE3(t *testing.T) {
	t.Run("a new head after an end ahead", func(t *testing.T) {
		m := endedAhead(t)
		before := time.Now()
		if !m.TryReserve(Prefill) {
			t.Fatal("no prefill slot")
		}
		at := before.Add(time.Second)
		if age := m.Head(at.UnixNano()).Age; age < time.Second-time.Since(before) || age > time.Second {
			t.Fatalf("1 s after the head began its age is %v; want about 1 s, not held at zero by an end an hour ahead", age)
		}
	})
	t.Run("a busy start ahead", func(t *testing.T) {
		m := NewMember(engines.Engine{ID: "p1"}, schemas.FleetEntry{}, true)
		for range 2 {
			if !m.TryReserve(Prefill) {
				t.Fatal("no prefill slot")
			}
		}
		back := time.Now().Add(-time.Hour) // the clock stepped back an hour
		m.PrefillEnded(back.UnixNano(), true, 100)
		m.Release(Prefill)
		m.Head(back.Add(time.Second).UnixNano())
		if age := m.Head(back.Add(2 * time.Second).UnixNano()).Age; age != time.Second {
			t.Fatalf("1 s after the step was seen the head's age is %v, want 1s", age)
		}
	})
	t.Run("an idle engine's end ahead", func(t *testing.T) {
		m := endedAhead(t)
		now := time.Now()
		m.loadEntry(now, time.Second)
		if l, _, _ := m.loadEntry(now.Add(time.Second), time.Second); l.HeadEnd != 0 {
			t.Fatalf("idle, 1 s after the step: entry %+v, want no end", l)
		}
	})
}

// TestPeerHeadGoesWithItsRouterRPLACE3: a silent router's counts, busy
// start and pace go after staleAfter (its last end, a fact about the
// engine, may stay, but with nothing in flight the head is unknown); a
// busy start without a prefill in flight counts for nothing.
func TestPeerHeadGoesWithItsRouterRPLACE3(t *testing.T) {
	s, clk, ls := clockedLoadShare(t)
	p1 := s.v.Fleet().Member("p1")
	ms := time.Millisecond
	ls.apply(bus.LoadSubject("r2"), report("r2", func(r *bus.LoadReport) {
		r.Append("p1", bus.EngineLoad{Prefill: 1, Tokens: 10, HeadBusy: 300 * ms, HeadEnd: 100 * ms, PaceMean: 200 * ms, PaceTokens: 50})
	}))
	if h := p1.Head(clk.Now().UnixNano()); h.Age != 100*ms || h.Mean != 200*ms || h.MeanTokens != 50 {
		t.Fatalf("the peer's head %+v, want 100ms old at its pace", h)
	}
	clk.Add(loadStaleAfter)
	ls.expire(clk.Now())
	if p1.peerHeadBusy.Load() != 0 || p1.peerMean.Load() != 0 || p1.peerMeanTokens.Load() != 0 ||
		p1.MeshReserved(Prefill) != 0 || p1.Head(clk.Now().UnixNano()) != (prefix.Progress{}) {
		t.Fatalf("after staleAfter: reserved %d, head %+v", p1.MeshReserved(Prefill), p1.Head(clk.Now().UnixNano()))
	}
	ls.apply(bus.LoadSubject("r2"), report("r2", func(r *bus.LoadReport) {
		r.Append("p1", bus.EngineLoad{Decode: 1, HeadBusy: 300 * ms}) // busy without a prefill
	}))
	if p1.peerHeadBusy.Load() != 0 || p1.Head(clk.Now().UnixNano()) != (prefix.Progress{}) {
		t.Fatal("a busy start without a prefill in flight counted")
	}
}

// TestHostilePeerHeadsBoundedRPLACE3: reports of extreme ages and paces,
// duplicate and unknown engines, from several routers, never give a
// negative head, and the cost never takes off more than one attempt's
// share of the work in flight nor counts more than all of it.
func TestHostilePeerHeadsBoundedRPLACE3(t *testing.T) {
	s, clk, ls := clockedLoadShare(t)
	rng := rand.New(rand.NewPCG(1, 2))
	pick := func(vals ...int64) int64 { return vals[rng.IntN(len(vals))] }
	dur := func() time.Duration {
		return time.Duration(pick(0, 1, int64(time.Microsecond), int64(time.Millisecond), int64(bus.LoadMaxAge), rng.Int64N(int64(bus.LoadMaxAge))))
	}
	ids := []string{"p1", "p2", "d1", "nope", "p1"}
	for i := range 5000 {
		rid := []string{"a", "b", "c", "d"}[rng.IntN(4)]
		data := report(rid, func(r *bus.LoadReport) {
			for range rng.IntN(8) {
				r.Append(ids[rng.IntN(len(ids))], bus.EngineLoad{
					Prefill: pick(0, 1, 5, bus.LoadMaxCount), Decode: pick(0, 1), Tokens: pick(0, 1, 1000, bus.LoadMaxCount),
					HeadBusy: dur(), HeadEnd: dur(), PaceMean: dur(), PaceTokens: pick(0, 1, 1000, bus.LoadMaxCount),
				})
			}
		})
		ls.apply(bus.LoadSubject(rid), data)
		clk.Add(time.Duration(rng.IntN(3)) * time.Millisecond)
		if i%7 == 0 {
			ls.expire(clk.Now())
		}
		for _, m := range s.v.Fleet().members {
			h := m.Head(clk.Now().UnixNano())
			if h.Age < 0 || h.Mean < 0 || h.MeanTokens < 0 {
				t.Fatalf("report %d: %s head %+v", i, m.ID, h)
			}
			n, tok := min(m.MeshReserved(Prefill), 1<<40), min(max(m.MeshTokens(), 0), 1<<40)
			c := prefix.Candidate{Outstanding: n, Tokens: m.MeshTokens(), Head: h}
			if cost := c.Cost(&prefix.Work{}); n > 0 && (cost > tok || cost < tok-tok/n) {
				t.Fatalf("report %d: %s cost %d of %d tokens, %d attempts, head %+v", i, m.ID, cost, tok, n, h)
			}
		}
	}
	if len(ls.peers) > 4 {
		t.Fatalf("%d peers kept, want at most the 4 that reported", len(ls.peers))
	}
}

// TestLoadTickAllocatesNothingRPLACE3: an idle tick, and a busy one whose
// counts did not change, allocate nothing (200 ticks a second).
func TestLoadTickAllocatesNothingRPLACE3(t *testing.T) {
	s := newStack(t, pd(), nil)
	ls := newLoadShare(s.v)
	pub := func(string, []byte) error { return nil }
	ls.tick(pub)
	if n := testing.AllocsPerRun(200, func() { ls.tick(pub) }); n != 0 {
		t.Fatalf("idle tick: %v allocations", n)
	}
	p1 := s.v.Fleet().Member("p1")
	if !p1.TryReserve(Prefill) {
		t.Fatal("no prefill slot")
	}
	p1.AddTokens(100)
	ls.apply(bus.LoadSubject("r2"), report("r2", entry("p1", 1, 0, 10)))
	ls.tick(pub)
	if n := testing.AllocsPerRun(50, func() { ls.tick(pub) }); n != 0 {
		t.Fatalf("busy unchanged tick: %v allocations", n)
	}
}

// TestHeadReadWhileReportsApplyRPLACE3: placement's lock-free reads of
// the head against apply, expire and tick on another goroutine, and
// reservations on a third (run with -race).
func TestHeadReadWhileReportsApplyRPLACE3(t *testing.T) {
	s := newStack(t, pd(), nil)
	ls := newLoadShare(s.v)
	p1 := s.v.Fleet().Member("p1")
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Add(2)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			ls.apply(bus.LoadSubject("r2"), report("r2", func(r *bus.LoadReport) {
				r.Append("p1", bus.EngineLoad{Prefill: int64(i % 3), Tokens: 100, HeadBusy: time.Millisecond, HeadEnd: time.Duration(i%2) * time.Millisecond, PaceMean: time.Millisecond, PaceTokens: 100})
			}))
			ls.tick(func(string, []byte) error { return nil })
		}
	}()
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if p1.TryReserve(Prefill) {
				p1.PrefillEnded(time.Now().UnixNano(), true, 100)
				p1.Release(Prefill)
			}
		}
	}()
	for range 20000 {
		if h := p1.Head(time.Now().UnixNano()); h.Age < 0 {
			t.Errorf("head %+v", h)
		}
	}
	close(stop)
	wg.Wait()
}
