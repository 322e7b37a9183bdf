package prefix

import (
	"math/rand/v2"
	"testing"
)

// TestTableMatchesAMap runs random puts and deletes (with hashes that
// crowd a few probe runs, and the hash 0) against a Go map: every lookup
// agrees, through growth and backward-shift deletion.
func TestTableMatchesAMap(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	tb := newTable()
	ref := map[uint64]int32{}
	key := func() uint64 {
		if r.IntN(4) == 0 {
			return uint64(r.IntN(64)) // small keys: 0, and many collisions of a narrow range
		}
		return r.Uint64()
	}
	var keys []uint64
	for i := range 200000 {
		switch k := key(); {
		case r.IntN(3) == 0 && len(keys) > 0:
			j := r.IntN(len(keys))
			k = keys[j]
			keys[j] = keys[len(keys)-1]
			keys = keys[:len(keys)-1]
			tb.del(k)
			delete(ref, storedKey(k))
		default:
			if _, ok := ref[storedKey(k)]; ok {
				break
			}
			tb.put(k, int32(i))
			ref[storedKey(k)] = int32(i)
			keys = append(keys, k)
		}
		if i%997 == 0 {
			for _, k := range keys {
				if s, ok := tb.get(k); !ok || s != ref[storedKey(k)] {
					t.Fatalf("step %d: key %x: got %d %v, want %d", i, k, s, ok, ref[storedKey(k)])
				}
			}
			if tb.n != len(ref) {
				t.Fatalf("step %d: %d entries, want %d", i, tb.n, len(ref))
			}
		}
	}
	for range 1000 {
		k := r.Uint64()
		if _, in := ref[storedKey(k)]; !in {
			if _, ok := tb.get(k); ok {
				t.Fatalf("absent key %x found", k)
			}
		}
	}
}
