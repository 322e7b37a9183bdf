package meshview

import (
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestSharedIndexRefusesHostileBatchesRBUS9: malformed batches, batches
// on another router's subject and placements on engines that are not
// placeable prefill engines of the fleet (unknown, decode only, ejected)
// change nothing and are counted.
func TestSharedIndexRefusesHostileBatchesRBUS9(t *testing.T) {
	s := newStack(t, prefixFleet(), nil)
	s.waitModels()
	m := newMeshBus(t)
	if err := s.v.Join(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := m.B.Conn().Flush(); err != nil { // the router's subscription is in place
		t.Fatal(err)
	}
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
		return testkit.GatheredSum(t, reg, "narwhal_prefix_batches_dropped_total", "reason", "invalid") == 2 &&
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
