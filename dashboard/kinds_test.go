package dashboard

import (
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/schemas"
)

// TestAppliersAreKinds checks that the page shows only kinds of
// schemas.EventKinds, applies an event of each without refusing it,
// refuses one of a shown kind that does not decode, and ignores the kinds
// it does not show.
func TestAppliersAreKinds(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	for kind := range appliers {
		if _, ok := schemas.LookupEventKind(kind); !ok {
			t.Errorf("the page applies kind %q, which schemas.EventKinds does not have", kind)
		}
	}
	for _, k := range schemas.EventKinds() {
		s := newState(func() time.Time { return now })
		s.applyEvent(k.Name, []byte(`{"schema":"`+k.Schema+`","id":"x","at":"2026-12-01T11:59:00Z","engine_id":"d1","router_id":"rt-1"}`))
		if s.ignored != 0 {
			t.Errorf("kind %s: a valid event was refused", k.Name)
		}
		s.applyEvent(k.Name, []byte(`{"schema":1}`))
		want := int64(0) // not shown: ignored
		if appliers[k.Name] != nil {
			want = 1
		}
		if s.ignored != want {
			t.Errorf("kind %s (shown: %v): %d refused after an event that does not decode, want %d", k.Name, want == 1, s.ignored, want)
		}
	}
}
