package fleet

import (
	"testing"

	"github.com/narwhalmesh/narwhal/schemas"
)

// TestDrainDone pins the rule that ends a drain (behaviour.md R-FLEET-3):
// every router's report lists the engine with zero legs; a router that
// does not list it has not seen the drain and is busy; with no report at
// all the caller's answer holds (the breaker: done; an engine draining
// itself: busy).
func TestDrainDone(t *testing.T) {
	rep := func(draining map[string]int64) schemas.RouterReport {
		return schemas.RouterReport{Draining: draining}
	}
	for _, c := range []struct {
		name    string
		reports []schemas.RouterReport
		want    bool
	}{
		{"every router at zero", []schemas.RouterReport{rep(map[string]int64{"d1": 0}), rep(map[string]int64{"d1": 0, "d2": 3})}, true},
		{"a leg in flight", []schemas.RouterReport{rep(map[string]int64{"d1": 0}), rep(map[string]int64{"d1": 1})}, false},
		{"a router that has not seen the drain", []schemas.RouterReport{rep(map[string]int64{"d1": 0}), rep(map[string]int64{})}, false},
		{"a router without any draining engine", []schemas.RouterReport{rep(nil)}, false},
	} {
		for _, none := range []WithoutReports{DoneWithoutReports, BusyWithoutReports} {
			if got := DrainDone("d1", c.reports, none); got != c.want {
				t.Errorf("%s (without reports %v): %v, want %v", c.name, none, got, c.want)
			}
		}
	}
	if !DrainDone("d1", nil, DoneWithoutReports) {
		t.Error("no router at all, for the breaker: want done at once")
	}
	if DrainDone("d1", nil, BusyWithoutReports) {
		t.Error("no router at all, for the engine itself: want busy")
	}
}
