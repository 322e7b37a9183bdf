package router

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// BenchmarkBodyBytesInflight measures the router's memory under a burst
// of large request bodies (R-API-8): each op is 20 clients posting an
// 8 MiB body at once to decode engines that take 300 ms to the first
// token, so the bodies are all held together unless the bound says no.
// The bulk of each body is a client kv_transfer_params, which no leg
// carries (R-API-5), so the engines' memory stays out of the figure.
// Reported: peak-heap-MiB (the process's peak HeapInuse over the op),
// bound-MiB (server.max_body_bytes_inflight) and refused/op (503s). The
// figure to read: with the 32 MiB bound the peak stays near a small
// multiple of the bound, without it (1 GiB) it follows the burst.
func BenchmarkBodyBytesInflight(b *testing.B) {
	for _, bound := range []int{32 << 20, 1 << 30} {
		b.Run("bound="+strconv.Itoa(bound>>20)+"MiB", func(b *testing.B) { benchBodies(b, bound) })
	}
}

func benchBodies(b *testing.B, bound int) {
	const clients = 20
	const size = 8 << 20
	url := benchRouter(b, 300*time.Millisecond, func(c *config.Config) {
		c.Request.MaxBodyBytes = 16 << 20
		c.Server.MaxBodyBytesInflight = bound
	}, nil)
	pad := bytes.Repeat([]byte("k"), size)
	body := append(append([]byte(`{"model":"sim-model","messages":[{"role":"user","content":"x"}],"max_tokens":2,"kv_transfer_params":{"pad":"`), pad...), `"}}`...)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	defer client.CloseIdleConnections()

	var refused, failed atomic.Int64
	var peak uint64
	runtime.GC()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		stop := make(chan struct{})
		sampled := make(chan uint64)
		go func() {
			var ms runtime.MemStats
			var peak uint64
			t := time.NewTicker(5 * time.Millisecond)
			defer t.Stop()
			for {
				runtime.ReadMemStats(&ms)
				peak = max(peak, ms.HeapInuse)
				select {
				case <-stop:
					sampled <- peak
					return
				case <-t.C:
				}
			}
		}()
		var wg sync.WaitGroup
		for j := 0; j < clients; j++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, err := client.Post(url+schemas.EndpointChat, "application/json", bytes.NewReader(body))
				if err != nil {
					failed.Add(1)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				switch resp.StatusCode {
				case 200:
				case 503:
					refused.Add(1)
				default:
					failed.Add(1)
				}
			}()
		}
		wg.Wait()
		close(stop)
		if p := <-sampled; p > peak {
			peak = p
		}
		runtime.GC()
	}
	b.StopTimer()
	if failed.Load() > 0 {
		b.Fatalf("%d requests failed", failed.Load())
	}
	b.ReportMetric(float64(peak)/(1<<20), "peak-heap-MiB")
	b.ReportMetric(float64(bound)/(1<<20), "bound-MiB")
	b.ReportMetric(float64(refused.Load())/float64(b.N), "refused/op")
}

// benchRouter starts a prefill and a decode simulator (the decode's first
// token after ttft, its sim.Config.TTFT) and a router over them, its
// config changed by mutate and its Options by options (either may be
// nil); it waits until the router knows both engines' models, returns its
// base URL and stops everything when b ends.
func benchRouter(b *testing.B, ttft time.Duration, mutate func(*config.Config), options func(*Options)) string {
	b.Helper()
	cfg := config.Default()
	cfg.Router.ID = "rt-bench"
	for _, d := range []struct {
		id   string
		role connector.Role
	}{{"p1", connector.RolePrefill}, {"d1", connector.RoleDecode}} {
		sc := sim.Config{Role: string(d.role), EngineID: d.id, Model: testModel}
		if d.role == connector.RoleDecode {
			sc.TTFT = ttft
		}
		srv := simtest.Start(b, sc)
		cfg.Fleet = append(cfg.Fleet, config.EngineSpec{ID: d.id, URL: srv.URL(), Role: d.role, Connector: "nixl"})
	}
	if mutate != nil {
		mutate(&cfg)
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
	return "http://" + ln.Addr().String()
}

// BenchmarkRefuseOverInflight is the server-side cost of refusing a
// completion request beyond server.max_inflight (R-API-8): one op is one
// request through the router's handler, answered 503 with Retry-After.
// Target: well under a millisecond (it is microseconds).
func BenchmarkRefuseOverInflight(b *testing.B) {
	cfg := config.Default()
	cfg.Router.ID = "rt-bench"
	cfg.Server.MaxInflight = 1
	cfg.Fleet = []config.EngineSpec{{ID: "d1", URL: "http://127.0.0.1:9", Role: connector.RoleBoth, Connector: "nixl"}}
	rt, err := New(Options{Config: &cfg, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	defer rt.watcher.close()
	rt.inflight.Store(1) // the one request allowed is running
	var ctx fasthttp.RequestCtx
	body := []byte(`{"model":"sim-model","messages":[{"role":"user","content":"x"}]}`)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		ctx.Request.Reset()
		ctx.Response.Reset()
		ctx.Request.Header.SetMethod("POST")
		ctx.Request.SetRequestURI(schemas.EndpointChat)
		ctx.Request.SetBody(body)
		rt.serve(&ctx)
		if ctx.Response.StatusCode() != 503 {
			b.Fatalf("status %d", ctx.Response.StatusCode())
		}
	}
}
