package router

import (
	"io"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// The client's trace context in these tests (W3C's example values).
const (
	clientTraceID     = "4bf92f3577b34da6a3ce929d0e0e4736"
	clientSpanID      = "00f067aa0ba902b7"
	clientTraceparent = "00-" + clientTraceID + "-" + clientSpanID + "-01"
	clientTracestate  = "vendor=opaque"
)

// tracedStack is a router over one producer and one decoder whose spans
// go to the returned in-memory exporter.
func tracedStack(t *testing.T, mutate func(*config.Config)) (*stack, *tracetest.InMemoryExporter) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(t.Context()) })
	s := newStackWith(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}, mutate, nil, io.Discard,
		func(o *Options) { o.TracerProvider = tp })
	s.waitModels()
	return s, exp
}

// requestSpans waits until the request span (kind server) has ended and
// returns every span exported so far, the request span first.
func requestSpans(t *testing.T, exp *tracetest.InMemoryExporter) tracetest.SpanStubs {
	t.Helper()
	var spans tracetest.SpanStubs
	testkit.WaitFor(t, 5*time.Second, "the request span", func() bool {
		spans = exp.GetSpans()
		for i, s := range spans {
			if s.SpanKind == trace.SpanKindServer {
				spans[0], spans[i] = spans[i], spans[0]
				return true
			}
		}
		return false
	})
	return spans
}

// attrs returns a span's attributes by key.
func attrs(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}

// byName returns the spans named name.
func byName(spans tracetest.SpanStubs, name string) []tracetest.SpanStub {
	var out []tracetest.SpanStub
	for _, s := range spans {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

// legTraceparent returns the traceparent the engine recorded on its only
// request of phase.
func legTraceparent(t *testing.T, srv *sim.Server, phase string) (traceparent, tracestate string) {
	t.Helper()
	var found []sim.RecordedRequest
	for _, r := range srv.Requests() {
		if r.Phase == phase {
			found = append(found, r)
		}
	}
	if len(found) != 1 {
		t.Fatalf("%d %s requests recorded, want 1: %+v", len(found), phase, found)
	}
	return found[0].Traceparent, found[0].Tracestate
}

// TestTraceOfARequest: with tracing on, one request is one trace — the
// request span continues the client's traceparent (same trace id, parent
// the client's span) and has one child each for placement, the prefill
// leg, the handoff check and the decode leg, with the engine ids, model,
// backend request id (R-OWN-4), outcome and token counts; each engine leg
// carries its own span's traceparent and the client's tracestate, as the
// simulator's request log shows (docs/observability.md, Tracing).
func TestTraceOfARequest(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(map[bool]string{true: "stream", false: "aggregated"}[stream], func(t *testing.T) {
			s, exp := tracedStack(t, nil)
			extra := `"max_tokens":5,"seed":1`
			if stream {
				extra += `,"stream":true`
			}
			resp, body := s.post(schemas.EndpointChat, chatBody("trace me", extra), "X-Request-Id", "traced-1",
				"traceparent", clientTraceparent, "tracestate", clientTracestate)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			spans := requestSpans(t, exp)
			if len(spans) != 5 {
				t.Fatalf("%d spans, want 5: %v", len(spans), spanNames(spans))
			}
			root := spans[0]
			if root.SpanContext.TraceID().String() != clientTraceID || root.Parent.SpanID().String() != clientSpanID || !root.Parent.IsRemote() {
				t.Fatalf("request span trace %s parent %s, want the client's %s %s", root.SpanContext.TraceID(), root.Parent.SpanID(), clientTraceID, clientSpanID)
			}
			if root.Name != "POST "+schemas.EndpointChat || root.Status.Code == codes.Error {
				t.Fatalf("request span %q status %+v", root.Name, root.Status)
			}
			ra := attrs(root)
			backendID := ra[attrBackendRequestID].AsString()
			if ra[attrRequestID].AsString() != "traced-1" || ra[attrModel].AsString() != testModel || ra[attrOutcome].AsString() != "ok" ||
				ra[attrPrefillEngine].AsString() != "p1" || ra[attrDecodeEngine].AsString() != "d1" || !strings.HasPrefix(backendID, "traced-1-1-") ||
				ra[attrStatus].AsInt64() != 200 || ra[attrPromptTokens].AsInt64() <= 0 || ra[attrCompletionTokens].AsInt64() != 5 ||
				ra[attrStream].AsBool() != stream {
				t.Fatalf("request span attributes %v", root.Attributes)
			}
			want := map[string]string{spanPlacement: "", spanPrefill: "p1", spanHandoff: "", spanDecode: "d1"}
			legs := map[string]tracetest.SpanStub{}
			for _, sp := range spans[1:] {
				engine, ok := want[sp.Name]
				if !ok || legs[sp.Name].Name != "" {
					t.Fatalf("unexpected span %q among %v", sp.Name, spanNames(spans))
				}
				legs[sp.Name] = sp
				a := attrs(sp)
				if sp.SpanContext.TraceID() != root.SpanContext.TraceID() || sp.Parent.SpanID() != root.SpanContext.SpanID() {
					t.Fatalf("span %s is not a child of the request span", sp.Name)
				}
				if a[attrOutcome].AsString() != "ok" || sp.Status.Code == codes.Error || a[attrAttempt].AsInt64() != 1 {
					t.Fatalf("span %s attributes %v status %+v", sp.Name, sp.Attributes, sp.Status)
				}
				if engine != "" && (a[attrEngine].AsString() != engine || a[attrBackendRequestID].AsString() != backendID) {
					t.Fatalf("span %s attributes %v, want engine %s and backend id %s", sp.Name, sp.Attributes, engine, backendID)
				}
				if sp.StartTime.Before(root.StartTime) || sp.EndTime.After(root.EndTime) {
					t.Fatalf("span %s [%v, %v] outside the request's [%v, %v]", sp.Name, sp.StartTime, sp.EndTime, root.StartTime, root.EndTime)
				}
			}
			if a := attrs(legs[spanPlacement]); a[attrPrefillEngine].AsString() != "p1" || a[attrDecodeEngine].AsString() != "d1" {
				t.Fatalf("placement span %v", legs[spanPlacement].Attributes)
			}
			if a := attrs(legs[spanDecode]); a[attrCompletionTokens].AsInt64() != 5 {
				t.Fatalf("decode span %v", legs[spanDecode].Attributes)
			}
			for phase, span := range map[string]tracetest.SpanStub{sim.PhasePrefill: legs[spanPrefill], sim.PhaseDecode: legs[spanDecode]} {
				srv := s.sims["p1"]
				if phase == sim.PhaseDecode {
					srv = s.sims["d1"]
				}
				tp, ts := legTraceparent(t, srv, phase)
				if wantTP := "00-" + clientTraceID + "-" + span.SpanContext.SpanID().String() + "-01"; tp != wantTP || ts != clientTracestate {
					t.Fatalf("%s leg sent traceparent %q tracestate %q, want %q %q", phase, tp, ts, wantTP, clientTracestate)
				}
			}
		})
	}
}

func spanNames(spans tracetest.SpanStubs) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.Name)
	}
	return out
}

// TestTraceRootWithoutClientContext: a request without a traceparent (or
// with a malformed one) starts a trace of its own, and its legs still
// carry the trace context of their spans.
func TestTraceRootWithoutClientContext(t *testing.T) {
	s, exp := tracedStack(t, nil)
	for i, header := range [][]string{nil, {"traceparent", "00-zz-00f067aa0ba902b7-01"}} {
		exp.Reset()
		s.sims["p1"].ResetRequests()
		s.sims["d1"].ResetRequests()
		resp, body := s.post(schemas.EndpointChat, chatBody("root", `"max_tokens":2,"stream":true`), header...)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		spans := requestSpans(t, exp)
		root := spans[0]
		if root.Parent.IsValid() || root.SpanContext.TraceID().String() == clientTraceID {
			t.Fatalf("case %d: request span has parent %v", i, root.Parent)
		}
		if len(byName(spans, spanPrefill)) != 1 || len(byName(spans, spanDecode)) != 1 {
			t.Fatalf("case %d: spans %v", i, spanNames(spans))
		}
		tp, _ := legTraceparent(t, s.sims["p1"], sim.PhasePrefill)
		if want := "00-" + root.SpanContext.TraceID().String() + "-" + byName(spans, spanPrefill)[0].SpanContext.SpanID().String() + "-01"; tp != want {
			t.Fatalf("case %d: prefill traceparent %q, want %q", i, tp, want)
		}
		tp, _ = legTraceparent(t, s.sims["d1"], sim.PhaseDecode)
		if want := "00-" + root.SpanContext.TraceID().String() + "-" + byName(spans, spanDecode)[0].SpanContext.SpanID().String() + "-01"; tp != want {
			t.Fatalf("case %d: decode traceparent %q, want %q", i, tp, want)
		}
	}
}

// TestTraceOfAFailedRequest: a request that fails has the fault's kind on
// its request span and on the span of the step that failed, both with an
// error status: a failed prefill leg or handoff check leaves no decode
// span, a failed decode leg's span carries the fault (R-FAIL-6).
func TestTraceOfAFailedRequest(t *testing.T) {
	cases := []struct {
		name, engine, phase, kind, failed string
		fault                             sim.Fault
		maxAgeS                           float64
	}{
		{"prefill", "p1", sim.PhasePrefill, "prefill_status", spanPrefill,
			sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhasePrefill, Status: 500, Message: "engine says no"}, 0},
		{"decode", "d1", sim.PhaseDecode, "upstream_status", spanDecode,
			sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500, Message: "engine says no"}, 0},
		// A prefill slower than handoff.max_age_s leaves an expired
		// handoff (R-OWN-2): the handoff check fails, no decode is sent.
		{"handoff", "p1", "", "handoff_expired", spanHandoff,
			sim.Fault{Kind: sim.FaultHeaderDelay, Phase: sim.PhasePrefill, DelayMS: 60}, 0.02},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, exp := tracedStack(t, func(c *config.Config) {
				c.Recovery.RetryAttempts = 0
				if tc.maxAgeS > 0 {
					c.Handoff.MaxAgeS = tc.maxAgeS
				}
			})
			s.sims[tc.engine].Arm(tc.fault)
			resp, body := s.post(schemas.EndpointChat, chatBody("fail", `"max_tokens":2,"stream":true`), "traceparent", clientTraceparent)
			if resp.StatusCode/100 != 5 {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			spans := requestSpans(t, exp)
			root := spans[0]
			ra := attrs(root)
			if root.Status.Code != codes.Error || ra[attrFaultKind].AsString() != tc.kind || ra[attrOutcome].AsString() != tc.kind ||
				ra[attrStatus].AsInt64() != int64(resp.StatusCode) || root.SpanContext.TraceID().String() != clientTraceID {
				t.Fatalf("request span status %+v attributes %v", root.Status, root.Attributes)
			}
			failed := byName(spans, tc.failed)
			if len(failed) != 1 {
				t.Fatalf("spans %v, want one %s", spanNames(spans), tc.failed)
			}
			if a := attrs(failed[0]); failed[0].Status.Code != codes.Error || a[attrFaultKind].AsString() != tc.kind || a[attrEngine].AsString() != tc.engine ||
				tc.fault.Message != "" && !strings.Contains(failed[0].Status.Description, tc.fault.Message) {
				t.Fatalf("%s span status %+v attributes %v", tc.failed, failed[0].Status, failed[0].Attributes)
			}
			if tc.phase != sim.PhaseDecode && len(byName(spans, spanDecode)) != 0 {
				t.Fatalf("a failed %s has decode spans: %v", tc.name, spanNames(spans))
			}
			if tc.name == "handoff" && len(s.sims["d1"].Requests()) != 0 {
				t.Fatalf("a decode request was sent for an expired handoff: %+v", s.sims["d1"].Requests())
			}
			if tc.phase == sim.PhaseDecode {
				if p := byName(spans, spanPrefill); len(p) != 1 || p[0].Status.Code == codes.Error {
					t.Fatalf("prefill span of a failed decode: %v", p)
				}
			}
		})
	}
}

// TestTracingOff: without a tracer provider no span is made (not even
// with a global OpenTelemetry provider installed), the legs
// carry no trace context when the client sent none, and carry the
// client's own traceparent and tracestate unchanged when it sent valid
// ones (the router passes the trace through; an engine's spans are then
// children of the client's span); a malformed traceparent is not passed
// on.
func TestTracingOff(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(t.Context()) })
	global := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(global) })
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}, nil)
	s.waitModels()
	cases := []struct {
		header         []string
		wantTP, wantTS string
		description    string
	}{
		{nil, "", "", "no client context"},
		{[]string{"traceparent", clientTraceparent, "tracestate", clientTracestate}, clientTraceparent, clientTracestate, "client context passed through"},
		{[]string{"traceparent", "00-" + clientTraceID + "-" + clientSpanID + "-zz"}, "", "", "malformed traceparent dropped"},
		{[]string{"traceparent", "00-00000000000000000000000000000000-" + clientSpanID + "-01"}, "", "", "zero trace id dropped"},
		{[]string{"traceparent", "00-" + strings.ToUpper(clientTraceID) + "-" + clientSpanID + "-01"}, "", "", "uppercase hex dropped"},
		{[]string{"traceparent", "ff-" + clientTraceID + "-" + clientSpanID + "-01"}, "", "", "version ff dropped"},
		{[]string{"traceparent", "00-" + clientTraceID + "-0000000000000000-01"}, "", "", "zero span id dropped"},
		{[]string{"traceparent", clientTraceparent + "-" + strings.Repeat("x", 6000)}, "", "", "huge version 00 dropped"},
		{[]string{"traceparent", "01-" + clientTraceID + "-" + clientSpanID + "-01-" + strings.Repeat("x", 6000)}, clientTraceparent, "", "future version written as version 00"},
		{[]string{"traceparent", clientTraceparent, "tracestate", strings.Repeat("k=v,", 2000)}, clientTraceparent, "", "huge tracestate dropped"},
		{[]string{"traceparent", clientTraceparent, "tracestate", "Bad Key=v"}, clientTraceparent, "", "invalid tracestate dropped"},
	}
	for _, tc := range cases {
		s.sims["p1"].ResetRequests()
		s.sims["d1"].ResetRequests()
		resp, body := s.post(schemas.EndpointChat, chatBody("off", `"max_tokens":2,"stream":true`), tc.header...)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: status %d: %s", tc.description, resp.StatusCode, body)
		}
		s.idle()
		for _, leg := range []struct{ engine, phase string }{{"p1", sim.PhasePrefill}, {"d1", sim.PhaseDecode}} {
			gotTP, gotTS := legTraceparent(t, s.sims[leg.engine], leg.phase)
			if gotTP != tc.wantTP || gotTS != tc.wantTS {
				t.Fatalf("%s: %s leg sent traceparent %q tracestate %q, want %q %q", tc.description, leg.phase, gotTP, gotTS, tc.wantTP, tc.wantTS)
			}
		}
	}
	if s.rt.tracer != nil {
		t.Fatal("a router without a tracer provider traces")
	}
	if n := len(exp.GetSpans()); n != 0 {
		t.Fatalf("%d spans with tracing off", n)
	}
}

// TestTraceOfAConcurrentAttempt: an attempt whose legs start at once (the
// sglang connector, R-DESC-7) has one legs span beside placement, the
// parent of both legs: each engine receives its traceparent.
func TestTraceOfAConcurrentAttempt(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(t.Context()) })
	s := newStackWith(t, sglangFleet(1, 1), func(c *config.Config) {
		c.Engine.FirstTokenTimeoutS = 5
		c.Engine.PrefillTimeoutS = 0.5
	}, nil, io.Discard, func(o *Options) { o.TracerProvider = tp })
	s.waitModels()
	resp, body := s.post(schemas.EndpointChat, chatBody("concurrent", `"max_tokens":3,"stream":true`), "X-Request-Id", "sg-traced",
		"traceparent", clientTraceparent)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	spans := requestSpans(t, exp)
	legs := byName(spans, spanLegs)
	if len(spans) != 3 || len(byName(spans, spanPlacement)) != 1 || len(legs) != 1 {
		t.Fatalf("spans %v, want the request, placement and legs", spanNames(spans))
	}
	root := spans[0]
	a := attrs(legs[0])
	if legs[0].Parent.SpanID() != root.SpanContext.SpanID() || root.SpanContext.TraceID().String() != clientTraceID ||
		a[attrPrefillEngine].AsString() != "p1" || a[attrDecodeEngine].AsString() != "d1" || a[attrOutcome].AsString() != "ok" ||
		a[attrCompletionTokens].AsInt64() != 3 || !strings.HasPrefix(a[attrBackendRequestID].AsString(), "sg-traced-1-") {
		t.Fatalf("legs span %+v parent %v", legs[0].Attributes, legs[0].Parent)
	}
	want := "00-" + clientTraceID + "-" + legs[0].SpanContext.SpanID().String() + "-01"
	for _, id := range []string{"p1", "d1"} {
		var got []string
		for _, r := range s.sims[id].Requests() {
			if strings.HasPrefix(r.RequestID, "sg-traced-") {
				got = append(got, r.Traceparent)
			}
		}
		if len(got) != 1 || got[0] != want {
			t.Fatalf("%s received traceparents %q, want [%s]", id, got, want)
		}
	}
}
