package promreg

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestRegisterSharesOneCollectorPerName(t *testing.T) {
	reg := prometheus.NewRegistry()
	opts := prometheus.CounterOpts{Name: "t_total", Help: "h"}
	a := Register(reg, prometheus.NewCounter(opts))
	b := Register(reg, prometheus.NewCounter(opts))
	if a != b {
		t.Fatal("a second counter of the same name was not the registered one")
	}
	a.Inc()
	b.Inc()
	if v := testutil.ToFloat64(a); v != 2 {
		t.Fatalf("t_total = %v, want 2", v)
	}
	// Another kind under the name: kept local, the registered one unchanged.
	g := Register(reg, prometheus.NewGauge(prometheus.GaugeOpts{Name: "t_total", Help: "h"}))
	g.Set(7)
	if v := testutil.ToFloat64(a); v != 2 {
		t.Fatalf("t_total = %v after a clashing gauge, want 2", v)
	}
}
