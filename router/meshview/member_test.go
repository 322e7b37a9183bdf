package meshview

import (
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestHeadFollowsPrefillEndsRPLACE3 proves what the cost's work ahead is
// told of the prefill an engine computes (Member.Head): nothing while no
// prefill is in flight; the time since the last prefill ended there (or
// since the first was reserved); and the mean time from one end to the
// next over the prefills that answered — the first sets it, each next
// moves it an eighth of the way, one that failed or went back in time
// leaves it.
func TestHeadFollowsPrefillEndsRPLACE3(t *testing.T) {
	m := NewMember(engines.Engine{ID: "p1"}, schemas.FleetEntry{}, true)
	t0 := time.Now().Add(time.Hour).UnixNano() // every end after the reservation's real clock
	ms := func(n int64) int64 { return t0 + n*int64(time.Millisecond) }
	head := func(at int64, wantAge, wantMean time.Duration, wantTokens int64) {
		t.Helper()
		want := prefix.Progress{Age: wantAge, Mean: wantMean, MeanTokens: wantTokens}
		if got := m.Head(at); got != want {
			t.Fatalf("Head at +%v = %+v, want %+v", time.Duration(at-t0), got, want)
		}
	}
	head(ms(10), 0, 0, 0)
	if !m.TryReserve(Prefill) {
		t.Fatal("no prefill slot")
	}
	before := time.Now()
	if age := m.Head(before.Add(time.Second).UnixNano()).Age; age < time.Second || age > time.Second+time.Since(before)+time.Second {
		t.Fatalf("1 s after the first reservation the head's age is %v", age)
	}
	m.PrefillEnded(ms(0), false, 999) // a failure: the next begins, no mean yet
	head(ms(100), 100*time.Millisecond, 0, 0)
	m.PrefillEnded(ms(400), true, 800)
	head(ms(500), 100*time.Millisecond, 400*time.Millisecond, 800)
	m.PrefillEnded(ms(1200), true, 1600) // 800 ms, 1,600 tokens: an eighth of the way
	head(ms(1200), 0, 450*time.Millisecond, 900)
	m.PrefillEnded(ms(6000), false, 1<<30)
	head(ms(6100), 100*time.Millisecond, 450*time.Millisecond, 900)
	m.PrefillEnded(ms(5000), true, 1<<30) // before the head began: not a duration
	head(ms(5100), 100*time.Millisecond, 450*time.Millisecond, 900)
	m.Release(Prefill)
	head(ms(5200), 0, 0, 0)
}
