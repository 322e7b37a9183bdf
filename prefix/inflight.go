package prefix

import (
	"sync"
	"sync/atomic"
)

// InflightSlots is how many prompts an Inflight keeps: more than the
// requests a prefill engine runs and queues at once in practice. When
// every slot holds an attempt still in flight, a further prompt is not
// kept (its credit is lost, never wrong).
const InflightSlots = 64

// InflightMaxKeys bounds the leading blocks kept of one prompt: 16,384
// tokens at 16 tokens a block. Longer prompts keep their first
// InflightMaxKeys blocks, and an engine's Inflight stays below 512 KiB.
const InflightMaxKeys = 1024

// Inflight is what one router has placed on one engine that the engine's
// KV events may not yet report (behaviour.md R-PLACE-4): the token-block
// keys (TokenBlockKey chains) of prompts whose prefill attempts are in
// flight there, and of those that ended less than a grace ago. An engine
// stores a prompt's blocks only once its prefill leaves the engine's
// queue, and its events take a few milliseconds more to reach the
// router; until then a second request of the same prompt would see none
// of it in the exact index and be sent elsewhere, though placed on the
// same engine it would find the blocks stored by the time it runs.
// Placement credits an exact engine with the longer of its exact match
// and its Inflight match.
//
// The zero value is empty and ready. It is safe for concurrent use; Match
// takes no lock while nothing is kept.
type Inflight struct {
	live  atomic.Int32 // slots with until != 0
	mu    sync.Mutex   // guards slots and gen
	gen   uint64
	slots [InflightSlots]inflightSlot
}

// inflightSlot is one kept prompt: its keys, and until, the UnixNano
// time its credit ends (inflightOpen while its attempt is in flight, 0
// for a free slot); gen tells a ticket's slot from a later reuse.
type inflightSlot struct {
	keys  []uint64
	until int64
	gen   uint64
	owner uint64 // AddOwned's owner, 0 for Add
}

// inflightOpen is an open slot's until: its attempt has not ended.
const inflightOpen = int64(^uint64(0) >> 1)

// InflightTicket names the slot Add kept a prompt in, for Settle. The
// zero ticket names none.
type InflightTicket struct {
	slot int32
	gen  uint64
}

// Add keeps keys (copied, at most InflightMaxKeys) as a prompt in flight
// until Settle; now is the time in UnixNano. It takes a free slot, else
// one whose credit ended before now, else the settled one ending
// soonest; when every slot is open it keeps nothing and returns the zero
// ticket. Empty keys are not kept. It allocates only the first time a
// slot holds a prompt longer than any it held before.
func (f *Inflight) Add(keys []uint64, now int64) InflightTicket {
	return f.AddOwned(keys, 0, now)
}

// AddOwned is Add for a prompt another party placed: owner (non-zero,
// e.g. a hash of the placing router's id) is the only one whose
// SettleChain can settle it.
func (f *Inflight) AddOwned(keys []uint64, owner uint64, now int64) InflightTicket {
	if len(keys) == 0 {
		return InflightTicket{}
	}
	keys = keys[:min(len(keys), InflightMaxKeys)]
	f.mu.Lock()
	defer f.mu.Unlock()
	pick := -1
	for i := range f.slots {
		s := &f.slots[i]
		if s.until == 0 || s.until <= now {
			pick = i
			break
		}
		if s.until != inflightOpen && (pick < 0 || s.until < f.slots[pick].until) {
			pick = i
		}
	}
	if pick < 0 {
		return InflightTicket{}
	}
	s := &f.slots[pick]
	if s.until == 0 {
		f.live.Add(1)
	}
	f.gen++
	s.keys = append(s.keys[:0], keys...)
	s.until, s.gen, s.owner = inflightOpen, f.gen, owner
	return InflightTicket{slot: int32(pick), gen: s.gen}
}

// Settle ends the credit of t's prompt at until (UnixNano): the attempt
// ended, and its blocks' events are due by then. until <= 0 frees the
// slot now. A ticket whose slot was taken again since, or the zero
// ticket, is ignored.
func (f *Inflight) Settle(t InflightTicket, until int64) {
	if t.gen == 0 || t.slot < 0 || int(t.slot) >= len(f.slots) {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s := &f.slots[t.slot]
	if s.gen != t.gen || s.until == 0 {
		return
	}
	if until <= 0 {
		s.until = 0
		s.keys = s.keys[:0]
		f.live.Add(-1)
		return
	}
	s.until = until
}

// SettleChain ends, at until (UnixNano; <= 0 frees the slot now), the
// credit of a prompt AddOwned kept for owner, known only by its chain:
// count keys, the last of them last (each key covers every block before
// it, so the two name one prompt). It settles the one such slot whose
// credit ends latest after until, and only ever shortens a credit; it
// reports whether it found one. A slot of another owner is never
// touched. This is how another router's attempt ending (bus.ParsePlacedEnd)
// reaches the credit its placement gave. It does not allocate.
func (f *Inflight) SettleChain(owner uint64, count int, last uint64, until int64) bool {
	if count <= 0 || f.live.Load() == 0 {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	pick := -1
	for i := range f.slots {
		s := &f.slots[i]
		if s.until != 0 && s.owner == owner && s.until > until && len(s.keys) == count && s.keys[count-1] == last &&
			(pick < 0 || s.until > f.slots[pick].until) {
			pick = i
		}
	}
	if pick < 0 {
		return false
	}
	s := &f.slots[pick]
	if until <= 0 {
		s.until, s.keys = 0, s.keys[:0]
		f.live.Add(-1)
		return true
	}
	s.until = until
	return true
}

// Match returns the leading blocks of keys that a kept prompt whose
// credit has not ended at now (UnixNano) shares, the longest of them; 0
// when none. Keys are chains (each key covers every block before it), so
// a prompt shares a prefix exactly as long as the last key the two have
// in common, found by binary search. It does not allocate.
func (f *Inflight) Match(keys []uint64, now int64) int {
	if len(keys) == 0 || f.live.Load() == 0 {
		return 0
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	best := 0
	for i := range f.slots {
		s := &f.slots[i]
		if s.until <= now {
			if s.until != 0 { // ended: freed, so that Match takes no lock once none is kept
				s.until, s.keys = 0, s.keys[:0]
				f.live.Add(-1)
			}
			continue
		}
		n := min(len(s.keys), len(keys))
		if n <= best || s.keys[best] != keys[best] {
			continue // cannot beat best
		}
		// s.keys[k] == keys[k] holds for k < the shared length and not
		// past it: find the first k where it fails.
		lo, hi := best+1, n
		for lo < hi {
			mid := int(uint(lo+hi) >> 1)
			if s.keys[mid] == keys[mid] {
				lo = mid + 1
			} else {
				hi = mid
			}
		}
		best = lo
	}
	return best
}

// Clear frees every slot (the engine's cache is gone: ejected, drained,
// restarted); tickets issued before are ignored from then on.
func (f *Inflight) Clear() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := range f.slots {
		s := &f.slots[i]
		if s.until != 0 {
			f.live.Add(-1)
		}
		s.until, s.keys = 0, s.keys[:0]
		s.gen = 0
	}
}
