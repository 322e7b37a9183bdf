package router

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
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
	cfg := config.Default()
	cfg.Router.ID = "rt-bench"
	for _, d := range []struct {
		id   string
		role connector.Role
	}{{"p1", connector.RolePrefill}, {"d1", connector.RoleDecode}} {
		srv := simtest.Start(b, sim.Config{Role: string(d.role), EngineID: d.id, Model: testModel})
		cfg.Fleet = append(cfg.Fleet, config.EngineSpec{ID: d.id, URL: srv.URL(), Role: d.role, Connector: "nixl"})
	}
	if err := cfg.Validate(); err != nil {
		b.Fatal(err)
	}
	opts := Options{Config: &cfg, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), ShutdownGrace: time.Second}
	if options != nil {
		options(&opts)
	}
	rt, err := New(opts)
	if err != nil {
		b.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- rt.Serve(ln) }()
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = rt.Shutdown(ctx)
		<-done
	})
	testkit.WaitFor(b, 5*time.Second, "the engines' models", func() bool {
		for _, m := range rt.fleet().Members() {
			if m.Models() == nil {
				return false
			}
		}
		return true
	})
	url := "http://" + ln.Addr().String() + schemas.EndpointChat
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
