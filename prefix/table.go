package prefix

import (
	"crypto/rand"
	"encoding/binary"
)

// table maps a block hash to its slot in an engineLRU: open addressing
// with linear probing over keys stored inline (one cache line per lookup,
// usually), kept at most half full, grown by doubling. The probe position
// mixes the key with a per-table random seed, so that hashes chosen by a
// hostile peer on the bus cannot be made to collide. Key 0 marks an
// empty entry; a block hash of 0 is stored as 1.
type table struct {
	keys  []uint64
	slots []int32
	n     int
	mask  uint64
	seed  uint64
}

const minTable = 1024

func newTable() *table {
	var b [8]byte
	_, _ = rand.Read(b[:])
	t := &table{seed: binary.LittleEndian.Uint64(b[:]) | 1}
	t.alloc(minTable)
	return t
}

func (t *table) alloc(size int) {
	t.keys = make([]uint64, size)
	t.slots = make([]int32, size)
	t.mask = uint64(size - 1)
	t.n = 0
}

func storedKey(h uint64) uint64 {
	if h == 0 {
		return 1
	}
	return h
}

// home is the probe start of key k.
func (t *table) home(k uint64) uint64 {
	k ^= t.seed
	k ^= k >> 32
	k *= 0xd6e8feb86659fd93
	k ^= k >> 32
	return k & t.mask
}

// get returns h's slot and whether h is in the table.
func (t *table) get(h uint64) (int32, bool) {
	k := storedKey(h)
	for i := t.home(k); ; i = (i + 1) & t.mask {
		switch t.keys[i] {
		case k:
			return t.slots[i], true
		case 0:
			return 0, false
		}
	}
}

// put adds h (not in the table) with slot s.
func (t *table) put(h uint64, s int32) {
	if 2*(t.n+1) > len(t.keys) {
		t.grow()
	}
	k := storedKey(h)
	i := t.home(k)
	for t.keys[i] != 0 {
		i = (i + 1) & t.mask
	}
	t.keys[i], t.slots[i] = k, s
	t.n++
}

func (t *table) grow() {
	keys, slots := t.keys, t.slots
	t.alloc(2 * len(keys))
	for i, k := range keys {
		if k != 0 {
			j := t.home(k)
			for t.keys[j] != 0 {
				j = (j + 1) & t.mask
			}
			t.keys[j], t.slots[j] = k, slots[i]
			t.n++
		}
	}
}

// del removes h if present, shifting later entries of its probe run
// back so that no tombstone is left.
func (t *table) del(h uint64) {
	k := storedKey(h)
	i := t.home(k)
	for t.keys[i] != k {
		if t.keys[i] == 0 {
			return
		}
		i = (i + 1) & t.mask
	}
	for j := (i + 1) & t.mask; t.keys[j] != 0; j = (j + 1) & t.mask {
		// The entry at j may move back to the hole at i unless its home
		// lies cyclically in (i, j].
		home := t.home(t.keys[j])
		if (j-home)&t.mask >= (j-i)&t.mask {
			t.keys[i], t.slots[i] = t.keys[j], t.slots[j]
			i = j
		}
	}
	t.keys[i] = 0
	t.n--
}

// clear empties the table, keeping its size.
func (t *table) clear() {
	clear(t.keys)
	t.n = 0
}
