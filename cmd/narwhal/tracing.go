package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// Service names of the processes' traces (resource attribute
// service.name; OTEL_SERVICE_NAME overrides them).
const (
	routerService  = "narwhal-router"
	breakerService = "narwhal-breaker"
)

// tracingEnabled reports whether the environment asks for traces: an OTLP
// endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), the SDK is not disabled
// (OTEL_SDK_DISABLED=true) and the traces exporter is not "none"
// (OTEL_TRACES_EXPORTER).
func tracingEnabled(getenv func(string) string) bool {
	if getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
		return false
	}
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return false
	}
	return !strings.EqualFold(strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")), "none")
}

// otlpProtocol is the OTLP protocol the environment asks for traces:
// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL,
// else "http/protobuf" (the specification's default). Only "grpc" and
// "http/protobuf" are supported.
func otlpProtocol(getenv func(string) string) (string, error) {
	p := strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
	if p == "" {
		p = strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_PROTOCOL"))
	}
	switch p {
	case "", "http/protobuf":
		return "http/protobuf", nil
	case "grpc":
		return "grpc", nil
	}
	return "", fmt.Errorf("OTLP protocol %q is not supported for traces: use grpc or http/protobuf", p)
}

// startTracing returns the tracer provider of a process named service
// (instance id instance), exporting spans in batches over OTLP when
// tracingEnabled; the exporter reads the standard OTEL_EXPORTER_OTLP_*
// variables (endpoint, headers, TLS, timeout), the SDK OTEL_TRACES_SAMPLER,
// OTEL_BSP_* and OTEL_RESOURCE_ATTRIBUTES. Otherwise it returns a nil
// provider: tracing is off and costs nothing. stop flushes what is
// buffered (bounded to 5 s) and shuts the provider down.
func startTracing(ctx context.Context, service, instance string, log *slog.Logger) (tp trace.TracerProvider, stop func(), err error) {
	if !tracingEnabled(os.Getenv) {
		return nil, func() {}, nil
	}
	protocol, err := otlpProtocol(os.Getenv)
	if err != nil {
		return nil, nil, err
	}
	var exp sdktrace.SpanExporter
	if protocol == "grpc" {
		exp, err = otlptracegrpc.New(ctx)
	} else {
		exp, err = otlptracehttp.New(ctx)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("tracing: OTLP exporter: %w", err)
	}
	res, err := resource.New(ctx,
		resource.WithTelemetrySDK(),
		resource.WithAttributes(attribute.String("service.name", service), attribute.String("service.instance.id", instance)),
		resource.WithFromEnv()) // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win
	if err != nil {
		log.Warn("tracing: resource attributes from the environment", "err", err)
	}
	setErrorLog(log)
	provider := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	log.Info("tracing on", "service", service, "protocol", protocol)
	return provider, func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := provider.Shutdown(sctx); err != nil {
			log.Warn("tracing: shutdown", "err", err)
		}
	}, nil
}

// errorLogged is when the last export error was logged (Unix ns).
var errorLogged atomic.Int64

// setErrorLog routes OpenTelemetry's own errors (a collector that cannot
// be reached) to log, at most one line a minute: a down collector must
// not flood the log.
func setErrorLog(log *slog.Logger) {
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		now := time.Now().UnixNano()
		last := errorLogged.Load()
		if now-last < int64(time.Minute) || !errorLogged.CompareAndSwap(last, now) {
			return
		}
		log.Warn("tracing: export failed (further errors within a minute are not logged)", "err", err)
	}))
}
