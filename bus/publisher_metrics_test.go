package bus_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestDroppedEventsStartAtZeroRBUS10 proves narwhal_events_dropped_total
// has a zero series for every reason and event kind from the start, so an
// alert on its rate sees the series before the first drop (R-BUS-10).
func TestDroppedEventsStartAtZeroRBUS10(t *testing.T) {
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1})
	b := connect(t, e)
	reg := prometheus.NewRegistry()
	p := bus.NewPublisher(b, 4, reg)
	defer p.Close()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[[2]string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "narwhal_events_dropped_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			seen[[2]string{label(m, "reason"), label(m, "kind")}] = m.GetCounter().GetValue()
		}
	}
	for _, r := range []string{bus.DropBufferFull, bus.DropExpired, bus.DropInvalid, bus.DropClosed} {
		for _, k := range []string{schemas.KindFailure, schemas.KindQuarantine, schemas.KindHandoff, schemas.KindRequest,
			schemas.KindProbe, schemas.KindEligibility, schemas.KindChaos, schemas.KindFleet, schemas.KindKVRecomputed} {
			v, ok := seen[[2]string{r, k}]
			if !ok || v != 0 {
				t.Errorf("narwhal_events_dropped_total{reason=%q,kind=%q}: present %v, value %v; want a zero series", r, k, ok, v)
			}
		}
	}
}

func label(m *dto.Metric, name string) string {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}
