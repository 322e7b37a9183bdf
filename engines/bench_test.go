package engines

import (
	"bufio"
	"context"
	"io"
	"strings"
	"testing"
)

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

// BenchmarkStreamNext is the engine side of the relay: one op is one decode
// chunk read, split off the SSE framing and classified.
func BenchmarkStreamNext(b *testing.B) {
	block := strings.Repeat("data: "+tokenChunk+"\n\n", 16)
	c := &Client{firstTokenTimeout: 1 << 62, readTimeout: 1 << 62}
	s := c.NewStream(context.Background(), "d1", &loopBody{block: []byte(block)})
	defer s.Close()
	w := bufio.NewWriter(io.Discard)
	b.SetBytes(int64(len(block) / 16))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		p, _, err := s.Next()
		if err != nil {
			b.Fatal(err)
		}
		w.Write(p)
	}
}
