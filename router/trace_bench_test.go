package router

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/narwhalmesh/narwhal/schemas"
)

// BenchmarkRequest is one streamed chat request of 4 tokens through the
// router and both legs over loopback simulators, read to its end: the
// request path's cost with tracing off (with and without a client
// traceparent, which is then passed through) and on (spans made and
// handed to an exporter that discards them). ns/op and allocs/op are the
// whole process's: client, router and simulators; compare the variants
// with each other, not with the relay's figures.
func BenchmarkRequest(b *testing.B) {
	on := sdktrace.NewTracerProvider(sdktrace.WithSyncer(tracetest.NewNoopExporter()))
	b.Cleanup(func() { _ = on.Shutdown(context.Background()) })
	for _, v := range []struct {
		name   string
		opts   func(*Options)
		header string
	}{
		{"tracing=off", nil, ""},
		{"tracing=off/client-traceparent", nil, clientTraceparent},
		{"tracing=on", func(o *Options) { o.TracerProvider = on }, ""},
		{"tracing=on/client-traceparent", func(o *Options) { o.TracerProvider = on }, clientTraceparent},
	} {
		b.Run(v.name, func(b *testing.B) { benchRequests(b, v.opts, v.header) })
	}
}

func benchRequests(b *testing.B, options func(*Options), traceparent string) {
	url := benchRouter(b, 0, nil, options) + schemas.EndpointChat
	body := chatBody("benchmark the request path", `"stream":true,"max_tokens":4`)
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	one := func() {
		req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if traceparent != "" {
			req.Header.Set("Traceparent", traceparent)
		}
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			b.Fatalf("status %d", resp.StatusCode)
		}
	}
	one()
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		one()
	}
}
