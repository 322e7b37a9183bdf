package sim

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// discardResponse is an http.ResponseWriter that counts and drops bytes,
// so the handler's own cost can be measured without a network.
type discardResponse struct {
	h http.Header
	n int
}

func (d *discardResponse) Header() http.Header         { return d.h }
func (d *discardResponse) Write(p []byte) (int, error) { d.n += len(p); return len(p), nil }
func (d *discardResponse) WriteHeader(int)             {}
func (d *discardResponse) FlushError() error           { return nil }

func streamBody(maxTokens int) []byte {
	return []byte(fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"benchmark me please"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":%d,"ignore_eos":true}`, maxTokens))
}

// serveInMemory runs one request through the handler into w.
func serveInMemory(h http.Handler, w *discardResponse, body []byte) {
	req, _ := http.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body))
	w.n = 0
	h.ServeHTTP(w, req)
}

// TestStreamAllocationsDoNotGrowWithTokens: the hot path allocates nothing
// per token — 1024 tokens cost (nearly) the same allocations as 16.
func TestStreamAllocationsDoNotGrowWithTokens(t *testing.T) {
	s, err := New(Config{EngineID: "e1", Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	h := s.Handler()
	w := &discardResponse{h: http.Header{}}
	short, long := streamBody(16), streamBody(1024)
	serveInMemory(h, w, long)
	if w.n < 1024*100 {
		t.Fatalf("only %d bytes for 1024 tokens", w.n)
	}
	a16 := testkit.LeastAllocs(50, func() { serveInMemory(h, w, short) })
	a1024 := testkit.LeastAllocs(50, func() { serveInMemory(h, w, long) })
	// sync.Pool may drop the pooled exchange (always possible under -race),
	// which regrows its buffers: a few dozen allocations, never ~1000.
	if a1024-a16 > 64 {
		t.Fatalf("16 tokens: %.0f allocs, 1024 tokens: %.0f allocs: the stream allocates per token", a16, a1024)
	}
	t.Logf("allocations per request: %.1f (16 tokens), %.1f (1024 tokens)", a16, a1024)
}

// BenchmarkStream16 measures one 16-token streaming chat request with zero
// latency over real loopback HTTP (client cost included).
func BenchmarkStream16(b *testing.B) {
	_, url := startEngine(b, Config{})
	c := newClient(b)
	body := streamBody(16)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		resp, err := c.Post(url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			b.Fatal(err)
		}
		resp.Body.Close()
	}
}

// BenchmarkStream16Handler measures the simulator's own cost of a 16-token
// stream, in memory (no network, no client).
func BenchmarkStream16Handler(b *testing.B) {
	s, err := New(Config{EngineID: "e1", Model: "m"})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	h := s.Handler()
	w := &discardResponse{h: http.Header{}}
	body := streamBody(16)
	b.ReportAllocs()
	for b.Loop() {
		serveInMemory(h, w, body)
	}
}

// BenchmarkStream16HandlerPrefill is BenchmarkStream16Handler with prefill
// compute (1 µs per uncached prompt token, the cache off so every request
// computes): the cost of the engine's shared prefill compute.
func BenchmarkStream16HandlerPrefill(b *testing.B) {
	s, err := New(Config{EngineID: "e1", Model: "m", PrefillPerToken: time.Microsecond, KVCacheBlocks: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	h := s.Handler()
	w := &discardResponse{h: http.Header{}}
	body := streamBody(16)
	b.ReportAllocs()
	for b.Loop() {
		serveInMemory(h, w, body)
	}
}
