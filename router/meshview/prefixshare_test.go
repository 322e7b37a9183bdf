package meshview

import (
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
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

// TestLongPlacementsAreNotDroppedRPLACE2: a burst of placements of the
// longest prompts (4,096 blocks, 32 KiB each: 7 fill a batch) is
// published whole — a placement that does not fit seals the batch for
// the flush loop and starts the next instead of being dropped — and
// every one reaches the other routers.
func TestLongPlacementsAreNotDroppedRPLACE2(t *testing.T) {
	s, m := joinedPrefixStack(t)
	nc := m.Peer.Conn()
	got := make(chan *nats.Msg, 64)
	sub, err := nc.ChanSubscribe(bus.PrefixSubject(s.v.id), got)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	placed := s.v.placed.Load()
	if placed == nil {
		t.Fatal("the shared index took no placements")
	}
	const burst = 20
	long := make([]uint64, bus.PrefixMaxHashes)
	for i := range burst {
		for k := range long {
			long[k] = uint64(i)<<32 | uint64(k+2)
		}
		(*placed)("p1", long)
	}
	seen := 0
	for seen < burst {
		select {
		case msg := <-got:
			bus.EachPrefixPlacement(msg.Data, nil, func(eid []byte, hs []uint64) {
				if string(eid) == "p1" && len(hs) == bus.PrefixMaxHashes && hs[0]>>32 == uint64(seen) {
					seen++
				}
			})
		case <-time.After(5 * time.Second):
			t.Fatalf("%d of %d long placements published in order, %v dropped", seen, burst,
				testkit.GatheredSum(t, s.reg, "narwhal_prefix_batches_dropped_total", "reason", "buffer_full"))
		}
	}
	if n := testkit.GatheredSum(t, s.reg, "narwhal_prefix_batches_dropped_total", "reason", "buffer_full"); n != 0 {
		t.Fatalf("%v placements dropped as buffer_full", n)
	}
}

// TestPlacementsQueueUpToTheirBoundRPLACE2: with no flush between them,
// placements fill the batch being filled and shareQueuedBatches full
// ones, and only the one after those is dropped and counted; a flush
// then publishes every batch in the order its placements were made, and
// the next ones reuse the published batches.
func TestPlacementsQueueUpToTheirBoundRPLACE2(t *testing.T) {
	s := newStack(t, prefixFleet(), nil)
	m := newMeshBus(t)
	share := newIndexShare(s.v) // not joined: no flush loop runs
	got := make(chan *nats.Msg, 64)
	sub, err := m.Peer.Conn().ChanSubscribe(bus.PrefixSubject(s.v.id), got)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := m.Peer.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	long := make([]uint64, bus.PrefixMaxHashes)
	place := func(i int) {
		for k := range long {
			long[k] = uint64(i)<<32 | uint64(k+2)
		}
		share.placed("p1", long)
	}
	perBatch := (bus.PrefixMaxBatch - 64) / bus.PrefixEntrySize("p1", bus.PrefixMaxHashes)
	held := perBatch * (shareQueuedBatches + 1)
	for i := range held + 1 {
		place(i)
	}
	if n := testkit.GatheredSum(t, s.reg, "narwhal_prefix_batches_dropped_total", "reason", "buffer_full"); n != 1 {
		t.Fatalf("%v placements dropped, want the one past the %d the batches hold", n, held)
	}
	share.flush(m.B.Conn())
	next := 0
	for batches := 0; batches < shareQueuedBatches+1; batches++ {
		select {
		case msg := <-got:
			bus.EachPrefixPlacement(msg.Data, nil, func(_ []byte, hs []uint64) {
				if hs[0]>>32 != uint64(next) {
					t.Fatalf("placement %d published where %d was next", hs[0]>>32, next)
				}
				next++
			})
		case <-time.After(5 * time.Second):
			t.Fatalf("%d batches published, want %d", batches, shareQueuedBatches+1)
		}
	}
	if next != held {
		t.Fatalf("%d placements published, want %d", next, held)
	}
	// The published batches are filled again: the one being filled came
	// with the flush, and the next is a published one, not a new one.
	free := len(share.free)
	if free != shareQueuedBatches+1 {
		t.Fatalf("%d batches free after the flush, want the %d published", free, shareQueuedBatches+1)
	}
	for i := range perBatch + 1 {
		place(held + 1 + i)
	}
	if len(share.free) != free-1 || len(share.full) != 1 {
		t.Fatalf("after a batch's worth and one more: %d free, %d full; want %d and 1", len(share.free), len(share.full), free-1)
	}
}

// TestLongRouterIDSharesNothingRPLACE2: a router id longer than a batch
// can name (255 bytes) turns sharing off; making the share (which the
// exact index still needs, for the engines' KV batches) does not panic.
func TestLongRouterIDSharesNothingRPLACE2(t *testing.T) {
	s := newStack(t, prefixFleet(), func(c *config.Config) { c.Router.ID = strings.Repeat("r", bus.PrefixMaxID+1) })
	share := newIndexShare(s.v)
	if share.cur.Len() != 0 {
		t.Fatalf("a share of a %d-byte router id holds %d placements", len(s.v.id), share.cur.Len())
	}
}

// TestSlowConsumerDropsAreCountedRBUS9: other routers' live batches that
// NATS drops because they came faster than this router applied them (a
// router flooding its subject) are counted as slow_consumer, once each,
// instead of vanishing without a trace.
func TestSlowConsumerDropsAreCountedRBUS9(t *testing.T) {
	s := newStack(t, prefixFleet(), nil)
	m := newMeshBus(t)
	share := newIndexShare(s.v)
	sub, err := m.B.Conn().SubscribeSync(bus.PrefixSubject("flood"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := sub.SetPendingLimits(1, -1); err != nil {
		t.Fatal(err)
	}
	if err := m.B.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		if err := m.Peer.Conn().Publish(bus.PrefixSubject("flood"), []byte("NWP1")); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.Peer.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 5*time.Second, "NATS to drop past the pending limit", func() bool {
		n, _ := sub.Dropped()
		return n == 4
	})
	share.countSlow(sub)
	share.countSlow(sub)
	if n := testkit.GatheredSum(t, s.reg, "narwhal_prefix_batches_dropped_total", "reason", "slow_consumer"); n != 4 {
		t.Fatalf("%v batches counted slow_consumer, want the 4 NATS dropped", n)
	}
}
