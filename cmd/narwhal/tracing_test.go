package main

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestTracingFromEnvironment: tracing is on only with an OTLP endpoint,
// and off again with OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none;
// the protocol follows the standard variables, the traces-specific one
// first (docs/observability.md, Tracing).
func TestTracingFromEnvironment(t *testing.T) {
	cases := []struct {
		env      map[string]string
		on       bool
		protocol string // "" when refused
	}{
		{map[string]string{}, false, "http/protobuf"},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, true, "http/protobuf"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, true, "http/protobuf"},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_SDK_DISABLED": "TRUE"}, false, "http/protobuf"},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_TRACES_EXPORTER": "none"}, false, "http/protobuf"},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, true, "grpc"},
		{map[string]string{"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, false, "http/protobuf"},
		{map[string]string{"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, false, ""},
	}
	for _, tc := range cases {
		getenv := func(k string) string { return tc.env[k] }
		if got := tracingEnabled(getenv); got != tc.on {
			t.Errorf("%v: tracing on = %v, want %v", tc.env, got, tc.on)
		}
		p, err := otlpProtocol(getenv)
		if p != tc.protocol || (err != nil) != (tc.protocol == "") {
			t.Errorf("%v: protocol %q (%v), want %q", tc.env, p, err, tc.protocol)
		}
	}
}

// collector is an OTLP/HTTP trace receiver on loopback: it keeps the
// service name and trace id of every span it is sent, by span name.
type collector struct {
	mu    sync.Mutex
	spans map[string][]exportedSpan
}

type exportedSpan struct{ service, traceID string }

func (c *collector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	var req coltracepb.ExportTraceServiceRequest
	if r.URL.Path != "/v1/traces" || err != nil || proto.Unmarshal(body, &req) != nil {
		http.Error(w, "bad export", http.StatusBadRequest)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, rs := range req.ResourceSpans {
		service := ""
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.Key == "service.name" {
				service = kv.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				c.spans[s.Name] = append(c.spans[s.Name], exportedSpan{service: service, traceID: traceHex(s.TraceId)})
			}
		}
	}
	w.Header().Set("Content-Type", "application/x-protobuf")
	b, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	_, _ = w.Write(b)
}

func (c *collector) named(name string) []exportedSpan {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]exportedSpan(nil), c.spans[name]...)
}

func traceHex(id []byte) string {
	const digits = "0123456789abcdef"
	out := make([]byte, 0, 2*len(id))
	for _, b := range id {
		out = append(out, digits[b>>4], digits[b&15])
	}
	return string(out)
}

// TestRouterExportsTraces: a router started with OTEL_EXPORTER_OTLP_ENDPOINT
// exports its requests' spans over OTLP/HTTP as service narwhal-router,
// continuing the client's trace, and its in-process breaker's tracer
// starts as narwhal-breaker.
func TestRouterExportsTraces(t *testing.T) {
	col := &collector{spans: map[string][]exportedSpan{}}
	srv := httptest.NewServer(col)
	defer srv.Close()
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", srv.URL)
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
	t.Setenv("NARWHAL_DATA_DIR", t.TempDir())
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}})
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testkit.LockedBuffer{}
	listen := "127.0.0.1:" + strconv.Itoa(freeTCPPort(t))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runRouter(ctx, cfg, listen, slog.New(slog.NewTextHandler(logs, nil)), nil) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("runRouter: %v", err)
		}
	}()
	client := &http.Client{Timeout: 5 * time.Second}
	defer client.CloseIdleConnections()
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	testkit.WaitFor(t, cmdTestBound, "a completed request", func() bool {
		req, _ := http.NewRequest(http.MethodPost, "http://"+listen+"/v1/chat/completions",
			strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Traceparent", "00-"+traceID+"-00f067aa0ba902b7-01")
		resp, err := client.Do(req)
		if err != nil {
			return false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	testkit.WaitFor(t, cmdTestBound, "the request's spans at the collector", func() bool {
		for _, name := range []string{"POST /v1/chat/completions", "narwhal.placement", "narwhal.prefill", "narwhal.handoff_check", "narwhal.decode"} {
			found := false
			for _, s := range col.named(name) {
				found = found || s.service == routerService && s.traceID == traceID
			}
			if !found {
				return false
			}
		}
		return true
	})
	for _, service := range []string{routerService, breakerService} {
		if !strings.Contains(logs.String(), "tracing on") || !strings.Contains(logs.String(), "service="+service) {
			t.Errorf("no 'tracing on' line for %s:\n%s", service, logs.String())
		}
	}
}
