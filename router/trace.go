package router

import (
	"context"
	"strconv"
	"time"

	"github.com/valyala/fasthttp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/router/meshview"
	"github.com/narwhalmesh/narwhal/schemas"
)

// This file is the request's trace (docs/observability.md, Tracing): one
// span per client request, the child of the client's W3C traceparent when
// it sent a valid one, with a child span per placement, prefill leg,
// handoff check and decode leg of every attempt. Each engine leg gets the
// traceparent of its own span, so an engine that traces joins the trace.
//
// Tracing is off unless Options.TracerProvider is set; then c.trace is nil
// and every hook below returns at its first line: no span, no allocation,
// and the legs carry the client's own traceparent and tracestate (when it
// sent valid ones) unchanged, as an intermediary that does not trace should.

// Span names, one per step of a request.
const (
	spanPlacement = "narwhal.placement"
	spanPrefill   = "narwhal.prefill"
	spanHandoff   = "narwhal.handoff_check"
	spanDecode    = "narwhal.decode"
	spanLegs      = "narwhal.legs" // both legs at once, for a concurrent connector
)

// Span attribute keys beyond OpenTelemetry's semantic conventions.
const (
	attrRequestID        = attribute.Key("narwhal.request_id")
	attrBackendRequestID = attribute.Key("narwhal.backend_request_id")
	attrModel            = attribute.Key("gen_ai.request.model")
	attrPrefillEngine    = attribute.Key("narwhal.prefill_engine")
	attrDecodeEngine     = attribute.Key("narwhal.decode_engine")
	attrEngine           = attribute.Key("narwhal.engine")
	attrAttempt          = attribute.Key("narwhal.attempt")
	attrAttempts         = attribute.Key("narwhal.attempts")
	attrOutcome          = attribute.Key("narwhal.outcome")
	attrFaultKind        = attribute.Key("narwhal.fault_kind")
	attrStream           = attribute.Key("narwhal.stream")
	attrPromptTokens     = attribute.Key("gen_ai.usage.input_tokens")
	attrCompletionTokens = attribute.Key("gen_ai.usage.output_tokens")
	attrStatus           = attribute.Key("http.response.status_code")
	attrConnector        = attribute.Key("narwhal.connector")
	attrTTFT             = attribute.Key("narwhal.ttft_s")
	attrFirstByte        = attribute.Key("narwhal.first_byte_s")
)

// traceContext is the W3C propagator of traceparent and tracestate; it
// validates what a client sends (a malformed header is ignored). The legs'
// headers are written by engines.Request.SetTrace.
var traceContext propagation.TraceContext

// callTrace is a traced request's spans.
type callTrace struct {
	tracer  trace.Tracer
	ctx     context.Context // carries the request span: the parent of every child span
	span    trace.Span      // the request span
	prefill trace.Span      // the prefill leg's span while it is open
	check   trace.Span      // the handoff check's span while it is open
	decode  trace.Span      // the decode leg's (or both legs') span while it is open
}

// requestHeaders reads a fasthttp request's headers for the propagator.
type requestHeaders struct{ h *fasthttp.RequestHeader }

func (r requestHeaders) Get(key string) string { return string(r.h.Peek(key)) }
func (r requestHeaders) Set(string, string)    {}
func (r requestHeaders) Keys() []string        { return []string{"traceparent", "tracestate"} }

// traceArrive starts the request span when tracing is on; when it is off
// it keeps the client's valid trace context to pass to the engine legs.
// Only a request that carries a traceparent pays anything with tracing off.
func (c *call) traceArrive(fctx *fasthttp.RequestCtx, endpoint string) {
	tracer := c.rt.tracer
	if tracer == nil {
		if len(fctx.Request.Header.Peek("traceparent")) == 0 {
			return
		}
		ctx := traceContext.Extract(context.Background(), requestHeaders{&fctx.Request.Header})
		var client engines.Request
		client.SetTrace(ctx) // validated and written again: empty when invalid
		c.traceparent, c.tracestate = client.Traceparent, client.Tracestate
		return
	}
	ctx := traceContext.Extract(context.Background(), requestHeaders{&fctx.Request.Header})
	ctx, span := tracer.Start(ctx, "POST "+endpoint,
		trace.WithSpanKind(trace.SpanKindServer),
		trace.WithTimestamp(c.arrival),
		trace.WithAttributes(attrRequestID.String(c.id), attribute.String("http.route", endpoint)))
	c.trace = &callTrace{tracer: tracer, ctx: ctx, span: span}
}

// start starts a child span of the request span.
func (t *callTrace) start(name string, kind trace.SpanKind, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	return t.tracer.Start(t.ctx, name, trace.WithSpanKind(kind), trace.WithAttributes(attrs...))
}

// endWith ends span with f's fault kind, the engine it blames and an error
// status; with outcome ok when f is nil.
func endWith(span trace.Span, f *engines.Fault) {
	if f == nil {
		span.SetAttributes(attrOutcome.String("ok"))
	} else {
		span.SetAttributes(attrOutcome.String(string(f.Kind)), attrFaultKind.String(string(f.Kind)))
		if f.EngineID != "" {
			span.SetAttributes(attrEngine.String(f.EngineID))
		}
		span.SetStatus(codes.Error, schemas.BoundField(f.Message))
	}
	span.End()
}

// tracePlace runs the attempt's placement in a placement span.
func (c *call) tracePlace(avoid *avoidSet) *engines.Fault {
	if c.trace == nil {
		return c.place(avoid)
	}
	_, span := c.trace.start(spanPlacement, trace.SpanKindInternal, attrAttempt.Int(c.attempts))
	f := c.place(avoid)
	if f == nil {
		span.SetAttributes(attrPrefillEngine.String(c.producer.ID), attrDecodeEngine.String(c.consumer.ID))
	}
	endWith(span, f)
	return f
}

// steps is the request's engines.Observer of an attempt: it releases the
// producer's prefill slot when the prefill leg ends (R-OWN-3), observes
// the leg's duration, records a late prefill failure, notes when the
// decode leg starts, and traces each step as a span. With tracing off it
// traces nothing, and every leg carries the client's own trace context.
type steps struct{ c *call }

// Begin opens step's span and returns the trace context its legs carry.
func (s steps) Begin(step connector.Step, detail connector.StepDetail) (traceparent, tracestate string) {
	c := s.c
	if step == connector.StepHandoffCheck || step == connector.StepLegs {
		c.decodeStart = time.Now()
	}
	t := c.trace
	if t == nil {
		return c.traceparent, c.tracestate
	}
	var ctx context.Context
	switch step {
	case connector.StepPrefill:
		ctx, t.prefill = t.start(spanPrefill, trace.SpanKindClient,
			attrAttempt.Int(c.attempts), attrEngine.String(c.producer.ID), attrBackendRequestID.String(c.backendID),
			attrConnector.String(c.producer.Connector.Name()))
	case connector.StepHandoffCheck:
		_, t.check = t.start(spanHandoff, trace.SpanKindInternal,
			attrAttempt.Int(c.attempts), attrPrefillEngine.String(c.producer.ID), attrDecodeEngine.String(c.consumer.ID))
		if detail.Connector != "" {
			t.check.SetAttributes(attrConnector.String(detail.Connector),
				attribute.Float64("narwhal.handoff_age_s", detail.HandoffAge.Seconds()))
		}
		return "", ""
	case connector.StepDecode:
		ctx, t.decode = t.start(spanDecode, trace.SpanKindClient,
			attrAttempt.Int(c.attempts), attrEngine.String(c.consumer.ID), attrBackendRequestID.String(c.backendID))
	case connector.StepLegs:
		// Both legs at once, in one span, the parent of both.
		ctx, t.decode = t.start(spanLegs, trace.SpanKindClient,
			attrAttempt.Int(c.attempts), attrPrefillEngine.String(c.producer.ID), attrDecodeEngine.String(c.consumer.ID),
			attrBackendRequestID.String(c.backendID), attrConnector.String(c.producer.Connector.Name()))
	default:
		return c.traceparent, c.tracestate
	}
	var legs engines.Request
	legs.SetTrace(ctx)
	return legs.Traceparent, legs.Tracestate
}

// End ends step's span with f.
func (s steps) End(step connector.Step, f *engines.Fault) {
	t := s.c.trace
	if t == nil {
		return
	}
	switch step {
	case connector.StepPrefill:
		if t.prefill != nil {
			endWith(t.prefill, f)
			t.prefill = nil
		}
	case connector.StepHandoffCheck:
		if t.check != nil {
			endWith(t.check, f)
			t.check = nil
		}
	}
}

// PrefillEnded releases the producer's prefill slot and observes the
// leg; a late failure (the KV had arrived: the client's stream goes on)
// is recorded. It may run on the prefill's own goroutine: it touches only
// atomics and fields of c that no longer change once the attempt runs.
func (s steps) PrefillEnded(late *engines.Fault) {
	c := s.c
	c.releasePrefill(late == nil && c.prefillAnswered.Load())
	c.rt.metrics.leg.WithLabelValues(schemas.PhasePrefill, c.modelSeries().label).Observe(time.Since(c.arrival).Seconds())
	if late != nil {
		c.recordFault(late)
	}
}

// PrefillAnswered marks the producer's prefill answered, so that its time
// counts in the producer's mean (releasePrefill), and applies its usage
// (R-PLACE-3): under a policy that keeps the prefix index, its cached
// tokens correct it.
func (s steps) PrefillAnswered(u connector.PrefillUsage) {
	c := s.c
	c.prefillAnswered.Store(true)
	if c.prediction.Model == "" || c.producer == nil {
		return
	}
	c.rt.mesh.CorrectPrefix(c.producer, &c.prediction, meshview.PrefillUsage{
		Usage: u.Present, PromptTokens: u.PromptTokens, Cached: u.Cached, CachedTokens: u.CachedTokens})
}

// traceFailed ends the attempt's open decode (or legs) span with the
// fault that ended the attempt before its first output.
func (c *call) traceFailed(f *engines.Fault) {
	if t := c.trace; t != nil && t.decode != nil {
		endWith(t.decode, f)
		t.decode = nil
	}
}

// traceEnd ends the open decode span and the request span with what the
// request came to: status, outcome (the fault kind when it failed), the
// engines of its last attempt, its token counts and timings.
func (c *call) traceEnd(now time.Time) {
	t := c.trace
	if t == nil {
		return
	}
	c.trace = nil
	failed := c.outcome != "ok"
	tokens := []attribute.KeyValue{attrPromptTokens.Int(c.promptTokens), attrCompletionTokens.Int(c.completionTokens)}
	if t.decode != nil {
		t.decode.SetAttributes(tokens...)
		t.decode.SetAttributes(attribute.Int("narwhal.chunks", c.chunks))
		if c.firstByte > 0 {
			t.decode.SetAttributes(attrFirstByte.Float64(c.firstByte.Seconds()))
		}
		t.decode.SetAttributes(attrOutcome.String(c.outcome))
		if failed {
			t.decode.SetAttributes(attrFaultKind.String(c.outcome))
			t.decode.SetStatus(codes.Error, c.outcome)
		}
		t.decode.End(trace.WithTimestamp(now))
	}
	s := t.span
	s.SetAttributes(attrStatus.Int(c.status), attrOutcome.String(c.outcome), attrAttempts.Int(c.attempts))
	if c.req != nil {
		s.SetAttributes(attrModel.String(schemas.BoundField(c.req.Model)), attrStream.Bool(c.req.Stream))
	}
	if c.backendID != "" {
		s.SetAttributes(attrBackendRequestID.String(c.backendID))
	}
	if c.producer != nil {
		s.SetAttributes(attrPrefillEngine.String(c.producer.ID), attrDecodeEngine.String(c.consumer.ID))
	}
	if c.promptTokens > 0 || c.completionTokens > 0 {
		s.SetAttributes(tokens...)
	}
	if c.ttft > 0 {
		s.SetAttributes(attrTTFT.Float64(c.ttft.Seconds()))
	}
	if c.firstByte > 0 {
		s.SetAttributes(attrFirstByte.Float64(c.firstByte.Seconds()))
	}
	if failed {
		s.SetAttributes(attrFaultKind.String(c.outcome))
		s.SetStatus(codes.Error, c.outcome+" (HTTP "+strconv.Itoa(c.status)+")")
	}
	s.End(trace.WithTimestamp(now))
}

// TracerName is the instrumentation scope of the router's spans.
const TracerName = "github.com/narwhalmesh/narwhal/router"
