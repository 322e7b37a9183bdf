package breaker

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestMetricsShareTheRoutersEngineLabelRBRK1 proves the breaker labels
// engines "engine", as the routers do, so that their series join; that
// an ejection is counted under it (R-BRK-1); and that every engine's
// ejection, readmission and probe series exist at zero from the start.
func TestMetricsShareTheRoutersEngineLabelRBRK1(t *testing.T) {
	h := newHarness(t, setup{fleet: []simSpec{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}})
	reg := prometheus.NewRegistry()
	b := h.connect("b-metrics")
	svc, err := New(Options{Config: h.cfg, Bus: b, ID: "b-metrics", Logger: testLogger(t), Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"p1", "d1"} {
		for _, name := range []string{"narwhal_breaker_ejections_total", "narwhal_breaker_readmissions_total", "narwhal_breaker_probes_total"} {
			if n := testkit.GatheredSeries(t, reg, name, "engine", id); n == 0 {
				t.Errorf("%s{engine=%q}: no series at start", name, id)
			}
		}
	}
	if n := testkit.GatheredSeries(t, reg, "narwhal_breaker_probes_total", "engine", "d1"); n != 3 {
		t.Errorf("narwhal_breaker_probes_total{engine=d1}: %d series, want one per outcome", n)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	defer func() { cancel(); <-done }()
	testkit.WaitFor(t, waitBound, "the breaker to lead", svc.Leader)
	h.ejectDecode("d1", "p1")
	testkit.WaitFor(t, waitBound, "the ejection counted", func() bool {
		return testkit.GatheredSum(t, reg, "narwhal_breaker_ejections_total", "engine", "d1") == 1
	})
	// The leader reports each engine's state: d1 ejected, p1 eligible.
	testkit.WaitFor(t, waitBound, "narwhal_breaker_engine_ejected{engine=d1} 1", func() bool {
		return testkit.GatheredSum(t, reg, "narwhal_breaker_engine_ejected", "engine", "d1") == 1
	})
	if n := testkit.GatheredSeries(t, reg, "narwhal_breaker_engine_ejected", "engine", "p1"); n != 1 || testkit.GatheredSum(t, reg, "narwhal_breaker_engine_ejected", "engine", "p1") != 0 {
		t.Errorf("narwhal_breaker_engine_ejected{engine=p1}: %d series, want one at 0", n)
	}
	if v := testkit.GatheredSum(t, reg, "narwhal_breaker_ejections_total", "engine", "p1"); v != 0 {
		t.Errorf("p1 ejections %v, want 0", v)
	}
	if v := testkit.GatheredSum(t, reg, "narwhal_breaker_events_total", "kind", schemas.KindFailure); v < 3 {
		t.Errorf("failure events consumed %v, want 3", v)
	}
}
