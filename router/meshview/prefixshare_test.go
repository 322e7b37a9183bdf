package meshview

import (
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestSharedIndexRefusesHostileBatchesRBUS9: malformed batches, batches
// on another router's subject and placements on engines that are not
// placeable prefill engines of the fleet (unknown, decode only, ejected)
// change nothing and are counted.
func TestSharedIndexRefusesHostileBatchesRBUS9(t *testing.T) {
	s, m := joinedPrefixStack(t)
	nc := m.Peer.Conn()
	var batch bus.PrefixBatch
	batch.Reset("evil")
	batch.Add("nope", []uint64{1, 2})
	batch.Add("d1", []uint64{3})
	s.v.setEligibility("p2", false, "test") // ejected: not learned either
	batch.Add("p2", []uint64{4})
	_ = nc.Publish(bus.PrefixSubject("evil"), batch.Bytes())
	_ = nc.Publish(bus.PrefixSubject("other"), batch.Bytes()) // names evil
	_ = nc.Publish(bus.PrefixSubject("evil"), []byte("NWP1 garbage"))
	reg := s.reg
	testkit.WaitFor(t, 5*time.Second, "the batches to be judged", func() bool {
		return testkit.GatheredSum(t, reg, "narwhal_prefix_batches_dropped_total", "reason", "invalid") == 1 &&
			testkit.GatheredSum(t, reg, "narwhal_prefix_batches_dropped_total", "reason", "router_id_mismatch") == 1 &&
			testkit.GatheredSum(t, reg, "narwhal_prefix_placements_ignored_total") == 3
	})
	for _, id := range []string{"nope", "d1", "p1", "p2"} {
		if n := s.v.PrefixIndex().Blocks(id); n != 0 {
			t.Fatalf("the index holds %d blocks of %s", n, id)
		}
	}
	batch.Reset("evil")
	batch.Add("p1", []uint64{7, 8})
	_ = nc.Publish(bus.PrefixSubject("evil"), batch.Bytes())
	testkit.WaitFor(t, 5*time.Second, "a valid placement to be learned", func() bool { return s.v.PrefixIndex().Blocks("p1") == 2 })
}

// TestSharedIndexIgnoresAnotherRoutersBatchRBUS11: a valid batch whose
// payload names router r1 (or this router) on router r2's subject is one
// router speaking for another (behaviour.md R-BUS-11): none of its
// placements is learned and it is counted in
// narwhal_prefix_batches_dropped_total{reason="router_id_mismatch"}, not as
// invalid; the same placements in r2's own batch are learned.
func TestSharedIndexIgnoresAnotherRoutersBatchRBUS11(t *testing.T) {
	s, m := joinedPrefixStack(t)
	nc := m.Peer.Conn()
	var batch bus.PrefixBatch
	for _, named := range []string{"r1", s.v.id} {
		batch.Reset(named)
		batch.Add("p1", []uint64{7, 8})
		if err := nc.Publish(bus.PrefixSubject("r2"), batch.Bytes()); err != nil {
			t.Fatal(err)
		}
	}
	reg := s.reg
	testkit.WaitFor(t, 5*time.Second, "the batches to be judged", func() bool {
		return testkit.GatheredSum(t, reg, "narwhal_prefix_batches_dropped_total", "reason", "router_id_mismatch") == 2
	})
	if n := testkit.GatheredSum(t, reg, "narwhal_prefix_batches_dropped_total", "reason", "invalid"); n != 0 {
		t.Errorf("%v batches counted invalid, want 0: they are valid batches on another router's subject", n)
	}
	if n := s.v.PrefixIndex().Blocks("p1"); n != 0 {
		t.Fatalf("the index learned %d blocks of p1 from batches on another router's subject", n)
	}
	batch.Reset("r2")
	batch.Add("p1", []uint64{7, 8})
	if err := nc.Publish(bus.PrefixSubject("r2"), batch.Bytes()); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 5*time.Second, "r2's own placement to be learned", func() bool { return s.v.PrefixIndex().Blocks("p1") == 2 })
	if n := testkit.GatheredSum(t, reg, "narwhal_prefix_batches_dropped_total", "reason", "router_id_mismatch"); n != 2 {
		t.Errorf("%v batches counted router_id_mismatch after r2's own, want 2", n)
	}
}

// joinedPrefixStack starts a router over prefixFleet joined to a mesh bus,
// its prefix subscription in place.
func joinedPrefixStack(t *testing.T) (*stack, *meshBus) {
	t.Helper()
	s := newStack(t, prefixFleet(), nil)
	s.waitModels()
	m := newMeshBus(t)
	if err := s.v.Join(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := m.B.Conn().Flush(); err != nil { // the router's subscription is in place
		t.Fatal(err)
	}
	return s, m
}

// TestSharedCutsRPLACE3: a chain this router cuts from its index (the
// engine's cached_tokens fell short of the prediction) is published as
// a batch of cuts on its subject after its placements, and a batch of
// cuts from another router cuts the same chain from this router's index
// — every router stops following a prefix the engine denied, not only
// the one that saw the answer. Cuts are judged as placements are (R-BUS-9,
// R-BUS-11): malformed, on another router's subject, or of an engine
// that is not a prefill engine of the fleet, they cut nothing.
func TestSharedCutsRPLACE3(t *testing.T) {
	s, m := joinedPrefixStack(t)
	nc := m.Peer.Conn()
	mine := make(chan *nats.Msg, 16)
	sub, err := nc.ChanSubscribe(bus.PrefixSubject(s.v.id), mine)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}

	// This router places a prompt of 100 blocks on p1 and the engine
	// answers that it held 40 blocks' worth: the index cuts 40…, and the
	// cut follows the placement on the bus.
	h := make([]uint64, 100)
	for i := range h {
		h[i] = uint64(1000 + i)
	}
	s.v.RecordPrefix("p1", h, nil)
	s.v.CorrectPrefix(s.v.Fleet().Member("p1"), &Prediction{Model: "m", Hashes: h, Matched: 100, PromptBytes: 6400, Whole: true},
		PrefillUsage{Usage: true, PromptTokens: 1600, Cached: true, CachedTokens: 640})
	if got := s.v.PrefixIndex().Match("p1", h); got != 40 {
		t.Fatalf("own cut: match %d, want 40", got)
	}
	var placed, cut []uint64
	for placed == nil || cut == nil {
		select {
		case msg := <-mine:
			data := msg.Data
			switch {
			case bus.IsPrefixCuts(data):
				if placed == nil {
					t.Fatal("the cut was published before the placement it corrects")
				}
				bus.EachPrefixCut(data, nil, func(eid []byte, hs []uint64) {
					if string(eid) == "p1" {
						cut = slices.Clone(hs)
					}
				})
			default:
				bus.EachPrefixPlacement(data, nil, func(eid []byte, hs []uint64) {
					if string(eid) == "p1" {
						placed = slices.Clone(hs)
					}
				})
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("published: placement %v, cut %v; want both within 5 s", placed != nil, cut != nil)
		}
	}
	if !slices.Equal(placed, h) || !slices.Equal(cut, h[40:]) {
		t.Fatalf("published placement of %d blocks and cut of %d, want 100 and the 60 from block 40", len(placed), len(cut))
	}

	// Another router's cuts: first the hostile ones, then a real one.
	other := make([]uint64, 20)
	for i := range other {
		other[i] = uint64(5000 + i)
	}
	var batch bus.PrefixBatch
	batch.Reset("r2")
	batch.Add("p2", other)
	_ = nc.Publish(bus.PrefixSubject("r2"), batch.Bytes())
	testkit.WaitFor(t, 5*time.Second, "r2's placement to be learned", func() bool { return s.v.PrefixIndex().Match("p2", other) == 20 })
	batch.ResetCuts("r1") // names r1 on r2's subject
	batch.Add("p2", other[5:])
	_ = nc.Publish(bus.PrefixSubject("r2"), batch.Bytes())
	_ = nc.Publish(bus.PrefixSubject("r2"), []byte("NWC1 garbage"))
	batch.ResetCuts("r2")
	batch.Add("nope", other[5:])
	batch.Add("d1", other[5:])
	_ = nc.Publish(bus.PrefixSubject("r2"), batch.Bytes())
	batch.ResetCuts("r2")
	batch.Add("p2", other[12:])
	_ = nc.Publish(bus.PrefixSubject("r2"), batch.Bytes())
	testkit.WaitFor(t, 5*time.Second, "r2's cut to be applied", func() bool { return s.v.PrefixIndex().Match("p2", other) == 12 })
	reg := s.reg
	if n := testkit.GatheredSum(t, reg, "narwhal_prefix_shared_cuts_applied_total"); n != 1 {
		t.Errorf("%v shared cuts applied, want r2's one on p2", n)
	}
	if n := testkit.GatheredSum(t, reg, "narwhal_prefix_batches_dropped_total", "reason", "router_id_mismatch"); n != 1 {
		t.Errorf("%v batches counted router_id_mismatch, want the cuts naming r1", n)
	}
	if n := testkit.GatheredSum(t, reg, "narwhal_prefix_batches_dropped_total", "reason", "invalid"); n != 1 {
		t.Errorf("%v batches counted invalid, want the garbage one", n)
	}
}
