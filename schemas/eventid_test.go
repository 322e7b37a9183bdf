package schemas

import (
	"strings"
	"testing"
)

// TestEventIDsAreUnpredictableRBUS11 proves that event ids, which are the
// stream's message ids, cannot be guessed from earlier ones (behaviour.md
// R-BUS-11): a NUID keeps a 12-character prefix and steps its tail by a
// fixed increment, so one seen id gave away the next; these ids are
// distinct, 22 characters, and consecutive ones share no common prefix of
// note.
func TestEventIDsAreUnpredictableRBUS11(t *testing.T) {
	seen := map[string]bool{}
	prev := NewEventID()
	shared := 0
	for range 10000 {
		id := NewEventID()
		if len(id) != 22 || strings.ContainsAny(id, "=+/ ") {
			t.Fatalf("event id %q: want 22 characters of URL-safe base64", id)
		}
		if seen[id] {
			t.Fatalf("event id %q twice", id)
		}
		seen[id] = true
		n := 0
		for n < len(id) && id[n] == prev[n] {
			n++
		}
		if n >= 4 {
			shared++
		}
		prev = id
	}
	// Chance of a shared 4-character prefix is 64^-4 per pair.
	if shared > 2 {
		t.Errorf("%d of 10000 consecutive ids share a 4-character prefix: ids look sequential", shared)
	}
}
