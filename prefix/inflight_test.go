package prefix

import (
	"sync"
	"testing"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestInflightCreditsPlacedPromptsUntilSettledRPLACE4 proves Inflight: a
// kept prompt matches the shared leading blocks of another (the longest
// of every kept prompt's), while open and until its settle time, not
// after; a prompt of other tokens shares nothing; Settle of a reused
// slot's old ticket changes nothing; Clear forgets everything.
func TestInflightCreditsPlacedPromptsUntilSettledRPLACE4(t *testing.T) {
	var f Inflight
	a := chainKeys(1, 40)
	// b: a's first 25 blocks of tokens, then 15 others.
	b := AppendTokenKeys(nil, append(chainTokens(1, 25), chainTokens(2, 15)...), 16, 0)
	if got := f.Match(a, 1); got != 0 {
		t.Fatalf("empty Inflight matches %d blocks", got)
	}
	ta := f.Add(a, 100)
	if got := f.Match(a, 1_000_000); got != 40 {
		t.Fatalf("open prompt matches %d of its own 40 blocks", got)
	}
	if got := f.Match(b, 1_000_000); got != 25 {
		t.Fatalf("a prompt sharing 25 blocks matches %d", got)
	}
	if got := f.Match(chainKeys(3, 40), 1_000_000); got != 0 {
		t.Fatalf("a prompt of other tokens matches %d", got)
	}
	tb := f.Add(a[:10], 100)
	if got := f.Match(a, 1_000_000); got != 40 {
		t.Fatalf("with a shorter prompt kept too, a matches %d, want the longest (40)", got)
	}
	f.Settle(ta, 2000)
	if got := f.Match(a, 1999); got != 40 {
		t.Fatalf("before its settle time the prompt matches %d, want 40", got)
	}
	if got := f.Match(a, 2000); got != 10 {
		t.Fatalf("at its settle time the prompt still matches %d; want only the open shorter one's 10", got)
	}
	// ta's slot is free again (Match freed it): a new prompt may take it,
	// and ta's late Settle must not end the new one's credit.
	tc := f.Add(chainKeys(4, 5), 3000)
	f.Settle(ta, 1)
	if got := f.Match(chainKeys(4, 5), 4000); got != 5 {
		t.Fatalf("a stale ticket's Settle ended a new prompt's credit: matches %d, want 5", got)
	}
	f.Settle(tb, 0)
	if got := f.Match(a, 4000); got != 0 {
		t.Fatalf("a prompt settled at 0 still matches %d", got)
	}
	f.Clear()
	if got := f.Match(chainKeys(4, 5), 4000); got != 0 || f.live.Load() != 0 {
		t.Fatalf("after Clear: match %d, %d live slots", got, f.live.Load())
	}
	f.Settle(tc, 9000) // issued before Clear: ignored
	if f.live.Load() != 0 {
		t.Fatalf("a ticket issued before Clear revived its slot")
	}
}

// chainTokens returns the tokens of chainKeys(seed, n).
func chainTokens(seed uint32, n int) []uint32 {
	tokens := make([]uint32, 16*n)
	for i := range tokens {
		tokens[i] = seed*100000 + uint32(i)
	}
	return tokens
}

// TestInflightIsBoundedRPLACE4: with every slot open a further prompt is
// not kept (the zero ticket); with settled slots the one ending soonest
// is taken; a prompt past InflightMaxKeys keeps only its head.
func TestInflightIsBoundedRPLACE4(t *testing.T) {
	var f Inflight
	tickets := make([]InflightTicket, InflightSlots)
	for i := range tickets {
		if tickets[i] = f.Add(chainKeys(uint32(10+i), 2), 1); tickets[i] == (InflightTicket{}) {
			t.Fatalf("slot %d of %d refused", i, InflightSlots)
		}
	}
	if tk := f.Add(chainKeys(9, 2), 1); tk != (InflightTicket{}) {
		t.Fatal("a prompt was kept with every slot open")
	}
	f.Settle(tickets[7], 5000)
	f.Settle(tickets[3], 4000)
	if tk := f.Add(chainKeys(9, 2), 1); tk.slot != 3 {
		t.Fatalf("took slot %d, want 3 (the settled one ending soonest)", tk.slot)
	}
	if got := f.Match(chainKeys(13, 2), 2); got != 0 {
		t.Fatalf("the replaced prompt still matches %d", got)
	}
	var g Inflight
	long := AppendTokenKeys(nil, chainTokens(5, InflightMaxKeys+100), 16, 0)
	g.Add(long, 1)
	if got := g.Match(long, 2); got != InflightMaxKeys {
		t.Fatalf("a prompt of %d blocks matches %d, want its first %d", len(long), got, InflightMaxKeys)
	}
}

// TestInflightMatchDoesNotAllocate: Match and a steady Add/Settle cycle
// allocate nothing; Match is safe beside concurrent writers (-race).
func TestInflightMatchDoesNotAllocate(t *testing.T) {
	var f Inflight
	a := chainKeys(1, 125) // 2,000 tokens
	for i := range 8 {
		f.Add(chainKeys(uint32(20+i), 125), 1)
	}
	if allocs := testkit.LeastAllocs(200, func() {
		tk := f.Add(a, 1)
		_ = f.Match(a, 2)
		f.Settle(tk, 0)
	}); allocs != 0 {
		t.Fatalf("%v allocations per Add/Match/Settle", allocs)
	}
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 500 {
				tk := f.Add(chainKeys(uint32(100+w), 3), int64(i))
				_ = f.Match(a, int64(i))
				f.Settle(tk, int64(i+1))
			}
		}()
	}
	wg.Wait()
}

// BenchmarkInflightMatch is Match of a 2,000-token prompt against 16 kept
// prompts, one sharing its first half.
func BenchmarkInflightMatch(b *testing.B) {
	var f Inflight
	a := chainKeys(1, 125)
	f.Add(a[:62], 1)
	for i := range 15 {
		f.Add(chainKeys(uint32(30+i), 125), 1)
	}
	b.ReportAllocs()
	for b.Loop() {
		if f.Match(a, 2) != 62 {
			b.Fatal("wrong match")
		}
	}
}

// TestInflightSettleChainRPLACE4: SettleChain finds a kept prompt by its
// owner, count of keys and its last key only (not by a prefix of it,
// not by another prompt's or another owner's), settles the one ending latest when two hold it,
// only ever shortens a credit, frees it with until <= 0, and allocates
// nothing.
func TestInflightSettleChainRPLACE4(t *testing.T) {
	var f Inflight
	a := AppendTokenKeys(nil, chainTokens(1, 20), 16, 0)
	b := AppendTokenKeys(nil, chainTokens(2, 20), 16, 0)
	const now = int64(1_000_000_000)
	ta := f.AddOwned(a, 7, now)
	f.Settle(ta, now+10e9)
	f.Settle(f.AddOwned(b, 7, now), now+10e9)
	if f.SettleChain(7, 10, a[9], 0) || f.SettleChain(7, 20, b[9], 0) || f.SettleChain(7, 0, a[19], 0) {
		t.Fatal("a prefix of a kept prompt, or a mismatched key, settled a credit")
	}
	if f.SettleChain(8, 20, a[19], 0) || f.Match(a, now) != 20 {
		t.Fatal("another owner's settle touched a credit")
	}
	if f.SettleChain(7, 20, a[19], now+20e9) {
		t.Fatal("a settle lengthened a credit")
	}
	if !f.SettleChain(7, 20, a[19], now+1e9) {
		t.Fatal("a's chain not found")
	}
	if f.Match(a, now+1e9) != 0 || f.Match(b, now+1e9) != 20 {
		t.Fatalf("after settling a: a %d, b %d blocks at 1 s", f.Match(a, now+1e9), f.Match(b, now+1e9))
	}
	// Two credits of b: the one ending latest is settled first.
	f.Settle(f.AddOwned(b, 7, now), now+5e9)
	// (A Match past a credit's end frees it: look before, then past.)
	if !f.SettleChain(7, 20, b[19], 0) || f.Match(b, now+4e9) != 20 || f.Match(b, now+6e9) != 0 {
		t.Fatal("settling b did not free the credit ending latest, or freed the other")
	}
	if f.SettleChain(7, 20, b[19], 0) {
		t.Fatal("a freed credit settled again")
	}
	f.Settle(f.AddOwned(a, 7, now), now+10e9)
	if n := testkit.LeastAllocs(100, func() { f.SettleChain(7, 20, a[19], now+10e9) }); n != 0 {
		t.Fatalf("SettleChain allocates %v times", n)
	}
}
