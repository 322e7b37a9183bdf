package bus

import (
	"errors"
	"slices"
	"testing"
)

// TestKVBatchRoundTripRPLACE4 proves the KV batch format: what KVBatch
// encodes, ParseKVBatch and ReadKVOps read back the same; every malformed
// batch (a hostile publisher, R-BUS-9) is refused whole; a full batch
// refuses more ops.
func TestKVBatchRoundTripRPLACE4(t *testing.T) {
	var b KVBatch
	b.Reset("p1", 42, 7, 16)
	if !b.Add(KVStored, 0, KVGPU, []uint64{1, 2, 3}) || !b.Add(KVRemoved, 3, KVCPU, []uint64{9}) ||
		!b.Add(KVCleared, 1, KVGPU, nil) || !b.Add(KVLost, 2, KVGPU, nil) {
		t.Fatal("a valid op was refused")
	}
	for _, bad := range []struct {
		op     KVOp
		rank   int
		medium KVMedium
		keys   []uint64
	}{{KVStored, 0, KVGPU, nil}, {KVCleared, 0, KVGPU, []uint64{1}}, {9, 0, KVGPU, nil}, {KVStored, KVMaxRanks, KVGPU, []uint64{1}},
		{KVStored, 0, 7, []uint64{1}}, {KVStored, 0, KVGPU, make([]uint64, KVMaxKeys+1)}} {
		if b.Add(bad.op, bad.rank, bad.medium, bad.keys) {
			t.Errorf("an invalid op was added: %+v", bad)
		}
	}
	h, ops, err := ParseKVBatch(b.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if string(h.EngineID) != "p1" || h.Epoch != 42 || h.Seq != 7 || h.BlockSize != 16 || len(ops) != 4 {
		t.Fatalf("header %+v, %d ops", h, len(ops))
	}
	if ops[0].Op != KVStored || !slices.Equal(ops[0].Keys, []uint64{1, 2, 3}) || ops[1].Rank != 3 || ops[1].Medium != KVCPU ||
		ops[2].Op != KVCleared || ops[3].Op != KVLost || len(ops[3].Keys) != 0 {
		t.Fatalf("ops %+v", ops)
	}
	var seen []KVOp
	var rh KVHeader
	buf, err := ReadKVOps(b.Bytes(), &rh, nil, func(op KVOp, rank int, m KVMedium, keys []uint64) { seen = append(seen, op) })
	if err != nil || !slices.Equal(seen, []KVOp{KVStored, KVRemoved, KVCleared, KVLost}) || cap(buf) == 0 {
		t.Fatalf("ReadKVOps: %v, %v", seen, err)
	}

	good := append([]byte(nil), b.Bytes()...)
	mutate := func(f func(p []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	for name, data := range map[string][]byte{
		"empty":         nil,
		"magic":         mutate(func(p []byte) []byte { p[0] = 'X'; return p }),
		"no id":         mutate(func(p []byte) []byte { p[4] = 0; return p }),
		"epoch 0":       mutate(func(p []byte) []byte { clear(p[7:15]); return p }),
		"seq 0":         mutate(func(p []byte) []byte { clear(p[15:23]); return p }),
		"block size 0":  mutate(func(p []byte) []byte { clear(p[23:25]); return p }),
		"no ops":        mutate(func(p []byte) []byte { clear(p[25:27]); return p[:27] }),
		"cut short":     good[:len(good)-1],
		"trailing":      append(append([]byte(nil), good...), 0),
		"more ops said": mutate(func(p []byte) []byte { p[25]++; return p }),
		"bad op":        mutate(func(p []byte) []byte { p[27] = 0; return p }),
		"too large":     make([]byte, KVMaxBatch+1),
	} {
		if _, err := CheckKVBatch(data); !errors.Is(err, ErrKVBatch) {
			t.Errorf("%s: CheckKVBatch = %v, want ErrKVBatch", name, err)
		}
		called := false
		var rh KVHeader
		if _, err := ReadKVOps(data, &rh, nil, func(KVOp, int, KVMedium, []uint64) { called = true }); err == nil || called {
			t.Errorf("%s: ReadKVOps read a refused batch", name)
		}
	}

	b.Reset("p1", 1, 1, 16)
	keys := make([]uint64, KVMaxKeys)
	n := 0
	for b.Add(KVStored, 0, KVGPU, keys) {
		n++
	}
	if b.Size() > KVMaxBatch || n == 0 {
		t.Fatalf("a full batch: %d bytes after %d ops", b.Size(), n)
	}
	if _, err := CheckKVBatch(b.Bytes()); err != nil {
		t.Fatalf("a full batch is refused: %v", err)
	}
	if KVMediumOf("CPU_PINNED") != KVCPU || KVMediumOf("") != KVGPU || KVMediumOf("STORAGE") != KVDisk {
		t.Error("KVMediumOf maps a medium wrongly")
	}
}
