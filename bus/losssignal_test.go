package bus

import "testing"

// TestLossSignalKeepsTheNewest proves that a stale loss report (of a
// consumer dropped already) never keeps out the current consumer's: the
// reader or follower that skips the stale number must still see the
// current one, or a consumer lost after it would never be made again
// (behaviour.md R-BUS-11: a reader keeps its name and its place).
func TestLossSignalKeepsTheNewest(t *testing.T) {
	s := newLossSignal()
	s.raise(3) // a consumer dropped already, still reporting
	s.raise(4) // the current one, lost
	if got := <-s; got != 4 {
		t.Fatalf("received %d after 3 then 4, want 4", got)
	}
	s.raise(5)
	s.raise(2) // a late report of an old consumer
	if got := <-s; got != 5 {
		t.Fatalf("received %d after 5 then 2, want 5", got)
	}
	select {
	case got := <-s:
		t.Fatalf("a second number %d waiting: one slot, the newest", got)
	default:
	}
}
