package router

import (
	"bufio"
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/router/meshview"
	"github.com/narwhalmesh/narwhal/schemas"
)

const benchChunk = `{"id":"chatcmpl-3f0c","object":"chat.completion.chunk","created":1764460000,"model":"m","choices":[{"index":0,"delta":{"content":" narwhal"},"logprobs":null,"finish_reason":null}]}`

// loopBody serves the same SSE block forever.
type loopBody struct {
	block []byte
	off   int
}

func (l *loopBody) Read(p []byte) (int, error) {
	n := copy(p, l.block[l.off:])
	l.off = (l.off + n) % len(l.block)
	return n, nil
}

func (l *loopBody) Close() error { return nil }

// BenchmarkRelayChunk is the router's per-token cost: one op is one decode
// chunk read from the engine's stream, classified and appended to the
// client's batch; each batch (what the engine had ready) is written as one
// flushed chunk, exactly as relayBody.WriteTo does under fasthttp. Target:
// 0 allocs/op, < 500 ns/op.
func BenchmarkRelayChunk(b *testing.B) { benchRelay(b, benchChunk) }

// benchUsageChunk is a metadata chunk that carries usage, as an engine
// sends with continuous usage statistics: the relay reads its usage and
// passes it on.
const benchUsageChunk = `{"id":"chatcmpl-3f0c","object":"chat.completion.chunk","created":1764460000,"model":"m","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":812,"completion_tokens":37,"total_tokens":849}}`

// BenchmarkRelayUsageChunk is BenchmarkRelayChunk for chunks that carry
// usage: each is scanned once, by the stream, and the relay reads usage
// from that scan (R-LEG-6). Target: 0 allocs/op.
func BenchmarkRelayUsageChunk(b *testing.B) { benchRelay(b, benchUsageChunk) }

func benchRelay(b *testing.B, chunk string) {
	block := []byte(strings.Repeat("data: "+chunk+"\n\n", 16))
	client := engines.NewClient(engines.Options{FirstTokenTimeout: 1 << 50, DecodeReadTimeout: 1 << 50})
	s := client.NewStream(context.Background(), "d1", &loopBody{block: block})
	defer s.Close()
	// The model's series, as prepare resolves them: each generated chunk
	// is observed in narwhal_inter_token_seconds.
	m := newMetrics(prometheus.NewRegistry(), func() *fleet { return &fleet{} }, "rt-bench", 600*time.Second)
	c := &call{req: &schemas.Request{Endpoint: schemas.EndpointChat}, stream: s, series: m.series("m")}
	// A connection whose write deadline the relay moves as it does a
	// client's (R-TMO-6); the bytes themselves go to io.Discard.
	conn, peer := net.Pipe()
	defer conn.Close()
	defer peer.Close()
	r := &relayBody{c: c, started: true, buf: make([]byte, 0, 16<<10), conn: conn, stall: 30 * time.Second}
	w := bufio.NewWriterSize(io.Discard, 4096)
	b.SetBytes(int64(len(block) / 16))
	b.ReportAllocs()
	b.ResetTimer()
	for c.chunks < b.N {
		if !r.fill() {
			b.Fatal("stream ended")
		}
		if _, err := r.write(w); err != nil {
			b.Fatal(err)
		}
		if err := w.Flush(); err != nil {
			b.Fatal(err)
		}
		r.buf = r.buf[:0]
	}
}

// BenchmarkPlace is one placement of both phases and their release.
func BenchmarkPlace(b *testing.B) {
	var ms []*member
	for i, role := range []connector.Role{connector.RolePrefill, connector.RolePrefill, connector.RoleDecode, connector.RoleDecode, connector.RoleDecode, connector.RoleDecode} {
		ms = append(ms, testMember("e"+string(rune('0'+i)), role))
	}
	f := meshview.NewFleet(ms...)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		sc := new(placeScratch) // a request's pooled buffers
		for pb.Next() {
			p, err := place(f, "m", prefillPhase, nil, "", leastLoaded{}, nil, sc)
			if err != nil {
				b.Fatal(err)
			}
			d, err := place(f, "m", decodePhase, nil, "", leastLoaded{}, nil, sc)
			if err != nil {
				b.Fatal(err)
			}
			p.Release(prefillPhase)
			d.Release(decodePhase)
		}
	})
}

// BenchmarkObserveOutput is what the relay adds per generated chunk for
// narwhal_inter_token_seconds: a clock read and one Observe on series
// resolved once per request. Target: 0 allocs/op, well under the relay's
// per-chunk cost.
func BenchmarkObserveOutput(b *testing.B) {
	m := newMetrics(prometheus.NewRegistry(), func() *fleet { return &fleet{} }, "rt-bench", 600*time.Second)
	c := &call{series: m.series("m")}
	b.ReportAllocs()
	for b.Loop() {
		c.observeOutput()
	}
}
