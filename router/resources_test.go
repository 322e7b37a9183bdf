package router

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/schemas"
)

func resourceFaultOf(resource string) *engines.Fault {
	f := engines.NewFault(engines.KindRouterResources, schemas.PhasePrefill, "p1", 0, "router out of local resources ("+resource+", …)")
	f.Resource = resource
	return f
}

// TestResourceWindowRFAIL9 proves the readiness window of behaviour.md
// R-FAIL-9: after a router_resources fault the router is unready, naming
// the resource, until 5 s pass without another; a later fault starts the
// window again.
func TestResourceWindowRFAIL9(t *testing.T) {
	if resourceWindow != 5*time.Second {
		t.Fatalf("resourceWindow %v, want 5 s", resourceWindow)
	}
	r := newResourceFaults(prometheus.NewRegistry())
	t0 := time.Unix(1000, 0)
	if p := r.problem(t0); p != "" {
		t.Fatalf("unready before any fault: %q", p)
	}
	f := resourceFaultOf("emfile")
	r.note(f, t0)
	if p := r.problem(t0.Add(4900 * time.Millisecond)); !strings.HasPrefix(p, "router out of local resources (emfile) 4.9 s ago") {
		t.Fatalf("4.9 s after: %q", p)
	}
	if p := r.problem(t0.Add(5 * time.Second)); p != "" {
		t.Fatalf("5 s after: still unready: %q", p)
	}
	r.note(resourceFaultOf("enobufs"), t0.Add(6*time.Second))
	if p := r.problem(t0.Add(10 * time.Second)); !strings.Contains(p, "(enobufs)") {
		t.Fatalf("4 s after a second fault: %q", p)
	}
	if p := r.problem(t0.Add(11 * time.Second)); p != "" {
		t.Fatalf("5 s after the second fault: %q", p)
	}
	// A wait at one engine's full pool is counted but leaves the router
	// ready: the pool is filled by that engine's unanswered legs.
	r.note(resourceFaultOf("pool"), t0.Add(12*time.Second))
	if p := r.problem(t0.Add(12 * time.Second)); p != "" {
		t.Fatalf("after a pool wait: unready: %q", p)
	}
	if n := testutil.ToFloat64(r.errors.WithLabelValues("pool")); n != 1 {
		t.Fatalf("pool waits counted %v, want 1", n)
	}
}
