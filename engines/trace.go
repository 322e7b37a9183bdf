package engines

import (
	"context"

	"github.com/valyala/fasthttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// The W3C trace context of engine legs (docs/observability.md, Tracing):
// a leg carries Request.Traceparent and Request.Tracestate as the
// traceparent and tracestate headers, so that an engine that traces
// (vLLM's --otlp-traces-endpoint) makes its spans children of the leg's.

// SetTrace sets r's Traceparent and Tracestate to the span context in ctx
// (the next leg's span); both become empty when ctx carries no valid span
// context. Call it before each leg: each leg has its own parent span.
func (r *Request) SetTrace(ctx context.Context) {
	r.Traceparent, r.Tracestate = "", ""
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return
	}
	propagation.TraceContext{}.Inject(ctx, (*traceCarrier)(r))
}

// traceCarrier receives the propagator's headers into a Request.
type traceCarrier Request

func (c *traceCarrier) Get(string) string { return "" }
func (c *traceCarrier) Keys() []string    { return nil }
func (c *traceCarrier) Set(key, value string) {
	switch key {
	case "traceparent":
		c.Traceparent = value
	case "tracestate":
		c.Tracestate = value
	}
}

// writeTrace adds r's trace context headers to h: the one place the
// engine legs get them.
func (r *Request) writeTrace(h *fasthttp.RequestHeader) {
	if r.Traceparent == "" {
		return
	}
	h.Set("Traceparent", r.Traceparent)
	if r.Tracestate != "" {
		h.Set("Tracestate", r.Tracestate)
	}
}
