package bus_test

import (
	"slices"
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestReadKVOpsRPLACE4: ReadKVOps gives the header and every op as
// ParseKVBatch does, refuses what CheckKVBatch refuses before any call,
// and allocates nothing once its buffer has grown.
func TestReadKVOpsRPLACE4(t *testing.T) {
	var b bus.KVBatch
	b.Reset("p1", 9, 3, 16)
	b.Add(bus.KVStored, 1, bus.KVCPU, []uint64{1, 2, 3})
	b.Add(bus.KVRemoved, 0, bus.KVGPU, []uint64{4})
	b.Add(bus.KVCleared, 2, bus.KVGPU, nil)
	data := b.Bytes()
	want, ops, err := bus.ParseKVBatch(data)
	if err != nil {
		t.Fatal(err)
	}
	var h bus.KVHeader
	var got []bus.KVEntry
	buf, err := bus.ReadKVOps(data, &h, nil, func(op bus.KVOp, rank int, medium bus.KVMedium, keys []uint64) {
		got = append(got, bus.KVEntry{Op: op, Rank: rank, Medium: medium, Keys: slices.Clone(keys)})
	})
	if err != nil {
		t.Fatal(err)
	}
	if string(h.EngineID) != "p1" || h.Epoch != want.Epoch || h.Seq != want.Seq || h.BlockSize != want.BlockSize || len(got) != len(ops) {
		t.Fatalf("header %+v, %d ops; want %+v, %d", h, len(got), want, len(ops))
	}
	for i := range ops {
		if got[i].Op != ops[i].Op || got[i].Rank != ops[i].Rank || got[i].Medium != ops[i].Medium || !slices.Equal(got[i].Keys, ops[i].Keys) {
			t.Fatalf("op %d: %+v, want %+v", i, got[i], ops[i])
		}
	}
	calls := 0
	if _, err := bus.ReadKVOps(data[:len(data)-1], &h, buf, func(bus.KVOp, int, bus.KVMedium, []uint64) { calls++ }); err == nil || calls != 0 {
		t.Fatalf("a cut batch: err %v after %d calls", err, calls)
	}
	n := 0
	count := func(bus.KVOp, int, bus.KVMedium, []uint64) { n++ }
	if a := testkit.LeastAllocs(100, func() { buf, _ = bus.ReadKVOps(data, &h, buf, count) }); a != 0 {
		t.Fatalf("ReadKVOps allocates %v times a batch", a)
	}
}
