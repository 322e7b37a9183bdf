package breaker

import (
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestProbesAreTraced: with a tracer provider, every readmission probe
// (R-BRK-3) is one span with the probed engine, the engines of its
// transfer, the model and the outcome — a failed probe with an error
// status — and both probe legs carry the span's traceparent, as the
// simulators' request logs show (docs/observability.md, Tracing).
func TestProbesAreTraced(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(t.Context()) })
	h := newHarness(t, setup{fleet: prefillAndDecode})
	h.sims["d1"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500, Message: "decode is broken", Count: 1})
	h.startLeaderWith("breaker-a", func(o *Options) { o.TracerProvider = tp })
	h.ejectDecode("d1", "p1")
	h.waitState("d1", schemas.StateEligible)

	var failed, succeeded *tracetest.SpanStub
	testkit.WaitFor(t, waitBound, "the probes' spans", func() bool {
		failed, succeeded = nil, nil
		for _, s := range exp.GetSpans() {
			if s.Name != spanProbe {
				t.Fatalf("span %q", s.Name)
			}
			switch probeAttrs(s)["narwhal.outcome"].AsString() {
			case schemas.ProbeFailure:
				failed = &s
			case schemas.ProbeSuccess:
				succeeded = &s
			}
		}
		return failed != nil && succeeded != nil
	})
	for _, s := range []*tracetest.SpanStub{failed, succeeded} {
		a := probeAttrs(*s)
		if a["narwhal.engine"].AsString() != "d1" || a["narwhal.prefill_engine"].AsString() != "p1" || a["narwhal.decode_engine"].AsString() != "d1" ||
			a["narwhal.phase"].AsString() != schemas.PhaseDecode || a["gen_ai.request.model"].AsString() != testModel ||
			a["narwhal.breaker_id"].AsString() != "breaker-a" || s.Parent.IsValid() {
			t.Fatalf("probe span %+v", s.Attributes)
		}
	}
	if failed.Status.Code != codes.Error || succeeded.Status.Code == codes.Error || probeAttrs(*failed)["narwhal.message"].AsString() == "" {
		t.Fatalf("probe span statuses: failed %+v, succeeded %+v", failed.Status, succeeded.Status)
	}
	// Each probe's two legs carry its span's traceparent.
	sent := map[string]int{}
	for _, srv := range []*sim.Server{h.sims["p1"], h.sims["d1"]} {
		for _, r := range probeRequests(srv) {
			sent[r.Traceparent]++
		}
	}
	for _, s := range []*tracetest.SpanStub{failed, succeeded} {
		want := "00-" + s.SpanContext.TraceID().String() + "-" + s.SpanContext.SpanID().String() + "-01"
		if sent[want] != 2 {
			t.Fatalf("traceparent %s sent on %d legs, want 2 (sent: %v)", want, sent[want], sent)
		}
	}
}

func probeAttrs(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}
