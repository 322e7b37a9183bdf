package bus_test

import (
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// BenchmarkPublish is the request path's cost of one event: Publish hands
// a request-completed event to the publisher's buffer without blocking;
// marshalling and the JetStream publish happen on the publisher's own
// goroutine (also measured here, since the benchmark waits for them).
func BenchmarkPublish(b *testing.B) {
	bs := bustest.Connect(b, bustest.StartWith(b, bus.EmbeddedOptions{Dir: b.TempDir(), Port: 0}), bus.ConnectOptions{})
	p := bus.NewPublisher(bs, 1<<16, nil)
	ttft, fb := 0.0012, 0.0015
	prompt, completion := 32, 16
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		p.Publish(&schemas.RequestCompleted{
			Envelope: schemas.Envelope{Schema: schemas.SchemaRequest, RouterID: "r1", RequestID: "req-1"},
			Endpoint: schemas.EndpointChat, Model: "m", Stream: true, Status: 200, ProducerID: "p1", ConsumerID: "d1",
			Attempts: 1, TTFTSeconds: &ttft, FirstByteSeconds: &fb, DurationSeconds: 0.002, PromptTokens: &prompt, CompletionTokens: &completion,
		})
	}
	p.Close()
	b.StopTimer()
	if d := p.Dropped(); d > 0 {
		b.Logf("%d of %d dropped (buffer full): the publisher fell behind", d, b.N)
	}
}

// BenchmarkPublishAcked is the whole cost of one event, stored: each
// iteration publishes one request-completed event and the benchmark
// waits, at the end, until the embedded JetStream has acknowledged every
// one. Publish is paced so the buffer never overflows (a drop fails the
// benchmark), so ns/op and allocs/op are per stored event — the caller's,
// the publisher goroutine's (encoding, async publish, batched acks) and
// the in-process server's together.
func BenchmarkPublishAcked(b *testing.B) {
	bs := bustest.Connect(b, bustest.StartWith(b, bus.EmbeddedOptions{Dir: b.TempDir(), Port: 0}), bus.ConnectOptions{})
	const buffer, pace = 1 << 14, 1 << 12
	p := bus.NewPublisher(bs, buffer, nil)
	defer p.Close()
	ttft, fb := 0.0012, 0.0015
	prompt, completion := 32, 16
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for p.Pending() >= pace {
			time.Sleep(50 * time.Microsecond) // pacing only: let the publisher catch up
		}
		p.Publish(&schemas.RequestCompleted{
			Envelope: schemas.Envelope{Schema: schemas.SchemaRequest, RouterID: "r1", RequestID: "req-1"},
			Endpoint: schemas.EndpointChat, Model: "m", Stream: true, Status: 200, ProducerID: "p1", ConsumerID: "d1",
			Attempts: 1, TTFTSeconds: &ttft, FirstByteSeconds: &fb, DurationSeconds: 0.002, PromptTokens: &prompt, CompletionTokens: &completion,
		})
	}
	if !testkit.Poll(time.Minute, 100*time.Microsecond, func() bool { return p.Published()+p.Dropped() >= uint64(b.N) }) {
		b.Fatalf("%d of %d acknowledged after a minute", p.Published(), b.N)
	}
	b.StopTimer()
	if d := p.Dropped(); d > 0 {
		b.Fatalf("%d of %d dropped", d, b.N)
	}
}
