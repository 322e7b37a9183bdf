package breaker

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/narwhalmesh/narwhal/schemas"
)

// TracerName is the instrumentation scope of the breaker's spans.
const TracerName = "github.com/narwhalmesh/narwhal/breaker"

// spanProbe is the name of a probe's span (docs/observability.md).
const spanProbe = "narwhal.probe"

// startProbeSpan starts p's span, a root span: a probe belongs to no
// client request. Without a tracer it does nothing.
func (s *Service) startProbeSpan(p *probe) {
	if s.tracer == nil {
		return
	}
	_, p.span = s.tracer.Start(context.Background(), spanProbe, trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(
			attribute.String("narwhal.engine", p.e.ID),
			attribute.String("narwhal.phase", p.phase),
			attribute.Bool("narwhal.joining", p.joining),
			attribute.String("narwhal.breaker_id", s.id)))
}

// traced returns ctx carrying p's span, so that the probe's legs carry its
// traceparent; ctx itself when p is not traced.
func (p *probe) traced(ctx context.Context) context.Context {
	if p.span == nil {
		return ctx
	}
	return trace.ContextWithSpan(ctx, p.span)
}

// endSpan ends p's span with what the probe came to: the engines of its
// transfer, the model, the outcome (success, failure or inconclusive) and
// its message; a failed probe has an error status.
func (p *probe) endSpan() {
	if p.span == nil {
		return
	}
	span := p.span
	p.span = nil
	span.SetAttributes(attribute.String("narwhal.outcome", p.outcome))
	if p.model != "" {
		span.SetAttributes(attribute.String("gen_ai.request.model", schemas.BoundField(p.model)))
	}
	if p.producer != "" {
		span.SetAttributes(attribute.String("narwhal.prefill_engine", p.producer), attribute.String("narwhal.decode_engine", p.consumer))
	}
	if p.message != "" {
		span.SetAttributes(attribute.String("narwhal.message", schemas.BoundField(p.message)))
	}
	if p.outcome == schemas.ProbeFailure {
		span.SetStatus(codes.Error, schemas.BoundField(p.message))
	}
	span.End()
}
